// estimate_gpu_layer_memory against sizes worked out by hand for the DeepSeek-V3-like layer of
// `flexep bench layer` (dim 7168, moe_inter 2048, top-8, one shared expert, sigmoid router), and its
// scaling with the EP size and the tokens. Its forward share matches what the bench measured the
// layer keeping for backward (saved_mb 984.0 MB at 32 experts, H100, 0e5a385) to 0.2%.
#include <gtest/gtest.h>

#include "flexep/layer/memory_estimate.h"

using namespace flexep;

namespace {

MoEConfig dsv3_like(int experts) {
  MoEConfig c;
  c.dim = 7168;
  c.moe_inter_dim = 2048;
  c.n_routed_experts = experts;
  c.n_activated_experts = 8;
  c.n_shared_experts = 1;
  c.score_func = ScoreFunc::sigmoid;
  c.norm_topk_prob = true;
  return c;
}

}  // namespace

TEST(MemoryEstimate, Dsv3LikeLayerByHand) {
  const LayerMemoryEstimate m = estimate_gpu_layer_memory(dsv3_like(64), BackendConfig{}, 1, 4096);
  // gate_and_up [64, 7168, 4096] + down [64, 2048, 7168] + gate [64, 7168] + the shared expert's
  // [1, 7168, 4096] + [1, 2048, 7168]
  const std::size_t params = 1879048192ull + 939524096ull + 458752ull + 29360128ull + 14680064ull;
  EXPECT_EQ(m.weights, 2 * params);
  EXPECT_EQ(m.gradients, 4 * params);
  // 32768 rows x (7168 + 4096 + 2048) x 2 B, the router's 4096 x 64 f32 twice, the shared expert's
  // 4096 x (4096 + 2048) x 2 B, x's 4096 x 7168 x 2 B: kept, and as much again.
  const std::size_t kept = 872415232ull + 2097152ull + 50331648ull + 58720256ull;
  EXPECT_EQ(m.activations, 2 * kept);
  EXPECT_EQ(m.total(), m.weights + m.gradients + m.activations);
}

TEST(MemoryEstimate, ForwardShareMatchesTheMeasuredSavedMemory) {
  const LayerMemoryEstimate m = estimate_gpu_layer_memory(dsv3_like(32), BackendConfig{}, 1, 4096);
  const double kept_mb = static_cast<double>(m.activations) / 2 / 1e6, measured_mb = 983.99748;
  EXPECT_NEAR(kept_mb, measured_mb, 0.002 * measured_mb);
}

TEST(MemoryEstimate, ScalesWithExpertParallelismAndTokens) {
  const MoEConfig c = dsv3_like(64);
  const LayerMemoryEstimate one = estimate_gpu_layer_memory(c, BackendConfig{}, 1, 4096);
  const LayerMemoryEstimate eight = estimate_gpu_layer_memory(c, BackendConfig{}, 8, 4096);
  // The routed experts split 8 ways, the gate and the shared expert on every rank.
  const std::size_t routed = 2 * (1879048192ull + 939524096ull), replicated = 2 * (458752ull + 29360128ull + 14680064ull);
  EXPECT_EQ(one.weights, routed + replicated);
  EXPECT_EQ(eight.weights, routed / 8 + replicated);
  EXPECT_EQ(eight.activations, one.activations);  // balanced: each rank receives what it sends
  const LayerMemoryEstimate twice = estimate_gpu_layer_memory(c, BackendConfig{}, 1, 8192);
  EXPECT_EQ(twice.activations, 2 * one.activations);
  EXPECT_EQ(twice.weights, one.weights);
}
