#include <algorithm>
#include <cmath>
#include <cstring>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "flexep/layer/gate.h"
#include "layer/gate_saved.h"

namespace flexep {

namespace {

// The seed comes from the content of x (its first four values, bit for bit), so a recompute under
// activation checkpointing sees the same x and routes identically, while every training step
// routes differently (Automodel seeds from the same four values).
std::uint64_t content_seed(const TensorView& x) {
  const std::size_t size = element_size(x.dtype);
  const std::int64_t n = std::min<std::int64_t>(x.numel(), 4);
  std::uint64_t h = splitmix64(static_cast<std::uint64_t>(n));
  for (std::int64_t i = 0; i < n; ++i) {
    std::uint64_t bits = 0;
    std::memcpy(&bits, static_cast<const char*>(x.data) + static_cast<std::size_t>(i) * size, size);
    h = splitmix64(h ^ bits);
  }
  return h;
}

}  // namespace

FakeBalancedGate::FakeBalancedGate(const MoEConfig& config, double noise, int skip_first_n_experts)
    : experts_(config.n_routed_experts), topk_(config.n_activated_experts), skip_(skip_first_n_experts),
      noise_(noise) {
  FLEXEP_CHECK_ARG(experts_ >= 1, "moe.n_routed_experts", "must be >= 1, got ", experts_);
  FLEXEP_CHECK_ARG(topk_ >= 1 && topk_ <= experts_, "moe.n_activated_experts", "must be in [1, moe.n_routed_experts = ",
                   experts_, "], got ", topk_);
  FLEXEP_CHECK_ARG(std::isfinite(noise) && noise >= 0, "noise",
                   "(backend.fake_gate_noise) must be finite and >= 0, got ", noise);
  // Automodel accepts fewer than k remaining experts and then repeats experts within a token; a
  // repeated expert breaks the dispatch contract, so we refuse it.
  FLEXEP_CHECK_ARG(skip_ >= 0 && skip_ <= experts_ - topk_, "skip_first_n_experts", "must be in [0, ",
                   experts_ - topk_, "] (moe.n_routed_experts - moe.n_activated_experts, so that every token still "
                   "has ", topk_, " distinct experts), got ", skip_);
}

GateOutput FakeBalancedGate::forward(const TensorView& x, const TensorView& token_mask) {
  check::rank(x, 2, "x");
  check::dtype(x, {DType::f32, DType::f64, DType::bf16, DType::f16}, "x");
  check::device(x, Device::cpu(), "x");
  const std::int64_t T = x.size(0);
  const int k = topk_, available = experts_ - skip_;
  const std::vector<unsigned char> valid = read_token_mask(token_mask, T);

  GateOutput out;
  out.weights = Tensor::empty({T, k}, x.dtype);
  std::vector<std::int64_t> indices(static_cast<std::size_t>(T * k));
  if (noise_ == 0) {
    for (std::int64_t i = 0; i < T * k; ++i) {
      write_from_double(out.weights, i, 1.0 / k);
      indices[static_cast<std::size_t>(i)] = i % available + skip_;
    }
  } else {
    const std::uint64_t seed = content_seed(x);
    const std::uint64_t weight_stream = stream_id("fake_gate.weights"), bias_stream = stream_id("fake_gate.bias"),
                        score_stream = stream_id("fake_gate.scores");
    // A per-expert popularity bias makes some experts systematically hot, like a real router.
    const std::size_t n = static_cast<std::size_t>(available);
    std::vector<double> bias(n);
    for (std::size_t e = 0; e < n; ++e) bias[e] = normal01(seed, bias_stream, e) * noise_ * 0.1;
    std::vector<double> raw(static_cast<std::size_t>(k)), scores(n);
    std::vector<unsigned char> scratch;
    for (std::int64_t t = 0; t < T; ++t) {
      double sum = 0;
      for (int j = 0; j < k; ++j) {
        // 1 - u lies in (0, 1], so the random part, and every weight, stays positive.
        raw[static_cast<std::size_t>(j)] = 1.0 - uniform01(seed, weight_stream, static_cast<std::uint64_t>(t * k + j));
        sum += raw[static_cast<std::size_t>(j)];
      }
      for (int j = 0; j < k; ++j)
        write_from_double(out.weights, t * k + j, (1.0 - noise_) / k + noise_ * raw[static_cast<std::size_t>(j)] / sum);
      for (std::size_t e = 0; e < n; ++e)
        scores[e] = uniform01(seed, score_stream, static_cast<std::uint64_t>(t) * n + e) + bias[e];
      std::int64_t* row = indices.data() + t * k;
      select_top_k(scores.data(), available, k, row, scratch);
      for (int j = 0; j < k; ++j) row[j] += skip_;
    }
  }
  out.expert_load = count_expert_load(indices, valid, k, experts_);
  out.indices = Tensor::from_vector(indices, {T, k});
  return out;
}

}  // namespace flexep
