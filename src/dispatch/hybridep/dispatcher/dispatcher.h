// The hybridep TokenDispatcher (include/flexep/dispatch/hybridep.h has the data flow). The class is
// split over dispatcher_cuda.cpp (set-up, buffers, SM counts, error checks, factory),
// dispatch_cuda.cpp (dispatch) and combine_cuda.cpp (combine, the backwards).
// Included only by *_cuda.cpp files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dispatch/common/failed_arg.h"
#include "dispatch/hybridep/dispatcher/buffers.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/dispatch/hybridep.h"

namespace flexep::hybridep {

// What a dispatch leaves for its combine and backwards: which dispatch it was. The metadata itself
// (records, staging, slot entries, the receiver layout) stays in the dispatch buffer, valid until
// the next dispatch on it; `sequence` and `storage` detect a stale handle.
struct HepHandle final : HandleState {
  std::uint64_t sequence = 0;                // dispatch call number on this dispatcher
  std::shared_ptr<DispatchStorage> storage;  // the buffer of that call
  DispatchMode mode = DispatchMode::blocking;
  int slots = 1;  // k, or the buffer's slots in the multihot form
};

// Pinned host memory the checks copy into (copies into pageable memory would block without the
// deadline of wait_stream). `control` is [DispatchControl | tokens_per_expert [L]], written by the
// preprocess kernel in blocking mode, which then writes the call's number into `control_seq`.
struct Readback {
  Status status;
  cuda::DeviceErrorRecord errors;
  long long dropped;
  alignas(16) unsigned char control[sizeof(DispatchControl) + 8 * 1024];  // L <= 1024 local experts
  Status published_status;  // the device status as the preprocess kernel saw it (with `control`)
  unsigned control_seq;
};

class Dispatcher final : public HybridEpDispatcher {
 public:
  Dispatcher(std::shared_ptr<Communicator> comm, int num_experts, const HybridEpOptions& options);
  ~Dispatcher() override;

  std::string_view backend() const override { return "hybridep"; }
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->size(); }
  int num_experts() const override { return experts_; }
  std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t max_tokens_per_rank) const override;
  std::int64_t max_tokens_per_rank() const override { return options_.max_tokens_per_rank; }

  DispatchResult dispatch(const DispatchInput& input, const DispatchOptions& options) override;
  HybridEpFp8Result dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                 const DispatchOptions& options) override;
  Tensor combine(const Handle& handle, const TensorView& expert_out) override;
  DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                  const TensorView& grad_token_probs) override;
  Tensor combine_backward(const Handle& handle, const TensorView& grad_out) override;

  const HybridEpOptions& options() const override { return options_; }
  HybridEpMemory memory() const override;
  void resize(const HybridEpOptions& options) override;
  void release() override;
  void init() override;
  void set_num_sms(int dispatch, int combine, int preprocess) override;
  HybridEpSms num_sms() const override;
  void check_errors() override;
  std::int64_t last_dropped() override;
  HybridEpKernelTimes kernel_times() override;
  void combine_into(const Handle& handle, const TensorView& expert_out, const TensorView& out) override;
  void combine_backward_into(const Handle& handle, const TensorView& grad_out, const TensorView& out) override;

 public:
  struct Routing;  // a call's checked routing shape (dispatch_cuda.cpp)

 private:
  enum Event { ev_plan, ev_preprocess, ev_dispatch, ev_dispatch_end, ev_combine, ev_combine_end, ev_count };

  cudaStream_t stream() const;
  void require_usable() const;
  void ensure_initialized();
  const HepHandle& own_handle(const Handle& handle) const;
  std::string sms_source() const;  // where sms_per_rank comes from, for the SM-count errors
  void check_tensor(const TensorView& t, const std::string& arg) const;  // device + 16-byte alignment
  // A [rows, H] tensor of the handle's hidden dtype (check_handle_tensor), then check_tensor.
  void check_rows(const TensorView& t, std::int64_t rows, const HepHandle& h, const std::string& arg) const;
  // Runs `checks`; when one raises an argument error, stops the call on every rank (stop_together)
  // and raises it.
  template <class Checks>
  void checked(Phase data, Phase reuse, Checks&& checks);
  // Waits for `s` (deadline) and raises what the kernels recorded, clearing it. `op` names the call.
  void check(cudaStream_t s, const std::string& op);
  // Waits on the host until done() holds (true) or the stream has finished without it (false);
  // past a generous deadline raises TimeoutError(op) saying `failure`.
  bool wait_until(cudaStream_t s, const std::string& op, const char* failure, const std::function<bool()>& done);
  void wait_stream(cudaStream_t s, const std::string& op);
  // Blocking dispatch: waits until the preprocess kernel has published call `seq`'s layout into
  // readback_->control (false: the stream finished without it, which only a bug would cause).
  bool wait_control(cudaStream_t s, unsigned seq, const std::string& op);
  void record(Event e, cudaStream_t s);
  bool blocking_check(const HepHandle& h) const {
    return options_.check_blocking_calls && h.mode == DispatchMode::blocking;
  }

  // dispatch and dispatch_fp8 (fp8: e4m3 rows + `scales`; the scales output view goes to *scales_out).
  DispatchResult dispatch_impl(const DispatchInput& input, const TensorView& scales, const DispatchOptions& options,
                               bool fp8, Tensor* scales_out);
  // dispatch_impl's steps, in order (dispatch_cuda.cpp).
  DispatchCall describe_call(const RankHeader& mine, const Routing& rt, const DispatchOptions& options, bool fp8,
                             bool failed);
  // The routing as slots, and the chunk plan; true when the plan kernel was the last launch.
  bool plan_routing(DispatchCall& c, const DispatchInput& input, const TensorView& scales, const Routing& rt,
                    const HybridEpSms& sms, bool overlap);
  void launch_exchange(DispatchCall& c, const HybridEpSms& sms, bool after_plan, bool overlap);
  [[noreturn]] void abort_failed_call(cudaStream_t s, const std::exception_ptr& local);
  std::int64_t read_layout(cudaStream_t s, unsigned seq, DispatchResult& result);  // blocking: out rows
  std::int64_t device_layout(const DispatchOptions& options, DispatchResult& result);  // budget: budget rows
  void wrap_rows(DispatchResult& result, std::int64_t rows, std::int64_t hidden, bool fp8, Tensor* scales_out);
  std::shared_ptr<HepHandle> make_handle(const Routing& rt, std::int64_t rows, DispatchMode mode);
  HandleView handle_view(const HepHandle& h) const;
  // The part of a HandleView that the dispatch buffer alone gives (records, token counts, epoch).
  static HandleView storage_view(const DispatchStorage& st);
  void run_combine(const HepHandle& h, const TensorView& rows, const TensorView& out, const TensorView& grad_probs,
                   const TensorView& grad_weights, Phase data, Phase reuse, cudaStream_t s);
  void run_combine_backward(const HepHandle& h, const TensorView& grad_out, const TensorView& out, cudaStream_t s);
  // This rank's checks failed in combine or a backward (phase `data`): its kernel still runs, moving
  // nothing, so that every peer's call ends with an argument error naming this rank and `why`
  // instead of a timeout. Then the caller raises its own error.
  void stop_together(Phase data, Phase reuse, FailedArg why);

  std::shared_ptr<Communicator> comm_;
  int experts_;
  HybridEpOptions options_;
  BufferConfig config_;
  std::shared_ptr<DispatchStorage> dispatch_;
  std::shared_ptr<CombineStorage> combine_;
  Status* status_ = nullptr;      // device
  PhaseTrace* trace_ = nullptr;   // device: the last traced dispatch's stamps (kernel_timing)
  bool traced_ = false;           // trace_ holds the last dispatch's stamps
  bool one_kernel_ = false;       // the last dispatch ran as the fused small-call kernel
  Readback* readback_ = nullptr;         // pinned host
  Readback* readback_device_ = nullptr;  // the same memory, as the GPU addresses it
  cuda::DeviceErrors errors_;
  std::uint64_t dispatch_seq_ = 0;
  bool broken_ = false;
  std::string broken_why_;
  HybridEpSms own_sms_;
  cudaEvent_t events_[ev_count] = {};
  bool recorded_[ev_count] = {};
};

// Refuses (ArgumentError naming "options", with the GiB needed and free) buffers for `options` that
// the device cannot hold, counting `reusable` bytes a resize frees first.
void require_memory(const HybridEpOptions& options, int ranks, int experts, int device, std::size_t reusable);

}  // namespace flexep::hybridep
