// combine and the two backwards of the alltoall dispatcher. None exchanges counts or plans: the
// message sizes and positions all come from the handle; each first tells every rank whether its
// arguments passed their checks (checked_on_every_rank).
//   combine:           partial sums on the owner -> back to the source -> sum over owners;
//   dispatch_backward: the same with grad_tokens, the return messages also carrying each entry's
//                      prob grad, gathered back to the slots on the source;
//   combine_backward:  grad_out packed like the dispatch's rows -> scattered to the same rows.
#include <exception>
#include <vector>

#include "dispatch/alltoall/dispatcher/dispatcher.h"
#include "dispatch/alltoall/dispatcher/transfer.h"
#include "dispatch/alltoall/kernels/kernels.h"
#include "dispatch/common/failed_arg.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

const AlltoallHandle& AlltoallDispatcher::own_handle(const Handle& handle) const {
  check_handle(handle);
  const auto* h = dynamic_cast<const AlltoallHandle*>(handle.get());
  FLEXEP_CHECK_ARG(h != nullptr, "handle", "claims this dispatcher as owner but is not an alltoall handle");
  return *h;
}

void AlltoallDispatcher::check_device(const TensorView& t, const std::string& arg) const {
  check::device(t, Device::cuda(comm_->device()), arg);
}

template <class Checks>
const AlltoallHandle& AlltoallDispatcher::checked_on_every_rank(const std::string& call, Checks&& checks) {
  const AlltoallHandle* h = nullptr;
  std::exception_ptr failed;
  try {
    h = &checks();
  } catch (const Error&) {
    failed = std::current_exception();
  }
  if (world_size() == 1) {  // nobody to tell
    if (failed) std::rethrow_exception(failed);
    return *h;
  }
  const long long mine = static_cast<long long>(failed ? failed_arg_of(failed) : FailedArg::none);
  const std::vector<long long> all = comm_->all_gather_i64({mine}, call + ":checks");
  if (failed) std::rethrow_exception(failed);
  for (int r = 0; r < world_size(); ++r)
    if (const long long word = all[static_cast<std::size_t>(r)]; word != 0)
      raise_peer_failure(r, call, static_cast<FailedArg>(word), comm_->rank(), "alltoall " + call);
  return *h;
}

Tensor AlltoallDispatcher::reduce(const AlltoallHandle& h, const TensorView& rows, const TensorView& grad_probs,
                                  Tensor* weight_grads, const std::string& phase) {
  const cudaStream_t s = stream();
  const Device dev = Device::cuda(comm_->device());
  const int R = world_size(), M = h.meta_width;
  const std::int64_t T = h.tokens, H = h.hidden;
  const bool with_probs = weight_grads != nullptr;

  // Level 1 on this rank as owner: one partial row per received row.
  Tensor partial = Tensor::empty({h.total_recv, H}, DType::bf16, dev);
  Tensor probs_out, probs_back;
  if (with_probs) {
    probs_out = Tensor::empty({h.total_recv * M}, DType::f32, dev);
    probs_back = Tensor::empty({h.total_send * M}, DType::f32, dev);
  }
  launch_partial_sums(rows.data, h.out_row.data<std::int32_t>(), h.total_recv, M, H, partial.raw(),
                      with_probs ? grad_probs.ptr<float>() : nullptr, with_probs ? probs_out.data<float>() : nullptr,
                      s);

  // Back along the dispatch's routes, reversed.
  Tensor returned = Tensor::empty({h.total_send, H}, DType::bf16, dev);
  const Routes back{h.recv_count, h.recv_offset, h.send_count, h.send_offset};
  {
    const cudaStream_t cs = fork(s);
    const Lane rows_lane{partial.raw(), returned.raw(), static_cast<std::size_t>(H) * 2};
    if (with_probs)
      send_recv(*comm_, cs, back, {rows_lane, {probs_out.raw(), probs_back.raw(), M * sizeof(float)}}, phase);
    else
      send_recv(*comm_, cs, back, {rows_lane}, phase);
    join(s, join_event_);
  }

  // Level 2 on this rank as source.
  Tensor out = Tensor::empty({T, H}, DType::bf16, dev);
  launch_sum_partials(returned.raw(), h.send_pos.data<std::int32_t>(), T, R, H, out.raw(), s);
  if (with_probs) {
    *weight_grads = Tensor::empty({T, h.multihot ? experts_ : h.slots}, DType::f32, dev);
    if (h.multihot) cuda::zero_async(*weight_grads, s);  // only routed cells are written
    launch_gather_weight_grads(probs_back.data<float>(), h.slot_entry.data<std::int32_t>(),
                               h.slot_expert.data<std::int32_t>(), T, h.slots, h.multihot,
                               weight_grads->data<float>(), s);
  }
  comm_->wait(s, phase);
  return out;
}

Tensor AlltoallDispatcher::combine(const Handle& handle, const TensorView& expert_out) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  cuda::StreamGuard stream_guard(stream());
  const AlltoallHandle& h = checked_on_every_rank("combine", [&]() -> const AlltoallHandle& {
    const AlltoallHandle& own = own_handle(handle);
    check_handle_tensor(expert_out, own.rows, own.hidden, own.hidden_dtype, "expert_out");
    check_device(expert_out, "expert_out");
    return own;
  });
  return reduce(h, expert_out, TensorView(), nullptr, "combine:partials");
}

DispatchGrads AlltoallDispatcher::dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                                    const TensorView& grad_token_probs) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  cuda::StreamGuard stream_guard(stream());
  const AlltoallHandle& h = checked_on_every_rank("dispatch_backward", [&]() -> const AlltoallHandle& {
    const AlltoallHandle& own = own_handle(handle);
    check_handle_tensor(grad_tokens, own.rows, own.hidden, own.hidden_dtype, "grad_tokens");
    check_device(grad_tokens, "grad_tokens");
    check_handle_tensor(grad_token_probs, own.rows, -1, own.prob_dtype, "grad_token_probs");
    check_device(grad_token_probs, "grad_token_probs");
    return own;
  });
  DispatchGrads g;
  g.hidden = reduce(h, grad_tokens, grad_token_probs, &g.weights, "dispatch_backward:partials");
  return g;
}

Tensor AlltoallDispatcher::combine_backward(const Handle& handle, const TensorView& grad_out) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  cuda::StreamGuard stream_guard(s);
  const AlltoallHandle& h = checked_on_every_rank("combine_backward", [&]() -> const AlltoallHandle& {
    const AlltoallHandle& own = own_handle(handle);
    check_handle_tensor(grad_out, own.tokens, own.hidden, own.hidden_dtype, "grad_out");
    check_device(grad_out, "grad_out");
    return own;
  });
  const Device dev = Device::cuda(comm_->device());
  const std::int64_t H = h.hidden;

  Tensor send_rows = Tensor::empty({h.total_send, H}, DType::bf16, dev);
  launch_pack_rows(grad_out.data, h.tokens, H, world_size(), h.send_pos.data<std::int32_t>(), send_rows.raw(), s);
  Tensor recv_rows = Tensor::empty({h.total_recv, H}, DType::bf16, dev);
  const Routes forward{h.send_count, h.send_offset, h.recv_count, h.recv_offset};
  {
    const cudaStream_t cs = fork(s);
    send_recv(*comm_, cs, forward, {{send_rows.raw(), recv_rows.raw(), static_cast<std::size_t>(H) * 2}},
              "combine_backward:rows");
    join(s, join_event_);
  }
  Tensor out = Tensor::empty({h.rows, H}, DType::bf16, dev);
  cuda::zero_async(out, s);  // padding, budget tail and dropped rows get no gradient
  launch_scatter_rows(recv_rows.raw(), nullptr, h.out_row.data<std::int32_t>(), h.total_recv, h.meta_width, H,
                      out.raw(), nullptr, s);
  comm_->wait(s, "combine_backward:rows");
  return out;
}

}  // namespace flexep::alltoall
