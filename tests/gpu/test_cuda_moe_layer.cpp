// The MoE layer on one GPU against the CPU reference layer holding the same (bf16-rounded) weights
// and inputs, its gate fed bf16 x (MoELayerOptions::gate_input_dtype) so that it rounds the logits
// and weights as the GPU router does. The GPU computes in bf16 with fp32 accumulation, so outputs
// and gradients agree to bf16 precision: ||gpu - cpu|| / ||cpu|| < 3e-2 (measured values are
// printed). Routing can differ on near-ties of the logits; the tests require at least 98% of the
// selections to agree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "flexep/core/random.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/cuda_moe_layer.h"
#include "flexep/layer/memory_estimate.h"
#include "flexep/layer/moe_layer.h"
#include "experts_test_util.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

double rel_error(const Tensor& got, const Tensor& ref) {
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < ref.numel(); ++i) {
    const double g = read_as_double(got, i), r = read_as_double(ref, i);
    if (!std::isfinite(g)) return INFINITY;
    num += (g - r) * (g - r);
    den += r * r;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// bf16-rounded copy of an f32 tensor, as f32.
Tensor round_bf16(const Tensor& t) { return t.to(DType::bf16).to(DType::f32); }

struct Case {
  const char* name;
  MoEConfig moe;
  double padding = 0;
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
    Case c{"swiglu_shared_gate_bias", base_config()};
    c.moe.n_shared_experts = 1;
    c.moe.shared_expert_gate = true;
    c.moe.expert_bias = true;
    c.moe.router_bias = true;
    v.push_back(c);
  }
  {
    Case c{"quick_geglu_sigmoid_correction", base_config()};
    c.moe.expert_activation = Activation::quick_geglu;
    c.moe.score_func = ScoreFunc::sigmoid;
    c.moe.gate_bias_update_factor = 1e-3;
    c.moe.norm_topk_prob = true;
    v.push_back(c);
  }
  {
    Case c{"relu2_shared_relu2_padding", base_config()};
    c.moe.expert_activation = Activation::relu2;
    c.moe.n_shared_experts = 2;
    c.moe.shared_expert_activation = Activation::relu2;
    c.padding = 0.25;
    v.push_back(c);
  }
  {
    Case c{"softmax_with_bias_groups_aux", base_config()};
    c.moe.score_func = ScoreFunc::softmax_with_bias;
    c.moe.n_expert_groups = 4;
    c.moe.n_limited_groups = 2;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.force_e_score_correction_bias = true;
    v.push_back(c);
  }
  {
    Case c{"sqrtsoftplus_swigluoai_after_down", base_config()};
    c.moe.score_func = ScoreFunc::sqrtsoftplus;
    c.moe.gate_bias_update_factor = 1e-3;
    c.moe.norm_topk_prob = true;
    c.moe.expert_activation = Activation::swigluoai;
    c.moe.activation_limit = 0.5;  // clamps act at init-0.1 weights
    c.moe.apply_router_weight_after_down = true;
    c.moe.expert_bias = true;
    v.push_back(c);
  }
  {
    Case c{"sigmoid_with_bias_geglu_shared_swiglu_limit", base_config()};
    c.moe.score_func = ScoreFunc::sigmoid_with_bias;
    c.moe.n_expert_groups = 4;
    c.moe.n_limited_groups = 2;
    c.moe.force_e_score_correction_bias = true;
    c.moe.aux_loss_coeff = 1e-2;
    c.moe.expert_activation = Activation::geglu;
    c.moe.n_shared_experts = 1;
    c.moe.shared_expert_gate = true;
    c.moe.swiglu_limit = 0.5;  // the shared swiglu expert is clamped
    v.push_back(c);
  }
  {
    Case c{"sigmoid_gate_fp32_weights_fp32_biased", base_config()};
    c.moe.score_func = ScoreFunc::sigmoid;
    c.moe.gate_dtype = DType::f32;  // the gate weight and bias stored in f32 on the GPU
    c.moe.router_bias = true;
    c.moe.router_weights_fp32 = true;
    c.moe.force_e_score_correction_bias = true;
    c.moe.router_weight_uses_score_correction_bias = true;
    c.moe.norm_topk_prob = true;
    c.moe.swiglu_limit = 0.5;
    v.push_back(c);
  }
  return v;
}

// Both ways of feeding the routed experts: the dispatcher's copy of the rows (the default) and the
// tokens read in place through the row table (gather_gemm.h).
TEST(CudaMoELayer, ForwardAndBackwardMatchCpuReference) {
  if (!testing::require_gpus(1)) return;
  for (const bool in_place : {false, true})
  for (const Case& c : cases()) {
    SCOPED_TRACE(std::string(c.name) + (in_place ? ", rows read in place" : ", rows copied"));
    const std::int64_t T = 257, D = c.moe.dim;
    MoELayerOptions co;
    co.seed = 11;
    co.init_std = 0.1;
    co.gate_input_dtype = DType::bf16;  // the GPU's bf16 routing
    MoELayer cpu(c.moe, BackendConfig{}, nullptr, co);
    // Same numbers on both sides: round the CPU parameters to bf16 first.
    for (Parameter* p : cpu.parameters()) p->value = round_bf16(p->value);
    if (c.moe.expert_bias)
      for (Parameter* p : cpu.parameters())
        if (p->name.find("bias") != std::string::npos) fill_normal(p->value, 5, stream_id(p->name.c_str()), 0, 0.05);
    for (Parameter* p : cpu.parameters()) p->value = round_bf16(p->value);
    // Clamped activations: grid tokens and gate/up weights (testing::on_grid), so that the GPU's
    // bf16 pre-activations equal the CPU's and both take the same side of every clamp.
    const bool clamped = c.moe.swiglu_limit > 0 ||
                         ((c.moe.expert_activation == Activation::swigluoai ||
                           c.moe.expert_activation == Activation::quick_geglu) && c.moe.activation_limit < 1);
    if (clamped)
      for (Parameter* p : cpu.parameters())
        if (p->name.find("gate_and_up_projs") != std::string::npos || p->name.find("gate_proj.weight") !=
            std::string::npos || p->name.find("up_proj.weight") != std::string::npos)
          p->value = testing::on_grid(p->value, 1.0 / 32, 1.0);

    const cuda::OwnedStream stream;  // before the layer and its tensors: destroyed after them
    CudaMoELayerOptions go;
    go.seed = 11;
    go.init_std = 0.1;
    CudaMoELayer gpu(c.moe, BackendConfig{}, nullptr, go);
    gpu.load_from(cpu, stream);
    gpu.compute().set_rows_in_place(in_place);
    ASSERT_EQ(gpu.compute().rows_in_place(), in_place);

    Tensor x = Tensor::empty({T, D}, DType::f32);
    fill_normal(x, 3, stream_id("x"), 0, 1);
    x = clamped ? testing::on_grid(x, 1.0, 1.0) : round_bf16(x);
    Tensor pad = Tensor::zeros({T}, DType::b8);
    for (std::int64_t t = 0; t < T; ++t) pad.data<bool>()[t] = uniform01(3, stream_id("pad"), t) < c.padding;
    Tensor g = Tensor::empty({T, D}, DType::f32);
    fill_normal(g, 4, stream_id("g"), 0, 1);
    g = round_bf16(g);

    MoEOutput ref = cpu.forward(x, pad, true);
    cpu.zero_grad();
    Tensor ref_gx = cpu.backward(ref, g);

    Tensor dx = cuda::to_device(x.to(DType::bf16), 0, stream);
    Tensor dpad = cuda::to_device(pad, 0, stream);
    Tensor dg = cuda::to_device(g.to(DType::bf16), 0, stream);
    CudaMoEOutput out = gpu.forward(dx, dpad, true, stream);
    Tensor gx = gpu.backward(out, dg, stream);

    const Tensor y = cuda::to_host(out.out, stream).to(DType::f32);
    const double ey = rel_error(y, ref.out);
    const double egx = rel_error(cuda::to_host(gx, stream).to(DType::f32), ref_gx);
    std::printf("%s: out rel %.2e, grad x rel %.2e\n", c.name, ey, egx);
    EXPECT_LT(ey, 3e-2);
    EXPECT_LT(egx, 3e-2);
    if (ref.aux_loss) {
      ASSERT_TRUE(out.aux_loss.defined());
      const double aux = read_as_double(cuda::to_host(out.aux_loss, stream), 0);
      EXPECT_NEAR(aux, *ref.aux_loss, 2e-2 * std::fabs(*ref.aux_loss) + 1e-6);
    }
    if (c.moe.gate_dtype == DType::f32)
      for (Parameter* p : gpu.parameters())
        if (p->name.rfind("gate.", 0) == 0) {
          EXPECT_EQ(p->value.dtype(), DType::f32) << p->name;
        }
    for (const auto& [name, grad] : gpu.host_gradients(stream)) {
      Tensor want;
      for (Parameter* p : cpu.parameters())
        if (p->name == name) want = p->grad.defined() ? p->grad : Tensor::zeros(p->value.shape(), DType::f32);
      ASSERT_TRUE(want.defined()) << name;
      ASSERT_EQ(want.shape(), grad.shape()) << name;
      const double e = rel_error(grad, want);
      std::printf("  %-36s rel %.2e\n", name.c_str(), e);
      EXPECT_LT(e, 5e-2) << name;
    }
  }
}

// A CPU layer with bf16-rounded parameters (biases given random values: init leaves them zero), and
// bf16-rounded input, padding mask and output gradient, as ForwardAndBackwardMatchCpuReference uses.
struct LayerData {
  std::unique_ptr<MoELayer> cpu;
  Tensor x, pad, g;  // host: f32 [T, dim], bool [T], f32 [T, dim]
};
LayerData layer_data(const Case& c, std::int64_t T, std::uint64_t grad_seed) {
  LayerData d;
  MoELayerOptions co;
  co.seed = 11;
  co.init_std = 0.1;
  co.gate_input_dtype = DType::bf16;
  d.cpu = std::make_unique<MoELayer>(c.moe, BackendConfig{}, nullptr, co);
  for (Parameter* p : d.cpu->parameters()) {
    if (c.moe.expert_bias && p->name.find("bias") != std::string::npos)
      fill_normal(p->value, 5, stream_id(p->name.c_str()), 0, 0.05);
    p->value = round_bf16(p->value);
  }
  d.x = Tensor::empty({T, c.moe.dim}, DType::f32);
  fill_normal(d.x, 3, stream_id("x"), 0, 1);
  d.x = round_bf16(d.x);
  d.pad = Tensor::zeros({T}, DType::b8);
  for (std::int64_t t = 0; t < T; ++t) d.pad.data<bool>()[t] = uniform01(3, stream_id("pad"), t) < c.padding;
  d.g = Tensor::empty({T, c.moe.dim}, DType::f32);
  fill_normal(d.g, grad_seed, stream_id("g"), 0, 1);
  d.g = round_bf16(d.g);
  return d;
}

// The expert weights, in the names host_gradients gives them (shared experts as nn.Linear weights).
bool is_expert_weight(const std::string& name) {
  auto ends_with = [&](const std::string& tail) {
    return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  if (name.rfind("experts.", 0) == 0) return ends_with("gate_and_up_projs") || ends_with("down_projs");
  return name.rfind("shared_experts.", 0) == 0 && ends_with(".weight");
}

// One forward and backward on the device; returns grad x on the host (f32).
Tensor run_layer(CudaMoELayer& gpu, const LayerData& d, const Tensor& g, cudaStream_t stream, Tensor* out = nullptr) {
  const Tensor dx = cuda::to_device(d.x.to(DType::bf16), 0, stream);
  const Tensor dpad = cuda::to_device(d.pad, 0, stream);
  const Tensor dg = cuda::to_device(g.to(DType::bf16), 0, stream);
  const CudaMoEOutput o = gpu.forward(dx, dpad, true, stream);
  const Tensor gx = gpu.backward(o, dg, stream);
  if (out) *out = cuda::to_host(o.out, stream).to(DType::f32);
  return cuda::to_host(gx, stream).to(DType::f32);
}

// GradMode::fresh_bf16_weights against the default accumulate_f32 on the same weights and data, for
// every configuration above: the same output and grad x (the modes differ only in where gradients
// go), the same f32 gradients (gate, biases, shared gate: same kernels), and expert weight gradients
// in bf16 equal to the f32 ones rounded: within half a bf16 ulp (2^-8 relative) plus the fp32
// summation-order difference of two cuBLAS paths (1e-5 of the tensor's largest entry).
TEST(CudaMoELayer, FreshBf16GradsMatchAccumulateMode) {
  if (!testing::require_gpus(1)) return;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const LayerData d = layer_data(c, 257, 4);
    const cuda::OwnedStream stream;
    CudaMoELayerOptions o;
    o.seed = 11;
    CudaMoELayer acc(c.moe, BackendConfig{}, nullptr, o);
    o.grad_mode = GradMode::fresh_bf16_weights;
    CudaMoELayer fresh(c.moe, BackendConfig{}, nullptr, o);
    acc.load_from(*d.cpu, stream);
    fresh.load_from(*d.cpu, stream);
    Tensor ya, yb;
    const Tensor gxa = run_layer(acc, d, d.g, stream, &ya), gxb = run_layer(fresh, d, d.g, stream, &yb);
    EXPECT_LT(rel_error(yb, ya), 1e-6);
    EXPECT_LT(rel_error(gxb, gxa), 1e-6);

    for (Parameter* p : fresh.parameters()) {
      const bool weight = p->name.size() > 5 && p->name.compare(p->name.size() - 5, 5, "projs") == 0;
      ASSERT_TRUE(p->grad.defined() || !p->requires_grad) << p->name;
      if (p->grad.defined()) {
        EXPECT_EQ(p->grad.dtype(), weight ? DType::bf16 : DType::f32) << p->name;
      }
    }
    const auto want = acc.host_gradients(stream), got = fresh.host_gradients(stream);
    ASSERT_EQ(want.size(), got.size());
    for (std::size_t i = 0; i < want.size(); ++i) {
      const std::string& name = want[i].first;
      SCOPED_TRACE(name);
      ASSERT_EQ(got[i].first, name);
      const Tensor& w = want[i].second;
      const Tensor& b = got[i].second;
      ASSERT_EQ(w.shape(), b.shape());
      if (!is_expert_weight(name)) {
        EXPECT_LT(rel_error(b, w), 1e-6);
        continue;
      }
      ASSERT_TRUE(testing::within_bf16_rounding(b, w, 1e-5));
    }
  }
}

// fresh_bf16_weights: two successive backwards give independent tensors for every parameter (gate,
// routed and shared experts, biases, shared gate): the first backward's are unchanged by the second
// (another output gradient) and by zero_grad, which only releases the layer's references.
TEST(CudaMoELayer, FreshBf16GradsAreNewTensorsPerBackward) {
  if (!testing::require_gpus(1)) return;
  const Case c = cases()[0];  // shared experts with a gate, expert and router biases: every kind
  const LayerData d = layer_data(c, 64, 4);
  Tensor g2 = Tensor::empty(d.g.shape(), DType::f32);
  fill_normal(g2, 9, stream_id("g"), 0, 1);
  g2 = round_bf16(g2);
  const cuda::OwnedStream stream;
  CudaMoELayerOptions o;
  o.grad_mode = GradMode::fresh_bf16_weights;
  CudaMoELayer gpu(c.moe, BackendConfig{}, nullptr, o);
  gpu.load_from(*d.cpu, stream);

  run_layer(gpu, d, d.g, stream);
  std::vector<Tensor> first, first_values;
  for (Parameter* p : gpu.parameters()) {
    ASSERT_TRUE(p->grad.defined()) << p->name;
    first.push_back(p->grad);  // what a caller keeps (autograd's .grad)
    first_values.push_back(cuda::to_host(p->grad, stream));
  }
  run_layer(gpu, d, g2, stream);
  const std::vector<Parameter*> ps = gpu.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    SCOPED_TRACE(ps[i]->name);
    ASSERT_TRUE(ps[i]->grad.defined());
    EXPECT_NE(ps[i]->grad.raw(), first[i].raw());
    EXPECT_TRUE(testing::same_bytes(cuda::to_host(first[i], stream), first_values[i]))
        << "the second backward changed the first one's gradient";
    EXPECT_FALSE(testing::same_bytes(cuda::to_host(ps[i]->grad, stream), first_values[i]))
        << "same gradient for another output gradient: not this backward's alone?";
  }
  gpu.zero_grad(stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (std::size_t i = 0; i < ps.size(); ++i) {
    EXPECT_FALSE(ps[i]->grad.defined()) << ps[i]->name;
    EXPECT_TRUE(testing::same_bytes(cuda::to_host(first[i], stream), first_values[i])) << ps[i]->name;
  }
  for (const auto& [name, grad] : gpu.host_gradients(stream))
    for (std::int64_t i = 0; i < grad.numel(); ++i) ASSERT_EQ(read_as_double(grad, i), 0.0) << name;
}

// The fake balanced gate on the device layer against the CPU layer with the same gate: without
// noise (routing cached per T on the device, and no copy of x kept, since no backward reads it)
// and with noise (routing from x on the host). T changes between calls and comes back, so a stale
// cached routing would show; both sides route identically, so outputs agree to bf16 precision.
TEST(CudaMoELayer, FakeGateMatchesCpuAcrossChangingT) {
  if (!testing::require_gpus(1)) return;
  for (double noise : {0.0, 0.3}) {
    SCOPED_TRACE("noise " + std::to_string(noise));
    Case c{"fake_gate", base_config()};
    BackendConfig backend;
    backend.fake_balanced_gate = true;
    backend.fake_gate_noise = noise;
    LayerData d = layer_data(c, 300, 4);
    d.cpu = std::make_unique<MoELayer>(c.moe, backend, nullptr, MoELayerOptions{});
    for (Parameter* p : d.cpu->parameters()) p->value = round_bf16(p->value);
    const cuda::OwnedStream stream;
    CudaMoELayer gpu(c.moe, backend, nullptr, CudaMoELayerOptions{});
    gpu.load_from(*d.cpu, stream);
    for (std::int64_t T : {300, 97, 300}) {
      SCOPED_TRACE("T " + std::to_string(T));
      LayerData part;
      part.x = Tensor::wrap(d.x.view().rows(0, T));
      part.pad = Tensor::zeros({T}, DType::b8);
      part.g = Tensor::wrap(d.g.view().rows(0, T));
      MoEOutput ref = d.cpu->forward(part.x, part.pad, true);
      d.cpu->zero_grad();
      const Tensor ref_gx = d.cpu->backward(ref, part.g);
      Tensor y;
      const Tensor gx = run_layer(gpu, part, part.g, stream, &y);
      EXPECT_LT(rel_error(y, ref.out), 3e-2);
      EXPECT_LT(rel_error(gx, ref_gx), 3e-2);
    }
  }
}

// Routing replay through the whole layer: the GPU layer with forced indices against the CPU layer
// with the same ones (bf16 routing on both); the GPU layer checks the ids on the host.
TEST(CudaMoELayer, ReplayMatchesCpuAndChecksIds) {
  if (!testing::require_gpus(1)) return;
  Case c{"replay", base_config()};
  c.moe.score_func = ScoreFunc::sigmoid;
  c.moe.norm_topk_prob = true;
  c.moe.enable_routing_replay = true;
  c.moe.n_shared_experts = 1;
  const std::int64_t T = 96, k = c.moe.n_activated_experts, E = c.moe.n_routed_experts;
  const LayerData d = layer_data(c, T, 4);
  std::vector<std::int64_t> forced(static_cast<std::size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) forced[static_cast<std::size_t>(t * k + j)] = (t * 5 + j * 3) % E;
  const Tensor forced_host = Tensor::from_vector(forced, {T, k});
  const cuda::OwnedStream stream;
  CudaMoELayer gpu(c.moe, BackendConfig{}, nullptr, CudaMoELayerOptions{});
  gpu.load_from(*d.cpu, stream);
  const MoEOutput ref = d.cpu->forward(d.x, d.pad, true, forced_host);
  d.cpu->zero_grad();
  const Tensor ref_gx = d.cpu->backward(ref, d.g);
  const Tensor dx = cuda::to_device(d.x.to(DType::bf16), 0, stream), dpad = cuda::to_device(d.pad, 0, stream);
  const Tensor dforced = cuda::to_device(forced_host, 0, stream);
  const CudaMoEOutput out = gpu.forward(dx, dpad, true, stream, dforced);
  const Tensor gx = gpu.backward(out, cuda::to_device(d.g.to(DType::bf16), 0, stream), stream);
  EXPECT_LT(rel_error(cuda::to_host(out.out, stream).to(DType::f32), ref.out), 3e-2);
  EXPECT_LT(rel_error(cuda::to_host(gx, stream).to(DType::f32), ref_gx), 3e-2);
  for (const auto& [name, grad] : gpu.host_gradients(stream))
    for (Parameter* p : d.cpu->parameters())
      if (p->name == name && p->grad.defined()) {
        EXPECT_LT(rel_error(grad, p->grad), 5e-2) << name;
      }
  auto arg_of = [&](const TensorView& r) {
    try {
      gpu.forward(dx, dpad, true, stream, r);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(no error)");
  };
  std::vector<std::int64_t> bad = forced;
  bad[5] = E;  // out of range
  EXPECT_EQ(arg_of(cuda::to_device(Tensor::from_vector(bad, {T, k}), 0, stream)), "replay_indices");
  bad = forced;
  bad[1] = bad[0];  // token 0 picks one expert twice
  EXPECT_EQ(arg_of(cuda::to_device(Tensor::from_vector(bad, {T, k}), 0, stream)), "replay_indices");
  bad = forced;
  bad[2] = -1;
  EXPECT_EQ(arg_of(cuda::to_device(Tensor::from_vector(bad, {T, k}), 0, stream)), "replay_indices");
  MoEConfig off = c.moe;
  off.enable_routing_replay = false;
  CudaMoELayer plain(off, BackendConfig{}, nullptr, CudaMoELayerOptions{});
  try {
    plain.forward(dx, dpad, true, stream, dforced);
    ADD_FAILURE() << "expected an ArgumentError";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "replay_indices");
  }
}

TEST(CudaMoELayer, ZeroTokensAndBadInput) {
  if (!testing::require_gpus(1)) return;
  MoEConfig c = base_config();
  CudaMoELayer gpu(c, BackendConfig{}, nullptr, {});
  Tensor dx = Tensor::empty({0, c.dim}, DType::bf16, Device::cuda(0));
  CudaMoEOutput out = gpu.forward(dx, TensorView(), true, nullptr);
  EXPECT_EQ(out.out.size(0), 0);
  Tensor gx = gpu.backward(out, Tensor::empty({0, c.dim}, DType::bf16, Device::cuda(0)), nullptr);
  EXPECT_EQ(gx.size(0), 0);
  for (const auto& [name, grad] : gpu.host_gradients(nullptr))
    for (std::int64_t i = 0; i < grad.numel(); ++i) ASSERT_EQ(read_as_double(grad, i), 0.0) << name;
  Tensor wrong = Tensor::empty({4, c.dim + 1}, DType::bf16, Device::cuda(0));
  try {
    gpu.forward(wrong, TensorView(), true, nullptr);
    FAIL() << "expected ArgumentError";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), "x");
  }
  Tensor host = Tensor::empty({4, c.dim}, DType::bf16);
  EXPECT_THROW(gpu.forward(host, TensorView(), true, nullptr), ArgumentError);
}

// What the forward keeps for backward, read from the pool (beyond y), against
// estimate_gpu_layer_memory's forward share: within 10%, where keeping the experts' and the shared
// expert's outputs (released once combined) would be 40% over. In one chunk and in two, whose
// outputs are released chunk by chunk.
TEST(CudaMoELayer, KeepsForBackwardWhatTheEstimateSays) {
  if (!testing::require_gpus(1)) return;
  MoEConfig c;
  c.dim = 1024;
  c.moe_inter_dim = 512;
  c.n_routed_experts = 16;
  c.n_activated_experts = 4;
  c.n_shared_experts = 1;
  c.score_func = ScoreFunc::sigmoid;
  c.norm_topk_prob = true;
  c.dtype = DType::bf16;
  const std::int64_t T = 2048;
  for (const int chunks : {1, 2}) {
    SCOPED_TRACE("dispatch_chunks " + std::to_string(chunks));
    BackendConfig b;
    b.dispatch_chunks = chunks;
    const cuda::OwnedStream stream;
    CudaMoELayer gpu(c, b, nullptr, {});
    Tensor x = Tensor::empty({T, c.dim}, DType::f32);
    fill_normal(x, 3, stream_id("x"), 0, 1);
    const Tensor dx = cuda::to_device(x.to(DType::bf16), 0, stream);
    {  // a first step makes what the layer keeps between steps (gradients, workspaces)
      CudaMoEOutput first = gpu.forward(dx, TensorView(), true, stream);
      gpu.backward(first, Tensor::zeros({T, c.dim}, DType::bf16, Device::cuda(0)), stream);
    }
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const double before = static_cast<double>(cuda::pool_used_bytes(0));
    CudaMoEOutput out = gpu.forward(dx, TensorView(), true, stream);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const double kept = static_cast<double>(cuda::pool_used_bytes(0)) - before - static_cast<double>(out.out.nbytes());
    const double estimate = static_cast<double>(estimate_gpu_layer_memory(c, b, 1, T).activations) / 2;
    std::printf("dispatch_chunks %d: kept %.2f MB, estimate %.2f MB\n", chunks, kept / 1e6, estimate / 1e6);
    EXPECT_NEAR(kept, estimate, 0.1 * estimate);
  }
}

}  // namespace
}  // namespace flexep
