// Grouped GEMMs (forward, dgrad, wgrad, wgrad_bf16) and the dense GEMM wrapper against CPU fp32 loops
// on the same bf16-rounded inputs. Tolerance: relative error norm < 1e-2 (bf16 outputs; typically
// ~2e-3), < 1e-4 for fp32 outputs of bf16 inputs (only the summation order differs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "experts_test_util.h"
#include "flexep/cuda/dense.h"
#include "flexep/cuda/grouped_gemm.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::expect_arg_error;

using testing::bf16_exact;
using testing::rel_error;

std::int64_t sum_of(const std::vector<std::int64_t>& c) { return std::accumulate(c.begin(), c.end(), std::int64_t{0}); }

// CPU loops in fp32 (double accumulation is not needed at these sizes; fp32 like the GPU).
Tensor ref_forward(const Tensor& a, const Tensor& b, const std::vector<std::int64_t>& counts, std::int64_t M) {
  const std::int64_t N = a.size(0), K = a.size(1);
  Tensor c = Tensor::zeros({N, M}, DType::f32);
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    for (std::int64_t r = row; r < row + counts[g]; ++r)
      for (std::int64_t m = 0; m < M; ++m) {
        float s = 0;
        for (std::int64_t k = 0; k < K; ++k)
          s += a.data<float>()[r * K + k] * b.data<float>()[(static_cast<std::int64_t>(g) * K + k) * M + m];
        c.data<float>()[r * M + m] = s;
      }
    row += counts[g];
  }
  return c;
}

Tensor ref_dgrad(const Tensor& d, const Tensor& b, const std::vector<std::int64_t>& counts) {
  const std::int64_t N = d.size(0), M = d.size(1), K = b.size(1);
  Tensor c = Tensor::zeros({N, K}, DType::f32);
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    for (std::int64_t r = row; r < row + counts[g]; ++r)
      for (std::int64_t k = 0; k < K; ++k) {
        float s = 0;
        for (std::int64_t m = 0; m < M; ++m)
          s += d.data<float>()[r * M + m] * b.data<float>()[(static_cast<std::int64_t>(g) * K + k) * M + m];
        c.data<float>()[r * K + k] = s;
      }
    row += counts[g];
  }
  return c;
}

Tensor ref_wgrad(const Tensor& a, const Tensor& d, const std::vector<std::int64_t>& counts, const Tensor& init) {
  const std::int64_t K = a.size(1), M = d.size(1);
  Tensor c = init.clone();
  std::int64_t row = 0;
  for (std::size_t g = 0; g < counts.size(); ++g) {
    for (std::int64_t k = 0; k < K; ++k)
      for (std::int64_t m = 0; m < M; ++m) {
        float s = 0;
        for (std::int64_t r = row; r < row + counts[g]; ++r)
          s += a.data<float>()[r * K + k] * d.data<float>()[r * M + m];
        c.data<float>()[(static_cast<std::int64_t>(g) * K + k) * M + m] += s;
      }
    row += counts[g];
  }
  return c;
}

// Runs forward, dgrad and wgrad on one shape and checks them. N may exceed sum(counts): the tail rows
// of forward/dgrad outputs must keep their poison, and wgrad blocks of empty experts their values.
void check_all(std::int64_t N, std::int64_t K, std::int64_t M, const std::vector<std::int64_t>& counts) {
  const std::int64_t G = static_cast<std::int64_t>(counts.size()), used = sum_of(counts);
  ASSERT_LE(used, N);
  const Tensor a = bf16_exact({N, K}, 1);
  const Tensor b = bf16_exact({G, K, M}, 2, 0.2);
  const Tensor d = bf16_exact({N, M}, 3);
  const Tensor w0 = bf16_exact({G, K, M}, 4);  // wgrad accumulates onto this
  const Tensor a_d = testing::to_gpu_bf16(a), b_d = testing::to_gpu_bf16(b), d_d = testing::to_gpu_bf16(d);

  Tensor c_d = testing::poisoned({N, M}, DType::bf16);
  cuda::grouped_gemm_forward(a_d, b_d, counts, c_d, nullptr);
  Tensor c = cuda::to_host(c_d, nullptr);
  EXPECT_LT(rel_error(c.to(DType::f32).view().rows(0, used), ref_forward(a, b, counts, M).view().rows(0, used)), 1e-2);
  for (std::int64_t i = used * M; i < N * M; ++i)
    ASSERT_TRUE(testing::is_poison_bf16(c, i)) << "forward wrote tail element " << i;

  Tensor g_d = testing::poisoned({N, K}, DType::bf16);
  cuda::grouped_gemm_dgrad(d_d, b_d, counts, g_d, nullptr);
  Tensor gx = cuda::to_host(g_d, nullptr);
  EXPECT_LT(rel_error(gx.to(DType::f32).view().rows(0, used), ref_dgrad(d, b, counts).view().rows(0, used)), 1e-2);
  for (std::int64_t i = used * K; i < N * K; ++i)
    ASSERT_TRUE(testing::is_poison_bf16(gx, i)) << "dgrad wrote tail element " << i;

  Tensor w_d = testing::to_gpu(w0);
  cuda::grouped_gemm_wgrad(a_d, d_d, counts, w_d, nullptr);
  const Tensor w = testing::to_cpu_f32(w_d);
  const Tensor w_ref = ref_wgrad(a, d, counts, w0);
  EXPECT_LT(rel_error(w, w_ref), 1e-4);
  for (std::int64_t g = 0; g < G; ++g) {
    if (counts[static_cast<std::size_t>(g)] != 0) continue;
    EXPECT_TRUE(testing::same_bytes(Tensor::wrap(w.view().rows(g, g + 1)).clone(),
                                    Tensor::wrap(w0.view().rows(g, g + 1)).clone()))
        << "wgrad changed the block of empty expert " << g;
  }
}

TEST(GroupedGemm, UnevenCountsWithZerosAndTail) {
  if (!testing::require_gpus(1)) return;
  check_all(25, 64, 48, {3, 0, 17, 1, 0});
}

TEST(GroupedGemm, LargerGroups) {
  if (!testing::require_gpus(1)) return;
  check_all(451, 128, 96, {130, 257, 0, 64});
}

TEST(GroupedGemm, OneExpert) {
  if (!testing::require_gpus(1)) return;
  check_all(40, 32, 64, {40});
}

TEST(GroupedGemm, OddShapes) {
  if (!testing::require_gpus(1)) return;
  check_all(14, 13, 7, {5, 0, 6});
}

TEST(GroupedGemm, AllCountsZeroWritesNothing) {
  if (!testing::require_gpus(1)) return;
  check_all(9, 16, 8, {0, 0, 0});
}

// Forward/dgrad send big experts to their own cublasGemmEx: all of them (threshold 0), or a mix where
// only expert 2 (17 * 64 * 48 = 52224 multiply-adds) is above the threshold.
TEST(GroupedGemm, OwnGemmPathAndMixed) {
  if (!testing::require_gpus(1)) return;
  {
    testing::OwnGemmThreshold all_own(0);
    check_all(25, 64, 48, {3, 0, 17, 1, 0});
    check_all(14, 13, 7, {5, 0, 6});
  }
  testing::OwnGemmThreshold mixed(10000);
  check_all(25, 64, 48, {3, 0, 17, 1, 0});
}

// wgrad_bf16 on one shape: c starts as NaN poison (beta = 0 must not read it), N may exceed
// sum(counts) (the tail rows of a and d hold data that must not count). Checks the relative error
// norm (< 1e-2, as every bf16 output here) and each element against the fp32 reference: rounding
// the fp32 sum to bf16 moves it by at most half a bf16 ulp, 2^-8 of its magnitude; the fp32 sums
// of cuBLAS and of the loop differ only in order, allowed 1e-3 of the largest entry (measured far
// below). Blocks of experts without rows must be exactly +0.
void check_wgrad_bf16(std::int64_t N, std::int64_t K, std::int64_t M, const std::vector<std::int64_t>& counts) {
  SCOPED_TRACE("wgrad_bf16 N " + std::to_string(N) + " K " + std::to_string(K) + " M " + std::to_string(M));
  const std::int64_t G = static_cast<std::int64_t>(counts.size());
  ASSERT_LE(sum_of(counts), N);
  const Tensor a = bf16_exact({N, K}, 21);
  const Tensor d = bf16_exact({N, M}, 22);
  Tensor w_d = testing::poisoned({G, K, M}, DType::bf16);
  cuda::grouped_gemm_wgrad_bf16(testing::to_gpu_bf16(a), testing::to_gpu_bf16(d), counts, w_d, nullptr);
  const Tensor w = cuda::to_host(w_d, nullptr);
  ASSERT_EQ(w.dtype(), DType::bf16);
  const Tensor ref = ref_wgrad(a, d, counts, Tensor::zeros({G, K, M}, DType::f32));
  EXPECT_LT(rel_error(w, ref), 1e-2);
  EXPECT_TRUE(testing::within_bf16_rounding(w, ref, 1e-3));
  for (std::int64_t g = 0; g < G; ++g) {
    if (counts[static_cast<std::size_t>(g)] != 0) continue;
    for (std::int64_t i = g * K * M; i < (g + 1) * K * M; ++i)
      ASSERT_EQ(w.data<bf16>()[i].bits, 0) << "block of empty expert " << g << " not zeroed at element " << i;
  }
}

// Every expert in the grouped call, every expert its own cublasGemmEx, and a mix (only expert 2,
// 17 * 64 * 48 = 52224 multiply-adds, above the threshold).
TEST(GroupedGemm, WgradBf16GroupedOwnAndMixed) {
  if (!testing::require_gpus(1)) return;
  for (std::int64_t threshold : {std::numeric_limits<std::int64_t>::max(), std::int64_t{0}, std::int64_t{10000}}) {
    SCOPED_TRACE("own-GEMM threshold " + std::to_string(threshold));
    testing::OwnGemmThreshold scope(threshold);
    check_wgrad_bf16(25, 64, 48, {3, 0, 17, 1, 0});
    check_wgrad_bf16(451, 128, 96, {130, 257, 0, 64});
    check_wgrad_bf16(14, 13, 7, {5, 0, 6});
    check_wgrad_bf16(40, 32, 64, {40});
  }
}

// No rows at all (N = 0, or counts all zero with a tail): c becomes all zeros, no GEMM runs.
TEST(GroupedGemm, WgradBf16WithoutRowsZeroesC) {
  if (!testing::require_gpus(1)) return;
  check_wgrad_bf16(9, 16, 8, {0, 0, 0});
  check_wgrad_bf16(0, 16, 8, {0, 0});
}

// The bf16 result is the f32 wgrad's (overwrite mode) rounded to bf16, up to the summation order.
TEST(GroupedGemm, WgradBf16IsF32WgradRounded) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts = {30, 0, 97, 5};
  const std::int64_t N = 140, K = 96, M = 80, G = 4;
  const Tensor a_d = testing::to_gpu_bf16(bf16_exact({N, K}, 31));
  const Tensor d_d = testing::to_gpu_bf16(bf16_exact({N, M}, 32));
  Tensor w32 = testing::poisoned({G, K, M}, DType::f32), w16 = testing::poisoned({G, K, M}, DType::bf16);
  cuda::grouped_gemm_wgrad(a_d, d_d, counts, w32, nullptr, /*accumulate=*/false);
  cuda::grouped_gemm_wgrad_bf16(a_d, d_d, counts, w16, nullptr);
  const Tensor f = testing::to_cpu_f32(w32), b = testing::to_cpu_f32(w16);
  // Half a bf16 ulp of rounding, plus the two fp32 sums' order differences (~1e-7 of the largest
  // entry at these sizes; a bf16 accumulation would be off by ~1e-2).
  ASSERT_TRUE(testing::within_bf16_rounding(b, f, 1e-5));
}

// accumulate: c += A^T D with c read as bf16 (beta = 1), each block the fp32 sum of its old value
// and the products rounded once; blocks of experts without rows keep their bits. In the grouped call
// and as single GEMMs.
TEST(GroupedGemm, WgradBf16AccumulateAddsToC) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts = {30, 0, 97, 5};
  const std::int64_t N = 140, K = 96, M = 80, G = 4;
  const Tensor a = bf16_exact({N, K}, 41), d = bf16_exact({N, M}, 42), c0 = bf16_exact({G, K, M}, 43);
  const Tensor ref = ref_wgrad(a, d, counts, c0);
  for (std::int64_t threshold : {std::numeric_limits<std::int64_t>::max(), std::int64_t{0}}) {
    SCOPED_TRACE("own-GEMM threshold " + std::to_string(threshold));
    testing::OwnGemmThreshold scope(threshold);
    Tensor c = testing::to_gpu_bf16(c0);
    cuda::grouped_gemm_wgrad_bf16(testing::to_gpu_bf16(a), testing::to_gpu_bf16(d), counts, c, nullptr,
                                  /*accumulate=*/true);
    const Tensor got = cuda::to_host(c, nullptr);
    EXPECT_TRUE(testing::within_bf16_rounding(got, ref, 1e-3));
    const Tensor before = c0.to(DType::bf16);
    for (std::int64_t i = K * M; i < 2 * K * M; ++i)
      ASSERT_EQ(got.data<bf16>()[i].bits, before.data<bf16>()[i].bits) << "empty expert 1 changed at " << i;
  }
}

TEST(GroupedGemm, ZeroRows) {
  if (!testing::require_gpus(1)) return;
  const Tensor a = Tensor::empty({0, 16}, DType::bf16, Device::cuda(0));
  const Tensor d = Tensor::empty({0, 8}, DType::bf16, Device::cuda(0));
  const Tensor b = testing::to_gpu_bf16(bf16_exact({2, 16, 8}, 5));
  const Tensor w0 = bf16_exact({2, 16, 8}, 6);
  Tensor c = Tensor::empty({0, 8}, DType::bf16, Device::cuda(0));
  Tensor gx = Tensor::empty({0, 16}, DType::bf16, Device::cuda(0));
  Tensor w = testing::to_gpu(w0);
  cuda::grouped_gemm_forward(a, b, {0, 0}, c, nullptr);
  cuda::grouped_gemm_dgrad(d, b, {0, 0}, gx, nullptr);
  cuda::grouped_gemm_wgrad(a, d, {0, 0}, w, nullptr);
  FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(w, nullptr), w0));
}

TEST(GroupedGemm, ExpertOffsets) {
  if (!testing::require_gpus(1)) return;
  const Tensor o = cuda::to_host(cuda::expert_offsets({3, 0, 5, 2}, 0, nullptr), nullptr);
  ASSERT_EQ(o.shape(), Shape({5}));
  const std::vector<std::int64_t> want = {0, 3, 3, 8, 10};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(o.data<std::int64_t>()[i], want[static_cast<std::size_t>(i)]);
  // Many uploads in a row reuse the staging ring: each must still deliver its own values.
  std::vector<Tensor> many;
  for (int i = 0; i < 40; ++i) many.push_back(cuda::expert_offsets({i, 1}, 0, nullptr));
  for (int i = 0; i < 40; ++i) {
    const Tensor h = cuda::to_host(many[static_cast<std::size_t>(i)], nullptr);
    EXPECT_EQ(h.data<std::int64_t>()[1], i);
    EXPECT_EQ(h.data<std::int64_t>()[2], i + 1);
  }
}

TEST(GroupedGemm, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const auto a = fake_cuda({10, 16}, DType::bf16), b = fake_cuda({2, 16, 8}, DType::bf16);
  const auto c = fake_cuda({10, 8}, DType::bf16), d = fake_cuda({10, 8}, DType::bf16);
  const auto gx = fake_cuda({10, 16}, DType::bf16), w = fake_cuda({2, 16, 8}, DType::f32);
  expect_arg_error([&] { cuda::grouped_gemm_forward(a, fake_cuda({2, 17, 8}, DType::bf16), {5, 5}, c, nullptr); }, "b");
  expect_arg_error([&] { cuda::grouped_gemm_forward(a, b, {6, 5}, c, nullptr); }, "counts");
  expect_arg_error([&] { cuda::grouped_gemm_forward(a, b, {5, 5, 0}, c, nullptr); }, "counts");
  expect_arg_error([&] { cuda::grouped_gemm_forward(a, b, {-1, 5}, c, nullptr); }, "counts");
  expect_arg_error([&] { cuda::grouped_gemm_forward(fake_cuda({10, 16}, DType::f32), b, {5, 5}, c, nullptr); }, "a");
  expect_arg_error([&] { cuda::grouped_gemm_forward(a, b, {5, 5}, fake_cuda({10, 9}, DType::bf16), nullptr); }, "c");
  expect_arg_error([&] { cuda::grouped_gemm_dgrad(d, fake_cuda({2, 16, 9}, DType::bf16), {5, 5}, gx, nullptr); }, "b");
  expect_arg_error([&] { cuda::grouped_gemm_dgrad(d, b, {5, 6}, gx, nullptr); }, "counts");
  expect_arg_error([&] { cuda::grouped_gemm_wgrad(a, d, {5, 5}, fake_cuda({2, 16, 8}, DType::bf16), nullptr); }, "c");
  expect_arg_error([&] { cuda::grouped_gemm_wgrad(a, fake_cuda({9, 8}, DType::bf16), {5, 4}, w, nullptr); }, "d");
  expect_arg_error([&] { cuda::grouped_gemm_wgrad(a, d, {11, 0}, w, nullptr); }, "counts");
  // wgrad_bf16 takes a bf16 c (see also the CPU test GroupedGemmArguments.WgradBf16).
  expect_arg_error([&] { cuda::grouped_gemm_wgrad_bf16(a, d, {5, 5}, w, nullptr); }, "c");
  expect_arg_error([&] { cuda::grouped_gemm_wgrad_bf16(a, d, {5, 5}, fake_cuda({2, 8, 16}, DType::bf16), nullptr); },
                   "c");
  const TensorView cpu_a(nullptr, DType::bf16, Shape{10, 16});
  expect_arg_error([&] { cuda::grouped_gemm_forward(cpu_a, b, {5, 5}, c, nullptr); }, "a");
  expect_arg_error([&] { cuda::expert_offsets({1, -2}, 0, nullptr); }, "counts");
  expect_arg_error([&] { cuda::set_grouped_gemm_own_gemm_min_work(-1); }, "macs");
}

// ---------------------------------------------------------------- dense GEMM

// C = alpha * op(A) op(B) + beta * C0 on the CPU.
Tensor ref_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta, const Tensor& c0) {
  const std::int64_t m = ta ? a.size(1) : a.size(0), k = ta ? a.size(0) : a.size(1);
  const std::int64_t n = tb ? b.size(0) : b.size(1);
  Tensor c = Tensor::empty({m, n}, DType::f32);
  for (std::int64_t i = 0; i < m; ++i)
    for (std::int64_t j = 0; j < n; ++j) {
      float s = 0;
      for (std::int64_t l = 0; l < k; ++l) {
        const float x = ta ? a.data<float>()[l * m + i] : a.data<float>()[i * k + l];
        const float y = tb ? b.data<float>()[j * k + l] : b.data<float>()[l * n + j];
        s += x * y;
      }
      c.data<float>()[i * n + j] = alpha * s + (beta != 0.f ? beta * c0.data<float>()[i * n + j] : 0.f);
    }
  return c;
}

void check_dense(bool ta, bool tb, DType ctype, float alpha, float beta) {
  const std::int64_t m = 37, k = 24, n = 40;
  const Tensor a = bf16_exact(ta ? Shape{k, m} : Shape{m, k}, 11);
  const Tensor b = bf16_exact(tb ? Shape{n, k} : Shape{k, n}, 12);
  const Tensor c0 = bf16_exact({m, n}, 13);
  Tensor c_d = ctype == DType::f32 ? testing::to_gpu(c0) : testing::to_gpu_bf16(c0);
  if (beta == 0.f) testing::poison(c_d);
  cuda::gemm(testing::to_gpu_bf16(a), ta, testing::to_gpu_bf16(b), tb, c_d, alpha, beta, nullptr);
  const double tol = ctype == DType::f32 ? 1e-4 : 1e-2;
  EXPECT_LT(rel_error(testing::to_cpu_f32(c_d), ref_gemm(a, ta, b, tb, alpha, beta, c0)), tol)
      << "ta " << ta << " tb " << tb << " ctype " << dtype_name(ctype) << " beta " << beta;
}

TEST(DenseGemm, AllTransposeCombinations) {
  if (!testing::require_gpus(1)) return;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      check_dense(ta, tb, DType::bf16, 1.f, 0.f);
      check_dense(ta, tb, DType::f32, 1.f, 1.f);
      check_dense(ta, tb, DType::f32, 0.5f, 0.f);
    }
}

TEST(DenseGemm, EmptyInnerDimension) {
  if (!testing::require_gpus(1)) return;
  const Tensor a = Tensor::empty({0, 6}, DType::bf16, Device::cuda(0));  // trans_a: op(a) is [6, 0]
  const Tensor b = Tensor::empty({0, 5}, DType::bf16, Device::cuda(0));  // op(b) is [0, 5]
  const Tensor c0 = bf16_exact({6, 5}, 14);
  Tensor c = testing::to_gpu(c0);
  cuda::gemm(a, true, b, false, c, 1.f, 1.f, nullptr);  // accumulate nothing
  EXPECT_TRUE(testing::same_bytes(cuda::to_host(c, nullptr), c0));
  cuda::gemm(a, true, b, false, c, 1.f, 0.f, nullptr);  // overwrite with zeros
  EXPECT_TRUE(testing::rows_equal(cuda::to_host(c, nullptr), 0, 6, 0.0));
}

TEST(DenseGemm, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const auto a = fake_cuda({4, 8}, DType::bf16), b = fake_cuda({8, 3}, DType::bf16), c = fake_cuda({4, 3}, DType::f32);
  expect_arg_error([&] { cuda::gemm(a, false, fake_cuda({7, 3}, DType::bf16), false, c, nullptr); }, "b");
  expect_arg_error([&] { cuda::gemm(a, false, b, false, fake_cuda({4, 4}, DType::f32), nullptr); }, "c");
  expect_arg_error([&] { cuda::gemm(fake_cuda({4, 8}, DType::f32), false, b, false, c, nullptr); }, "a");
  expect_arg_error([&] { cuda::gemm(a, false, b, false, fake_cuda({4, 3}, DType::i32), nullptr); }, "c");
}

}  // namespace
}  // namespace flexep
