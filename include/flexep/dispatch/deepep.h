// The `deepep` backend of the TokenDispatcher: DeepEP's rank-major layout (docs/semantics.md,
// "Rank-major dispatch"; docs/deepep.md), and the expert-major layout derived from it on the
// receiver, rows moved by our CUDA kernels over NVLink into NCCL
// symmetric windows (NCCL_WIN_DEFAULT, never multicast). All ranks in one NVLink domain, any
// number of them (kMaxSymmetricRanks). Per call on each rank:
//
//   dispatch:  a count kernel validates the ids and counts rows per destination rank and pairs per
//              expert; the counts and the call signature are all-gathered (host sync: blocking mode);
//              every rank derives every receiver's layout (core/rank_major.h); the send kernel places
//              each (token, destination) row from the count kernel's destination masks and writes
//              it ONCE, at its final rank-major place in the destination's window, with its slots
//              (recv_topk_idx, recv_topk_weights) and source token, then releases one flag per
//              destination; the listing kernel acquires them and lists each local expert's rows
//              (expert_rows). recv_x, recv_topk_idx and recv_topk_weights ARE the window: no copy.
//   combine:   each received row travels back to its source's window (one row per (token, rank));
//              the source sums them in fp32 over ascending rank: bitwise the host backend.
//   backwards: dispatch_backward is a combine that also returns the slots' weight gradients;
//              combine_backward writes grad_out rows along the saved layout (no count exchange).
//   expert-major (DispatchOptions::layout, the default): the same rank-major dispatch, then the
//              receiver gathers the rows into its experts' lists (tokens [M, H], token_probs [M]);
//              combine first sums each received row's entries in ascending local expert (level 1
//              of the combine), then runs the rank-major combine; the backwards mirror it.
//
// Every flag carries a growing epoch (one per kind of operation); every wait has a deadline and
// ends in a TimeoutError naming the phase and the rank waited for.
//
// Validity of outputs: recv_x, recv_topk_idx and recv_topk_weights are views of the receive window,
// valid until this rank's next combine call (a peer overwrites them only after that combine's rows
// reached it); the output of combine_backward likewise until the next dispatch_backward. Clone them
// to keep them longer.
//
// Modes. Blocking: the counts cross through one host all-gather, every dispatch waits for the GPU,
// and every error is raised by the call itself on every rank; combine and the backwards wait too
// unless check_blocking_calls is off (then a device error they record is raised by the next
// dispatch). Budget (rank_major layout, overflow = error): the counts cross on the device (the
// notify kernel writes each rank's words into every peer's window), recv_x has budget_rows rows
// (the tail zero, its slots -1), tokens_per_expert stays on the device, and no call waits for the
// GPU, so a dispatch + combine can be captured in a CUDA graph; an argument error, a configuration
// mismatch or a budget overflow is raised on every rank by the next check_errors() (or blocking call).
// Budget mode of the expert_major layout: budget_rows counts expert-major entries (the tokens
// output), every rank-major row is received (max_recv_rows bounds them), the drop policy keeps the
// host plan's prefix of each receiver's entries; its outputs (tokens [budget_rows, H], token_probs)
// are the dispatcher's buffers, valid until the next budget dispatch, sized by the budget: one
// uncaptured call with a budget before capturing calls with it (a capture cannot grow them: an
// ArgumentError naming options.budget_rows).
//
// Low-latency mode (DeepEP's LL): low_latency_dispatch writes the masked expert-major layout
// [E_local, R * T_ll, H] with per-expert counts, low_latency_combine each token's weighted sum;
// one kernel each, no host sync, bitwise the CPU oracle (core/low_latency.h).
//
// Built now: blocking and budget mode of both layouts, low-latency mode, top-k form, bf16 or e4m3
// rows (dispatch_fp8), f32 weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "flexep/comm/communicator.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep {

struct DeepEpOptions {
  std::int64_t hidden = 0;               // H of every call (required)
  std::int64_t max_tokens_per_rank = 0;  // T of any call on any rank, at most (required)
  int max_topk = 0;                      // k at most (0: the number of experts)
  std::int64_t max_recv_rows = 0;        // rows of the receive window (0: ranks * max_tokens_per_rank)
  int sms = 0;                           // CTAs of the send kernels (0: 20, DeepEP's default)
  double timeout_seconds = 30;           // deadline of every device wait
  void* stream = nullptr;                // cudaStream_t of every call; nullptr: the current stream
  bool check_blocking_calls = true;      // combine and the backwards wait for the GPU and raise its errors
  // Low-latency mode: T of a low_latency_dispatch on any rank, at most (DeepEP's
  // num_max_dispatch_tokens_per_rank); 0: no low-latency buffers. They take about
  // 2 * E_local * R * T * 2H bytes of window and local memory (4 * T * max_topk * H more).
  std::int64_t low_latency_max_tokens = 0;
};

// A low-latency dispatch (docs/semantics.md, "Low-latency dispatch"): views of the dispatcher's
// buffers, valid until its next low_latency_dispatch. Nothing is waited for: every tensor is
// on the device, and a dispatch + combine can be captured in a CUDA graph.
struct LowLatencyResult {
  Tensor recv_x;         // [E_local, R * T_ll, H] bf16 (e4m3 for an FP8 dispatch): each expert's rows first
  Tensor recv_scales;    // [E_local, R * T_ll, H / 128] f32 (FP8 dispatch), else empty
  Tensor recv_count;     // [E_local] int32: rows of each local expert
  Tensor recv_src_info;  // [E_local, R * T_ll] int32: each row's source token
  Tensor layout_range;   // [E_local, R] int64: (begin << 32) | count of each source rank's rows
  Handle handle;
};

// Bytes a deepep dispatcher's buffers hold on one rank.
struct DeepEpMemory {
  std::size_t window = 0;  // the NCCL window: recv_x and its slots, the rows coming back, the counts, LL regions
  std::size_t flags = 0;   // the flag buffer (one flag per kind and peer, the abort words)
  std::size_t local = 0;   // this rank's own: operation state, budget-mode buffers, low-latency outputs
  std::size_t total() const { return window + flags + local; }
};

class DeepEpDispatcher : public TokenDispatcher {
 public:
  // Bytes the buffers of a dispatcher with these options would hold on each of `ranks` ranks, as
  // created (a budget-mode expert-major dispatch adds its outputs, sized by its budget).
  static DeepEpMemory size_hint(const DeepEpOptions& options, int ranks, int num_experts);

  virtual const DeepEpOptions& options() const = 0;
  virtual DeepEpMemory memory() const = 0;  // held now (0 after release())
  // Collective (every rank the same sizes, verified: hidden, max_tokens_per_rank, max_topk,
  // max_recv_rows, low_latency_max_tokens): new buffers for new options. Handles and outputs of
  // earlier dispatches become invalid (a stale handle is an ArgumentError naming `handle`). A rank
  // whose options are rejected makes every rank raise, and the old buffers stay.
  virtual void resize(const DeepEpOptions& options) = 0;
  // Collective: waits for the device and every rank, then frees the buffers; handles and outputs
  // of earlier dispatches become invalid. The next dispatch, or init(), allocates them again.
  virtual void release() = 0;
  virtual void init() = 0;  // collective; the factory calls it
  // CTAs of the send, way-back and low-latency kernels (DeepEpOptions::sms; 0: DeepEP's 20), for
  // this rank's later calls (DeepEP's Buffer.set_num_sms). Graphs keep the count they captured.
  virtual void set_num_sms(int sms) = 0;
  virtual int num_sms() const = 0;  // the effective count

  // FP8 dispatch, as DeepEP's dispatch of an (x, x_scales) pair: input.hidden [T, H] e4m3
  // (pre-quantized; H a multiple of 128) with `scales` [T, H / 128] f32; each (token, rank) row
  // and its scales travel once, like bf16 rows, in either layout and either mode. Every rank of
  // a call dispatches the same format. combine and the backwards take and give bf16.
  virtual Fp8DispatchResult dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                         const DispatchOptions& options) = 0;

  // DeepEP's low-latency mode (options.low_latency_max_tokens > 0), one kernel per direction:
  // x [T, H] bf16, or e4m3 with `scales` [T, H / 128] f32; indices [T, k] int32/int64 (k <= 32),
  // -1 for no expert. Every (token, expert) pair travels on its own. A bad id sends nothing and is
  // raised, on this rank, by the next check_errors().
  virtual LowLatencyResult low_latency_dispatch(const TensorView& x, const TensorView& indices,
                                                const TensorView& scales = TensorView()) = 0;
  // expert_out [E_local, R * T_ll, H] bf16 in recv_x's places; indices and weights [T, k] (f32)
  // of the dispatch -> out [T, H] bf16, each token's weighted sum (a view of the dispatcher's
  // buffer, valid until its next low_latency_combine).
  virtual Tensor low_latency_combine(const Handle& handle, const TensorView& expert_out, const TensorView& indices,
                                     const TensorView& weights) = 0;
  // Waits for this dispatcher's GPU work and raises what it recorded: a budget-mode call's argument
  // error, mismatch or overflow (as blocking mode would have raised it, on every rank; the
  // dispatcher stays usable), or a timeout naming the phase and the peer (then it is unusable).
  virtual void check_errors() = 0;
  // Waits and returns the pairs the last dispatch dropped on this rank as receiver: a budget-mode
  // dispatch with the drop policy keeps each receiver's first budget_rows rows of the (source rank,
  // source token) order, or for the expert-major layout the host plan's entries below the budget
  // (DispatchResult::dropped of a budget call stays 0: nothing waits there).
  virtual std::int64_t last_dropped() = 0;
};

std::unique_ptr<DeepEpDispatcher> make_deepep_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                         const DeepEpOptions& options);

}  // namespace flexep
