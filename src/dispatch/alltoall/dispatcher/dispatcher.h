// The alltoall TokenDispatcher (see include/flexep/dispatch/alltoall.h for the data flow). The
// class is split over dispatcher_cuda.cpp (set-up, streams, handshake), dispatch_cuda.cpp
// (dispatch) and combine_cuda.cpp (combine, backwards).
// Included only by *_cuda.cpp files.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "dispatch/alltoall/dispatcher/handle.h"
#include "dispatch/alltoall/dispatcher/layout.h"
#include "flexep/comm/communicator.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/dispatch/alltoall.h"

namespace flexep::alltoall {

class AlltoallDispatcher final : public TokenDispatcher {
 public:
  AlltoallDispatcher(std::shared_ptr<Communicator> comm, int num_experts, const AlltoallOptions& options);
  ~AlltoallDispatcher() override;

  std::string_view backend() const override { return "alltoall"; }
  int rank() const override { return comm_->rank(); }
  int world_size() const override { return comm_->size(); }
  int num_experts() const override { return experts_; }
  std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t max_tokens_per_rank) const override;

  DispatchResult dispatch(const DispatchInput& input, const DispatchOptions& options) override;
  Tensor combine(const Handle& handle, const TensorView& expert_out) override;
  DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                  const TensorView& grad_token_probs) override;
  Tensor combine_backward(const Handle& handle, const TensorView& grad_out) override;

 public:
  struct Routing;  // a call's checked routing shape (dispatch_cuda.cpp)

 private:
  struct Staging;
  struct Packed;

  // dispatch's steps, in order (dispatch_cuda.cpp).
  Staging count_slots(const DispatchInput& input, const Routing& rt, const RankHeader& mine, bool failed);
  Exchange exchange_counts(const Tensor& payload);
  RankPlan agree(const Exchange& ex, const DispatchOptions& options, int slots);
  Tensor upload_placement(const RankPlan& rp);
  std::shared_ptr<AlltoallHandle> make_handle(const Routing& rt, const RankPlan& rp, const Tensor& slot_expert);
  Packed pack(AlltoallHandle& h, const Staging& st, const TensorView& hidden, const RankPlan& rp);
  Packed send_tokens(const AlltoallHandle& h, const Packed& sent);
  DispatchResult place_received(AlltoallHandle& h, const Packed& in, const Tensor& placement, const RankPlan& rp,
                                DispatchMode mode);

  // The stream of this call: options.stream, or the thread's current stream.
  cudaStream_t stream() const;
  // The stream NCCL work goes on: `s` itself, or the internal stream made to wait for `s`.
  cudaStream_t fork(cudaStream_t s);
  // Makes `s` wait for the NCCL work issued on the internal stream so far (no-op without one).
  void join(cudaStream_t s, cudaEvent_t event);
  // First call only: all ranks agree on E before any message sized by E is exchanged.
  void handshake();
  const AlltoallHandle& own_handle(const Handle& handle) const;
  // combine and the backwards exchange no counts: every rank's verdict on its arguments goes round
  // first (one word per rank, phase "<call>:checks"), so that one rank's ArgumentError is raised on
  // every rank instead of leaving the others to wait out their deadline for its rows. Returns the
  // handle `checks` found valid; the failing rank raises its own error, the others one naming it.
  template <class Checks>
  const AlltoallHandle& checked_on_every_rank(const std::string& call, Checks&& checks);
  void check_device(const TensorView& t, const std::string& arg) const;
  // combine and dispatch_backward: the two-level sum of `rows` along the handle; with grad_probs,
  // also the prob grads of every slot (weight_grads [T, slots or E]).
  Tensor reduce(const AlltoallHandle& h, const TensorView& rows, const TensorView& grad_probs, Tensor* weight_grads,
                const std::string& phase);

  std::shared_ptr<Communicator> comm_;
  int experts_;
  AlltoallOptions options_;
  cuda::DeviceErrors errors_;
  bool agreed_ = false;
  cudaStream_t comm_stream_ = nullptr;  // separate_stream only
  cudaEvent_t fork_event_ = nullptr, meta_event_ = nullptr, join_event_ = nullptr;
};

}  // namespace flexep::alltoall
