// The `hybridep` backend of the TokenDispatcher: dispatch and combine as our own CUDA kernels over
// NVLink, on NCCL symmetric memory (NCCL 2.28 device API, NCCL_WIN_DEFAULT windows, never
// multicast). All ranks must be in one NVLink domain (at most 32 ranks). docs/hybridep.md has the
// design; in short, per call on each rank:
//
//   dispatch:  the single-GPU plan ranks this rank's (token, expert) pairs per expert (CUB, stable);
//              a preprocess kernel writes [header | counts per expert] into every rank's window and
//              waits for everyone's, computes every rank's expert-major layout (core/plan.cpp's
//              arithmetic, padding and the budget rule included) and stages one record per
//              (token, destination rank); the persistent dispatch kernel stores each token row ONCE
//              per destination rank over NVLink into the first of its rows there, with its
//              (row, prob) pairs, and publishes each 32-token chunk with a release flag; receiver
//              warps of the same kernel acquire the flags, copy the row into the token's other rows,
//              write the probs and zero the padding. The output IS the window: no copy, no permute.
//   combine:   on each owner rank, a token's rows summed in fp32 over ascending local expert and
//              rounded to bf16 (one partial row per (token, source rank), in the owner's window);
//              the source rank pulls the partials over NVLink and sums them in fp32 over ascending
//              owner rank: the two-level sum of docs/semantics.md, bitwise equal to the host backend.
//   backwards: dispatch_backward is the combine of grad_tokens, whose owners also return each
//              pair's prob gradient; combine_backward pulls grad_out rows along the saved handle
//              (no count exchange, no planning) into a fresh [N, H] tensor.
//
// Every flag carries a monotonically increasing epoch (no reset kernels, no barrier kernels), set
// with release and read with acquire at system scope; every wait has a deadline (%globaltimer,
// timeout_seconds): on expiry the kernel records the phase and the rank it waited for, exits, and
// the host raises TimeoutError(phase, peer). After a timeout the dispatcher is unusable.
//
// VALIDITY OF OUTPUTS (as in Hybrid-EP): DispatchResult::tokens and token_probs are views of this
// dispatcher's receive window, valid until the next dispatch on the same dispatcher (stream order);
// the handle likewise belongs to its dispatch: using it after the next dispatch is an ArgumentError
// naming "handle". Clone the outputs, or use one dispatcher per layer, to keep them longer (the
// MoE layer's backward needs them: one dispatcher per layer). Outputs of combine and the backwards
// are fresh tensors (or caller-provided, *_into).
//
// Modes: blocking (tokens_per_expert on the host; the call waits until the preprocess kernel has
// published the layout, not for the rows to arrive, as DeepEP's dispatch; combine and the
// backwards of a blocking dispatch wait for the GPU unless check_blocking_calls is off) and budget
// (no host synchronisation at all, CUDA-graph capturable together with combine_into; errors are
// recorded on the device and raised by the next host check: check_errors(), last_dropped(), or a
// blocking call). Overflow with the error policy fails the call on every rank; the drop policy
// drops the rows at or past the budget and counts them (last_dropped()).
//
// Errors: argument errors found on one rank travel with the count exchange and are raised on every
// rank, as are configuration mismatches and overflows. Arguments of combine and the backwards are
// checked locally only: a rank that rejects its arguments raises at once, and the others then fail
// with a TimeoutError naming it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "flexep/comm/communicator.h"
#include "flexep/core/config.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep {

struct HybridEpOptions {
  std::int64_t max_tokens_per_rank = 4096;  // T of any rank in one call
  std::int64_t hidden = 0;                  // H (required; a multiple of 8)
  int max_topk = 0;                         // slots per token the buffers hold; 0 = num_experts. The
                                            // multihot form may route a token to at most this many.
  std::int64_t max_recv_rows = 0;           // expert-major rows per rank; 0 = the worst case
  std::int64_t max_pad_multiple = 128;      // the pad_multiple the worst case allows for
  // SM counts (grid sizes, honoured exactly); 0 = the process-wide setting (set_hybridep_num_sms).
  int dispatch_sms = 0, combine_sms = 0, preprocess_sms = 0;
  double timeout_seconds = 100.0;    // deadline of every wait on the device
  cudaStream_t stream = nullptr;     // nullptr: cuda::current_stream() at each call
  bool check_blocking_calls = true;  // see "Modes" above
  bool kernel_timing = false;        // record events around the kernels (kernel_times())
  bool fp8 = false;                  // also allow dispatch_fp8 (H a multiple of 512; a scales region)
  // Tokens per work item of the kernels: 0 = chosen per call (the largest power of two in
  // [4, 32] that gives every pipeline 8+ items, down to 2 while a pipeline would get none;
  // docs/hybridep.md), or 1, 2, 4, 8, 16, 32 (sweeps).
  int part_tokens = 0;

  // SM counts from Automodel-style configuration: dispatch_sms(), combine_sms(), preprocess_sms().
  static HybridEpOptions from_backend(const BackendConfig& backend, std::int64_t max_tokens_per_rank,
                                      std::int64_t hidden);
};

// Bytes of device memory, per buffer: the symmetric window, its NCCL flag buffer, and plain device
// memory next to it (plan scratch, staging, control).
struct HybridEpMemory {
  std::size_t dispatch_window = 0, dispatch_flags = 0, dispatch_local = 0;
  std::size_t combine_window = 0, combine_flags = 0, combine_local = 0;
  std::size_t total() const {
    return dispatch_window + dispatch_flags + dispatch_local + combine_window + combine_flags + combine_local;
  }
};

using HybridEpFp8Result = Fp8DispatchResult;

struct HybridEpSms {
  int dispatch = 0, combine = 0, preprocess = 0;
};

// A step of the last dispatch on this GPU (kernel_timing): when the earliest and the
// latest CTA reached it, microseconds after the first preprocess CTA started (the device clock).
struct HybridEpPhase {
  std::string name;  // src/dispatch/hybridep/kernels/phase_trace.h lists the steps
  double first = 0, last = 0;
};

// Time of the last call's kernels (events around them; kernel_timing must be on). Microseconds;
// 0 for a kernel that has not run.
struct HybridEpKernelTimes {
  double plan = 0;  // the single-GPU plan (multihot slots, chunk plan kernel) before the preprocess kernel
  double preprocess = 0, dispatch = 0, combine = 0;
  // The dispatch ran as one kernel (a call that fits one plan chunk): its preprocess
  // steps are inside `dispatch`, and `preprocess` is ~0.
  bool one_kernel = false;
  std::vector<HybridEpPhase> dispatch_phases;  // in the order of the steps; those reached only
};

class HybridEpDispatcher : public TokenDispatcher {
 public:
  // Bytes the buffers of a dispatcher with these options would hold on `ranks` ranks.
  static HybridEpMemory size_hint(const HybridEpOptions& options, int ranks, int num_experts);

  virtual const HybridEpOptions& options() const = 0;
  virtual HybridEpMemory memory() const = 0;  // held now (0 after release())
  // Collective (same options on every rank, verified): new buffers for new options. Outputs and
  // handles of earlier dispatches become invalid.
  virtual void resize(const HybridEpOptions& options) = 0;
  // Collective: frees the buffers (outputs still referenced keep their window alive); the next
  // call, or init(), allocates them again.
  virtual void release() = 0;
  virtual void init() = 0;  // collective; the factory calls it

  // Grid sizes of this dispatcher's kernels (0 = the process-wide setting). Checked against the
  // GPU's SM count. Graphs keep the sizes they were captured with.
  virtual void set_num_sms(int dispatch, int combine = 0, int preprocess = 0) = 0;
  virtual HybridEpSms num_sms() const = 0;  // the effective counts

  // Waits for this dispatcher's stream (with a deadline) and raises what its kernels recorded:
  // device argument errors, aborted calls (every rank raises alike), timeouts.
  virtual void check_errors() = 0;
  // Waits and returns the pairs the last dispatch dropped on this rank as receiver (drop policy).
  virtual std::int64_t last_dropped() = 0;
  virtual HybridEpKernelTimes kernel_times() = 0;  // waits for the events

  // FP8 dispatch (options().fp8): input.hidden [T, H] e4m3 (pre-quantized) with `scales` [T, H / 128]
  // f32, one scale per 128 consecutive elements of a row; both travel with the token (the row once
  // per destination rank, like bf16 rows) and land expert-major. Semantics as dispatch().
  virtual HybridEpFp8Result dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                         const DispatchOptions& options) = 0;

  // Allocation-free forms for CUDA graphs: `out` [T, H] bf16 (combine) / [N, H] bf16
  // (combine_backward) on this dispatcher's GPU.
  virtual void combine_into(const Handle& handle, const TensorView& expert_out, const TensorView& out) = 0;
  virtual void combine_backward_into(const Handle& handle, const TensorView& grad_out, const TensorView& out) = 0;
};

// Process-wide SM counts of every hybridep dispatcher whose own counts are 0 (DeepEP's
// Buffer.set_num_sms). combine and preprocess 0 = the dispatch count. Defaults: 20, 20, 20
// (BackendConfig::dispatcher_num_sms).
void set_hybridep_num_sms(int dispatch, int combine = 0, int preprocess = 0);
HybridEpSms hybridep_num_sms();

// Collective: allocates the buffers on every rank. `comm` is this rank's communicator (its GPU is
// where inputs must live); num_experts = E, a multiple of comm->size().
std::unique_ptr<HybridEpDispatcher> make_hybridep_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                             const HybridEpOptions& options);

}  // namespace flexep
