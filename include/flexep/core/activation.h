// The expert activations with the routing prob applied inside the FFN (docs/semantics.md, "Experts"), one row at a
// time. h is the gate/up projection row ([up_dim]), a the activation row ([inter]):
//   swiglu      h = [gate | up] halves:  a = silu(gate) * up; with swiglu_limit L > 0 gate is
//               clamped <= L and up to [-L, L] first (Automodel's swiglu_clamped / DeepSeek-V4)
//   swigluoai   h = [gate | up] halves; with limit > 0 gate clamped <= limit, up clamped to
//               [-limit, limit]:  a = gate * sigmoid(alpha * gate) * (up + 1)   (GPT-OSS)
//   quick_geglu h interleaved (gate = even columns, up = odd columns), gate clamped <= limit,
//               up clamped to [-limit, limit]:  a = gate * sigmoid(alpha * gate) * (up + 1)
//   geglu       h = [gate | up] halves:  a = gelu_tanh(gate) * up   (torch's tanh approximation)
//   relu2       h = [inter]:  a = relu(h)^2
// The prob multiply (a * p) is done by the caller. These scalar definitions are the oracle of the
// fused CUDA kernels (which compute in fp32).
#pragma once

#include <algorithm>
#include <cmath>

#include "flexep/core/config.h"

namespace flexep {

struct ActivationParams {
  Activation kind = Activation::swiglu;
  double alpha = 1.702;
  double limit = 7.0;
  double swiglu_limit = 0.0;  // swiglu only; 0 = no clamp
};

// The activation parameters of the routed experts (shared experts: swap in shared_expert_activation).
inline ActivationParams activation_params(const MoEConfig& c, Activation kind) {
  return {kind, c.activation_alpha, c.activation_limit, c.swiglu_limit};
}

inline bool is_gated(Activation a) { return a != Activation::relu2; }

template <class R>
inline R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

namespace act_detail {
// torch.clamp(x, max=hi) and clamp(x, -hi, hi), NaN passing through.
template <class R>
inline R clamp_max(R x, R hi) {
  return std::min(x, hi);
}
template <class R>
inline R clamp_sym(R x, R hi) {
  return std::min(std::max(x, -hi), hi);
}
// torch.clamp's backward: the gradient passes where the input lies inside the closed range.
template <class R>
inline bool passes_max(R x, R hi) {
  return x <= hi;
}
template <class R>
inline bool passes_sym(R x, R hi) {
  return x >= -hi && x <= hi;
}

constexpr double kSqrt2OverPi = 0.7978845608028654;
constexpr double kGeluCoeff = 0.044715;

// gelu_tanh(g) = 0.5 g (1 + tanh(k)), k = sqrt(2/pi) (g + 0.044715 g^3), and its derivative.
template <class R>
inline R gelu_tanh(R g) {
  const R k = R(kSqrt2OverPi) * (g + R(kGeluCoeff) * g * g * g);
  return R(0.5) * g * (R(1) + std::tanh(k));
}
template <class R>
inline R gelu_tanh_grad(R g) {
  const R th = std::tanh(R(kSqrt2OverPi) * (g + R(kGeluCoeff) * g * g * g));
  const R dk = R(kSqrt2OverPi) * (R(1) + R(3 * kGeluCoeff) * g * g);
  return R(0.5) * (R(1) + th) + R(0.5) * g * (R(1) - th * th) * dk;
}
}  // namespace act_detail

// a[i] for i < inter from the pre-activation row h.
template <class R>
inline void activation_forward(const R* h, R* a, int inter, const ActivationParams& p) {
  using namespace act_detail;
  switch (p.kind) {
    case Activation::swiglu: {
      const bool clamp = p.swiglu_limit > 0;
      const R lim = R(p.swiglu_limit);
      for (int i = 0; i < inter; ++i) {
        R g = h[i], u = h[inter + i];
        if (clamp) g = clamp_max(g, lim), u = clamp_sym(u, lim);
        a[i] = g * sigmoid(g) * u;
      }
      break;
    }
    case Activation::swigluoai: {
      const bool clamp = p.limit > 0;
      const R alpha = R(p.alpha), lim = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        R g = h[i], u = h[inter + i];
        if (clamp) g = clamp_max(g, lim), u = clamp_sym(u, lim);
        a[i] = g * sigmoid(alpha * g) * (u + R(1));
      }
      break;
    }
    case Activation::quick_geglu: {
      const R alpha = R(p.alpha), limit = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        const R g = clamp_max(h[2 * i], limit);
        const R u = clamp_sym(h[2 * i + 1], limit);
        a[i] = g * sigmoid(alpha * g) * (u + R(1));
      }
      break;
    }
    case Activation::geglu:
      for (int i = 0; i < inter; ++i) a[i] = gelu_tanh(h[i]) * h[inter + i];
      break;
    case Activation::relu2:
      for (int i = 0; i < inter; ++i) {
        const R x = h[i] > R(0) ? h[i] : R(0);
        a[i] = x * x;
      }
      break;
  }
}

// grad_h (length up_dim) from grad_a (length inter). Clamped inputs have zero gradient beyond the
// limit (matching torch.clamp's backward: gradient passes where the input is inside the range,
// boundaries included).
template <class R>
inline void activation_backward(const R* h, const R* grad_a, R* grad_h, int inter, const ActivationParams& p) {
  using namespace act_detail;
  switch (p.kind) {
    case Activation::swiglu: {
      const bool clamp = p.swiglu_limit > 0;
      const R lim = R(p.swiglu_limit);
      for (int i = 0; i < inter; ++i) {
        const R graw = h[i], uraw = h[inter + i];
        const R g = clamp ? clamp_max(graw, lim) : graw, u = clamp ? clamp_sym(uraw, lim) : uraw;
        const R s = sigmoid(g);
        const R silu = g * s;
        grad_h[i] = !clamp || passes_max(graw, lim) ? grad_a[i] * u * (s + g * s * (R(1) - s)) : R(0);
        grad_h[inter + i] = !clamp || passes_sym(uraw, lim) ? grad_a[i] * silu : R(0);
      }
      break;
    }
    case Activation::swigluoai: {
      const bool clamp = p.limit > 0;
      const R alpha = R(p.alpha), lim = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        const R graw = h[i], uraw = h[inter + i];
        const R g = clamp ? clamp_max(graw, lim) : graw, u = clamp ? clamp_sym(uraw, lim) : uraw;
        const R s = sigmoid(alpha * g);
        const R glu = g * s;
        const R dglu = s + alpha * g * s * (R(1) - s);
        grad_h[i] = !clamp || passes_max(graw, lim) ? grad_a[i] * (u + R(1)) * dglu : R(0);
        grad_h[inter + i] = !clamp || passes_sym(uraw, lim) ? grad_a[i] * glu : R(0);
      }
      break;
    }
    case Activation::quick_geglu: {
      const R alpha = R(p.alpha), limit = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        const R graw = h[2 * i], uraw = h[2 * i + 1];
        const R g = clamp_max(graw, limit);
        const R u = clamp_sym(uraw, limit);
        const R s = sigmoid(alpha * g);
        const R glu = g * s;
        const R dglu = s + alpha * g * s * (R(1) - s);
        grad_h[2 * i] = passes_max(graw, limit) ? grad_a[i] * (u + R(1)) * dglu : R(0);
        grad_h[2 * i + 1] = passes_sym(uraw, limit) ? grad_a[i] * glu : R(0);
      }
      break;
    }
    case Activation::geglu:
      for (int i = 0; i < inter; ++i) {
        const R g = h[i], u = h[inter + i];
        grad_h[i] = grad_a[i] * gelu_tanh_grad(g) * u;
        grad_h[inter + i] = grad_a[i] * gelu_tanh(g);
      }
      break;
    case Activation::relu2:
      for (int i = 0; i < inter; ++i) grad_h[i] = h[i] > R(0) ? grad_a[i] * R(2) * h[i] : R(0);
      break;
  }
}

}  // namespace flexep
