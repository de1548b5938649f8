// CudaGroupedExperts against the CPU GroupedExperts (f32) holding the same bf16-rounded weights, on
// the same bf16-rounded tokens. Tolerance: relative error norm < 1e-2 for outputs and every gradient
// (bf16 intermediates h, a*p, grad a*p, grad h; in GradMode::fresh_bf16_weights the weight gradients'
// own bf16 rounding adds at most 2^-8 relative per element); tail rows exactly zero, padding rows
// (x = 0, p = 0) exactly zero output, experts without rows exactly zero weight gradients.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "experts_test_util.h"
#include "flexep/layer/cuda_grouped_experts.h"
#include "flexep/layer/grouped_experts.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::expect_arg_error;

using testing::bf16_exact;
using testing::rel_error;

constexpr int kRoutedExperts = 8;

MoEConfig make_config(Activation act, bool bias, int dim, int inter) {
  MoEConfig c;
  c.n_routed_experts = kRoutedExperts;
  c.dim = dim;
  c.moe_inter_dim = inter;
  c.expert_bias = bias;
  c.expert_activation = act;
  c.dtype = DType::bf16;
  return c;
}

// Initialises the CPU module, rounds its weights to bf16 (kept in f32) and gives the biases random
// bf16 values (init leaves them zero, which would test nothing).
void prepare_cpu(GroupedExperts& cpu, std::uint64_t seed) {
  cpu.init(seed, 0.1);
  std::uint64_t s = seed;
  for (Parameter* p : cpu.parameters()) {
    if (p->name == "gate_up_proj_bias" || p->name == "down_proj_bias")
      p->value = bf16_exact(p->value.shape(), ++s, 0.5);
    else
      p->value = p->value.to(DType::bf16).to(DType::f32);
  }
}

// Three experts (swiglu with biases, dim 64, inter 32) on the GPU, holding prepare_cpu(seed)'s values.
std::unique_ptr<CudaGroupedExperts> small_gpu_experts(std::uint64_t seed, GradMode mode, cudaStream_t stream) {
  const MoEConfig cfg = make_config(Activation::swiglu, true, 64, 32);
  GroupedExperts cpu(cfg, 3, 0, DType::f32);
  prepare_cpu(cpu, seed);
  auto gpu = std::make_unique<CudaGroupedExperts>(cfg, 3, 0, 0, mode);
  gpu->load_from(cpu, stream);
  return gpu;
}

Tensor host_f32(const TensorView& d, cudaStream_t s) { return cuda::to_host(d, s).to(DType::f32); }

Tensor uniform_probs(std::int64_t n, std::uint64_t seed) {
  Tensor p = Tensor::empty({n}, DType::f32);
  fill_uniform(p, seed, 98, 0.1, 1.0);
  return p;
}


// Expert e's slice of a per-expert gradient is exactly zero.
bool expert_slice_zero(const Tensor& grad, std::int64_t e) {
  const Tensor slice = Tensor::wrap(grad.view().rows(e, e + 1)).clone();
  for (std::int64_t i = 0; i < slice.numel(); ++i)
    if (read_as_double(slice, i) != 0.0) return false;
  return true;
}

bool is_weight(const Parameter& p) { return p.name == "gate_and_up_projs" || p.name == "down_projs"; }

// The gradient dtype a mode gives a parameter.
DType grad_dtype(GradMode mode, const Parameter& p) {
  return mode == GradMode::fresh_bf16_weights && is_weight(p) ? DType::bf16 : DType::f32;
}

// Automodel 0.7.0's expert options on top of make_config.
struct Options {
  bool after_down = false;     // apply_router_weight_after_down
  double swiglu_limit = 0.0;
  double activation_limit = 7.0;
  bool gathered = false;       // forward_gathered: the rows read in place from a shuffled source
};

void check_case(Activation act, bool bias, int dim, int inter, const std::vector<std::int64_t>& counts,
                std::int64_t N, bool keep_tokens, GradMode mode = GradMode::accumulate_f32, Options opt = {}) {
  SCOPED_TRACE(std::string(to_string(act)) + (bias ? " bias" : " no bias") + " dim " + std::to_string(dim) +
               " inter " + std::to_string(inter) + " N " + std::to_string(N) + (keep_tokens ? " Tensor" : " view") +
               (mode == GradMode::fresh_bf16_weights ? " fresh_bf16_weights" : " accumulate_f32") +
               (opt.after_down ? " after-down" : "") + " swiglu_limit " + std::to_string(opt.swiglu_limit) +
               (opt.gathered ? " gathered" : ""));
  const int local = static_cast<int>(counts.size()), first = kRoutedExperts - local;
  MoEConfig cfg = make_config(act, bias, dim, inter);
  cfg.apply_router_weight_after_down = opt.after_down;
  cfg.swiglu_limit = opt.swiglu_limit;
  cfg.activation_limit = opt.activation_limit;
  const std::int64_t active = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  ASSERT_LE(active, N);
  const cuda::OwnedStream stream;
  GroupedExperts cpu(cfg, local, first, DType::f32);
  prepare_cpu(cpu, 7);
  const bool clamped = opt.swiglu_limit > 0 || (act == Activation::swigluoai && opt.activation_limit < 1);
  if (clamped) cpu.gate_and_up_projs().value = testing::on_grid(cpu.gate_and_up_projs().value, 1.0 / 32, 1.0);
  CudaGroupedExperts gpu(cfg, local, first, 0, mode);
  gpu.load_from(cpu, stream);

  Tensor x = bf16_exact({N, dim}, 71);
  if (clamped) x = testing::on_grid(x, 1.0, 1.0);  // exact pre-activations (testing::on_grid)
  Tensor probs = uniform_probs(N, 72);
  const std::int64_t pad_row = active > 2 ? 1 : -1;  // a padding row inside expert-major rows
  if (pad_row >= 0) {
    for (std::int64_t c = 0; c < dim; ++c) x.data<float>()[pad_row * dim + c] = 0.f;
    probs.data<float>()[pad_row] = 0.f;
  }
  const Tensor x_d = testing::to_gpu_bf16(x), probs_d = testing::to_gpu(probs);
  if (clamped && active > 0) {
    // The premise of the clamped cases: some pre-activations of this data lie beyond the limit.
    const Tensor& w = cpu.gate_and_up_projs().value;
    const double limit = opt.swiglu_limit > 0 ? opt.swiglu_limit : opt.activation_limit;
    int beyond = 0;
    for (std::int64_t c = 0; c < 2 * inter; ++c) {
      double h = 0;
      for (std::int64_t d = 0; d < dim; ++d) h += x.data<float>()[d] * w.data<float>()[d * 2 * inter + c];
      beyond += std::abs(h) > limit;
    }
    EXPECT_GT(beyond, 0) << "row 0 of expert 0 crosses no clamp";
  }

  // Forward. Gathered: row i lives at source row perm[i] (a shuffle into 3 more rows than needed); the
  // padding row and the rows past the counts are read through id -1 (zero rows).
  CudaExpertsOutput fo;
  if (opt.gathered) {
    std::vector<std::int32_t> perm(static_cast<std::size_t>(N + 3));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937_64(74));
    Tensor source = Tensor::zeros({N + 3, static_cast<std::int64_t>(dim)}, DType::f32);
    Tensor ids = Tensor::empty({N}, DType::i32);
    for (std::int64_t i = 0; i < N; ++i) {
      const bool zero_row = i == pad_row || i >= active;
      ids.data<std::int32_t>()[i] = zero_row ? -1 : perm[static_cast<std::size_t>(i)];
      std::copy_n(x.data<float>() + i * dim, dim, source.data<float>() + perm[static_cast<std::size_t>(i)] * dim);
    }
    fo = gpu.forward_gathered(testing::to_gpu_bf16(source), testing::to_gpu(ids), probs_d, counts, stream);
  } else {
    fo = keep_tokens ? gpu.forward(x_d, probs_d, counts, stream) : gpu.forward(x_d.view(), probs_d, counts, stream);
  }
  const ExpertsOutput co = cpu.forward(x, probs, counts);
  ASSERT_EQ(fo.out.shape(), Shape({N, static_cast<std::int64_t>(dim)}));
  const Tensor out = host_f32(fo.out, stream);
  EXPECT_LT(rel_error(out, co.out), 1e-2);
  EXPECT_TRUE(testing::rows_equal(out, active, N, 0.0)) << "rows past the counts must be zero";
  if (pad_row >= 0) {
    EXPECT_TRUE(testing::rows_equal(out, pad_row, pad_row + 1, 0.0)) << "padding row must be zero";
  }

  // Backward.
  const Tensor g = bf16_exact({N, dim}, 73);
  const CudaExpertsGrads gg = gpu.backward(fo, testing::to_gpu_bf16(g), stream);
  const ExpertsGrads cg = cpu.backward(co, g);
  ASSERT_EQ(gg.tokens.shape(), Shape({N, static_cast<std::int64_t>(dim)}));
  ASSERT_EQ(gg.probs.shape(), Shape({N}));
  const Tensor gx = host_f32(gg.tokens, stream), gp = host_f32(gg.probs, stream);
  EXPECT_LT(rel_error(gx, cg.tokens), 1e-2);
  EXPECT_LT(rel_error(gp, cg.probs), 1e-2);
  EXPECT_TRUE(testing::rows_equal(gx, active, N, 0.0));
  EXPECT_TRUE(testing::rows_equal(gp, active, N, 0.0));

  const std::vector<Parameter*> gpu_params = gpu.parameters(), cpu_params = cpu.parameters();
  ASSERT_EQ(gpu_params.size(), cpu_params.size());
  for (std::size_t i = 0; i < gpu_params.size(); ++i) {
    SCOPED_TRACE(gpu_params[i]->name);
    EXPECT_EQ(gpu_params[i]->name, cpu_params[i]->name);
    ASSERT_TRUE(gpu_params[i]->grad.defined());
    ASSERT_EQ(gpu_params[i]->grad.shape(), gpu_params[i]->value.shape());
    ASSERT_EQ(gpu_params[i]->grad.dtype(), grad_dtype(mode, *gpu_params[i]));
    const Tensor grad = cuda::to_host(gpu_params[i]->grad, stream);
    EXPECT_LT(rel_error(grad, cpu_params[i]->grad), 1e-2);
    for (int e = 0; e < local; ++e) {
      if (counts[static_cast<std::size_t>(e)] == 0) {
        EXPECT_TRUE(expert_slice_zero(grad, e)) << "expert " << e;
      }
    }
  }
}

TEST(CudaGroupedExperts, Swiglu) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true}) check_case(Activation::swiglu, bias, 64, 32, {7, 0, 12, 3}, 25, false);
}

TEST(CudaGroupedExperts, QuickGeglu) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true}) check_case(Activation::quick_geglu, bias, 64, 32, {7, 0, 12, 3}, 25, false);
}

TEST(CudaGroupedExperts, Relu2) {
  if (!testing::require_gpus(1)) return;
  for (bool bias : {false, true}) check_case(Activation::relu2, bias, 64, 32, {7, 0, 12, 3}, 25, true);
}

TEST(CudaGroupedExperts, OddShapesScalarKernels) {
  if (!testing::require_gpus(1)) return;
  check_case(Activation::swiglu, true, 20, 12, {5, 0, 4}, 10, false);
  check_case(Activation::quick_geglu, true, 20, 12, {5, 4}, 9, true);
}

TEST(CudaGroupedExperts, OneExpertAndLargerCounts) {
  if (!testing::require_gpus(1)) return;
  check_case(Activation::swiglu, true, 64, 32, {16}, 16, true);
  check_case(Activation::swiglu, false, 128, 64, {300, 5, 0, 211, 1}, 520, false);
  testing::OwnGemmThreshold all_own(0);  // every expert through its own cublasGemmEx
  check_case(Activation::quick_geglu, true, 128, 64, {300, 5, 0, 211, 1}, 520, false);
}

TEST(CudaGroupedExperts, SwigluOaiAndGeglu) {
  if (!testing::require_gpus(1)) return;
  Options low_limit;
  low_limit.activation_limit = 0.5;  // swigluoai's clamps act on this data (h ~ N(0, 0.8))
  for (bool bias : {false, true}) {
    check_case(Activation::swigluoai, bias, 64, 32, {7, 0, 12, 3}, 25, false, GradMode::accumulate_f32, low_limit);
    check_case(Activation::geglu, bias, 64, 32, {7, 0, 12, 3}, 25, true);
  }
  check_case(Activation::swigluoai, true, 20, 12, {5, 0, 4}, 10, false);  // scalar kernels, limit 7
  check_case(Activation::geglu, true, 20, 12, {5, 4}, 9, true);
}

TEST(CudaGroupedExperts, SwigluLimit) {
  if (!testing::require_gpus(1)) return;
  Options limited;
  limited.swiglu_limit = 0.5;
  for (bool bias : {false, true})
    check_case(Activation::swiglu, bias, 64, 32, {7, 0, 12, 3}, 25, false, GradMode::accumulate_f32, limited);
  check_case(Activation::swiglu, true, 20, 12, {5, 0, 4}, 10, true, GradMode::fresh_bf16_weights, limited);
}

// apply_router_weight_after_down against the CPU oracle for every activation, both gradient modes,
// vector and scalar kernels, a padding row and experts without rows.
TEST(CudaGroupedExperts, AfterDown) {
  if (!testing::require_gpus(1)) return;
  Options after;
  after.after_down = true;
  for (Activation act : {Activation::swiglu, Activation::swigluoai, Activation::quick_geglu, Activation::geglu,
                         Activation::relu2})
    for (bool bias : {false, true})
      check_case(act, bias, 64, 32, {7, 0, 12, 3}, 25, bias, GradMode::accumulate_f32, after);
  check_case(Activation::swiglu, true, 20, 12, {5, 0, 4}, 10, false, GradMode::fresh_bf16_weights, after);
  after.swiglu_limit = 0.5;
  check_case(Activation::swiglu, true, 64, 32, {7, 0, 12, 3}, 25, false, GradMode::fresh_bf16_weights, after);
  check_case(Activation::swiglu, true, 64, 32, {0, 0, 0}, 0, false, GradMode::accumulate_f32, after);
}

// After the down projection the prob multiplies the finished bf16 row once: the output with probs p
// equals bf16(y1 * p) bit for bit, y1 being the output with probs 1 (= the row before the prob).
// With the prob inside the FFN the roundings fall elsewhere: the same identity fails somewhere.
TEST(CudaGroupedExperts, AfterDownRoundsOnceAfterTheMultiply) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts = {9, 0, 14};
  const std::int64_t N = 23, dim = 64;
  for (bool after : {true, false}) {
    SCOPED_TRACE(after ? "after down" : "inside the FFN");
    MoEConfig cfg = make_config(Activation::swiglu, true, 64, 32);
    cfg.apply_router_weight_after_down = after;
    const cuda::OwnedStream stream;
    GroupedExperts cpu(cfg, 3, 0, DType::f32);
    prepare_cpu(cpu, 9);
    CudaGroupedExperts gpu(cfg, 3, 0, 0);
    gpu.load_from(cpu, stream);
    const Tensor x_d = testing::to_gpu_bf16(bf16_exact({N, dim}, 91));
    const Tensor probs = uniform_probs(N, 92);
    Tensor ones = Tensor::empty({N}, DType::f32);
    for (std::int64_t i = 0; i < N; ++i) ones.data<float>()[i] = 1.f;
    const Tensor y = host_f32(gpu.forward(x_d.view(), testing::to_gpu(probs), counts, stream).out, stream);
    const Tensor y1 = host_f32(gpu.forward(x_d.view(), testing::to_gpu(ones), counts, stream).out, stream);
    std::int64_t exact = 0;
    for (std::int64_t r = 0; r < N; ++r)
      for (std::int64_t c = 0; c < dim; ++c)
        exact += y.data<float>()[r * dim + c] ==
                 bf16::from_float(y1.data<float>()[r * dim + c] * probs.data<float>()[r]).to_float();
    if (after)
      EXPECT_EQ(exact, N * dim);
    else
      EXPECT_LT(exact, N * dim);
  }
}

// The experts reading their rows in place (gather_gemm.h): the same results as on the copied rows.
TEST(CudaGroupedExperts, GatheredRowsSwigluWithBias) {
  if (!testing::require_gpus(1)) return;
  Options opt;
  opt.gathered = true;
  check_case(Activation::swiglu, true, 64, 32, {5, 0, 11}, 20, true, GradMode::accumulate_f32, opt);
  check_case(Activation::swiglu, false, 136, 72, {130, 1, 64}, 200, true, GradMode::fresh_bf16_weights, opt);
}

TEST(CudaGroupedExperts, GatheredRowsAfterDown) {
  if (!testing::require_gpus(1)) return;
  Options opt;
  opt.gathered = true;
  opt.after_down = true;
  check_case(Activation::swiglu, true, 64, 32, {7, 9, 0}, 16, true, GradMode::accumulate_f32, opt);
}

// Backward's data gradients on either kernel (ExpertDgrad: cuBLAS, or flexep's grouped GEMM reading
// the weights transposed), each against the CPU reference: ragged groups with an empty expert, copied
// and gathered rows, the prob after the down projection, no rows, and widths the Hopper kernel does
// not take (not multiples of 8: cuBLAS then).
TEST(CudaGroupedExperts, DataGradientsOnEitherKernel) {
  if (!testing::require_gpus(1)) return;
  struct Chosen {
    explicit Chosen(ExpertDgrad k) : previous(expert_dgrad()) { set_expert_dgrad(k); }
    ~Chosen() { set_expert_dgrad(previous); }
    ExpertDgrad previous;
  };
  for (const ExpertDgrad kernel : {ExpertDgrad::cublas, ExpertDgrad::gather_gemm}) {
    SCOPED_TRACE(kernel == ExpertDgrad::cublas ? "cuBLAS dgrad" : "Hopper kernel dgrad");
    const Chosen chosen(kernel);
    check_case(Activation::swiglu, true, 64, 32, {7, 0, 12, 3}, 25, false);
    check_case(Activation::swiglu, false, 128, 64, {300, 5, 0, 211, 1}, 520, false, GradMode::fresh_bf16_weights);
    Options gathered;
    gathered.gathered = true;
    check_case(Activation::swiglu, false, 136, 72, {130, 1, 64}, 200, true, GradMode::fresh_bf16_weights, gathered);
    Options after;
    after.after_down = true;
    check_case(Activation::swiglu, true, 64, 32, {7, 9, 0}, 16, true, GradMode::accumulate_f32, after);
    check_case(Activation::quick_geglu, true, 20, 12, {5, 0, 4}, 10, false);
    check_case(Activation::swiglu, true, 64, 32, {0, 0, 0}, 0, false);
  }
}

// Backward's weight gradients on flexep's kernel (ExpertWgrad::wgrad_gemm, reading in-place rows
// through their table), with the data gradients on either kernel, against the CPU reference: the
// cases above, f32 gradients (added to the module's zeroed buffers) and new bf16 ones.
TEST(CudaGroupedExperts, WeightGradientsOnTheKernel) {
  if (!testing::require_gpus(1)) return;
  struct Chosen {
    Chosen(ExpertDgrad d, ExpertWgrad w) : dgrad(expert_dgrad()), wgrad(expert_wgrad()) {
      set_expert_dgrad(d);
      set_expert_wgrad(w);
    }
    ~Chosen() {
      set_expert_dgrad(dgrad);
      set_expert_wgrad(wgrad);
    }
    ExpertDgrad dgrad;
    ExpertWgrad wgrad;
  };
  for (const ExpertDgrad dgrad : {ExpertDgrad::cublas, ExpertDgrad::gather_gemm}) {
    SCOPED_TRACE(dgrad == ExpertDgrad::cublas ? "cuBLAS dgrad" : "Hopper kernel dgrad");
    const Chosen chosen(dgrad, ExpertWgrad::wgrad_gemm);
    check_case(Activation::swiglu, true, 64, 32, {7, 0, 12, 3}, 25, false);
    check_case(Activation::swiglu, false, 128, 64, {300, 5, 0, 211, 1}, 520, false, GradMode::fresh_bf16_weights);
    Options gathered;
    gathered.gathered = true;
    check_case(Activation::swiglu, false, 136, 72, {130, 1, 64}, 200, true, GradMode::fresh_bf16_weights, gathered);
    check_case(Activation::swiglu, true, 64, 32, {5, 0, 11}, 20, true, GradMode::accumulate_f32, gathered);
    Options after;
    after.after_down = true;
    check_case(Activation::swiglu, true, 64, 32, {7, 9, 0}, 16, true, GradMode::accumulate_f32, after);
    check_case(Activation::quick_geglu, true, 20, 12, {5, 0, 4}, 10, false);
    check_case(Activation::swiglu, true, 64, 32, {0, 0, 0}, 0, false);
    check_case(Activation::relu2, true, 64, 32, {0, 0}, 5, true, GradMode::fresh_bf16_weights);
  }
}

TEST(CudaGroupedExperts, ZeroRows) {
  if (!testing::require_gpus(1)) return;
  check_case(Activation::swiglu, true, 64, 32, {0, 0, 0}, 0, false);
}

TEST(CudaGroupedExperts, AllCountsZero) {
  if (!testing::require_gpus(1)) return;
  check_case(Activation::relu2, true, 64, 32, {0, 0}, 5, true);
}

// fresh_bf16_weights against the CPU reference, through the grouped cuBLAS call (threshold INT64_MAX)
// and through one cublasGemmEx per expert (threshold 0); experts without rows, all experts without
// rows, and no rows at all.
TEST(CudaGroupedExperts, FreshBf16WeightGradsMatchCpu) {
  if (!testing::require_gpus(1)) return;
  const GradMode fresh = GradMode::fresh_bf16_weights;
  for (std::int64_t threshold : {std::numeric_limits<std::int64_t>::max(), std::int64_t{0}}) {
    SCOPED_TRACE("own-GEMM threshold " + std::to_string(threshold));
    testing::OwnGemmThreshold scope(threshold);
    check_case(Activation::swiglu, true, 64, 32, {7, 0, 12, 3}, 25, false, fresh);
    check_case(Activation::relu2, false, 64, 32, {7, 0, 12, 3}, 25, true, fresh);
    check_case(Activation::quick_geglu, true, 20, 12, {5, 0, 4}, 10, false, fresh);
    check_case(Activation::swiglu, false, 128, 64, {300, 5, 0, 211, 1}, 520, false, fresh);
    check_case(Activation::relu2, true, 64, 32, {0, 0}, 5, true, fresh);
    check_case(Activation::swiglu, true, 64, 32, {0, 0, 0}, 0, false, fresh);
  }
}

// Two modules with the same weights, one per mode, on the same data: forward and the token/prob
// gradients are the same code (bitwise equal), bias gradients too (same kernels, f32 in both modes);
// each bf16 weight gradient is the f32 one rounded: within half a bf16 ulp (2^-8 relative) plus the
// fp32 summation-order difference of two cuBLAS paths (1e-5 of the largest entry).
TEST(CudaGroupedExperts, FreshBf16GradsAreF32GradsRounded) {
  if (!testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const MoEConfig cfg = make_config(Activation::swiglu, true, 64, 32);
  const std::vector<std::int64_t> counts = {40, 0, 97, 6};
  const std::int64_t N = 150;
  GroupedExperts cpu(cfg, 4, 4, DType::f32);
  prepare_cpu(cpu, 13);
  CudaGroupedExperts acc(cfg, 4, 4, 0), fresh(cfg, 4, 4, 0, GradMode::fresh_bf16_weights);
  acc.load_from(cpu, stream);
  fresh.load_from(cpu, stream);
  const Tensor x_d = testing::to_gpu_bf16(bf16_exact({N, 64}, 101));
  const Tensor p_d = testing::to_gpu(uniform_probs(N, 102));
  const Tensor g_d = testing::to_gpu_bf16(bf16_exact({N, 64}, 103));
  const CudaExpertsOutput fa = acc.forward(x_d, p_d, counts, stream), fb = fresh.forward(x_d, p_d, counts, stream);
  const CudaExpertsGrads ga = acc.backward(fa, g_d, stream), gb = fresh.backward(fb, g_d, stream);
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(fa.out, stream), cuda::to_host(fb.out, stream)));
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(ga.tokens, stream), cuda::to_host(gb.tokens, stream)));
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(ga.probs, stream), cuda::to_host(gb.probs, stream)));
  const std::vector<Parameter*> pa = acc.parameters(), pb = fresh.parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    SCOPED_TRACE(pa[i]->name);
    const Tensor want = cuda::to_host(pa[i]->grad, stream), got = cuda::to_host(pb[i]->grad, stream);
    ASSERT_EQ(got.dtype(), grad_dtype(GradMode::fresh_bf16_weights, *pb[i]));
    if (!is_weight(*pb[i])) {
      EXPECT_TRUE(testing::same_bytes(got, want));
      continue;
    }
    ASSERT_TRUE(testing::within_bf16_rounding(got, want, 1e-5));
    EXPECT_TRUE(expert_slice_zero(got, 1)) << "expert 1 has no rows";
  }
}

// fresh_bf16_weights: each backward hands over new tensors. The first backward's gradients stay as
// they were through a second backward (other grad_out) and a zero_grad, which only drops the module's
// references.
TEST(CudaGroupedExperts, FreshBf16GradsAreNewTensorsPerBackward) {
  if (!testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const std::vector<std::int64_t> counts = {9, 0, 14};
  const std::int64_t N = 24;
  const auto module = small_gpu_experts(17, GradMode::fresh_bf16_weights, stream);
  CudaGroupedExperts& gpu = *module;
  const Tensor x_d = testing::to_gpu_bf16(bf16_exact({N, 64}, 111));
  const Tensor p_d = testing::to_gpu(uniform_probs(N, 112));
  const CudaExpertsOutput fo = gpu.forward(x_d, p_d, counts, stream);

  gpu.backward(fo, testing::to_gpu_bf16(bf16_exact({N, 64}, 113)), stream);
  std::vector<Tensor> first, first_values;
  for (Parameter* p : gpu.parameters()) {
    first.push_back(p->grad);  // shares the storage: what a caller keeps
    first_values.push_back(cuda::to_host(p->grad, stream));
  }
  gpu.backward(fo, testing::to_gpu_bf16(bf16_exact({N, 64}, 114)), stream);
  const std::vector<Parameter*> ps = gpu.parameters();
  for (std::size_t i = 0; i < ps.size(); ++i) {
    SCOPED_TRACE(ps[i]->name);
    ASSERT_TRUE(ps[i]->grad.defined());
    EXPECT_NE(ps[i]->grad.raw(), first[i].raw()) << "the second backward reused the first one's tensor";
    EXPECT_TRUE(testing::same_bytes(cuda::to_host(first[i], stream), first_values[i]))
        << "the second backward changed the first one's gradient";
    EXPECT_FALSE(testing::same_bytes(cuda::to_host(ps[i]->grad, stream), first_values[i]))
        << "the second backward (another grad_out) gave the same gradient: not this backward's alone?";
  }
  gpu.zero_grad(stream);
  gpu.materialize_grads(stream);
  for (std::size_t i = 0; i < ps.size(); ++i) {
    EXPECT_FALSE(ps[i]->grad.defined()) << ps[i]->name;
    EXPECT_TRUE(testing::same_bytes(cuda::to_host(first[i], stream), first_values[i])) << ps[i]->name;
  }
}

// The Tensor overload (tokens kept by reference) and the view overload (tokens copied) compute the
// same thing bit for bit; gradients accumulate over calls and zero_grad clears them.
TEST(CudaGroupedExperts, OverloadsAgreeAndGradsAccumulate) {
  if (!testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  const std::vector<std::int64_t> counts = {9, 0, 14};
  const std::int64_t N = 24;
  const auto module = small_gpu_experts(11, GradMode::accumulate_f32, stream);
  CudaGroupedExperts& gpu = *module;
  const Tensor x_d = testing::to_gpu_bf16(bf16_exact({N, 64}, 81));
  const Tensor p_d = testing::to_gpu(uniform_probs(N, 82));
  const Tensor g_d = testing::to_gpu_bf16(bf16_exact({N, 64}, 83));

  auto grads_now = [&] {
    std::vector<Tensor> out;
    for (Parameter* p : gpu.parameters()) out.push_back(cuda::to_host(p->grad, stream));
    return out;
  };
  const CudaExpertsOutput a = gpu.forward(x_d, p_d, counts, stream);
  const CudaExpertsGrads ga = gpu.backward(a, g_d, stream);
  const std::vector<Tensor> once = grads_now();
  const CudaExpertsOutput b = gpu.forward(x_d.view(), p_d, counts, stream);
  const CudaExpertsGrads gb = gpu.backward(b, g_d, stream);
  const std::vector<Tensor> twice = grads_now();

  EXPECT_TRUE(testing::same_bytes(cuda::to_host(a.out, stream), cuda::to_host(b.out, stream)));
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(ga.tokens, stream), cuda::to_host(gb.tokens, stream)));
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(ga.probs, stream), cuda::to_host(gb.probs, stream)));
  for (std::size_t i = 0; i < once.size(); ++i) {
    Tensor doubled = once[i].clone();
    for (std::int64_t j = 0; j < doubled.numel(); ++j) doubled.data<float>()[j] *= 2.f;
    EXPECT_LT(rel_error(twice[i], doubled), 1e-6) << gpu.parameters()[i]->name;
  }
  gpu.zero_grad(stream);
  gpu.materialize_grads(stream);
  for (const Tensor& t : grads_now()) EXPECT_TRUE(testing::rows_equal(t, 0, t.size(0), 0.0));
  // zero_grad is lazy for the weight gradients: the next backward overwrites them (beta = 0), so a
  // zero_grad + backward gives one backward's gradients (cuBLAS may pick another kernel for beta = 0,
  // so up to fp32 rounding), the empty expert's block included.
  gpu.backward(a, g_d, stream);
  gpu.zero_grad(stream);
  gpu.backward(b, g_d, stream);
  const std::vector<Tensor> fresh = grads_now();
  for (std::size_t i = 0; i < once.size(); ++i)
    EXPECT_LT(rel_error(fresh[i], once[i]), 1e-6) << gpu.parameters()[i]->name;
}

// init draws GroupedExperts::init's numbers (rounded to bf16); copy_values_to brings them back.
TEST(CudaGroupedExperts, InitMatchesCpuInit) {
  if (!testing::require_gpus(1)) return;
  const cuda::OwnedStream stream;
  for (Activation act : {Activation::swiglu, Activation::relu2}) {
    const MoEConfig cfg = make_config(act, true, 24, 16);
    GroupedExperts cpu(cfg, 3, 2, DType::f32), back(cfg, 3, 2, DType::f32);
    cpu.init(1234, 0.02);
    CudaGroupedExperts gpu(cfg, 3, 2, 0);
    gpu.init(1234, 0.02, stream);
    gpu.copy_values_to(back, stream);
    const std::vector<Parameter*> want = cpu.parameters(), got = back.parameters();
    ASSERT_EQ(want.size(), got.size());
    for (std::size_t i = 0; i < want.size(); ++i)
      EXPECT_TRUE(testing::same_bytes(got[i]->value, want[i]->value.to(DType::bf16).to(DType::f32)))
          << want[i]->name;
  }
}

TEST(CudaGroupedExperts, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const MoEConfig cfg = make_config(Activation::swiglu, false, 16, 8);
  CudaGroupedExperts gpu(cfg, 2, 0, 0), other(cfg, 2, 0, 0);
  const auto x = fake_cuda({10, 16}, DType::bf16), p = fake_cuda({10}, DType::f32);
  expect_arg_error([&] { gpu.forward(fake_cuda({10, 16}, DType::f32), p, {5, 5}, nullptr); }, "tokens");
  expect_arg_error([&] { gpu.forward(fake_cuda({10, 17}, DType::bf16), p, {5, 5}, nullptr); }, "tokens");
  expect_arg_error([&] { gpu.forward(TensorView(nullptr, DType::bf16, Shape{10, 16}), p, {5, 5}, nullptr); },
                   "tokens");
  expect_arg_error([&] { gpu.forward(x, fake_cuda({11}, DType::f32), {5, 5}, nullptr); }, "probs");
  expect_arg_error([&] { gpu.forward(x, p, {6, 5}, nullptr); }, "tokens_per_expert");
  expect_arg_error([&] { gpu.forward(x, p, {5, 5, 0}, nullptr); }, "tokens_per_expert");
  expect_arg_error([&] { gpu.forward(x, p, {-1, 5}, nullptr); }, "tokens_per_expert");
  expect_arg_error([&] { gpu.backward(CudaExpertsOutput{}, x, nullptr); }, "forward_output");

  const Tensor x_d = testing::to_gpu_bf16(bf16_exact({10, 16}, 91));
  const Tensor p_d = testing::to_gpu(uniform_probs(10, 92));
  const CudaExpertsOutput fo = gpu.forward(x_d, p_d, {4, 5}, nullptr);
  expect_arg_error([&] { gpu.backward(fo, fake_cuda({9, 16}, DType::bf16), nullptr); }, "grad_out");
  expect_arg_error([&] { gpu.backward(fo, fake_cuda({10, 16}, DType::f32), nullptr); }, "grad_out");
  expect_arg_error([&] { other.backward(fo, x, nullptr); }, "forward_output");

  MoEConfig f32_cfg = cfg;
  f32_cfg.dtype = DType::f32;
  expect_arg_error([&] { CudaGroupedExperts bad(f32_cfg, 2, 0, 0); }, "moe.dtype");
  expect_arg_error([&] { CudaGroupedExperts bad(cfg, 2, 0, 1000); }, "device");
  expect_arg_error([&] { CudaGroupedExperts bad(cfg, 2, 7, 0); }, "first_expert");
}

}  // namespace
}  // namespace flexep
