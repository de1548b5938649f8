// Router backward, one warp per token: grad_weights [T, k] -> grad_logits [T, E], the exact
// derivative of the forward (the CPU Gate::backward formulas, in fp64 whatever the score dtype).
#include "cuda/router_device.cuh"
#include "cuda/router_kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::router {

namespace {

constexpr double kNormEps = 1e-20;

template <class S>
__global__ void __launch_bounds__(kTokenBlockThreads)
    router_backward_kernel(const BackwardParams pr, const BackwardArgs<S> a) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kTokensPerBlock + warp;
  if (t >= a.tokens) return;  // whole warps only: the shuffles below stay full-warp
  const int E = pr.experts, k = pr.topk;

  // Slot j on lane j: through route_scale and the normalisation w = w0 / (sum w0 + eps).
  const bool in_slot = lane < k;
  double gw = 0, w0 = 0;
  int expert = -1;
  if (in_slot) {
    const std::int64_t o = t * k + lane;
    gw = pr.route_scale * static_cast<double>(a.grad_weights[o]);
    w0 = static_cast<double>(a.topk_scores[o]);
    const std::int64_t id = a.indices[o];
    expert = id >= 0 && id < E ? static_cast<int>(id) : -1;  // only ever compared with expert ids
  }
  if (pr.normalized) {
    const double sum = warp_sum(w0) + kNormEps;
    const double dot = warp_sum(gw * w0);
    gw = in_slot ? gw / sum - dot / (sum * sum) : 0.0;
  }

  // g starts as dLoss/dscores (only the aux term for plain softmax, whose weights bypass the scores)
  // and becomes dLoss/dlogits in place; two register arrays per lane.
  double p[kMaxPerLane], g[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + kWarpSize * i;
    p[i] = e < E ? static_cast<double>(a.scores[t * E + e]) : 0.0;
    g[i] = 0;
  }
  if (!pr.topk_then_softmax) scatter_add_from_slots(g, expert, gw, k, lane);

  if (pr.aux && (a.mask == nullptr || a.mask[t])) {
    // dL/d original_scores = aux_scale * f_e / Lctx, then through their own normalisation (the
    // original scores are p, or p + bias: the same sum the forward made in S).
    double local_sum = 0, local_dot = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + kWarpSize * i;
      if (e < E) {
        const double orig =
            a.score_offset ? static_cast<double>(a.scores[t * E + e] + static_cast<S>(a.score_offset[e])) : p[i];
        local_sum += orig;
        local_dot += pr.aux_scale * a.f_over_ctx[e] * orig;
      }
    }
    const double denom = pr.normalized ? warp_sum(local_sum) + kNormEps : 1.0;
    const double dot = warp_sum(local_dot);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + kWarpSize * i;
      if (e < E) {
        const double d = pr.aux_scale * a.f_over_ctx[e];
        g[i] += pr.normalized ? d / denom - dot / (denom * denom) : d;
      }
    }
  }

  // Through the score function (p and g are zero outside the row).
  if (pr.score == kSigmoid) {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) g[i] = g[i] * p[i] * (1.0 - p[i]);
  } else if (pr.score == kSqrtSoftplus) {
    // p = sqrt(softplus(z)): dp/dz = softplus'(z) / (2 p), softplus' = sigmoid (1 beyond 20).
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + kWarpSize * i;
      if (e < E && g[i] != 0.0) {
        const double z = static_cast<double>(a.logits[t * E + e]);
        const double ds = z > 20.0 ? 1.0 : 1.0 / (1.0 + exp(-z));
        g[i] = g[i] * ds / (2.0 * p[i]);
      }
    }
  } else {
    double local = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) local += g[i] * p[i];
    const double dot = warp_sum(local);
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) g[i] = p[i] * (g[i] - dot);
  }
  if (pr.topk_then_softmax) {
    // w0 = softmax over the k selected logits: straight to those logits.
    const double dot = warp_sum(gw * w0);
    scatter_add_from_slots(g, expert, in_slot ? w0 * (gw - dot) : 0.0, k, lane);
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + kWarpSize * i;
    if (e < E) a.grad_logits[t * E + e] = static_cast<S>(g[i]);
  }
}

}  // namespace

template <class S>
void launch_router_backward(const BackwardParams& p, const BackwardArgs<S>& a, cudaStream_t stream) {
  if (a.tokens == 0) return;
  const std::int64_t blocks = (a.tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  router_backward_kernel<S><<<static_cast<unsigned>(blocks), kTokenBlockThreads, 0, stream>>>(p, a);
  FLEXEP_CUDA_CHECK_LAUNCH("router_backward_kernel");
}

template void launch_router_backward<float>(const BackwardParams&, const BackwardArgs<float>&, cudaStream_t);
template void launch_router_backward<double>(const BackwardParams&, const BackwardArgs<double>&, cudaStream_t);

}  // namespace flexep::cuda::router
