// The expert activations with the routing prob applied inside the FFN (DESIGN §2), one row at a
// time. h is the gate/up projection row ([up_dim]), a the activation row ([inter]):
//   swiglu      h = [gate | up] halves:  a = silu(gate) * up
//   quick_geglu h interleaved (gate = even columns, up = odd columns), gate clamped <= limit,
//               up clamped to [-limit, limit]:  a = gate * sigmoid(alpha * gate) * (up + 1)
//   relu2       h = [inter]:  a = relu(h)^2
// The prob multiply (a * p) is done by the caller. These scalar definitions are the oracle of the
// fused CUDA kernels.
#pragma once

#include <algorithm>
#include <cmath>

#include "flexep/core/config.h"

namespace flexep {

struct ActivationParams {
  Activation kind = Activation::swiglu;
  double alpha = 1.702;
  double limit = 7.0;
};

inline bool is_gated(Activation a) { return a != Activation::relu2; }

template <class R>
inline R sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

// a[i] for i < inter from the pre-activation row h.
template <class R>
inline void activation_forward(const R* h, R* a, int inter, const ActivationParams& p) {
  switch (p.kind) {
    case Activation::swiglu:
      for (int i = 0; i < inter; ++i) {
        const R g = h[i], u = h[inter + i];
        a[i] = g * sigmoid(g) * u;
      }
      break;
    case Activation::quick_geglu: {
      const R alpha = R(p.alpha), limit = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        const R g = std::min(h[2 * i], limit);
        const R u = std::min(std::max(h[2 * i + 1], -limit), limit);
        a[i] = g * sigmoid(alpha * g) * (u + R(1));
      }
      break;
    }
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
  switch (p.kind) {
    case Activation::swiglu:
      for (int i = 0; i < inter; ++i) {
        const R g = h[i], u = h[inter + i], s = sigmoid(g);
        const R silu = g * s;
        grad_h[i] = grad_a[i] * u * (s + g * s * (R(1) - s));
        grad_h[inter + i] = grad_a[i] * silu;
      }
      break;
    case Activation::quick_geglu: {
      const R alpha = R(p.alpha), limit = R(p.limit);
      for (int i = 0; i < inter; ++i) {
        const R graw = h[2 * i], uraw = h[2 * i + 1];
        const R g = std::min(graw, limit);
        const R u = std::min(std::max(uraw, -limit), limit);
        const R s = sigmoid(alpha * g);
        const R glu = g * s;
        const R dglu = s + alpha * g * s * (R(1) - s);
        grad_h[2 * i] = graw <= limit ? grad_a[i] * (u + R(1)) * dglu : R(0);
        grad_h[2 * i + 1] = (uraw >= -limit && uraw <= limit) ? grad_a[i] * glu : R(0);
      }
      break;
    }
    case Activation::relu2:
      for (int i = 0; i < inter; ++i) grad_h[i] = h[i] > R(0) ? grad_a[i] * R(2) * h[i] : R(0);
      break;
  }
}

}  // namespace flexep
