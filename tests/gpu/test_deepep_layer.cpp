// The MoE layer on deepep, two simulated ranks on GPU 0: the routed experts reading the dispatcher's
// received rank-major rows in place (rows_in_place: the gathered grouped GEMM through deepep's
// listing) against the same layer on the expert-major copy. Same outputs and gradients to bf16 GEMM
// precision (the gate/up GEMM runs on another kernel, so not bit for bit), and less memory kept for
// backward: a token's row once per rank instead of once per (token, local expert).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/deepep.h"
#include "flexep/layer/cuda_moe_layer.h"
#include "gpu/dispatch_harness.h"
#include "gpu/experts_test_util.h"
#include "gpu/gpu_test_util.h"
#include "gpu/multi_gpu.h"

namespace flexep::testing {
namespace {

constexpr int kRanks = 2;
constexpr std::int64_t kTokens = 300;

MoEConfig layer_config() {
  MoEConfig c;
  c.dim = 256;
  c.moe_inter_dim = 128;
  c.n_routed_experts = 8;
  c.n_activated_experts = 4;
  c.score_func = ScoreFunc::sigmoid;
  c.norm_topk_prob = true;
  c.dtype = DType::bf16;
  return c;
}

struct RankResult {
  Tensor out, grad_x;
  std::vector<std::pair<std::string, Tensor>> grads;
};

// One layer per rank and way of reading the rows; a warm-up step (the dispatcher's and the pool's
// first allocations), then the measured one. `kept` gets what both ranks' forwards keep in the pool
// for backward beyond their outputs (the ranks meet around it, so nothing else is in flight).
std::vector<RankResult> run_layers(bool in_place, std::int64_t& kept) {
  const MoEConfig c = layer_config();
  std::vector<RankResult> results(kRanks);
  std::int64_t pool_before = 0, pool_after = 0, outputs = 0;
  const auto errors = run_gpu_ranks(
      kRanks,
      [&](GpuRank& g) {
        DeepEpOptions o;
        o.hidden = c.dim;
        o.max_tokens_per_rank = kTokens;
        o.max_topk = c.n_activated_experts;
        o.timeout_seconds = 20;
        o.stream = g.stream;
        std::shared_ptr<TokenDispatcher> d = make_deepep_dispatcher(g.comm, c.n_routed_experts, o);
        BackendConfig b;
        b.dispatcher = DispatcherKind::deepep;
        b.rows_in_place = in_place;
        CudaMoELayerOptions lo;
        lo.seed = 5;
        lo.init_std = 0.1;
        CudaMoELayer layer(c, b, d, lo);
        ASSERT_EQ(layer.compute().rows_in_place(), in_place);
        const Tensor x = cuda::to_device(random_tensor({kTokens, c.dim}, DType::bf16, 21, "x", g.rank), 0, g.stream);
        const Tensor gy = cuda::to_device(random_tensor({kTokens, c.dim}, DType::bf16, 22, "gy", g.rank), 0, g.stream);
        {
          CudaMoEOutput warm = layer.forward(x, TensorView(), true, g.stream);
          layer.backward(warm, gy, g.stream);
          layer.zero_grad(g.stream);
        }
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
        g.comm->barrier("before forward");
        if (g.rank == 0) pool_before = static_cast<std::int64_t>(cuda::pool_used_bytes(0));
        g.comm->barrier("measured");
        CudaMoEOutput out = layer.forward(x, TensorView(), true, g.stream);
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
        g.comm->barrier("after forward");
        if (g.rank == 0) {
          pool_after = static_cast<std::int64_t>(cuda::pool_used_bytes(0));
          outputs = 2 * static_cast<std::int64_t>(out.out.nbytes());  // both ranks' y, alike in size
        }
        g.comm->barrier("read");
        const Tensor gx = layer.backward(out, gy, g.stream);
        RankResult& r = results[static_cast<std::size_t>(g.rank)];
        r.out = cuda::to_host(out.out, g.stream);
        r.grad_x = cuda::to_host(gx, g.stream);
        r.grads = layer.host_gradients(g.stream);
      },
      test_comm_options());
  EXPECT_TRUE(all_ok(errors)) << (in_place ? "rows in place" : "rows copied");
  kept = pool_after - pool_before - outputs;
  return results;
}

TEST(SimulatedRanksDeepEpLayer, RowsInPlaceMatchCopiedRowsAndKeepLess) {
  const Simulate sim(kRanks);
  if (!require_gpus(1)) return;
  std::int64_t kept_copied = 0, kept_in_place = 0;
  const std::vector<RankResult> copied = run_layers(false, kept_copied);
  const std::vector<RankResult> in_place = run_layers(true, kept_in_place);
  for (int r = 0; r < kRanks; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult &want = copied[static_cast<std::size_t>(r)], &got = in_place[static_cast<std::size_t>(r)];
    ASSERT_TRUE(got.out.defined() && want.out.defined());
    EXPECT_LT(rel_error(got.out, want.out), 1e-2);
    EXPECT_LT(rel_error(got.grad_x, want.grad_x), 1e-2);
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (std::size_t i = 0; i < want.grads.size(); ++i) {
      EXPECT_EQ(got.grads[i].first, want.grads[i].first);
      EXPECT_LT(rel_error(got.grads[i].second, want.grads[i].second), 1e-2) << want.grads[i].first;
    }
  }
  // Copied: each rank keeps one row per (token, local expert) it received. In place: the received
  // rows once each. With 8 experts on 2 ranks and top-4, a token reaching a rank reaches ~2.3 of its
  // experts there, so the copy is over twice the rows.
  const std::int64_t row = layer_config().dim * 2;
  EXPECT_GT(kept_copied - kept_in_place, kRanks * kTokens / 2 * row)
      << "kept for backward: " << kept_copied << " bytes with copied rows, " << kept_in_place << " in place";
}

}  // namespace
}  // namespace flexep::testing
