// Launchers of the hybridep kernels (chunk_plan.cu, preprocess.cu, dispatch.cu, combine.cu,
// combine_backward.cu) and the views of the buffers they take by value. Nothing here
// synchronises or allocates, so a budget-mode dispatch and its combine can be captured in a CUDA
// graph. Every kernel bounds-checks the indices it reads from memory a peer wrote.
// Included only by *_cuda.cpp and .cu files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch/hybridep/kernels/device_state.h"
#include "dispatch/hybridep/kernels/layout_math.h"
#include "dispatch/hybridep/kernels/phase_trace.h"
#include "flexep/comm/symmetric_buffer.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::hybridep {

static_assert(kMaxRanks == kMaxSymmetricPeers, "one lane per rank in the kernels");

constexpr int kThreads = 256;             // the plan and preprocess kernels: 8 warps
constexpr int kDispatchSenderWarps = 4;   // dispatch kernel: warps 0-3 send, warps 4-7 receive
constexpr int kCombineProducerWarps = 4;  // combine kernels: warps 0-3 produce, 4-7 consume

// The dispatch buffer of this rank, as the dispatch-side kernels see it.
struct DispatchView {
  SymmetricPeers peers;  // every rank's dispatch window and flag buffer
  int rank = 0, ranks = 1, experts = 1, local_experts = 1;
  int width = 1, record_bytes = 16, max_chunks = 1;
  OwnerOf owner;  // expert -> owner rank (local_experts)
  long long max_tokens = 0, hidden = 0, capacity_rows = 0;
  unsigned long long off_counts = 0, slot_bytes = 0, off_records = 0, off_probs = 0, off_tokens = 0, off_scales = 0;
  // Plain device memory of this rank.
  DispatchControl* control = nullptr;
  long long* tpe = nullptr;          // [L] tokens_per_expert of this rank (follows control)
  long long* begin = nullptr;        // [L]
  long long* kept = nullptr;         // [L]
  long long* snapshot = nullptr;     // [R * slot_bytes / 8]
  unsigned char* staging = nullptr;  // [R][max_tokens] records
  int* slot_entry = nullptr;         // [T * slots]: destination rank * width + entry, or -1
  unsigned* work = nullptr;          // [2 + max_chunks] work counters (work_items.cuh), zero between kernels
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  int part_tokens = 0;  // part size (parts.h); 0: chosen per call
};

// One dispatch call.
struct DispatchCall {
  const void* hidden = nullptr;   // [T, H] bf16, or e4m3 (dispatch_fp8)
  const void* scales = nullptr;   // [T, H / 128] f32 (dispatch_fp8), moved with the rows
  long long row_bytes = 0;        // bytes of one row: 2H (bf16) or H (e4m3); a multiple of 16
  long long scale_bytes = 0;      // bytes of one row's scales: 0, or H / 32 (a multiple of 16)
  long long tokens = 0;           // T (0 when this rank's checks failed: it then reads no input)
  int slots = 1;                  // k (top-k form) or the buffer's slots (multihot form)
  const void* indices = nullptr;  // [T, slots] expert ids (user indices, or the multihot slots)
  int indices_i64 = 0;
  const float* weights = nullptr;  // [T, slots]
  // The chunk plan of this rank's pairs (pad 1, no budget): counts per global expert, and per slot
  // its rank among its chunk's pairs of its expert (-1 for no or invalid expert), to which
  // plan_chunk_base[chunk][e] (pairs of earlier chunks) adds.
  // inline_plan: no plan kernel ran; T <= kPlanChunkTokens and the preprocess kernel plans the one
  // chunk itself (counts in shared memory, slot ranks into plan_slot_rows, chunk base 0).
  const long long* plan_counts = nullptr;
  const int* plan_chunk_base = nullptr;
  int* plan_slot_rows = nullptr;
  int inline_plan = 0;
  cuda::DeviceErrorRecord* errors = nullptr;  // never null: bad ids found by the plan (header device_* words)
  long long header[word::count] = {};               // this rank's header (device_* words filled on device)
  long long pad_multiple = 1;
  long long budget = -1;  // < 0: blocking mode
  int drop = 0;
  // Blocking mode: CTA 0 of the preprocess kernel copies [control | tokens_per_expert] into this
  // pinned host memory, then writes host_seq to *host_seq_at, so that the host learns the layout
  // without waiting for the data movement (as DeepEP's host-mapped receive counters).
  unsigned char* host_control = nullptr;
  Status* host_status = nullptr;  // and the status, so that an error an earlier call left is raised now
  unsigned* host_seq_at = nullptr;
  unsigned host_seq = 0;
  PhaseTrace* trace = nullptr;  // kernel_timing: the steps' stamps (phase_trace.h); else null
};

// The dispatch a handle belongs to, on this rank (read by combine and the backwards).
struct HandleView {
  const unsigned char* records = nullptr;  // this rank's dispatch window: received records [R][max_tokens]
  int record_bytes = 16;
  long long max_tokens = 0;
  const DispatchControl* control = nullptr;  // tokens of every rank, epoch of the dispatch
  const long long* tpe = nullptr;            // [L]
  const long long* begin = nullptr;          // [L]
  const long long* kept = nullptr;           // [L]
  const unsigned char* staging = nullptr;    // sender side: which ranks got each token
  const int* slot_entry = nullptr;           // [T * slots]
  const int* slot_expert = nullptr;          // multihot: [T * slots] expert of each slot
  int slots = 1;
  int multihot = 0;
  int experts = 1, local_experts = 1;
  long long tokens = 0;  // T on this rank
  long long rows = 0;    // N of this rank's expert-major output
};

// This rank's combine buffer.
struct CombineView {
  SymmetricPeers peers;  // every rank's combine window and flag buffer
  int rank = 0, ranks = 1, width = 1, max_chunks = 1;
  long long max_tokens = 0, hidden = 0;
  unsigned long long off_partials = 0, off_grads = 0;
  int flag_ready = 0, flag_consumed = 0, flag_abort = 0, flag_abort_arg = 0;
  OpControl* control = nullptr;
  unsigned* work = nullptr;  // [2 + R * max_chunks] work counters (work_items.cuh), zero between kernels
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  int part_tokens = 0;  // part size (parts.h); 0: chosen per call
};

// combine (grad_probs null) or dispatch_backward.
struct CombineCall {
  const void* rows = nullptr;         // [N, H] bf16: expert_out or grad_tokens
  void* out = nullptr;                // [T, H] bf16
  const float* grad_probs = nullptr;  // [N] (dispatch_backward)
  float* grad_weights = nullptr;      // [T, k] or [T, E] (zeroed by the caller in the multihot form)
  Phase data_phase = Phase::combine_partials;
  Phase reuse_phase = Phase::combine_reuse;
  int failed_arg = 0;  // FailedArg: this rank's checks failed; it moves nothing and tells every peer why
};

// --- chunk_plan.cu -------------------------------------------------------------------------------------
// The single-GPU plan (pad 1, no budget) in one kernel of chunks (chunk_plan_math.h): per global
// expert the pair count, per (chunk, expert) the pairs of earlier chunks, and each slot's rank in
// its chunk (-1: no or invalid expert); bad ids reported as the general plan (src/cuda/local_plan*)
// reports them. For up to kChunkPlanMaxSmem / 32 experts: every count a hybridep buffer takes.
struct ChunkPlanCall {
  const void* indices = nullptr;  // [tokens, slots] expert ids
  int indices_i64 = 0;
  long long tokens = 0;
  int slots = 1, experts = 1;
  long long* counts = nullptr;  // [experts]
  int* chunk_base = nullptr;    // [plan_chunks(tokens)][experts]
  int* slot_rank = nullptr;     // [tokens * slots]
  unsigned* done = nullptr;     // CTAs finished; zero between calls (the last CTA zeroes it)
  cuda::DeviceErrorRecord* errors = nullptr;
};
constexpr std::size_t kChunkPlanMaxSmem = 200 * 1024;
bool chunk_plan_fits(int experts);
void prepare_chunk_plan(int experts);  // raises the shared-memory limit (buffer creation, never in a capture)
void launch_chunk_plan(const ChunkPlanCall& c, int grid, cudaStream_t stream);

// --- preprocess.cu -------------------------------------------------------------------------------------
// Multihot -> `slots` slots per token: the routed experts in ascending order, then -1 (prob 0). A
// token routed to more than `slots` experts is reported as "routing_map" (value = its count).
void launch_multihot_slots(const unsigned char* routing_map, const float* probs, long long tokens, int experts,
                           int slots, int* slot_expert, float* slot_weight, cuda::DeviceErrorRecord* errors,
                           cudaStream_t stream);
// Count exchange, layout of every rank, the abort decision, staging records and slot entries.
// `grid` CTAs of kThreads; dynamic shared memory preprocess_smem_bytes(E).
// Five arrays of E 64-bit values (lay_out_call); the fused kernel puts them beside its rings.
__host__ __device__ constexpr std::size_t preprocess_smem_bytes(int experts) {
  return static_cast<std::size_t>(experts) * 5 * sizeof(long long);
}
// `after_plan`: the launch directly follows launch_chunk_plan on `stream`, so it may be scheduled
// while the plan runs (programmatic dependent launch; the kernel waits for the plan grid's
// completion before it reads anything).
void launch_preprocess(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream,
                       bool after_plan = false);
// Raises the kernel's dynamic shared memory limit once (outside any graph capture).
void prepare_preprocess(int experts);

// --- dispatch.cu -------------------------------------------------------------------------------------------
// Bulk copies through shared-memory rings. False when a row (row_bytes + scale_bytes) is too large
// for the rings (more than 32 KB): the dispatcher refuses such an H when it is created.
bool dispatch_supported(long long row_bytes, long long scale_bytes);
// `after_preprocess`: the launch directly follows launch_preprocess on `stream` (nothing in between),
// so it may overlap the preprocess kernel's tail (programmatic dependent launch; the kernel still
// waits for the preprocess grid's completion before it reads anything).
void launch_dispatch(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream,
                     bool after_preprocess = false);
// Raises the kernels' dynamic shared-memory limits on the current device (once per buffer, outside
// any graph capture): the dispatch kernel's and the fused small-call kernel's.
void prepare_dispatch();
// A call whose tokens fit one plan chunk (DispatchCall::inline_plan) as ONE kernel: the preprocess
// steps in every CTA, then the dispatch roles (same protocol, records, flags and output bytes), no
// preprocess kernel. Returns its grid: the largest of at most `max_grid` CTAs in which every
// pipeline sends a part of the call's `tokens` (parts.h, fused_grid; what makes the count slots
// safe to reuse without the preprocess kernel's grid boundary), or 0 when the call cannot take it:
// more than 8 slots per token, or the preprocess arrays of E experts leave too little shared memory
// for the rings.
int dispatch_small_grid(long long row_bytes, long long scale_bytes, int experts, int slots, long long tokens,
                        int max_grid, int part_tokens);
void launch_dispatch_small(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream);

// --- combine.cu ------------------------------------------------------------------------------------------
// False for rows it cannot hold (H > 8192): the dispatcher refuses such an H when it is created.
bool combine_supported(long long hidden);
void launch_combine(const CombineView& v, const HandleView& h, const CombineCall& c, int grid, cudaStream_t stream);
void prepare_combine();  // as prepare_dispatch

// --- combine_backward.cu ---------------------------------------------------------------------------------
// grad_out [T, H] -> out [N, H] along the handle, with bulk copies through shared-memory rings.
// False for rows it cannot hold (2H > 32 KB). `failed_arg` (FailedArg, not none): this rank's checks
// failed; it moves nothing, and every peer's kernel reports an abort naming this rank and the argument.
bool combine_backward_supported(long long hidden);
void launch_combine_backward(const CombineView& v, const HandleView& h, const void* grad_out, void* out, int grid,
                             cudaStream_t stream, int failed_arg);
void prepare_combine_backward();  // as prepare_dispatch

}  // namespace flexep::hybridep
