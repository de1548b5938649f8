// The routing kernel: one warp per token computes the scores, the (group-limited) top-k selection and
// the weights exactly as the CPU Gate does (src/layer/gate.cpp, route()), and counts the expert load.
#include <cuda_bf16.h>

#include <type_traits>

#include "cuda/router_device.cuh"
#include "cuda/router_kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::router {

namespace {

constexpr std::size_t align16(std::size_t n) { return (n + 15) / 16 * 16; }

// Shared memory of one warp for group limiting: the selection keys [E], the group scores [G] and
// the kept flags [G].
template <class S>
__host__ __device__ inline std::size_t group_smem_per_warp(int experts, int groups) {
  return align16(sizeof(S) * experts) + align16(sizeof(S) * groups) + align16(groups);
}

// The bias; rounded to bf16 where Automodel casts it to x's dtype (the bf16 linear).
template <class S>
__device__ inline S bias_of(const RouteArgs<S>& a, int e, bool round_bf16) {
  if (a.bias_is_bf16) return static_cast<S>(__bfloat162float(static_cast<const __nv_bfloat16*>(a.bias)[e]));
  const float b = static_cast<const float*>(a.bias)[e];
  return static_cast<S>(round_bf16 ? __bfloat162float(__float2bfloat16_rn(b)) : b);
}


// Softmax over the warp's row (p = exp(z - max) / sum), the sigmoid, or sqrt(softplus) (torch's
// softplus: the identity beyond 20), into p.
template <int kScore, class S>
__device__ inline void row_scores(const RouteParams& pr, const S (&z)[kMaxPerLane], S (&p)[kMaxPerLane], int lane) {
  const int E = pr.experts;
  if constexpr (kScore == kSigmoid) {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + kWarpSize * i < E) p[i] = S(1) / (S(1) + exp_of(-z[i]));
    return;
  }
  if constexpr (kScore == kSqrtSoftplus) {
    static_assert(std::is_same_v<S, float>, "sqrtsoftplus routes in fp32");
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i)
      if (lane + kWarpSize * i < E) p[i] = sqrtf(z[i] > 20.f ? z[i] : log1pf(expf(z[i])));  // S is float
    return;
  }
  S m = negative_infinity<S>();
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + kWarpSize * i < E) m = fmax(m, z[i]);
  m = warp_max(m);
  S sum = 0;
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + kWarpSize * i < E) sum += (p[i] = exp_of(z[i] - m));
  sum = warp_sum(sum);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + kWarpSize * i < E) p[i] = p[i] / sum;
}

// Keeps the limited_groups best groups (score: sum of the top-2 keys or the max key of the group,
// computed sequentially like the CPU so both get the same bits) and sets the keys of the others to
// -inf or multiplies them by 0 (Automodel's mask). `smem` is this warp's slice of
// group_smem_per_warp<S> bytes.
template <class S>
__device__ inline void limit_groups(const RouteParams& pr, S (&key)[kMaxPerLane], unsigned char* smem, int lane) {
  const int E = pr.experts, G = pr.groups, size = E / G;
  S* keys = reinterpret_cast<S*>(smem);
  S* group_score = reinterpret_cast<S*>(smem + align16(sizeof(S) * E));
  unsigned char* kept = smem + align16(sizeof(S) * E) + align16(sizeof(S) * G);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + kWarpSize * i < E) keys[lane + kWarpSize * i] = key[i];
  __syncwarp();
  for (int g = lane; g < G; g += kWarpSize) {
    S first = negative_infinity<S>(), second = first;
    for (int q = 0; q < size; ++q) {
      const S v = keys[g * size + q];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = pr.top2_group_score ? first + second : first;
    kept[g] = 0;
  }
  __syncwarp();
  for (int j = 0; j < pr.limited_groups; ++j) {
    Candidate<S> c = no_candidate<S>();
    for (int g = lane; g < G; g += kWarpSize)
      if (!kept[g] && ranks_before(group_score[g], g, c.key, c.index)) c = {group_score[g], g, S(0)};
    c = warp_best(c);
    if (lane == 0 && c.index != kNoIndex) kept[c.index] = 1;
    __syncwarp();
  }
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + kWarpSize * i;
    if (e < E && !kept[e / size]) key[i] = pr.neg_inf_mask ? negative_infinity<S>() : key[i] * S(0);
  }
}

// One instantiation per score kind (pr.score == kScore) and for replay or top-k selection: each
// carries only its own math. The minimum of one block per SM lets ptxas use the registers the two
// per-lane arrays need (its default occupancy target spills a few bytes); the per-token work is tiny,
// so occupancy is not what limits this kernel.
template <class S, int kScore, bool kReplay>
__global__ void __launch_bounds__(kTokenBlockThreads, 1) route_kernel(const RouteParams pr, const RouteArgs<S> a) {
  extern __shared__ __align__(16) unsigned char route_smem[];
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * kTokensPerBlock + warp;
  if (t >= a.tokens) return;  // the whole warp leaves together: the full-warp shuffles stay valid
  const int E = pr.experts, k = pr.topk;

  // Logits (+ bias, rounded to bf16 for the bf16 linear; written back so the saved logits are the
  // ones the scores come from).
  S* logits = a.logits + t * E;
  S key[kMaxPerLane], p[kMaxPerLane];
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i) {
    const int e = lane + kWarpSize * i;
    key[i] = negative_infinity<S>();
    p[i] = S(0);
    if (e < E) {
      S z = logits[e];
      if (a.bias) z += bias_of(a, e, pr.round_logits_bf16);
      if (pr.round_logits_bf16) z = static_cast<S>(__bfloat162float(__float2bfloat16_rn(static_cast<float>(z))));
      if (a.bias || pr.round_logits_bf16) logits[e] = z;
      key[i] = z;
    }
  }
  row_scores<kScore>(pr, key, p, lane);
#pragma unroll
  for (int i = 0; i < kMaxPerLane; ++i)
    if (lane + kWarpSize * i < E) a.scores[t * E + lane + kWarpSize * i] = p[i];

  // Selection key: the raw logits (plain softmax), else the scores + correction bias, group-limited.
  if (!pr.topk_then_softmax) {
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + kWarpSize * i;
      if (e < E) key[i] = a.correction_bias ? p[i] + static_cast<S>(a.correction_bias[e]) : p[i];
    }
    if (pr.groups > 1 && !kReplay)
      limit_groups(pr, key, route_smem + static_cast<std::size_t>(warp) * group_smem_per_warp<S>(E, pr.groups), lane);
  }

  // Lane j keeps slot j: its expert and the value its weight is made of (the logit for plain softmax,
  // the original score otherwise).
  int slot_index = 0;
  S slot_value = S(0);
  if (kReplay) {
    // Replay: the given experts, their values read back from this warp's own stores above. An id
    // outside [0, E) is passed on for the dispatcher to report; it reads nothing and weighs NaN.
    __syncwarp();
    if (lane < k) {
      const std::int64_t id = a.replay[t * k + lane];
      const bool valid = id >= 0 && id < E;
      slot_index = valid ? static_cast<int>(id) : -1;
      if (!valid) {
        slot_value = static_cast<S>(NAN);
      } else if (pr.topk_then_softmax) {
        slot_value = logits[id];
      } else {
        slot_value = a.scores[t * E + id];
        if (pr.weights_from_biased) slot_value += static_cast<S>(a.correction_bias[id]);
      }
    }
  } else {
    // Top-k, best first.
    unsigned taken = 0;  // bit i: expert lane + 32 i already selected
    for (int j = 0; j < k; ++j) {
      Candidate<S> c = no_candidate<S>();
#pragma unroll
      for (int i = 0; i < kMaxPerLane; ++i) {
        const int e = lane + kWarpSize * i;
        if (e < E && !((taken >> i) & 1u) && ranks_before(key[i], e, c.key, c.index)) {
          const S value = pr.topk_then_softmax  ? key[i]
                          : pr.weights_from_biased ? p[i] + static_cast<S>(a.correction_bias[e])
                                                   : p[i];
          c = {key[i], e, value};
        }
      }
      c = warp_best(c);
      // k <= E candidates always exist; the guard only keeps a shift in range.
      if (c.index != kNoIndex && c.index % kWarpSize == lane) taken |= 1u << (c.index / kWarpSize);
      if (lane == j) {
        slot_index = c.index == kNoIndex ? 0 : c.index;
        slot_value = c.payload;
      }
    }
  }

  // Weights: softmax over the k selected logits (plain softmax), normalisation, route_scale.
  const bool in_slot = lane < k;
  S w0 = slot_value;
  if (pr.topk_then_softmax) {
    const S m = warp_max(in_slot ? slot_value : negative_infinity<S>());
    const S ex = in_slot ? exp_of(slot_value - m) : S(0);
    const S sum = warp_sum(ex);  // every lane takes part in the shuffles
    w0 = in_slot ? ex / sum : S(0);
  }
  S denom = S(1);
  if (pr.normalized) denom = warp_sum(in_slot ? w0 : S(0)) + static_cast<S>(1e-20);
  if (in_slot) {
    const std::int64_t o = t * k + lane;
    a.topk_scores[o] = w0;
    const float w = static_cast<float>(w0 / denom * static_cast<S>(pr.route_scale));
    // Automodel's weights.type_as(x): bf16 values, which the dispatchers take as f32.
    a.weights[o] = pr.round_weights_bf16 ? __bfloat162float(__float2bfloat16_rn(w)) : w;
    a.indices[o] = slot_index >= 0 ? slot_index : a.replay[o];
    if (slot_index >= 0 && (!a.mask || a.mask[t]))
      atomicAdd(reinterpret_cast<unsigned long long*>(a.load) + slot_index, 1ull);  // integer: order-free
  }

  if (a.score_denominator) {
    S sum = 0;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
      const int e = lane + kWarpSize * i;
      if (e < E) sum += pr.weights_from_biased ? p[i] + static_cast<S>(a.correction_bias[e]) : p[i];
    }
    sum = warp_sum(sum);
    if (lane == 0) a.score_denominator[t] = sum + static_cast<S>(1e-20);
  }
}

}  // namespace

template <class S>
void launch_route(const RouteParams& p, const RouteArgs<S>& a, cudaStream_t stream) {
  if (a.tokens == 0) return;
  const std::int64_t blocks = (a.tokens + kTokensPerBlock - 1) / kTokensPerBlock;
  const std::size_t smem = p.groups > 1 ? kTokensPerBlock * group_smem_per_warp<S>(p.experts, p.groups) : 0;
  const dim3 grid(static_cast<unsigned>(blocks));
  auto launch = [&](auto score, auto replay) {
    route_kernel<S, decltype(score)::value, decltype(replay)::value><<<grid, kTokenBlockThreads, smem, stream>>>(p, a);
  };
  auto with_score = [&](auto replay) {
    switch (p.score) {
      case kSigmoid: launch(std::integral_constant<int, kSigmoid>{}, replay); break;
      case kSqrtSoftplus:
        // sqrtsoftplus always routes in fp32 (the host casts f64 logits first): no f64 kernel.
        if constexpr (std::is_same_v<S, float>) launch(std::integral_constant<int, kSqrtSoftplus>{}, replay);
        else throw_error("launch_route: sqrtsoftplus routes in fp32; the f64 logits must be cast first");
        break;
      default: launch(std::integral_constant<int, kSoftmax>{}, replay); break;
    }
  };
  if (a.replay)
    with_score(std::true_type{});
  else
    with_score(std::false_type{});
  FLEXEP_CUDA_CHECK_LAUNCH("route_kernel");
}

template void launch_route<float>(const RouteParams&, const RouteArgs<float>&, cudaStream_t);
template void launch_route<double>(const RouteParams&, const RouteArgs<double>&, cudaStream_t);

}  // namespace flexep::cuda::router
