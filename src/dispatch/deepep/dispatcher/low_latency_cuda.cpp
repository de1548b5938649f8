// The deepep low-latency mode (DeepEP's LL, for decode): one kernel per direction, every
// (token, expert) pair on its own, the masked expert-major layout [E_local, R * T_ll, H] with
// per-expert counts. No call waits for the GPU and every output lives in buffers the dispatcher
// allocated at creation, so a dispatch + combine can be captured in a CUDA graph.
#include "dispatch/deepep/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"

namespace flexep::deepep {

std::size_t Dispatcher::low_latency_buffer_bytes(const DeepEpOptions& o, int ranks, int num_experts) {
  const auto T = static_cast<std::size_t>(o.low_latency_max_tokens), R = static_cast<std::size_t>(ranks),
             L = static_cast<std::size_t>(num_experts / ranks), H = static_cast<std::size_t>(o.hidden);
  if (T == 0) return 0;
  // recv_x (bytes), recv_scales, recv_count, recv_src_info, layout_range, route, out: as allocated below
  return L * R * T * 2 * H + L * R * T * (H / kFp8ScaleBlock) * 4 + L * 4 + L * R * T * 4 + L * R * 8 +
         L * R * T * 4 + T * H * 2;
}

void Dispatcher::allocate_low_latency_buffers() {
  const std::int64_t T = options_.low_latency_max_tokens;
  if (T == 0) return;
  const std::int64_t R = world_size(), L = local_experts(), H = options_.hidden;
  const Device dev = Device::cuda(comm_->device());
  ll_.recv_x = Tensor::empty({L, R * T, 2 * H}, DType::e4m3, dev);  // bytes: bf16 rows, or e4m3 ones
  ll_.recv_scales = Tensor::empty({L, R * T, H / kFp8ScaleBlock}, DType::f32, dev);
  ll_.recv_count = Tensor::zeros({L}, DType::i32, dev);
  ll_.recv_src_info = Tensor::empty({L, R * T}, DType::i32, dev);
  ll_.layout_range = Tensor::empty({L, R}, DType::i64, dev);
  ll_.route = Tensor::empty({L, R * T}, DType::i32, dev);
  ll_.out = Tensor::empty({T, H}, DType::bf16, dev);
}

const LowLatencyHandle& Dispatcher::own_low_latency_handle(const Handle& handle) const {
  check_handle(handle);
  const auto* h = dynamic_cast<const LowLatencyHandle*>(handle.get());
  FLEXEP_CHECK_ARG(h != nullptr, "handle", "is not a low-latency handle; low_latency_combine takes what "
                                           "low_latency_dispatch returned");
  check_generation(h->generation);
  FLEXEP_CHECK_ARG(h->sequence == ll_sequence_, "handle",
                   "is from an earlier low_latency_dispatch, whose routes a later one of this dispatcher replaced; "
                   "low_latency_combine takes the latest low-latency handle");
  return *h;
}

LowLatencyResult Dispatcher::low_latency_dispatch(const TensorView& x, const TensorView& indices,
                                                  const TensorView& scales) {
  const CallScope call = open_call();
  require_usable();
  ensure_initialized();
  const std::int64_t TL = options_.low_latency_max_tokens;
  FLEXEP_CHECK_ARG(TL > 0, "options.low_latency_max_tokens",
                   "is 0: this deepep dispatcher has no low-latency buffers; create it with "
                   "DeepEpOptions::low_latency_max_tokens >= the tokens of a low-latency call");
  const Device dev = Device::cuda(comm_->device());
  check::rank(x, 2, "x");
  check::dtype(x, {DType::bf16, DType::e4m3}, "x");
  check::device(x, dev, "x");
  const bool fp8 = x.dtype == DType::e4m3;
  const std::int64_t T = x.size(0), H = x.size(1);
  FLEXEP_CHECK_ARG(H == options_.hidden, "x", "has H=", H, " but this deepep dispatcher was created for "
                   "DeepEpOptions::hidden=", options_.hidden);
  FLEXEP_CHECK_ARG(T <= TL, "x", "has ", T, " tokens, more than the ", TL,
                   " of the low-latency buffers (DeepEpOptions::low_latency_max_tokens)");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(x.data) % 16 == 0, "x",
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
  const int S = fp8 ? static_cast<int>(H / kFp8ScaleBlock) : 0;
  if (fp8) {
    FLEXEP_CHECK_ARG(H % kFp8ScaleBlock == 0, "x", "has H=", H, "; FP8 rows need a multiple of ", kFp8ScaleBlock);
    check::shape(scales, {T, S}, "scales");
    check::dtype(scales, {DType::f32}, "scales");
    check::device(scales, dev, "scales");
  } else {
    FLEXEP_CHECK_ARG(!scales.defined(), "scales", "is given with bf16 rows; scales go with e4m3 rows only");
  }
  check::rank(indices, 2, "indices");
  check::shape(indices, {T, -1}, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  check::device(indices, dev, "indices");
  const int k = static_cast<int>(indices.size(1));
  FLEXEP_CHECK_ARG(k >= 1 && k <= ll_slots(), "indices", "has k=", k, " columns; the low-latency mode takes 1 to ",
                   ll_slots(), " (DeepEpOptions::max_topk, at most ", kMaxLowLatencyTopk, ")");

  const int R = world_size(), L = local_experts();
  const long long row_bytes = fp8 ? H : 2 * H;
  LowLatencyDispatchCall c;
  c.peers = sym_.peer_table();
  c.rank = rank();
  c.ranks = R;
  c.experts = experts_;
  c.local_experts = L;
  c.k = k;
  c.slots = ll_slots();
  c.tokens = T;
  c.max_tokens = TL;
  c.row_bytes = row_bytes;
  c.scale_cols = S;
  c.x = x.data;
  c.scales = fp8 ? scales.ptr<float>() : nullptr;
  c.indices = indices.data;
  c.indices_i64 = indices.dtype == DType::i64;
  c.errors = errors_.record();
  c.win = win_;
  c.op = ops_ + kLowLatencyDispatch;
  c.status = status_;
  c.timeout_ns = device_timeout_ns(options_.timeout_seconds);
  c.recv_x = ll_.recv_x.raw();
  c.recv_scales = fp8 ? ll_.recv_scales.data<float>() : nullptr;
  c.recv_count = ll_.recv_count.data<std::int32_t>();
  c.recv_src_info = ll_.recv_src_info.data<std::int32_t>();
  c.layout_range = reinterpret_cast<long long*>(ll_.layout_range.raw());
  c.route = ll_.route.data<std::int32_t>();
  launch_low_latency_dispatch(c, low_latency_ctas(), call.stream);

  auto h = std::make_shared<LowLatencyHandle>();
  h->backend = "deepep";
  h->owner = this;
  h->rank = rank();
  h->tokens = T;
  h->topk = k;
  h->hidden = H;
  h->rows = R * TL;  // per local expert
  h->local_experts = L;
  h->hidden_dtype = DType::bf16;
  h->sequence = ++ll_sequence_;
  h->generation = generation_;
  LowLatencyResult r;
  r.recv_x = Tensor::wrap(TensorView(ll_.recv_x.raw(), fp8 ? DType::e4m3 : DType::bf16, {L, R * TL, H}, dev));
  if (fp8) r.recv_scales = ll_.recv_scales;
  r.recv_count = ll_.recv_count;
  r.recv_src_info = ll_.recv_src_info;
  r.layout_range = ll_.layout_range;
  r.handle = std::move(h);
  return r;
}

Tensor Dispatcher::low_latency_combine(const Handle& handle, const TensorView& expert_out, const TensorView& indices,
                                       const TensorView& weights) {
  const CallScope call = open_call();
  require_usable();
  require_buffers();
  const LowLatencyHandle& h = own_low_latency_handle(handle);
  const Device dev = Device::cuda(comm_->device());
  const int R = world_size(), L = local_experts();
  const std::int64_t TL = options_.low_latency_max_tokens;
  check::shape(expert_out, {L, R * TL, h.hidden}, "expert_out");
  check::dtype(expert_out, {DType::bf16}, "expert_out");
  check::device(expert_out, dev, "expert_out");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(expert_out.data) % 16 == 0, "expert_out",
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
  check::shape(indices, {h.tokens, h.topk}, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  check::device(indices, dev, "indices");
  check::shape(weights, {h.tokens, h.topk}, "weights");
  check::dtype(weights, {DType::f32}, "weights");
  check::device(weights, dev, "weights");

  LowLatencyCombineCall c;
  c.peers = sym_.peer_table();
  c.rank = rank();
  c.ranks = R;
  c.experts = experts_;
  c.local_experts = L;
  c.k = static_cast<int>(h.topk);
  c.slots = ll_slots();
  c.tokens = h.tokens;
  c.max_tokens = TL;
  c.hidden = h.hidden;
  c.expert_out = expert_out.data;
  c.recv_count = ll_.recv_count.data<std::int32_t>();
  c.route = ll_.route.data<std::int32_t>();
  c.indices = indices.data;
  c.indices_i64 = indices.dtype == DType::i64;
  c.weights = weights.ptr<float>();
  c.win = win_;
  c.op = ops_ + kLowLatencyCombine;
  c.status = status_;
  c.timeout_ns = device_timeout_ns(options_.timeout_seconds);
  c.out = ll_.out.raw();
  launch_low_latency_combine(c, low_latency_ctas(), call.stream);
  return Tensor::wrap(TensorView(ll_.out.raw(), DType::bf16, {h.tokens, h.hidden}, dev));
}

}  // namespace flexep::deepep
