// Fused expert activation kernels: bias add, activation, prob multiply (forward) and their backward.
// One warp per row; each lane handles V consecutive outputs at a time (V = 8: 16-byte accesses).
#include "flexep/cuda/expert_activation.h"

#include <cmath>
#include <type_traits>

#include "cuda/expert_rows.cuh"
#include "flexep/cuda/expert_bias.h"

namespace flexep::cuda {
namespace {

using detail::bf16_t;
using detail::kRowThreads;
using detail::kWarpsPerBlock;
using detail::load_bf16;
using detail::store_bf16;

enum ActKind : int { kSwiglu = 0, kQuickGeglu = 1, kRelu2 = 2, kSwigluOai = 3, kGeglu = 4 };

struct Act {
  int kind;
  float alpha, limit;
  float swiglu_limit;  // swiglu: > 0 clamps (Automodel's swiglu_limit)
};

// [gate | up] halves (swiglu, swigluoai, geglu); quick_geglu interleaves, relu2 has no up.
__host__ __device__ inline bool halves(int kind) { return kind == kSwiglu || kind == kSwigluOai || kind == kGeglu; }

__device__ inline float sigmoid_f(float x) { return 1.f / (1.f + expf(-x)); }

// The pre-activation values behind outputs [i, i + V) of one row, bias added: g = gate (swiglu,
// quick_geglu) or the input (relu2), u = up (gated only; 0 for relu2). h and b point at the row.
template <int V>
__device__ inline void load_pre(const Act& act, const bf16_t* h, const bf16_t* b, std::int64_t inter, std::int64_t i,
                                float (&g)[V], float (&u)[V]) {
  if (act.kind == kQuickGeglu) {  // interleaved: gate = even columns, up = odd columns
    float x[2 * V];
    load_bf16<2 * V>(h + 2 * i, x);
    if (b) {
      float y[2 * V];
      load_bf16<2 * V>(b + 2 * i, y);
#pragma unroll
      for (int j = 0; j < 2 * V; ++j) x[j] += y[j];
    }
#pragma unroll
    for (int j = 0; j < V; ++j) {
      g[j] = x[2 * j];
      u[j] = x[2 * j + 1];
    }
    return;
  }
  load_bf16<V>(h + i, g);
  if (b) {
    float y[V];
    load_bf16<V>(b + i, y);
#pragma unroll
    for (int j = 0; j < V; ++j) g[j] += y[j];
  }
  if (halves(act.kind)) {  // gate = [0, inter), up = [inter, 2 inter)
    load_bf16<V>(h + inter + i, u);
    if (b) {
      float y[V];
      load_bf16<V>(b + inter + i, y);
#pragma unroll
      for (int j = 0; j < V; ++j) u[j] += y[j];
    }
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) u[j] = 0.f;
  }
}

// Clamps written as core/activation.h's std::min / std::max (same NaN behaviour).
__device__ inline float clamp_gate(float g, float limit) { return limit < g ? limit : g; }
__device__ inline float clamp_up(float u, float limit) {
  const float lo = u < -limit ? -limit : u;
  return limit < lo ? limit : lo;
}

// gelu_tanh(g) = 0.5 g (1 + tanh(k)), k = sqrt(2/pi) (g + 0.044715 g^3) (core/activation.h).
constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCoeff = 0.044715f;
__device__ inline float gelu_tanh_f(float g) {
  return 0.5f * g * (1.f + tanhf(kSqrt2OverPi * (g + kGeluCoeff * g * g * g)));
}

__device__ inline float act_forward(const Act& act, float g, float u) {
  if (act.kind == kSwiglu) {
    if (act.swiglu_limit > 0.f) g = clamp_gate(g, act.swiglu_limit), u = clamp_up(u, act.swiglu_limit);
    return g * sigmoid_f(g) * u;
  }
  if (act.kind == kQuickGeglu || act.kind == kSwigluOai) {
    const bool clamp = act.kind == kQuickGeglu || act.limit > 0.f;  // swigluoai clamps only when limit > 0
    const float gc = clamp ? clamp_gate(g, act.limit) : g, uc = clamp ? clamp_up(u, act.limit) : u;
    return gc * sigmoid_f(act.alpha * gc) * (uc + 1.f);
  }
  if (act.kind == kGeglu) return gelu_tanh_f(g) * u;
  const float x = g > 0.f ? g : 0.f;
  return x * x;
}

// Backward of one output: grad_a is the gradient reaching act (already times p). Returns the
// activation value in `a` (for grad_probs) and the gradients of the (biased) gate and up inputs.
// Clamp gradients as torch.clamp's backward: they pass where the input is inside the closed range.
__device__ inline void act_backward(const Act& act, float g, float u, float grad_a, float& dg, float& du, float& a) {
  if (act.kind == kSwiglu) {
    const float lim = act.swiglu_limit;
    const bool clamp = lim > 0.f;
    const float gc = clamp ? clamp_gate(g, lim) : g, uc = clamp ? clamp_up(u, lim) : u;
    const float s = sigmoid_f(gc), silu = gc * s;
    a = silu * uc;
    dg = !clamp || g <= lim ? grad_a * uc * (s + gc * s * (1.f - s)) : 0.f;
    du = !clamp || (u >= -lim && u <= lim) ? grad_a * silu : 0.f;
  } else if (act.kind == kQuickGeglu || act.kind == kSwigluOai) {
    const float lim = act.limit;
    const bool clamp = act.kind == kQuickGeglu || lim > 0.f;
    const float gc = clamp ? clamp_gate(g, lim) : g, uc = clamp ? clamp_up(u, lim) : u;
    const float s = sigmoid_f(act.alpha * gc);
    const float glu = gc * s;
    const float dglu = s + act.alpha * gc * s * (1.f - s);
    a = glu * (uc + 1.f);
    dg = !clamp || g <= lim ? grad_a * (uc + 1.f) * dglu : 0.f;
    du = !clamp || (u >= -lim && u <= lim) ? grad_a * glu : 0.f;
  } else if (act.kind == kGeglu) {
    const float th = tanhf(kSqrt2OverPi * (g + kGeluCoeff * g * g * g));
    const float dk = kSqrt2OverPi * (1.f + 3.f * kGeluCoeff * g * g);
    const float gelu = 0.5f * g * (1.f + th);
    a = gelu * u;
    dg = grad_a * (0.5f * (1.f + th) + 0.5f * g * (1.f - th * th) * dk) * u;
    du = grad_a * gelu;
  } else {
    const float x = g > 0.f ? g : 0.f;
    a = x * x;
    dg = g > 0.f ? grad_a * 2.f * g : 0.f;
    du = 0.f;
  }
}

// One instantiation per activation kind K (act.kind == K): each kernel carries only its own math,
// which keeps it within its register budget.
template <int V, int K>
__global__ void __launch_bounds__(kRowThreads)
    activation_forward_kernel(Act act, const bf16_t* __restrict__ h, const bf16_t* __restrict__ bias,
                              const float* __restrict__ probs, const std::int64_t* offsets, int num_experts,
                              std::int64_t rows, std::int64_t inter, bf16_t* __restrict__ out) {
  act.kind = K;  // a compile-time constant from here on: the other kinds' branches fold away
  const std::int64_t up = act.kind == kRelu2 ? inter : 2 * inter;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t active = detail::active_rows(offsets, num_experts, rows);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += nwarps) {
    bf16_t* o = out + row * inter;
    if (row >= active) {
      const float zero[V] = {};
      for (std::int64_t i = static_cast<std::int64_t>(lane) * V; i < inter; i += 32 * V) store_bf16<V>(o + i, zero);
      continue;
    }
    const float p = probs ? probs[row] : 1.f;
    const bf16_t* hr = h + row * up;
    const std::int64_t e = offsets ? detail::find_expert(offsets, num_experts, row) : 0;
    const bf16_t* br = bias ? bias + e * up : nullptr;
    // No aliasing (__restrict__) and an unrolled loop: the next chunks' loads are issued before
    // this chunk's stores, instead of one 16-byte chunk per lane in flight.
#pragma unroll 2
    for (std::int64_t i = static_cast<std::int64_t>(lane) * V; i < inter; i += 32 * V) {
      float g[V], u[V], a[V];
      load_pre<V>(act, hr, br, inter, i, g, u);
#pragma unroll
      for (int j = 0; j < V; ++j) a[j] = act_forward(act, g[j], u[j]) * p;
      store_bf16<V>(o + i, a);
    }
  }
}

template <int V, int K>
__global__ void __launch_bounds__(kRowThreads)
    activation_backward_kernel(Act act, const bf16_t* __restrict__ h, const bf16_t* __restrict__ bias,
                               const float* __restrict__ probs, const std::int64_t* offsets, int num_experts,
                               std::int64_t rows, std::int64_t inter, const bf16_t* __restrict__ grad_ap,
                               bf16_t* __restrict__ grad_h, float* __restrict__ grad_probs) {
  act.kind = K;  // a compile-time constant from here on: the other kinds' branches fold away
  const std::int64_t up = act.kind == kRelu2 ? inter : 2 * inter;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t active = detail::active_rows(offsets, num_experts, rows);
  const std::int64_t nwarps = static_cast<std::int64_t>(gridDim.x) * kWarpsPerBlock;
  // The row loop is uniform per warp, so every lane reaches warp_sum.
  for (std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32; row < rows;
       row += nwarps) {
    bf16_t* gh = grad_h + row * up;
    if (row >= active) {
      const float zero[V] = {};
      for (std::int64_t c = static_cast<std::int64_t>(lane) * V; c < up; c += 32 * V) store_bf16<V>(gh + c, zero);
      if (grad_probs && lane == 0) grad_probs[row] = 0.f;
      continue;
    }
    const float p = probs ? probs[row] : 1.f;
    const bf16_t* hr = h + row * up;
    const bf16_t* gar = grad_ap + row * inter;
    const std::int64_t e = offsets ? detail::find_expert(offsets, num_experts, row) : 0;
    const bf16_t* br = bias ? bias + e * up : nullptr;
    float dot = 0.f;
#pragma unroll 2
    for (std::int64_t i = static_cast<std::int64_t>(lane) * V; i < inter; i += 32 * V) {
      float g[V], u[V], ga[V], dg[V], du[V];
      load_pre<V>(act, hr, br, inter, i, g, u);
      load_bf16<V>(gar + i, ga);
#pragma unroll
      for (int j = 0; j < V; ++j) {
        float a;
        act_backward(act, g[j], u[j], ga[j] * p, dg[j], du[j], a);
        dot += ga[j] * a;
      }
      if (act.kind == kQuickGeglu) {
        float x[2 * V];
#pragma unroll
        for (int j = 0; j < V; ++j) {
          x[2 * j] = dg[j];
          x[2 * j + 1] = du[j];
        }
        store_bf16<2 * V>(gh + 2 * i, x);
      } else {
        store_bf16<V>(gh + i, dg);
        if (halves(act.kind)) store_bf16<V>(gh + inter + i, du);
      }
    }
    dot = detail::warp_sum(dot);
    if (grad_probs && lane == 0) grad_probs[row] = dot;
  }
}

Act make_act(const ActivationParams& p) {
  Act a{};
  switch (p.kind) {
    case Activation::swiglu: a.kind = kSwiglu; break;
    case Activation::swigluoai: a.kind = kSwigluOai; break;
    case Activation::quick_geglu: a.kind = kQuickGeglu; break;
    case Activation::geglu: a.kind = kGeglu; break;
    case Activation::relu2: a.kind = kRelu2; break;
    default: throw_argument_error("act", "unknown activation kind ", static_cast<int>(p.kind));
  }
  FLEXEP_CHECK_ARG(std::isfinite(p.alpha) && std::isfinite(p.limit), "act", "alpha and limit must be finite, got ",
                   p.alpha, " and ", p.limit);
  FLEXEP_CHECK_ARG(p.swiglu_limit >= 0, "act", "swiglu_limit must be >= 0 (infinity allowed), got ", p.swiglu_limit);
  a.alpha = static_cast<float>(p.alpha);
  a.limit = static_cast<float>(p.limit);
  a.swiglu_limit = static_cast<float>(p.swiglu_limit);  // an infinite limit stays infinite: no clamp
  return a;
}

// f(std::integral_constant<int, kind>) for the runtime kind.
template <class F>
void with_kind(int kind, F&& f) {
  switch (kind) {
    case kSwiglu: f(std::integral_constant<int, kSwiglu>{}); break;
    case kQuickGeglu: f(std::integral_constant<int, kQuickGeglu>{}); break;
    case kRelu2: f(std::integral_constant<int, kRelu2>{}); break;
    case kSwigluOai: f(std::integral_constant<int, kSwigluOai>{}); break;
    default: f(std::integral_constant<int, kGeglu>{}); break;
  }
}

template <class T>
const T* ptr_or_null(const TensorView& t) {
  return t.defined() ? static_cast<const T*>(t.data) : nullptr;
}

// Checks what forward and backward share; returns E.
int check_common(const Act& act, const TensorView& h, const TensorView& gate_up_bias, const TensorView& probs,
                 const TensorView& expert_offsets, std::int64_t rows, std::int64_t inter) {
  FLEXEP_CHECK_ARG(inter >= 1, "out", "needs at least one column (inter >= 1), got ", inter);
  const std::int64_t up = act.kind == kRelu2 ? inter : 2 * inter;
  detail::check_matrix(h, rows, up, DType::bf16, "h");
  const int E = detail::check_rows_args(probs, expert_offsets, rows, h.device);
  if (gate_up_bias.defined()) {
    detail::check_matrix(gate_up_bias, E, up, DType::bf16, "gate_up_bias");
    check::device(gate_up_bias, h.device, "gate_up_bias");
  }
  return E;
}

// The kernels take their pointers as __restrict__: an output must share no byte with an input.
void check_disjoint(const TensorView& out, const char* out_name, const TensorView& in, const char* in_name) {
  if (!out.defined() || !in.defined() || out.data == nullptr || in.data == nullptr) return;
  const auto* a = static_cast<const char*>(out.data);
  const auto* b = static_cast<const char*>(in.data);
  const bool overlap = a < b + in.nbytes() && b < a + out.nbytes();
  FLEXEP_CHECK_ARG(!overlap, out_name, "overlaps ", in_name, ": the kernel reads ", in_name, " while it writes ",
                   out_name, "; pass separate memory");
}

}  // namespace

void activation_forward(const ActivationParams& params, const TensorView& h, const TensorView& gate_up_bias,
                        const TensorView& probs, const TensorView& expert_offsets, const TensorView& out,
                        cudaStream_t stream) {
  const Act act = make_act(params);
  check::rank(out, 2, "out");
  const std::int64_t rows = out.size(0), inter = out.size(1);
  const int E = check_common(act, h, gate_up_bias, probs, expert_offsets, rows, inter);
  detail::check_matrix(out, rows, inter, DType::bf16, "out");
  check::device(out, h.device, "out");
  check_disjoint(out, "out", h, "h");
  check_disjoint(out, "out", gate_up_bias, "gate_up_bias");
  check_disjoint(out, "out", probs, "probs");
  if (rows == 0) return;
  DeviceGuard guard(h.device.index);
  const bool vec = inter % 8 == 0 && detail::aligned16(h) && detail::aligned16(gate_up_bias) && detail::aligned16(out);
  const int blocks = detail::row_blocks(rows, h.device.index);
  auto* hp = static_cast<const bf16_t*>(h.data);
  auto* bp = ptr_or_null<bf16_t>(gate_up_bias);
  auto* pp = ptr_or_null<float>(probs);
  auto* op = ptr_or_null<std::int64_t>(expert_offsets);
  auto* outp = static_cast<bf16_t*>(out.data);
  with_kind(act.kind, [&](auto kind) {
    constexpr int K = decltype(kind)::value;
    if (vec)
      activation_forward_kernel<8, K><<<blocks, kRowThreads, 0, stream>>>(act, hp, bp, pp, op, E, rows, inter, outp);
    else
      activation_forward_kernel<1, K><<<blocks, kRowThreads, 0, stream>>>(act, hp, bp, pp, op, E, rows, inter, outp);
  });
  FLEXEP_CUDA_CHECK_LAUNCH("activation_forward");
}

void activation_backward(const ActivationParams& params, const TensorView& h, const TensorView& gate_up_bias,
                         const TensorView& probs, const TensorView& expert_offsets, const TensorView& grad_ap,
                         const TensorView& grad_h, const TensorView& grad_probs, const TensorView& grad_gate_up_bias,
                         cudaStream_t stream) {
  const Act act = make_act(params);
  check::rank(grad_ap, 2, "grad_ap");
  const std::int64_t rows = grad_ap.size(0), inter = grad_ap.size(1);
  const std::int64_t up = act.kind == kRelu2 ? inter : 2 * inter;
  FLEXEP_CHECK_ARG(inter >= 1, "grad_ap", "needs at least one column (inter >= 1), got ", inter);
  const int E = check_common(act, h, gate_up_bias, probs, expert_offsets, rows, inter);
  detail::check_matrix(grad_ap, rows, inter, DType::bf16, "grad_ap");
  check::device(grad_ap, h.device, "grad_ap");
  detail::check_matrix(grad_h, rows, up, DType::bf16, "grad_h");
  check::device(grad_h, h.device, "grad_h");
  if (grad_probs.defined()) {
    check::shape(grad_probs, {rows}, "grad_probs");
    check::dtype(grad_probs, {DType::f32}, "grad_probs");
    check::device(grad_probs, h.device, "grad_probs");
  }
  if (grad_gate_up_bias.defined()) {
    detail::check_matrix(grad_gate_up_bias, E, up, DType::f32, "grad_gate_up_bias");
    check::device(grad_gate_up_bias, h.device, "grad_gate_up_bias");
  }
  check_disjoint(grad_h, "grad_h", h, "h");
  check_disjoint(grad_h, "grad_h", grad_ap, "grad_ap");
  check_disjoint(grad_h, "grad_h", gate_up_bias, "gate_up_bias");
  check_disjoint(grad_probs, "grad_probs", probs, "probs");
  if (rows == 0) return;
  DeviceGuard guard(h.device.index);
  const bool vec = inter % 8 == 0 && detail::aligned16(h) && detail::aligned16(gate_up_bias) &&
                   detail::aligned16(grad_ap) && detail::aligned16(grad_h);
  const int blocks = detail::row_blocks(rows, h.device.index);
  auto* hp = static_cast<const bf16_t*>(h.data);
  auto* bp = ptr_or_null<bf16_t>(gate_up_bias);
  auto* pp = ptr_or_null<float>(probs);
  auto* op = ptr_or_null<std::int64_t>(expert_offsets);
  auto* gap = static_cast<const bf16_t*>(grad_ap.data);
  auto* ghp = static_cast<bf16_t*>(grad_h.data);
  auto* gpp = grad_probs.defined() ? static_cast<float*>(grad_probs.data) : nullptr;
  with_kind(act.kind, [&](auto kind) {
    constexpr int K = decltype(kind)::value;
    if (vec)
      activation_backward_kernel<8, K><<<blocks, kRowThreads, 0, stream>>>(act, hp, bp, pp, op, E, rows, inter, gap,
                                                                           ghp, gpp);
    else
      activation_backward_kernel<1, K><<<blocks, kRowThreads, 0, stream>>>(act, hp, bp, pp, op, E, rows, inter, gap,
                                                                           ghp, gpp);
  });
  FLEXEP_CUDA_CHECK_LAUNCH("activation_backward");
  // The bias gradient is the per-expert column sum of grad_h as stored (what a bf16 autograd graph sums).
  if (grad_gate_up_bias.defined()) expert_column_sum(grad_h, TensorView(), expert_offsets, grad_gate_up_bias, stream);
}

}  // namespace flexep::cuda
