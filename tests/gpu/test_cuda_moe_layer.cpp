// The MoE layer on one GPU against the CPU reference layer holding the same (bf16-rounded) weights
// and inputs. The GPU computes in bf16 with fp32 accumulation, so outputs and gradients agree to
// bf16 precision: ||gpu - cpu|| / ||cpu|| < 3e-2 (measured values are printed). Routing can differ on
// near-ties of the logits; the tests require at least 98% of the selections to agree.
#include <gtest/gtest.h>

#include <cmath>

#include "flexep/core/random.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/cuda_moe_layer.h"
#include "flexep/layer/moe_layer.h"
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
  return v;
}

TEST(CudaMoELayer, ForwardAndBackwardMatchCpuReference) {
  if (!testing::require_gpus(1)) return;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::int64_t T = 257, D = c.moe.dim;
    MoELayerOptions co;
    co.seed = 11;
    co.init_std = 0.1;
    MoELayer cpu(c.moe, BackendConfig{}, nullptr, co);
    // Same numbers on both sides: round the CPU parameters to bf16 first.
    for (Parameter* p : cpu.parameters()) p->value = round_bf16(p->value);
    if (c.moe.expert_bias)
      for (Parameter* p : cpu.parameters())
        if (p->name.find("bias") != std::string::npos) fill_normal(p->value, 5, stream_id(p->name.c_str()), 0, 0.05);
    for (Parameter* p : cpu.parameters()) p->value = round_bf16(p->value);

    const cuda::OwnedStream stream;  // before the layer and its tensors: destroyed after them
    CudaMoELayerOptions go;
    go.seed = 11;
    go.init_std = 0.1;
    CudaMoELayer gpu(c.moe, BackendConfig{}, nullptr, go);
    gpu.load_from(cpu, stream);

    Tensor x = Tensor::empty({T, D}, DType::f32);
    fill_normal(x, 3, stream_id("x"), 0, 1);
    x = round_bf16(x);
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

}  // namespace
}  // namespace flexep
