// Fused activation kernels and expert bias kernels against core/activation.h row by row, on the same
// bf16-rounded inputs. Tolerances: bf16 outputs relative error norm < 1e-2; fp32 reductions < 1e-5
// (only the summation order differs); inactive (tail) and padding rows exactly zero or untouched.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "experts_test_util.h"
#include "flexep/core/activation.h"
#include "flexep/cuda/expert_activation.h"
#include "flexep/cuda/expert_bias.h"
#include "flexep/cuda/expert_prob.h"
#include "flexep/cuda/grouped_gemm.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::expect_arg_error;

using testing::bf16_exact;
using testing::rel_error;

ActivationParams params_of(Activation kind) {
  ActivationParams p;
  p.kind = kind;
  return p;
}

std::int64_t up_of(Activation kind, std::int64_t inter) { return is_gated(kind) ? 2 * inter : inter; }

// Expert of each row for the given counts (-1 past the active rows).
std::vector<int> row_experts(const std::vector<std::int64_t>& counts, std::int64_t rows) {
  std::vector<int> e(static_cast<std::size_t>(rows), -1);
  std::int64_t r = 0;
  for (std::size_t g = 0; g < counts.size(); ++g)
    for (std::int64_t i = 0; i < counts[g]; ++i) e[static_cast<std::size_t>(r++)] = static_cast<int>(g);
  return e;
}

Tensor uniform_probs(std::int64_t n, std::uint64_t seed) {
  Tensor p = Tensor::empty({n}, DType::f32);
  fill_uniform(p, seed, 99, 0.1, 1.0);
  return p;
}

// Row r of h plus the bias row of its expert (f32 add of bf16 values, as the kernel does).
std::vector<float> biased_row(const Tensor& h, const Tensor& bias, std::int64_t r, int e) {
  const std::int64_t up = h.size(1);
  std::vector<float> x(h.data<float>() + r * up, h.data<float>() + (r + 1) * up);
  if (bias.defined())
    for (std::int64_t c = 0; c < up; ++c) x[static_cast<std::size_t>(c)] += bias.data<float>()[e * up + c];
  return x;
}

void check_activation(const ActivationParams& act, bool with_bias, std::int64_t inter);
void check_activation(Activation kind, bool with_bias, std::int64_t inter) {
  check_activation(params_of(kind), with_bias, inter);
}

void check_activation(const ActivationParams& act, bool with_bias, std::int64_t inter) {
  const Activation kind = act.kind;
  SCOPED_TRACE(std::string(to_string(kind)) + (with_bias ? " with bias" : " without bias") + ", inter " +
               std::to_string(inter) + ", limit " + std::to_string(act.limit) + ", swiglu_limit " +
               std::to_string(act.swiglu_limit));
  const std::vector<std::int64_t> counts = {5, 0, 9, 3};
  const std::int64_t N = 20, E = 4, active = 17, up = up_of(kind, inter);
  const std::int64_t pad_row = 6;  // a padding row inside expert 2: p = 0
  const Tensor h = bf16_exact({N, up}, 21, 3.0);  // std 3: the clamps at +-7 (and +-2 below) are crossed
  const Tensor bias = with_bias ? bf16_exact({E, up}, 22) : Tensor();
  Tensor probs = uniform_probs(N, 23);
  probs.data<float>()[pad_row] = 0.f;
  const std::vector<int> expert = row_experts(counts, N);

  const Tensor h_d = testing::to_gpu_bf16(h), probs_d = testing::to_gpu(probs);
  const Tensor bias_d = with_bias ? testing::to_gpu_bf16(bias) : Tensor();
  const Tensor offsets = cuda::expert_offsets(counts, 0, nullptr);
  const TensorView bias_v = with_bias ? bias_d.view() : TensorView();

  // Forward.
  Tensor out_d = testing::poisoned({N, inter}, DType::bf16);
  cuda::activation_forward(act, h_d, bias_v, probs_d, offsets, out_d, nullptr);
  Tensor ref = Tensor::zeros({N, inter}, DType::f32);
  for (std::int64_t r = 0; r < active; ++r) {
    const std::vector<float> x = biased_row(h, bias, r, expert[static_cast<std::size_t>(r)]);
    float* a = ref.data<float>() + r * inter;
    activation_forward(x.data(), a, static_cast<int>(inter), act);
    for (std::int64_t i = 0; i < inter; ++i) a[i] *= probs.data<float>()[r];
  }
  const Tensor out = testing::to_cpu_f32(out_d);
  EXPECT_LT(rel_error(out, ref), 1e-2);
  EXPECT_TRUE(testing::rows_equal(out, active, N, 0.0)) << "inactive rows must be exactly zero";
  EXPECT_TRUE(testing::rows_equal(out, pad_row, pad_row + 1, 0.0)) << "padding row (p = 0) must be exactly zero";

  // Backward.
  const Tensor ga = bf16_exact({N, inter}, 24);
  const Tensor gb0 = bf16_exact({E, up}, 25);  // accumulated onto
  const Tensor ga_d = testing::to_gpu_bf16(ga);
  Tensor gh_d = testing::poisoned({N, up}, DType::bf16);
  Tensor gp_d = testing::poisoned({N}, DType::f32);
  Tensor gb_d = testing::to_gpu(gb0);
  cuda::activation_backward(act, h_d, bias_v, probs_d, offsets, ga_d, gh_d, gp_d, gb_d, nullptr);
  Tensor gh_ref = Tensor::zeros({N, up}, DType::f32), gp_ref = Tensor::zeros({N}, DType::f32), gb_ref = gb0.clone();
  for (std::int64_t r = 0; r < active; ++r) {
    const int e = expert[static_cast<std::size_t>(r)];
    const std::vector<float> x = biased_row(h, bias, r, e);
    const float p = probs.data<float>()[r];
    std::vector<float> a(static_cast<std::size_t>(inter)), grad_a(static_cast<std::size_t>(inter));
    activation_forward(x.data(), a.data(), static_cast<int>(inter), act);
    float dot = 0;
    for (std::int64_t i = 0; i < inter; ++i) {
      const float g = ga.data<float>()[r * inter + i];
      grad_a[static_cast<std::size_t>(i)] = g * p;
      dot += g * a[static_cast<std::size_t>(i)];
    }
    gp_ref.data<float>()[r] = dot;
    float* gh = gh_ref.data<float>() + r * up;
    activation_backward(x.data(), grad_a.data(), gh, static_cast<int>(inter), act);
    for (std::int64_t c = 0; c < up; ++c) gb_ref.data<float>()[e * up + c] += gh[c];
  }
  const Tensor gh = testing::to_cpu_f32(gh_d), gp = testing::to_cpu_f32(gp_d), gb = testing::to_cpu_f32(gb_d);
  EXPECT_LT(rel_error(gh, gh_ref), 1e-2);
  EXPECT_LT(rel_error(gp, gp_ref), 1e-2);
  EXPECT_LT(rel_error(gb, gb_ref), 1e-2);
  EXPECT_TRUE(testing::rows_equal(gh, active, N, 0.0)) << "inactive rows of grad_h must be exactly zero";
  EXPECT_TRUE(testing::rows_equal(gp, active, N, 0.0)) << "inactive rows of grad_probs must be exactly zero";
  for (std::int64_t c = 0; c < up; ++c)
    ASSERT_EQ(gb.data<float>()[1 * up + c], gb0.data<float>()[1 * up + c]) << "bias grad of empty expert 1 changed";
}

TEST(ExpertActivation, SwigluVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true})
    for (std::int64_t inter : {64, 12}) check_activation(Activation::swiglu, bias, inter);
}

TEST(ExpertActivation, QuickGegluVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true})
    for (std::int64_t inter : {64, 12}) check_activation(Activation::quick_geglu, bias, inter);
}

TEST(ExpertActivation, Relu2VectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true})
    for (std::int64_t inter : {64, 12}) check_activation(Activation::relu2, bias, inter);
}

// GPT-OSS's swigluoai: [gate | up] halves (not quick_geglu's interleaving), clamped at limit 7, and
// unclamped with limit 0; alpha other than the default too.
TEST(ExpertActivation, SwigluOaiVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (double limit : {7.0, 0.0})
    for (bool bias : {false, true})
      for (std::int64_t inter : {64, 12}) {
        ActivationParams p = params_of(Activation::swigluoai);
        p.limit = limit;
        p.alpha = 1.5;
        check_activation(p, bias, inter);
      }
}

TEST(ExpertActivation, GegluVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true})
    for (std::int64_t inter : {64, 12}) check_activation(Activation::geglu, bias, inter);
}

// swiglu with swiglu_limit 2 (DeepSeek-V4): gate clamped <= 2, up to [-2, 2]; std-3 data crosses both.
TEST(ExpertActivation, SwigluLimitVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true})
    for (std::int64_t inter : {64, 12}) {
      ActivationParams p = params_of(Activation::swiglu);
      p.swiglu_limit = 2.0;
      check_activation(p, bias, inter);
    }
}

// The clamps really act on the GPU: with swiglu_limit 2 the output differs from plain swiglu's, and
// the gradient is exactly zero where the inputs lie beyond the limit.
TEST(ExpertActivation, SwigluLimitClampsAndZeroesGradients) {
  if (!testing::require_gpus(1)) return;
  const std::int64_t N = 4, inter = 8, up = 16;
  Tensor h = Tensor::empty({N, up}, DType::f32);
  for (std::int64_t i = 0; i < h.numel(); ++i) h.data<float>()[i] = static_cast<float>((i % 7) - 3) * 1.25f;  // +-3.75
  const Tensor h_d = testing::to_gpu_bf16(h);
  ActivationParams clamped = params_of(Activation::swiglu), plain = params_of(Activation::swiglu);
  clamped.swiglu_limit = 2.0;
  Tensor a_d = testing::poisoned({N, inter}, DType::bf16), b_d = testing::poisoned({N, inter}, DType::bf16);
  cuda::activation_forward(clamped, h_d, TensorView(), TensorView(), TensorView(), a_d, nullptr);
  cuda::activation_forward(plain, h_d, TensorView(), TensorView(), TensorView(), b_d, nullptr);
  EXPECT_GT(rel_error(testing::to_cpu_f32(a_d), testing::to_cpu_f32(b_d)), 1e-2);
  Tensor gh_d = testing::poisoned({N, up}, DType::bf16);
  const Tensor ga = bf16_exact({N, inter}, 71);
  cuda::activation_backward(clamped, h_d, TensorView(), TensorView(), TensorView(), testing::to_gpu_bf16(ga), gh_d,
                            TensorView(), TensorView(), nullptr);
  const Tensor gh = testing::to_cpu_f32(gh_d);
  int zeros = 0;
  for (std::int64_t r = 0; r < N; ++r)
    for (std::int64_t i = 0; i < inter; ++i) {
      const float g = h.data<float>()[r * up + i], u = h.data<float>()[r * up + inter + i];
      if (g > 2.f) {
        EXPECT_EQ(gh.data<float>()[r * up + i], 0.f);
        ++zeros;
      }
      if (u > 2.f || u < -2.f) {
        EXPECT_EQ(gh.data<float>()[r * up + inter + i], 0.f);
        ++zeros;
      }
    }
  EXPECT_GT(zeros, 4);
}

// After-down prob multiply (expert_prob.h): y = bf16(u * p) and grad_u = bf16(g * p) bit for bit
// against the same fp32 products on the host; grad_probs = <g, u> to fp32 summation order.
TEST(ExpertProb, ScaleRowsForwardBackwardVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  for (std::int64_t dim : {64, 13}) {
    SCOPED_TRACE("dim " + std::to_string(dim));
    const std::int64_t N = 37;
    const Tensor u = bf16_exact({N, dim}, 81, 2.0), g = bf16_exact({N, dim}, 82), probs = uniform_probs(N, 83);
    const Tensor u_d = testing::to_gpu_bf16(u), g_d = testing::to_gpu_bf16(g), probs_d = testing::to_gpu(probs);
    Tensor y_d = testing::poisoned({N, dim}, DType::bf16);
    cuda::prob_scale_rows(u_d, probs_d, y_d, nullptr);
    Tensor gu_d = testing::poisoned({N, dim}, DType::bf16), gp_d = testing::poisoned({N}, DType::f32);
    cuda::prob_scale_rows_backward(g_d, u_d, probs_d, gu_d, gp_d, nullptr);
    const Tensor y = testing::to_cpu_f32(y_d), gu = testing::to_cpu_f32(gu_d), gp = cuda::to_host(gp_d, nullptr);
    Tensor gp_ref = Tensor::zeros({N}, DType::f32);
    for (std::int64_t r = 0; r < N; ++r) {
      const float p = probs.data<float>()[r];
      double dot = 0;
      for (std::int64_t c = 0; c < dim; ++c) {
        const std::int64_t i = r * dim + c;
        ASSERT_EQ(y.data<float>()[i], bf16::from_float(u.data<float>()[i] * p).to_float()) << r << "," << c;
        ASSERT_EQ(gu.data<float>()[i], bf16::from_float(g.data<float>()[i] * p).to_float()) << r << "," << c;
        dot += static_cast<double>(g.data<float>()[i]) * u.data<float>()[i];
      }
      gp_ref.data<float>()[r] = static_cast<float>(dot);
    }
    EXPECT_LT(rel_error(gp, gp_ref), 1e-5);
  }
  // Zero rows: nothing to do, nothing written.
  const Tensor empty = Tensor::empty({0, 8}, DType::bf16, Device::cuda(0));
  const Tensor no_probs = Tensor::empty({0}, DType::f32, Device::cuda(0));
  cuda::prob_scale_rows(empty, no_probs, empty, nullptr);
}

TEST(ExpertProb, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const auto u = fake_cuda({10, 8}, DType::bf16), y = fake_cuda({10, 8}, DType::bf16);
  const auto probs = fake_cuda({10}, DType::f32);
  expect_arg_error([&] { cuda::prob_scale_rows(fake_cuda({10, 8}, DType::f32), probs, y, nullptr); }, "u");
  expect_arg_error([&] { cuda::prob_scale_rows(u, fake_cuda({9}, DType::f32), y, nullptr); }, "probs");
  expect_arg_error([&] { cuda::prob_scale_rows(u, TensorView(), y, nullptr); }, "probs");
  expect_arg_error([&] { cuda::prob_scale_rows(u, probs, fake_cuda({10, 9}, DType::bf16), nullptr); }, "y");
  {
    // The kernels take __restrict__ pointers: in place is refused (real buffers: the check compares
    // addresses).
    const Tensor real_u = Tensor::empty({10, 8}, DType::bf16, Device::cuda(0));
    const Tensor real_g = Tensor::empty({10, 8}, DType::bf16, Device::cuda(0));
    const Tensor real_p = Tensor::empty({10}, DType::f32, Device::cuda(0));
    expect_arg_error([&] { cuda::prob_scale_rows(real_u, real_p, real_u, nullptr); }, "y");
    expect_arg_error([&] { cuda::prob_scale_rows_backward(real_g, real_u, real_p, real_g, TensorView(), nullptr); },
                     "grad_u");
    expect_arg_error([&] { cuda::prob_scale_rows_backward(real_g, real_u, real_p, real_u, TensorView(), nullptr); },
                     "grad_u");
  }
  expect_arg_error(
      [&] { cuda::prob_scale_rows_backward(y, u, probs, fake_cuda({10, 8}, DType::f32), TensorView(), nullptr); },
      "grad_u");
  expect_arg_error(
      [&] {
        cuda::prob_scale_rows_backward(y, u, probs, fake_cuda({10, 8}, DType::bf16), fake_cuda({11}, DType::f32),
                                       nullptr);
      },
      "grad_probs");
}

// One expert owning every row, p = 1 (the shared-expert use): undefined offsets and probs.
TEST(ExpertActivation, OneGroupWithoutProbs) {
  if (!testing::require_gpus(1)) return;
  const std::int64_t N = 9, inter = 16, up = 32;
  const ActivationParams act = params_of(Activation::swiglu);
  const Tensor h = bf16_exact({N, up}, 31), bias = bf16_exact({1, up}, 32);
  Tensor out_d = testing::poisoned({N, inter}, DType::bf16);
  cuda::activation_forward(act, testing::to_gpu_bf16(h), testing::to_gpu_bf16(bias), TensorView(), TensorView(),
                           out_d, nullptr);
  Tensor ref = Tensor::empty({N, inter}, DType::f32);
  for (std::int64_t r = 0; r < N; ++r) {
    const std::vector<float> x = biased_row(h, bias, r, 0);
    activation_forward(x.data(), ref.data<float>() + r * inter, static_cast<int>(inter), act);
  }
  EXPECT_LT(rel_error(testing::to_cpu_f32(out_d), ref), 1e-2);
}

TEST(ExpertActivation, ZeroRows) {
  if (!testing::require_gpus(1)) return;
  const ActivationParams act = params_of(Activation::swiglu);
  const Tensor h = Tensor::empty({0, 16}, DType::bf16, Device::cuda(0));
  const Tensor out = Tensor::empty({0, 8}, DType::bf16, Device::cuda(0));
  const Tensor probs = Tensor::empty({0}, DType::f32, Device::cuda(0));
  const Tensor offsets = cuda::expert_offsets({0, 0}, 0, nullptr);
  const Tensor gb0 = bf16_exact({2, 16}, 33);
  Tensor gb = testing::to_gpu(gb0);
  cuda::activation_forward(act, h, TensorView(), probs, offsets, out, nullptr);
  cuda::activation_backward(act, h, TensorView(), probs, offsets, out, h, probs, gb, nullptr);
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(gb, nullptr), gb0));
}

// The gate/up bias gradient is reproducible bit for bit and equals the column sums of grad_h as stored.
TEST(ExpertActivation, BiasGradIsDeterministic) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts = {1000, 1500, 0, 499};
  const std::int64_t N = 3000, E = 4, inter = 64, up = 128;
  const ActivationParams act = params_of(Activation::swiglu);
  const Tensor h_d = testing::to_gpu_bf16(bf16_exact({N, up}, 41));
  const Tensor bias_d = testing::to_gpu_bf16(bf16_exact({E, up}, 42));
  const Tensor probs_d = testing::to_gpu(uniform_probs(N, 43));
  const Tensor ga_d = testing::to_gpu_bf16(bf16_exact({N, inter}, 44));
  const Tensor offsets = cuda::expert_offsets(counts, 0, nullptr);
  const Tensor gb0 = bf16_exact({E, up}, 45);
  Tensor results[2];
  Tensor gh_host;
  for (Tensor& result : results) {
    Tensor gh_d = testing::poisoned({N, up}, DType::bf16);
    Tensor gb_d = testing::to_gpu(gb0);
    cuda::activation_backward(act, h_d, bias_d, probs_d, offsets, ga_d, gh_d, TensorView(), gb_d, nullptr);
    result = cuda::to_host(gb_d, nullptr);
    gh_host = testing::to_cpu_f32(gh_d);
  }
  EXPECT_TRUE(testing::same_bytes(results[0], results[1]));
  Tensor ref = gb0.clone();
  const std::vector<int> expert = row_experts(counts, N);
  for (std::int64_t r = 0; r < N; ++r) {
    const int e = expert[static_cast<std::size_t>(r)];
    if (e < 0) continue;
    for (std::int64_t c = 0; c < up; ++c) ref.data<float>()[e * up + c] += gh_host.data<float>()[r * up + c];
  }
  EXPECT_LT(rel_error(results[0], ref), 1e-5);
}

TEST(ExpertColumnSum, ScaledVectorAndScalar) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts = {300, 0, 899};
  const std::int64_t N = 1200, E = 3;
  for (std::int64_t C : {40, 13}) {
    SCOPED_TRACE("columns " + std::to_string(C));
    const Tensor x = bf16_exact({N, C}, 51), scale = uniform_probs(N, 52), out0 = bf16_exact({E, C}, 53);
    const Tensor x_d = testing::to_gpu_bf16(x), scale_d = testing::to_gpu(scale);
    const Tensor offsets = cuda::expert_offsets(counts, 0, nullptr);
    Tensor runs[2];
    for (Tensor& run : runs) {
      Tensor out_d = testing::to_gpu(out0);
      cuda::expert_column_sum(x_d, scale_d, offsets, out_d, nullptr);
      run = cuda::to_host(out_d, nullptr);
    }
    EXPECT_TRUE(testing::same_bytes(runs[0], runs[1]));
    Tensor ref = out0.clone();
    const std::vector<int> expert = row_experts(counts, N);
    for (std::int64_t r = 0; r < N; ++r) {
      const int e = expert[static_cast<std::size_t>(r)];
      if (e < 0) continue;
      for (std::int64_t c = 0; c < C; ++c)
        ref.data<float>()[e * C + c] += scale.data<float>()[r] * x.data<float>()[r * C + c];
    }
    EXPECT_LT(rel_error(runs[0], ref), 1e-5);
    for (std::int64_t c = 0; c < C; ++c) ASSERT_EQ(runs[0].data<float>()[C + c], out0.data<float>()[C + c]);
  }
}

void check_down_bias(std::int64_t dim) {
  SCOPED_TRACE("dim " + std::to_string(dim));
  const std::vector<std::int64_t> counts = {5, 0, 9, 3};
  const std::int64_t N = 20, E = 4, active = 17;
  const Tensor y0 = bf16_exact({N, dim}, 61), bias = bf16_exact({E, dim}, 62), probs = uniform_probs(N, 63);
  const Tensor bias_d = testing::to_gpu_bf16(bias), probs_d = testing::to_gpu(probs);
  const Tensor offsets = cuda::expert_offsets(counts, 0, nullptr);
  const std::vector<int> expert = row_experts(counts, N);

  Tensor y_d = testing::to_gpu_bf16(y0);
  cuda::down_bias_forward(y_d, bias_d, probs_d, offsets, nullptr);
  const Tensor y = testing::to_cpu_f32(y_d);
  Tensor ref = y0.clone();
  for (std::int64_t r = 0; r < active; ++r)
    for (std::int64_t c = 0; c < dim; ++c)
      ref.data<float>()[r * dim + c] += bias.data<float>()[expert[static_cast<std::size_t>(r)] * dim + c] *
                                        probs.data<float>()[r];
  EXPECT_LT(rel_error(y, ref), 1e-2);
  for (std::int64_t i = active * dim; i < N * dim; ++i) ASSERT_EQ(y.data<float>()[i], y0.data<float>()[i]);

  const Tensor g = bf16_exact({N, dim}, 64), gb0 = bf16_exact({E, dim}, 65), gp0 = bf16_exact({N}, 66);
  Tensor gb_d = testing::to_gpu(gb0), gp_d = testing::to_gpu(gp0);
  cuda::down_bias_backward(testing::to_gpu_bf16(g), bias_d, probs_d, offsets, gb_d, gp_d, nullptr);
  Tensor gb_ref = gb0.clone(), gp_ref = gp0.clone();
  for (std::int64_t r = 0; r < active; ++r) {
    const int e = expert[static_cast<std::size_t>(r)];
    for (std::int64_t c = 0; c < dim; ++c) {
      gb_ref.data<float>()[e * dim + c] += probs.data<float>()[r] * g.data<float>()[r * dim + c];
      gp_ref.data<float>()[r] += g.data<float>()[r * dim + c] * bias.data<float>()[e * dim + c];
    }
  }
  const Tensor gb = cuda::to_host(gb_d, nullptr), gp = cuda::to_host(gp_d, nullptr);
  EXPECT_LT(rel_error(gb, gb_ref), 1e-5);
  EXPECT_LT(rel_error(gp, gp_ref), 1e-5);
  for (std::int64_t r = active; r < N; ++r) ASSERT_EQ(gp.data<float>()[r], gp0.data<float>()[r]);
  for (std::int64_t c = 0; c < dim; ++c) ASSERT_EQ(gb.data<float>()[dim + c], gb0.data<float>()[dim + c]);
}

TEST(ExpertBias, DownBiasForwardBackward) {
  if (!testing::require_gpus(1)) return;
  check_down_bias(24);
  check_down_bias(10);
}

TEST(ExpertActivation, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const ActivationParams act = params_of(Activation::swiglu);
  const auto h = fake_cuda({10, 16}, DType::bf16), out = fake_cuda({10, 8}, DType::bf16);
  const auto probs = fake_cuda({10}, DType::f32), offsets = fake_cuda({3}, DType::i64);
  const auto bias = fake_cuda({2, 16}, DType::bf16);
  auto fwd = [&](const TensorView& h_, const TensorView& b_, const TensorView& p_, const TensorView& o_,
                 const TensorView& out_) { cuda::activation_forward(act, h_, b_, p_, o_, out_, nullptr); };
  expect_arg_error([&] { fwd(fake_cuda({10, 17}, DType::bf16), bias, probs, offsets, out); }, "h");
  expect_arg_error([&] { fwd(h, bias, fake_cuda({10}, DType::f64), offsets, out); }, "probs");
  expect_arg_error([&] { fwd(h, bias, fake_cuda({9}, DType::f32), offsets, out); }, "probs");
  expect_arg_error([&] { fwd(h, fake_cuda({3, 16}, DType::bf16), probs, offsets, out); }, "gate_up_bias");
  expect_arg_error([&] { fwd(h, bias, probs, fake_cuda({3}, DType::i32), out); }, "expert_offsets");
  expect_arg_error([&] { fwd(h, bias, probs, offsets, fake_cuda({10, 8}, DType::f32)); }, "out");
  expect_arg_error(
      [&] {
        cuda::activation_backward(act, h, bias, probs, offsets, out, fake_cuda({10, 8}, DType::bf16), probs,
                                  TensorView(), nullptr);
      },
      "grad_h");
  expect_arg_error(
      [&] {
        cuda::activation_backward(act, h, bias, probs, offsets, out, h, probs, fake_cuda({2, 16}, DType::bf16),
                                  nullptr);
      },
      "grad_gate_up_bias");
  {
    // The kernels take __restrict__ pointers: an output overlapping an input is refused.
    const Tensor buf = Tensor::empty({10, 16}, DType::bf16, Device::cuda(0));
    const TensorView real_h = buf.view();
    const TensorView out_in_h(buf.raw(), DType::bf16, {10, 8}, Device::cuda(0));
    expect_arg_error([&] { fwd(real_h, TensorView(), probs, offsets, out_in_h); }, "out");
    expect_arg_error(
        [&] {
          cuda::activation_backward(act, real_h, TensorView(), probs, offsets, out, real_h, TensorView(), TensorView(),
                                    nullptr);
        },
        "grad_h");
  }
  expect_arg_error([&] { cuda::down_bias_forward(fake_cuda({10, 8}, DType::f32), out, probs, offsets, nullptr); }, "y");
  expect_arg_error([&] { cuda::down_bias_forward(out, fake_cuda({2, 9}, DType::bf16), probs, offsets, nullptr); },
                   "down_bias");
  const auto sums = fake_cuda({2, 8}, DType::f32);
  expect_arg_error([&] { cuda::expert_column_sum(out, fake_cuda({11}, DType::f32), offsets, sums, nullptr); }, "scale");
  expect_arg_error([&] { cuda::expert_column_sum(out, probs, offsets, fake_cuda({3, 8}, DType::f32), nullptr); },
                   "out");
}

}  // namespace
}  // namespace flexep
