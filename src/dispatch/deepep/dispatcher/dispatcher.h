// The deepep TokenDispatcher (include/flexep/dispatch/deepep.h has the data flow). The class is
// split over dispatcher_cuda.cpp (options, handles, errors), buffers_cuda.cpp (the window and every
// buffer: sizes, init, release, resize), dispatch_cuda.cpp (dispatch and combine_backward, the row
// stores), combine_cuda.cpp (combine and dispatch_backward, the way back) and low_latency_cuda.cpp.
// Included only by *_cuda.cpp files.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dispatch/common/call_signature.h"
#include "dispatch/common/device_deadline.h"
#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/deepep/kernels/low_latency.h"
#include "flexep/comm/communicator.h"
#include "flexep/comm/symmetric_buffer.h"
#include "flexep/core/rank_major.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/deepep.h"

namespace flexep::deepep {

// What a dispatch leaves for its combine and the backwards. HandleState::rows is the rows of the
// layout the caller holds (recv_x's N, or the expert-major M); the rows moved are always the N
// rank-major ones.
struct DeepEpHandle : HandleState {
  std::uint64_t sequence = 0;
  std::uint64_t generation = 0;                   // the buffers it refers to (Dispatcher::generation_)
  std::int64_t recv_rows = 0;                     // N
  bool budget = false;                            // budget mode: no call of this handle waits for the GPU
  Tensor call_layout;                             // layout_word, int64 on the device
  Tensor slot_expert;                             // [T * k] int32, validated ids (-1: none)
  Tensor dest_row;                                // [R * T] int32: row on rank d, -1 = not sent
  Tensor recv_src;                                // [N] int32: the source token of each received row (-1: tail)
  // expert_major only: the received row of every entry (-1: padding), each slot's entry (-1: an
  // expert elsewhere), each row's entries in ascending local expert (-1 after the last).
  Tensor expert_rows, slot_pos, row_order;        // [M], [N * k], [N * k] int32
};

// What a low-latency dispatch leaves for its combine: the call's shape (the routes stay in the
// dispatcher's buffers, hence only the latest low-latency handle combines).
struct LowLatencyHandle : HandleState {
  std::uint64_t sequence = 0;
  std::uint64_t generation = 0;
};

// The low-latency mode's per-rank device buffers (outside the window), allocated at creation.
struct LowLatencyBuffers {
  Tensor recv_x, recv_scales, recv_count, recv_src_info, layout_range, route, out;
};

class Dispatcher final : public DeepEpDispatcher {
 public:
  Dispatcher(std::shared_ptr<Communicator> comm, int num_experts, const DeepEpOptions& options);
  ~Dispatcher() override;

  std::string_view backend() const override { return "deepep"; }
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->size(); }
  int num_experts() const override { return experts_; }
  std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t max_tokens_per_rank) const override;
  std::int64_t max_tokens_per_rank() const override { return options_.max_tokens_per_rank; }

  DispatchResult dispatch(const DispatchInput& input, const DispatchOptions& options) override;
  Fp8DispatchResult dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                 const DispatchOptions& options) override;
  LowLatencyResult low_latency_dispatch(const TensorView& x, const TensorView& indices,
                                        const TensorView& scales) override;
  Tensor low_latency_combine(const Handle& handle, const TensorView& expert_out, const TensorView& indices,
                             const TensorView& weights) override;
  Tensor combine(const Handle& handle, const TensorView& expert_out) override;
  DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                  const TensorView& grad_token_probs) override;
  Tensor combine_backward(const Handle& handle, const TensorView& grad_out) override;
  void check_errors() override;
  std::int64_t last_dropped() override;

  const DeepEpOptions& options() const override { return options_; }
  DeepEpMemory memory() const override;
  void resize(const DeepEpOptions& options) override;
  void release() override;
  void init() override;
  void set_num_sms(int sms) override;
  int num_sms() const override { return send_ctas(); }

  // What options size, on `ranks` ranks of `num_experts` experts (checked by check_options).
  struct Sizes {
    int max_topk = 0;
    std::int64_t capacity_rows = 0;
    int ll_slots = 0;
  };
  static Sizes sizes_of(const DeepEpOptions& options, int ranks, int num_experts);
  static WindowLayout window_layout(const DeepEpOptions& options, int ranks, int num_experts);
  static std::size_t state_bytes(int ranks, int num_experts);  // OpControl per kind, Status, the snapshot
  static std::size_t budget_buffer_bytes(const DeepEpOptions& options, int ranks, int num_experts);
  static std::size_t low_latency_buffer_bytes(const DeepEpOptions& options, int ranks, int num_experts);

 private:
  // What every call opens: CUDA initialised, this rank's device and the call's stream current
  // (temporaries and outputs are allocated, and freed, on it).
  class CallScope {
   public:
    CallScope(int device, cudaStream_t s) : init_((cuda::init(), true)), device_(device), current_(s), stream(s) {}

   private:
    bool init_;
    cuda::DeviceGuard device_;
    cuda::StreamGuard current_;

   public:
    const cudaStream_t stream;
  };
  CallScope open_call() const { return CallScope(comm_->device(), stream()); }

  // dispatch and dispatch_fp8 (fp8: e4m3 rows with `scales`; their output goes to *scales_out).
  DispatchResult dispatch_rows(const DispatchInput& input, const TensorView& scales, const DispatchOptions& options,
                               bool fp8, Tensor* scales_out);

  // The count exchange's outcome on this rank: the layout words on the device, and the sizes.
  struct CallLayout {
    Tensor words;                                // layout_word
    std::int64_t recv_rows = 0;                  // N: recv_x's rows (budget: the budget, or the window's
                                                 // rows for the expert-major layout)
    std::int64_t entries = 0;                    // expert_rows' length (budget: its capacity, or the
                                                 // budget for the expert-major layout)
    std::vector<std::int64_t> tokens_per_expert;  // blocking mode
  };
  // Blocking mode: one host all-gather; every error of the call is raised here, on every rank.
  CallLayout exchange_on_host(const call_signature::CallSignature& mine, const std::exception_ptr& local,
                              const Tensor& counts_host, const DispatchOptions& options);
  // Where a dispatch's rows land (device/chunk_rows.cuh): the count kernel's masks and their chunk
  // bases; `budget`: the drop policy's rank-major budget (-1: none).
  struct RowPlaces {
    const unsigned* dest_mask = nullptr;
    const int* chunk_base = nullptr;
    std::int64_t chunks = 0;
    long long budget = -1;
  };
  // Budget mode: the notify kernel (which also writes the chunk bases); errors reach the host at
  // the next check (check()).
  CallLayout exchange_on_device(const call_signature::CallSignature& mine, const Tensor& counts,
                                const DispatchOptions& options, int k, bool failed, const RowPlaces& places);
  // The count exchange's words of every rank, read: the signatures, rows[s * R + d] from source s
  // to receiver d, and pairs[s * E + e] from source s for global expert e.
  struct Gathered {
    std::vector<call_signature::CallSignature> headers;
    std::vector<std::int64_t> rows, pairs;
  };
  Gathered read_gathered(const long long* all) const;
  // The rules every rank applies to the gathered words, blocking mode's and budget mode's decoding
  // alike: a peer's failure, a mismatch, a receiver over the budget or over its window raise the
  // same error on every rank; else every receiver's layout.
  std::vector<RankMajorLayout> agree(const Gathered& g, const DispatchOptions& options) const;
  // The error every rank raises for an aborted budget-mode call, from the count exchange's words;
  // returns without raising when this rank's own failure was raised already.
  void raise_abort();
  std::string epochs(const Status& st) const;  // a timeout's epochs, for its message
  // A combine or backward that a peer stopped (its own checks failed): the error every other rank
  // raises, naming that rank and its argument. The dispatcher stays usable.
  [[noreturn]] void raise_peer_failure(const Status& st, const std::string& op);
  // This rank's checks failed in combine, a backward (kind): it still takes part, sending nothing
  // and telling every peer why, so that every rank stops together; then the caller raises.
  void stop_together(Kind kind, Phase phase, FailedArg why);
  // A dispatch's per-call device tensors. Blocking mode allocates them; budget mode takes views of
  // buffers the dispatcher owns, so that a captured CUDA graph allocates nothing it keeps: a budget
  // dispatch's handle and outputs are valid until the next budget dispatch. Those whose size is the
  // window's are allocated at creation; the expert-major layout's outputs (entry_rows: the rows as
  // bf16 elements, entry_scales) and a pad above 128's lists grow with the call's budget
  // (reserve_budget).
  enum class Scratch : int { slot_expert, dest_mask, counts, layout, dest_row, recv_src, tokens_per_expert,
                             expert_rows, chunk_base, token_probs, slot_pos, row_order, entry_rows, entry_scales, kinds };
  Tensor scratch(bool budget, Scratch which, std::int64_t n, bool zero);
  static DType scratch_dtype(Scratch which);
  static std::array<std::int64_t, static_cast<std::size_t>(Scratch::kinds)> budget_buffer_sizes(
      const DeepEpOptions& options, int ranks, int num_experts);
  void allocate_budget_buffers();
  // Budget mode, in the local checks: grows the buffers this call needs. Inside a CUDA graph
  // capture a buffer cannot grow (it would become the graph's own allocation): an ArgumentError
  // naming options.budget_rows, on every rank, as for any failed local check.
  void reserve_budget(const DispatchOptions& options, int k, std::int64_t hidden, bool fp8);
  void allocate_low_latency_buffers();
  // CTAs of the send kernels and of the low-latency kernels: DeepEpOptions::sms, DeepEP's 20 by default.
  int send_ctas() const { return options_.sms > 0 ? options_.sms : 20; }
  int low_latency_ctas() const { return send_ctas(); }
  // The calls of the two ways rows travel, with what every call of a kind shares (this rank, its
  // peers and window, the kind's operation state, the deadline); the callers add the rows.
  SendRowsCall rows_sender(Kind kind) const;
  ReceiveCall rows_receiver(Kind kind, Phase phase, const ReceiveCall* listing) const;
  SendPartialsCall partials_sender(Kind kind) const;
  ReduceCall partials_reducer(Kind kind, Phase phase) const;
  // K of the low-latency routes and of ll_back: at most 32 slots per token (a warp's lanes).
  int ll_slots() const { return max_topk_ < kMaxLowLatencyTopk ? max_topk_ : kMaxLowLatencyTopk; }
  const LowLatencyHandle& own_low_latency_handle(const Handle& handle) const;
  cudaStream_t stream() const;
  void check_options(int num_experts);  // options_ alone; sets max_topk_ and capacity_rows_
  // Collective: `options` checked on every rank and their sizes compared with rank 0's; on success
  // they become options_, else every rank raises (`phase` names the step) and options_ stays.
  void agree_on_options(const DeepEpOptions& options, const std::string& phase);
  // Collective: the window, the flags, the operation state and the modes' buffers for options_.
  void allocate();
  void ensure_initialized() {
    if (local_ == nullptr) init();
  }
  // combine, the backwards: a dispatcher whose buffers were released holds no handle's rows.
  void require_buffers() const;
  // A [rows, H] bf16 argument of combine or a backward: the handle's shape, this GPU, 16-byte aligned.
  void check_rows(const TensorView& t, std::int64_t rows, const DeepEpHandle& h, const std::string& arg) const;
  const DeepEpHandle& own_handle(const Handle& handle) const;
  void check_generation(std::uint64_t generation) const;  // a handle from before a release or resize
  void require_usable() const;
  // Waits for `s` and raises what the kernels recorded (a timeout names the phase and the rank);
  // after a timeout the dispatcher is unusable.
  void check(cudaStream_t s, const std::string& op);
  // What travels of each token: its row, of row_bytes, and with FP8 rows its scales.
  struct RowPayload {
    const void* rows = nullptr;     // [T, row_bytes]
    long long row_bytes = 0;
    const float* scales = nullptr;  // [T, scale_cols] or null
    int scale_cols = 0;
  };
  static RowPayload bf16_rows(const TensorView& rows) { return {rows.data, 2 * rows.size(1), nullptr, 0}; }
  // Sends the payload (this rank's tokens) along the handle's dest_row into the peers' windows
  // at `rows_at` (with the slots when given), then waits for the rows coming here.
  // `listing`: the receive kernels also list each local expert's rows (and, for the expert-major
  // layout, the entries' probs and places). `places`: a dispatch, whose send kernel places each row
  // from the masks and writes h.dest_row (else the rows follow h.dest_row). In budget mode the send
  // kernel also clears the region's tail (TailCall).
  void move_rows(const DeepEpHandle& h, const RowPayload& payload, const Tensor* slot_expert, const TensorView& weights,
                 unsigned long long rows_at, Kind kind, Phase phase, const ReceiveCall* listing,
                 const RowPlaces* places);
  // Level 1 of the combine for the expert-major layout: the handle's [M, H] entries -> [N, H] rows
  // (and, with grad_probs [M], their slots' gradients [N, k]).
  Tensor sum_entries(const DeepEpHandle& h, const TensorView& entries, const TensorView& grad_probs, Tensor* grad_w);
  // The way back: `rows` ([N, H], one per received token) to their sources, summed there into out.
  void move_back(const DeepEpHandle& h, const TensorView& rows, const TensorView& grad_w, const TensorView& out,
                 const TensorView& out_w, Kind kind, Phase phase);
  char* window() const { return static_cast<char*>(sym_.local()); }
  const unsigned* own_flags() const;

  std::shared_ptr<Communicator> comm_;
  int experts_;
  DeepEpOptions options_;
  std::int64_t capacity_rows_ = 0;
  int max_topk_ = 0;
  WindowLayout win_;
  SymmetricBuffer sym_;
  char* local_ = nullptr;  // device: OpControl[kKinds], then Status
  OpControl* ops_ = nullptr;
  Status* status_ = nullptr;
  long long* snapshot_ = nullptr;  // [R * P]: the count exchange's words of an aborted call
  std::uint64_t generation_ = 0;  // buffers allocated or released so far
  std::array<Tensor, static_cast<std::size_t>(Scratch::kinds)> budget_buffers_;
  std::uint64_t budget_sequence_ = 0;  // the latest budget dispatch's handle
  Tensor dropped_;                     // [1] int64: the pairs the latest budget dispatch dropped here
  bool last_was_budget_ = false;
  LowLatencyBuffers ll_;
  std::uint64_t ll_sequence_ = 0;      // the latest low-latency dispatch's handle
  cuda::DeviceErrors errors_;
  std::uint64_t calls_ = 0;
  bool broken_ = false;
  std::string broken_why_;
};

}  // namespace flexep::deepep
