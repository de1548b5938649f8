// The deepep combine and dispatch_backward: one row per received token back to its source, summed
// there over the ranks in ascending order (docs/semantics.md, "Rank-major dispatch"). For the
// expert-major layout, level 1 of the combine first sums each received row's entries here.
#include "dispatch/deepep/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

void Dispatcher::check_rows(const TensorView& t, std::int64_t rows, const DeepEpHandle& h,
                                  const std::string& arg) const {
  check_handle_tensor(t, rows, h.hidden, h.hidden_dtype, arg);
  check::device(t, Device::cuda(comm_->device()), arg);
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg,
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
}

void Dispatcher::move_back(const DeepEpHandle& h, const TensorView& rows, const TensorView& grad_w,
                                 const TensorView& out, const TensorView& out_w, Kind kind, Phase phase) {
  const cudaStream_t s = stream();
  const int ctas = send_ctas();
  SendPartialsCall c = partials_sender(kind);
  c.k = static_cast<int>(h.topk);
  c.rows = h.recv_rows;
  c.hidden = h.hidden;
  c.max_tokens = options_.max_tokens_per_rank;
  c.layout = reinterpret_cast<const long long*>(h.call_layout.raw());
  c.y = rows.data;
  c.grad_w = grad_w.defined() ? grad_w.ptr<float>() : nullptr;
  c.src = h.recv_src.data<std::int32_t>();
  launch_send_partials(c, ctas, s);

  ReduceCall r = partials_reducer(kind, phase);
  r.k = static_cast<int>(h.topk);
  r.tokens = h.tokens;
  r.hidden = h.hidden;
  r.max_tokens = options_.max_tokens_per_rank;
  r.dest_row = h.dest_row.data<std::int32_t>();
  r.slot_expert = h.slot_expert.data<std::int32_t>();
  r.out = out.data;
  r.grad_w = out_w.defined() ? static_cast<float*>(out_w.data) : nullptr;
  r.own_rows = c.y;
  r.own_grad_w = c.grad_w;
  launch_reduce(r, ctas, s);
}

Tensor Dispatcher::sum_entries(const DeepEpHandle& h, const TensorView& entries, const TensorView& grad_probs,
                                     Tensor* grad_w) {
  const Device dev = Device::cuda(comm_->device());
  Tensor rows = Tensor::empty({h.recv_rows, h.hidden}, DType::bf16, dev);
  SumRowsCall c;
  c.entries = entries.data;
  c.row_order = h.row_order.data<std::int32_t>();
  c.layout = h.budget ? reinterpret_cast<const long long*>(h.call_layout.raw()) : nullptr;
  c.rows = h.recv_rows;
  c.hidden = h.hidden;
  c.k = static_cast<int>(h.topk);
  c.out = rows.raw();
  if (grad_w != nullptr) {
    *grad_w = Tensor::empty({h.recv_rows, h.topk}, DType::f32, dev);
    c.grad_probs = grad_probs.ptr<float>();
    c.slot_pos = h.slot_pos.data<std::int32_t>();
    c.grad_w = grad_w->data<float>();
  }
  launch_sum_rows(c, stream());
  return rows;
}

SendPartialsCall Dispatcher::partials_sender(Kind kind) const {
  SendPartialsCall c;
  c.peers = sym_.peer_table();
  c.rank = rank();
  c.ranks = world_size();
  c.win = win_;
  c.op = ops_ + kind;
  c.kind = kind;
  return c;
}

ReduceCall Dispatcher::partials_reducer(Kind kind, Phase phase) const {
  ReduceCall r;
  r.flags = own_flags();
  r.rank = rank();
  r.ranks = world_size();
  r.kind = kind;
  r.local_experts = local_experts();
  r.op = ops_ + kind;
  r.status = status_;
  r.timeout_ns = device_timeout_ns(options_.timeout_seconds);
  r.phase = phase;
  r.window = window();
  r.win = win_;
  return r;
}

void Dispatcher::stop_together(Kind kind, Phase phase, FailedArg why) {
  // Nothing to send and nothing to receive: the kernels only take part in the flags, the sender's
  // carrying why this rank stopped.
  const cudaStream_t s = stream();
  if (kind == kCombineBackward) {  // the rows' way
    SendRowsCall c = rows_sender(kind);
    c.row_bytes = 16;
    c.failed_arg = static_cast<int>(why);
    launch_send_rows(c, 1, s);
    launch_receive(rows_receiver(kind, phase, nullptr), s);
  } else {
    SendPartialsCall c = partials_sender(kind);  // the way back
    c.hidden = 8;
    c.failed_arg = static_cast<int>(why);
    launch_send_partials(c, 1, s);
    ReduceCall r = partials_reducer(kind, phase);
    r.hidden = 8;
    launch_reduce(r, 1, s);
  }
  // Peers that failed in this same call left their abort words here too: this rank raises its own
  // error for the call, so their record is dropped (the next check would raise it a second time).
  // A timeout stays: the dispatcher is unusable then. (Inside a capture nothing ran.)
  if (cuda::capturing(s)) return;
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(s));
  Status st;
  FLEXEP_CUDA_CHECK(cudaMemcpy(&st, status_, sizeof st, cudaMemcpyDeviceToHost));
  if (st.code == static_cast<int>(hybridep::StatusCode::abort) && st.phase == static_cast<int>(phase))
    FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));
}

Tensor Dispatcher::combine(const Handle& handle, const TensorView& expert_out) {
  const CallScope call = open_call();
  const cudaStream_t s = call.stream;
  require_usable();
  require_buffers();
  const DeepEpHandle* hp = nullptr;
  try {
    hp = &own_handle(handle);
    check_rows(expert_out, hp->rows, *hp, "expert_out");
  } catch (const Error&) {
    stop_together(kCombine, Phase::combine_partials, failed_arg_of(std::current_exception()));
    throw;
  }
  const DeepEpHandle& h = *hp;
  Tensor out = Tensor::empty({h.tokens, h.hidden}, DType::bf16, Device::cuda(comm_->device()));
  const bool expert_major = h.layout == DispatchLayout::expert_major;
  const Tensor rows = expert_major ? sum_entries(h, expert_out, TensorView(), nullptr) : Tensor();
  move_back(h, expert_major ? TensorView(rows) : expert_out, TensorView(), out, TensorView(), kCombine,
            Phase::combine_partials);
  if (options_.check_blocking_calls && !h.budget) check(s, "combine");
  return out;
}

DispatchGrads Dispatcher::dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                                  const TensorView& grad_token_probs) {
  const CallScope call = open_call();
  const cudaStream_t s = call.stream;
  require_usable();
  require_buffers();
  const Device dev = Device::cuda(comm_->device());
  const DeepEpHandle* hp = nullptr;
  try {
    hp = &own_handle(handle);
    check_rows(grad_tokens, hp->rows, *hp, "grad_tokens");
    // rank_major: the gradient of recv_topk_weights [N, k]; expert_major: of token_probs [M]
    check_handle_tensor(grad_token_probs, hp->rows, hp->layout == DispatchLayout::expert_major ? -1 : hp->topk,
                        hp->prob_dtype, "grad_token_probs");
    check::device(grad_token_probs, dev, "grad_token_probs");
  } catch (const Error&) {
    stop_together(kDispatchBackward, Phase::dispatch_backward_partials, failed_arg_of(std::current_exception()));
    throw;
  }
  const DeepEpHandle& h = *hp;
  const bool expert_major = h.layout == DispatchLayout::expert_major;
  DispatchGrads g;
  g.hidden = Tensor::empty({h.tokens, h.hidden}, DType::bf16, dev);
  g.weights = Tensor::empty({h.tokens, h.topk}, DType::f32, dev);
  Tensor slot_grads;
  const Tensor rows = expert_major ? sum_entries(h, grad_tokens, grad_token_probs, &slot_grads) : Tensor();
  move_back(h, expert_major ? TensorView(rows) : grad_tokens, expert_major ? TensorView(slot_grads) : grad_token_probs,
            g.hidden, g.weights, kDispatchBackward, Phase::dispatch_backward_partials);
  if (options_.check_blocking_calls && !h.budget) check(s, "dispatch_backward");
  return g;
}

}  // namespace flexep::deepep
