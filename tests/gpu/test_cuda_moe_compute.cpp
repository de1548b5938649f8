// CudaMoECompute (layer/cuda_moe_compute.h), the GPU layer on weights given per call: against
// CudaMoELayer holding the same weights (bitwise: the owner runs the same kernels through it), against
// the CPU reference MoECompute given the same bf16 weights (to bf16 precision, as
// test_cuda_moe_layer.cpp measures), with a backward given copies of the weights while the forward's
// tensors hold NaN, with a routing override, with zero tokens, and its argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cpu/moe_compute_util.h"
#include "cpu/same_bytes.h"
#include "experts_test_util.h"
#include "flexep/core/random.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/cuda_moe_compute.h"
#include "flexep/layer/cuda_moe_layer.h"
#include "flexep/layer/moe_compute.h"
#include "flexep/layer/moe_layer.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::HeldWeights;
using testing::rel_error;
using testing::same_bytes;

struct Case {
  const char* name;
  MoEConfig moe;
  double padding = 0;
  double aux_scale = 1.0;
};

MoEConfig base_config() {
  MoEConfig c;
  c.dim = 64;
  c.n_routed_experts = 16;
  c.n_activated_experts = 4;
  c.moe_inter_dim = 48;
  c.dtype = DType::f32;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  {
    Case c{"swiglu_shared_gate_bias_padding", base_config(), 0.2};
    c.moe.n_shared_experts = 1;
    c.moe.shared_expert_gate = true;
    c.moe.expert_bias = true;
    c.moe.router_bias = true;
    v.push_back(c);
  }
  {
    Case c{"quick_geglu_sigmoid_correction_groups", base_config()};
    c.moe.expert_activation = Activation::quick_geglu;
    c.moe.score_func = ScoreFunc::sigmoid;
    c.moe.gate_bias_update_factor = 1e-3;
    c.moe.n_expert_groups = 4;
    c.moe.n_limited_groups = 2;
    c.moe.norm_topk_prob = true;
    v.push_back(c);
  }
  {
    Case c{"relu2_shared_relu2_no_gate_padding", base_config(), 0.25};
    c.moe.expert_activation = Activation::relu2;
    c.moe.n_shared_experts = 2;
    c.moe.shared_expert_activation = Activation::relu2;
    v.push_back(c);
  }
  {
    Case c{"softmax_with_bias_groups_aux", base_config(), 0.0, 0.5};
    c.moe.score_func = ScoreFunc::softmax_with_bias;
    c.moe.n_expert_groups = 4;
    c.moe.n_limited_groups = 2;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.force_e_score_correction_bias = true;
    v.push_back(c);
  }
  {
    // Automodel's latent projections (biases on) around the routed experts, in a latent width
    // other than dim.
    Case c{"latent_projections_bias_shared_padding", base_config(), 0.2};
    c.moe.moe_latent_size = 40;
    c.moe.expert_bias = true;
    c.moe.n_shared_experts = 1;
    c.moe.score_func = ScoreFunc::sigmoid;
    c.moe.force_e_score_correction_bias = true;
    v.push_back(c);
  }
  return v;
}

Tensor round_bf16(const Tensor& t) { return t.to(DType::bf16).to(DType::f32); }

// A CPU layer with bf16-rounded values (biases and the correction bias random: init leaves them
// zero) to load the device layer from; inputs rounded to bf16.
struct Data {
  std::unique_ptr<MoELayer> cpu;
  Tensor x, pad, g;  // host f32 [T, dim], bool [T], f32 [T, dim]
};

Data make_data(const Case& c, std::int64_t T) {
  Data d;
  MoELayerOptions o;
  o.seed = 11;
  o.init_std = 0.1;
  d.cpu = std::make_unique<MoELayer>(c.moe, BackendConfig{}, nullptr, o);
  for (Parameter* p : d.cpu->parameters()) {
    if (p->name.find("bias") != std::string::npos) fill_normal(p->value, 5, stream_id(p->name.c_str()), 0, 0.05);
    p->value = round_bf16(p->value);
  }
  if (Gate* g = d.cpu->gate())
    if (g->e_score_correction_bias().defined()) fill_normal(g->e_score_correction_bias(), 6, stream_id("cb"), 0, 0.02);
  d.x = Tensor::empty({T, c.moe.dim}, DType::f32);
  fill_normal(d.x, 3, stream_id("x"), 0, 1);
  d.x = round_bf16(d.x);
  d.pad = Tensor::zeros({T}, DType::b8);
  for (std::int64_t t = 0; t < T; ++t) d.pad.data<bool>()[t] = uniform01(3, stream_id("pad"), t) < c.padding;
  d.g = Tensor::empty({T, c.moe.dim}, DType::f32);
  fill_normal(d.g, 4, stream_id("g"), 0, 1);
  d.g = round_bf16(d.g);
  return d;
}

// Device copies of every given weight (new addresses, same bytes).
HeldWeights device_copies(const MoEWeights& w, cudaStream_t stream) {
  HeldWeights h;
  for (const std::string& name : moe_weight_names()) {
    const TensorView& v = *w.find(name);
    if (!v.defined()) continue;
    Tensor t = Tensor::empty(v.shape, v.dtype, v.device);
    cuda::copy_async(t, v, stream);
    *h.w.find(name) = h.hold(t);
  }
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  return h;
}

// Host copies, same dtypes (bf16 weights, f32 correction bias): what the CPU reference takes.
HeldWeights host_copies(const MoEWeights& w, cudaStream_t stream) {
  HeldWeights h;
  for (const std::string& name : moe_weight_names()) {
    const TensorView& v = *w.find(name);
    if (v.defined()) *h.w.find(name) = h.hold(cuda::to_host(v, stream));
  }
  return h;
}

struct RunResult {
  Tensor out, aux, load, grad_x;                         // host
  std::map<std::string, Tensor> grads;                   // host
};

RunResult results_on_host(const CudaMoEOutput& o, const MoEBackward& b, cudaStream_t stream) {
  RunResult r;
  r.out = cuda::to_host(o.out, stream);
  if (o.aux_loss.defined()) r.aux = cuda::to_host(o.aux_loss, stream);
  r.load = cuda::to_host(o.expert_load, stream);
  r.grad_x = cuda::to_host(b.grad_x, stream);
  for (const auto& [name, g] : b.gradients.named()) r.grads[name] = cuda::to_host(g, stream);
  return r;
}

RunResult run_compute(CudaMoECompute& m, const MoEWeights& fwd_w, const MoEWeights& bwd_w, const Data& d,
                      double aux_scale, cudaStream_t stream, const RoutingOverride& routing = {},
                      const std::function<void()>& between = {}) {
  const Tensor dx = cuda::to_device(d.x.to(DType::bf16), 0, stream);
  const Tensor dpad = cuda::to_device(d.pad, 0, stream);
  const Tensor dg = cuda::to_device(d.g.to(DType::bf16), 0, stream);
  const CudaMoEOutput o = m.forward(fwd_w, dx, dpad, true, routing, stream);
  if (between) between();
  const MoEBackward b = m.backward(bwd_w, *o.saved, dg, aux_scale, stream);
  return results_on_host(o, b, stream);
}

TEST(CudaMoECompute, MatchesCudaMoELayerBitwise) {
  if (!testing::require_gpus(1)) return;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Data d = make_data(c, 257);
    const cuda::OwnedStream stream;
    CudaMoELayerOptions o;
    o.grad_mode = GradMode::fresh_bf16_weights;
    CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, o);
    layer.load_from(*d.cpu, stream);
    const Tensor dx = cuda::to_device(d.x.to(DType::bf16), 0, stream);
    const Tensor dpad = cuda::to_device(d.pad, 0, stream);
    const Tensor dg = cuda::to_device(d.g.to(DType::bf16), 0, stream);
    const CudaMoEOutput lo = layer.forward(dx, dpad, true, stream);
    const Tensor lgx = layer.backward(lo, dg, stream);
    std::map<std::string, Tensor> layer_grads;
    for (Parameter* p : layer.parameters())
      if (p->grad.defined()) layer_grads[p->name] = cuda::to_host(p->grad, stream);

    CudaMoECompute compute(c.moe, BackendConfig{}, nullptr, 0);
    // The layer's own tensors as the weights: the same values the layer just computed with.
    const RunResult r = run_compute(compute, layer.weights(), layer.weights(), d, 1.0, stream);
    EXPECT_TRUE(same_bytes(r.out, cuda::to_host(lo.out, stream)));
    EXPECT_TRUE(same_bytes(r.grad_x, cuda::to_host(lgx, stream)));
    EXPECT_TRUE(same_bytes(r.load, cuda::to_host(lo.expert_load, stream)));
    ASSERT_EQ(r.aux.defined(), lo.aux_loss.defined());
    if (r.aux.defined()) {
      EXPECT_TRUE(same_bytes(r.aux, cuda::to_host(lo.aux_loss, stream)));
    }
    // Every parameter the layer trained got a gradient here too: bf16, equal to the layer's (its
    // f32 small gradients rounded to bf16).
    ASSERT_EQ(r.grads.size(), layer_grads.size());
    for (const auto& [name, want] : layer_grads) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(r.grads.count(name));
      const Tensor& got = r.grads.at(name);
      EXPECT_EQ(got.dtype(), DType::bf16);
      EXPECT_TRUE(same_bytes(got, want.dtype() == DType::bf16 ? want : want.to(DType::bf16)));
    }
  }
}

// The same inputs and weights on the CPU reference (bf16 weights and x on the host: computed in f32):
// outputs and gradients agree to bf16 precision, ||gpu - cpu|| / ||cpu|| < 3e-2 (5e-2 for
// gradients), the aux loss to 2e-2; routing may differ on near-ties, so the expert loads agree in
// total and within 2% of the selections.
TEST(CudaMoECompute, MatchesCpuReference) {
  if (!testing::require_gpus(1)) return;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Data d = make_data(c, 257);
    const cuda::OwnedStream stream;
    CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, {});  // a holder of device weights
    layer.load_from(*d.cpu, stream);
    const HeldWeights dw = device_copies(layer.weights(), stream);
    const HeldWeights hw = host_copies(dw.w, stream);

    CudaMoECompute gpu(c.moe, BackendConfig{}, nullptr, 0);
    const RunResult r = run_compute(gpu, dw.w, dw.w, d, c.aux_scale, stream);

    MoECompute cpu(c.moe, BackendConfig{}, nullptr);
    const Tensor x16 = d.x.to(DType::bf16), g16 = d.g.to(DType::bf16);
    const MoEOutput ro = cpu.forward(hw.w, x16, d.pad, true);
    const MoEBackward rb = cpu.backward(hw.w, *ro.saved, g16, c.aux_scale);

    const double eo = rel_error(r.out.to(DType::f32), ro.out.to(DType::f32));
    const double egx = rel_error(r.grad_x.to(DType::f32), rb.grad_x.to(DType::f32));
    std::printf("%s: out rel %.2e, grad x rel %.2e\n", c.name, eo, egx);
    EXPECT_LT(eo, 3e-2);
    EXPECT_LT(egx, 3e-2);
    ASSERT_EQ(r.aux.defined(), ro.aux_loss.has_value());
    if (ro.aux_loss) {
      EXPECT_NEAR(read_as_double(r.aux, 0), *ro.aux_loss, 2e-2 * std::fabs(*ro.aux_loss) + 1e-6);
    }
    std::int64_t total = 0, total_ref = 0, diff = 0;
    for (std::int64_t e = 0; e < c.moe.n_routed_experts; ++e) {
      const std::int64_t a = r.load.data<std::int64_t>()[e], b = ro.expert_load.data<std::int64_t>()[e];
      total += a;
      total_ref += b;
      diff += std::abs(a - b);
    }
    EXPECT_EQ(total, total_ref);
    EXPECT_LE(diff, total / 50 + 2);
    const auto want = rb.gradients.named();
    ASSERT_EQ(r.grads.size(), want.size());
    for (const auto& [name, w] : want) {
      SCOPED_TRACE(name);
      ASSERT_TRUE(r.grads.count(name));
      EXPECT_EQ(w.dtype(), r.grads.at(name).dtype());
      const double e = rel_error(r.grads.at(name).to(DType::f32), w.to(DType::f32));
      std::printf("  %-36s rel %.2e\n", name.c_str(), e);
      EXPECT_LT(e, 5e-2);
    }
  }
}

// FSDP2 with reshard_after_forward: the forward's weight buffers are overwritten (NaN) before the
// backward, which gets copies at other addresses; its results equal a run that kept its weights.
TEST(CudaMoECompute, BackwardReadsTheWeightsItIsGiven) {
  if (!testing::require_gpus(1)) return;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Data d = make_data(c, 130);
    const cuda::OwnedStream stream;
    CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, {});
    layer.load_from(*d.cpu, stream);
    const HeldWeights kept = device_copies(layer.weights(), stream);
    const HeldWeights fwd = device_copies(layer.weights(), stream);
    const HeldWeights bwd = device_copies(layer.weights(), stream);
    CudaMoECompute a(c.moe, BackendConfig{}, nullptr, 0), b(c.moe, BackendConfig{}, nullptr, 0);
    const RunResult want = run_compute(a, kept.w, kept.w, d, c.aux_scale, stream);
    const RunResult got = run_compute(b, fwd.w, bwd.w, d, c.aux_scale, stream, {}, [&] {
      FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
      for (const Tensor& t : fwd.keep) testing::poison(t);
      FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
    });
    EXPECT_TRUE(same_bytes(got.out, want.out));
    EXPECT_TRUE(same_bytes(got.grad_x, want.grad_x));
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (const auto& [name, w] : want.grads) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(same_bytes(got.grads.at(name), w));
    }
  }
}

// A routing override on the device against the CPU reference with the same override: the expert load
// is exact (same indices), there is no aux loss and no gate gradient, and the gate weights need not
// be given.
TEST(CudaMoECompute, RoutingOverrideMatchesCpu) {
  if (!testing::require_gpus(1)) return;
  Case c = cases()[0];
  c.moe.aux_loss_coeff = 0.1;
  const std::int64_t T = 200, k = c.moe.n_activated_experts, E = c.moe.n_routed_experts;
  const Data d = make_data(c, T);
  Tensor idx = Tensor::empty({T, k}, DType::i64), wts = Tensor::empty({T, k}, DType::f32);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      idx.data<std::int64_t>()[t * k + j] = (t % 7 == 3 && j == 0) ? -1 : (t * 5 + j * 3) % E;
      wts.data<float>()[t * k + j] = static_cast<float>(0.1 + 0.2 * j + 0.001 * t);
    }
  const cuda::OwnedStream stream;
  CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, {});
  layer.load_from(*d.cpu, stream);
  HeldWeights dw = device_copies(layer.weights(), stream);
  HeldWeights hw = host_copies(dw.w, stream);
  dw.w.gate = {};
  hw.w.gate = {};
  const Tensor didx = cuda::to_device(idx, 0, stream), dwts = cuda::to_device(wts, 0, stream);

  CudaMoECompute gpu(c.moe, BackendConfig{}, nullptr, 0);
  const RunResult r = run_compute(gpu, dw.w, dw.w, d, 1.0, stream, {didx, dwts});
  MoECompute cpu(c.moe, BackendConfig{}, nullptr);
  const MoEOutput ro = cpu.forward(hw.w, d.x.to(DType::bf16), d.pad, true, {idx, wts});
  const MoEBackward rb = cpu.backward(hw.w, *ro.saved, d.g.to(DType::bf16));
  EXPECT_FALSE(r.aux.defined());
  EXPECT_FALSE(ro.aux_loss.has_value());
  EXPECT_TRUE(same_bytes(r.load, ro.expert_load));
  EXPECT_LT(rel_error(r.out.to(DType::f32), ro.out.to(DType::f32)), 3e-2);
  EXPECT_LT(rel_error(r.grad_x.to(DType::f32), rb.grad_x.to(DType::f32)), 3e-2);
  EXPECT_FALSE(r.grads.count("gate.weight"));
  const auto want = rb.gradients.named();
  ASSERT_EQ(r.grads.size(), want.size());
  for (const auto& [name, w] : want)
    EXPECT_LT(rel_error(r.grads.at(name).to(DType::f32), w.to(DType::f32)), 5e-2) << name;
}

TEST(CudaMoECompute, ZeroTokens) {
  if (!testing::require_gpus(1)) return;
  const Case c = cases()[0];
  const cuda::OwnedStream stream;
  CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, {});
  CudaMoECompute m(c.moe, BackendConfig{}, nullptr, 0);
  const Tensor x = Tensor::empty({0, c.moe.dim}, DType::bf16, Device::cuda(0));
  const CudaMoEOutput o = m.forward(layer.weights(), x, TensorView(), true, {}, stream);
  EXPECT_EQ(o.out.size(0), 0);
  const MoEBackward b = m.backward(layer.weights(), *o.saved, x, 1.0, stream);
  EXPECT_EQ(b.grad_x.size(0), 0);
  for (const auto& [name, g] : b.gradients.named()) {
    const Tensor h = cuda::to_host(g, stream);
    EXPECT_EQ(h.shape(), layer.weights().find(name)->shape) << name;
    for (std::int64_t i = 0; i < h.numel(); ++i) ASSERT_EQ(read_as_double(h, i), 0.0) << name;
  }
  const Tensor load = cuda::to_host(o.expert_load, stream);
  for (std::int64_t e = 0; e < load.numel(); ++e) EXPECT_EQ(load.data<std::int64_t>()[e], 0);
}

TEST(CudaMoECompute, WrongWeightsAreNamed) {
  if (!testing::require_gpus(1)) return;
  const Case c = cases()[0];
  const cuda::OwnedStream stream;
  CudaMoELayer layer(c.moe, BackendConfig{}, nullptr, {});
  CudaMoECompute m(c.moe, BackendConfig{}, nullptr, 0);
  const Tensor x = Tensor::zeros({4, c.moe.dim}, DType::bf16, Device::cuda(0));
  auto expect_named = [&](const MoEWeights& w, const std::string& name, const std::string& part) {
    try {
      m.forward(w, x, TensorView(), true, {}, stream);
      ADD_FAILURE() << "accepted a wrong " << name;
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), name) << e.what();
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  for (const MoEWeightSpec& s : m.weight_specs()) {
    SCOPED_TRACE(s.name);
    const TensorView good = *layer.weights().find(s.name);
    MoEWeights w = layer.weights();
    *w.find(s.name) = TensorView();
    expect_named(w, s.name, "missing");
    const Tensor host = Tensor::zeros(s.shape, good.dtype);
    *w.find(s.name) = host;
    expect_named(w, s.name, "cpu");
    *w.find(s.name) = testing::fake_cuda(s.shape, DType::f64);
    expect_named(w, s.name, "f64");
    std::vector<std::int64_t> dims;
    for (int i = 0; i < s.shape.rank(); ++i) dims.push_back(s.shape[i] + 1);
    *w.find(s.name) = testing::fake_cuda(Shape(dims), good.dtype);
    expect_named(w, s.name, s.shape.str());
  }
  // f32 expert weights are refused on the GPU (the caller casts them to bf16, as Automodel does).
  MoEWeights w = layer.weights();
  w.experts.down_projs = testing::fake_cuda(w.experts.down_projs.shape, DType::f32);
  expect_named(w, "experts.down_projs", "bf16");
}

}  // namespace
}  // namespace flexep
