// combine and the two backwards of the hybridep dispatcher. None exchanges counts or plans: the
// layout comes from the handle's dispatch, still in the dispatch buffer. Each call is one kernel on
// the combine buffer; a blocking dispatch's calls wait for it and raise device errors
// (check_blocking_calls), a budget dispatch's calls never wait.
#include "dispatch/hybridep/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

void Dispatcher::check_rows(const TensorView& t, std::int64_t rows, const HepHandle& h, const std::string& arg) const {
  check_handle_tensor(t, rows, h.hidden, h.hidden_dtype, arg);
  check_tensor(t, arg);
}

void Dispatcher::run_combine(const HepHandle& h, const TensorView& rows, const TensorView& out,
                             const TensorView& grad_probs, const TensorView& grad_weights, Phase data, Phase reuse,
                             cudaStream_t s) {
  CombineCall c;
  c.rows = rows.data;
  c.out = out.data;
  c.grad_probs = grad_probs.defined() ? grad_probs.ptr<float>() : nullptr;
  c.grad_weights = grad_weights.defined() ? grad_weights.ptr<float>() : nullptr;
  c.data_phase = data;
  c.reuse_phase = reuse;
  CombineView view = combine_->view(status_, options_.timeout_seconds);
  view.part_tokens = options_.part_tokens;
  record(ev_combine, s);
  launch_combine(view, handle_view(h), c, num_sms().combine, s);
  record(ev_combine_end, s);
}

void Dispatcher::run_combine_backward(const HepHandle& h, const TensorView& grad_out, const TensorView& out,
                                      cudaStream_t s) {
  record(ev_combine, s);
  CombineView view = combine_->view(status_, options_.timeout_seconds);
  view.part_tokens = options_.part_tokens;
  launch_combine_backward(view, handle_view(h), grad_out.data, out.data, num_sms().combine, s, 0);
  record(ev_combine_end, s);
}

template <class Checks>
void Dispatcher::checked(Phase data, Phase reuse, Checks&& checks) {
  try {
    checks();
  } catch (const Error&) {
    stop_together(data, reuse, failed_arg_of(std::current_exception()));
    throw;
  }
}

void Dispatcher::stop_together(Phase data, Phase reuse, FailedArg why) {
  // Without buffers no peer can be in this call (every handle comes from a dispatch of all ranks).
  if (!dispatch_ || !combine_) return;
  const cudaStream_t s = stream();
  // The handle may be the bad argument: the kernel reads only the last dispatch's token counts.
  const HandleView h = storage_view(*dispatch_);
  CombineView view = combine_->view(status_, options_.timeout_seconds);
  view.part_tokens = options_.part_tokens;
  if (data == Phase::combine_backward_rows) {
    launch_combine_backward(view, h, nullptr, nullptr, num_sms().combine, s, static_cast<int>(why));
  } else {
    CombineCall c;
    c.data_phase = data;
    c.reuse_phase = reuse;
    c.failed_arg = static_cast<int>(why);
    launch_combine(view, h, c, num_sms().combine, s);
  }
  // Peers that failed in this same call left their abort words here too: this rank raises its own
  // error, so their record is dropped (the next check would raise it a second time). A timeout
  // stays: the dispatcher is unusable then. (Inside a capture nothing ran.)
  if (cuda::capturing(s)) return;
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(s));
  Status st;
  FLEXEP_CUDA_CHECK(cudaMemcpy(&st, status_, sizeof st, cudaMemcpyDeviceToHost));
  if (st.code == static_cast<int>(StatusCode::abort) && st.phase == static_cast<int>(data))
    FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));
}

Tensor Dispatcher::combine(const Handle& handle, const TensorView& expert_out) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  cuda::StreamGuard stream_guard(stream());  // `out` is allocated on the call's stream
  require_usable();
  const HepHandle* h = nullptr;
  checked(Phase::combine_partials, Phase::combine_reuse, [&] { h = &own_handle(handle); });
  Tensor out = Tensor::empty({h->tokens, h->hidden}, DType::bf16, Device::cuda(comm_->device()));
  combine_into(handle, expert_out, out);
  return out;
}

void Dispatcher::combine_into(const Handle& handle, const TensorView& expert_out, const TensorView& out) {
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  require_usable();
  const HepHandle* hp = nullptr;
  checked(Phase::combine_partials, Phase::combine_reuse, [&] {
    hp = &own_handle(handle);
    check_rows(expert_out, hp->rows, *hp, "expert_out");
    check_rows(out, hp->tokens, *hp, "out");
  });
  const HepHandle& h = *hp;
  run_combine(h, expert_out, out, TensorView(), TensorView(), Phase::combine_partials, Phase::combine_reuse, s);
  if (blocking_check(h)) check(s, "combine");
}

DispatchGrads Dispatcher::dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                            const TensorView& grad_token_probs) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  cuda::StreamGuard stream_guard(s);
  require_usable();
  const HepHandle* hp = nullptr;
  checked(Phase::dispatch_backward_partials, Phase::dispatch_backward_reuse, [&] {
    hp = &own_handle(handle);
    check_rows(grad_tokens, hp->rows, *hp, "grad_tokens");
    check_handle_tensor(grad_token_probs, hp->rows, -1, hp->prob_dtype, "grad_token_probs");
    check::device(grad_token_probs, Device::cuda(comm_->device()), "grad_token_probs");
  });
  const HepHandle& h = *hp;
  const Device dev = Device::cuda(comm_->device());
  DispatchGrads g;
  g.hidden = Tensor::empty({h.tokens, h.hidden}, DType::bf16, dev);
  // [T, k] gets a value in every slot; [T, E] only in routed cells, the rest must be 0.
  g.weights = Tensor::empty({h.tokens, h.multihot ? experts_ : h.slots}, DType::f32, dev);
  if (h.multihot) cuda::zero_async(g.weights, s);
  run_combine(h, grad_tokens, g.hidden, grad_token_probs, g.weights, Phase::dispatch_backward_partials,
              Phase::dispatch_backward_reuse, s);
  if (blocking_check(h)) check(s, "dispatch_backward");
  return g;
}

Tensor Dispatcher::combine_backward(const Handle& handle, const TensorView& grad_out) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  cuda::StreamGuard stream_guard(stream());  // `out` is allocated on the call's stream
  require_usable();
  const HepHandle* h = nullptr;
  checked(Phase::combine_backward_rows, Phase::combine_backward_reuse, [&] { h = &own_handle(handle); });
  Tensor out = Tensor::empty({h->rows, h->hidden}, DType::bf16, Device::cuda(comm_->device()));
  combine_backward_into(handle, grad_out, out);
  return out;
}

void Dispatcher::combine_backward_into(const Handle& handle, const TensorView& grad_out, const TensorView& out) {
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  require_usable();
  const HepHandle* hp = nullptr;
  checked(Phase::combine_backward_rows, Phase::combine_backward_reuse, [&] {
    hp = &own_handle(handle);
    check_rows(grad_out, hp->tokens, *hp, "grad_out");
    check_rows(out, hp->rows, *hp, "out");
  });
  const HepHandle& h = *hp;
  run_combine_backward(h, grad_out, out, s);
  if (blocking_check(h)) check(s, "combine_backward");
}

}  // namespace flexep::hybridep
