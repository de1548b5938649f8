// backend.dispatch_chunks on the GPU layer: the routed path cut into chunks of rows, each through a
// sibling dispatcher, pipelined on two streams, against the same layer in one chunk. Two simulated
// ranks on GPU 0 with hybridep and deepep (deepep also reading its rows in place), and one GPU with
// the single-GPU dispatcher (rows copied and in place; f32 and fresh bf16 gradients, whose chunks are
// summed in f32 and rounded once). A chunk's GEMMs see fewer rows, so cuBLAS may choose another
// kernel: the outputs agree to bf16 GEMM precision, and a row taken from the wrong chunk or a chunk
// left out would be off by O(1).
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/deepep.h"
#include "flexep/dispatch/hybridep.h"
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
  c.n_shared_experts = 1;
  c.score_func = ScoreFunc::sigmoid;
  c.norm_topk_prob = true;
  c.dtype = DType::bf16;
  return c;
}

struct Setting {
  DispatcherKind dispatcher = DispatcherKind::host;  // host: the single-GPU dispatcher (EP size 1)
  bool in_place = false;
  GradMode grad_mode = GradMode::accumulate_f32;
  std::string name() const {
    return std::string(dispatcher == DispatcherKind::host ? "local" : to_string(dispatcher)) +
           (in_place ? ", in place" : "") + (grad_mode == GradMode::fresh_bf16_weights ? ", bf16 grads" : "");
  }
};

struct RankResult {
  Tensor out, grad_x;
  std::vector<std::pair<std::string, Tensor>> grads;
};

std::shared_ptr<TokenDispatcher> make_dispatcher(const Setting& s, const MoEConfig& c, GpuRank& g) {
  if (s.dispatcher == DispatcherKind::hybridep) {
    HybridEpOptions o;
    o.hidden = c.dim;
    o.max_tokens_per_rank = kTokens;
    o.max_topk = c.n_activated_experts;
    o.timeout_seconds = 20;
    o.stream = g.stream;
    return make_hybridep_dispatcher(g.comm, c.n_routed_experts, o);
  }
  DeepEpOptions o;
  o.hidden = c.dim;
  o.max_tokens_per_rank = kTokens;
  o.max_topk = c.n_activated_experts;
  o.timeout_seconds = 20;
  o.stream = g.stream;
  return make_deepep_dispatcher(g.comm, c.n_routed_experts, o);
}

// Two steps per layer (the second after zero_grad: the dispatchers' and the pool's reuse), the
// second's results returned.
std::vector<RankResult> run_layers(const Setting& s, int chunks) {
  const MoEConfig c = layer_config();
  const int R = s.dispatcher == DispatcherKind::host ? 1 : kRanks;
  std::vector<RankResult> results(static_cast<std::size_t>(R));
  auto body = [&](GpuRank& g) {
    BackendConfig b;
    b.dispatcher = s.dispatcher;
    b.rows_in_place = s.in_place;
    b.dispatch_chunks = chunks;
    CudaMoELayerOptions lo;
    lo.seed = 5;
    lo.init_std = 0.1;
    lo.grad_mode = s.grad_mode;
    CudaMoELayer layer(c, b, R > 1 ? make_dispatcher(s, c, g) : nullptr, lo);
    ASSERT_EQ(layer.compute().rows_in_place(), s.in_place);
    const Tensor x = cuda::to_device(random_tensor({kTokens, c.dim}, DType::bf16, 21, "x", g.rank), 0, g.stream);
    const Tensor gy = cuda::to_device(random_tensor({kTokens, c.dim}, DType::bf16, 22, "gy", g.rank), 0, g.stream);
    for (int step = 0; step < 2; ++step) {
      layer.zero_grad(g.stream);
      CudaMoEOutput out = layer.forward(x, TensorView(), true, g.stream);
      const Tensor gx = layer.backward(out, gy, g.stream);
      RankResult& r = results[static_cast<std::size_t>(g.rank)];
      r.out = cuda::to_host(out.out, g.stream);
      r.grad_x = cuda::to_host(gx, g.stream);
      r.grads = layer.host_gradients(g.stream);
    }
  };
  if (R == 1) {
    GpuRank g;
    FLEXEP_CUDA_CHECK(cudaStreamCreate(&g.stream));
    body(g);
    cuda::destroy_stream(g.stream);
    return results;
  }
  const auto errors = run_gpu_ranks(R, body, test_comm_options());
  EXPECT_TRUE(all_ok(errors)) << s.name() << ", " << chunks << " chunks";
  return results;
}

void expect_close(const std::vector<RankResult>& got, const std::vector<RankResult>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t r = 0; r < want.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    ASSERT_TRUE(got[r].out.defined() && want[r].out.defined());
    EXPECT_LT(rel_error(got[r].out, want[r].out), 1e-2);
    EXPECT_LT(rel_error(got[r].grad_x, want[r].grad_x), 1e-2);
    ASSERT_EQ(got[r].grads.size(), want[r].grads.size());
    for (std::size_t i = 0; i < want[r].grads.size(); ++i) {
      EXPECT_EQ(got[r].grads[i].first, want[r].grads[i].first);
      EXPECT_LT(rel_error(got[r].grads[i].second, want[r].grads[i].second), 1e-2) << want[r].grads[i].first;
    }
  }
}

TEST(ChunkedLayer, OneGpuChunksMatchOneChunk) {
  if (!require_gpus(1)) return;
  for (const Setting& s : {Setting{}, Setting{DispatcherKind::host, true},
                           Setting{DispatcherKind::host, false, GradMode::fresh_bf16_weights}}) {
    SCOPED_TRACE(s.name());
    const std::vector<RankResult> want = run_layers(s, 1);
    for (int chunks : {2, 3}) {
      SCOPED_TRACE(std::to_string(chunks) + " chunks");
      expect_close(run_layers(s, chunks), want);
    }
  }
}

TEST(SimulatedRanksChunkedLayer, HybridEpAndDeepEpChunksMatchOneChunk) {
  const Simulate sim(kRanks);
  if (!require_gpus(1)) return;
  for (const Setting& s : {Setting{DispatcherKind::hybridep}, Setting{DispatcherKind::deepep},
                           Setting{DispatcherKind::deepep, true}}) {
    SCOPED_TRACE(s.name());
    const std::vector<RankResult> want = run_layers(s, 1);
    expect_close(run_layers(s, 3), want);
  }
}

}  // namespace
}  // namespace flexep::testing
