// The gathered grouped GEMM (cuda/gather_gemm.h) against a CPU fp32 loop on the same bf16 inputs
// (relative error norm < 1e-2: bf16 outputs) and against cuBLAS's grouped GEMM on a permuted copy;
// B as [K, M] (the forward) and as [M, K] (transposed: the data gradients, against cuBLAS's dgrad).
// Rows outside the groups must keep their poison; bad row ids and offsets are reported by name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "experts_test_util.h"
#include "flexep/core/error.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/grouped_gemm.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::expect_arg_error;

using testing::bf16_exact;
using testing::offsets_of;
using testing::on_device;
using testing::rel_error;

Tensor device_i64(const std::vector<std::int64_t>& v) { return on_device(v); }
Tensor device_i32(const std::vector<std::int32_t>& v) { return on_device(v); }

// c[i] = a[ids[i]] * b[g] (bt: b[g]^T) in fp32 for the rows of every group; rows with id -1 are zero.
Tensor reference(const Tensor& a, const std::vector<std::int32_t>& ids, const std::vector<std::int64_t>& off,
                 const Tensor& b, std::int64_t N, bool bt) {
  const std::int64_t K = a.size(1), M = b.size(bt ? 1 : 2);
  Tensor c = Tensor::zeros({N, M}, DType::f32);
  for (std::size_t g = 0; g + 1 < off.size(); ++g)
    for (std::int64_t i = off[g]; i < off[g + 1]; ++i) {
      const std::int64_t id = ids.empty() ? i : ids[static_cast<std::size_t>(i)];
      if (id < 0) continue;
      for (std::int64_t m = 0; m < M; ++m) {
        float s = 0;
        for (std::int64_t k = 0; k < K; ++k)
          s += a.data<float>()[id * K + k] *
               b.data<float>()[static_cast<std::int64_t>(g) * K * M + (bt ? m * K + k : k * M + m)];
        c.data<float>()[i * M + m] = s;
      }
    }
  return c;
}

// One shape: random row ids (a permutation of a's rows with some -1 padding rows), or none; B as
// [G, K, M], or with bt as [G, M, K] (GatherGemmBLayout::m_by_k).
void check(std::int64_t R, std::int64_t K, std::int64_t M, const std::vector<std::int64_t>& counts, std::int64_t N,
           bool gather, std::uint64_t seed, bool bt = false) {
  const auto off = offsets_of(counts);
  ASSERT_LE(off.back(), N);
  const std::int64_t G = static_cast<std::int64_t>(counts.size());
  const Tensor a = bf16_exact({R, K}, seed);
  const Tensor b = bf16_exact(bt ? Shape{G, M, K} : Shape{G, K, M}, seed + 1, 0.2);
  std::vector<std::int32_t> ids;
  if (gather) {
    std::mt19937_64 rng(seed);
    ids.resize(static_cast<std::size_t>(N));
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(R + 1)) - 1;  // -1: padding
  }
  Tensor c_d = testing::poisoned({N, M}, DType::bf16);
  cuda::gather_grouped_gemm(testing::to_gpu_bf16(a), gather ? TensorView(device_i32(ids)) : TensorView(),
                            device_i64(off), testing::to_gpu_bf16(b), c_d, nullptr, nullptr,
                            bt ? cuda::GatherGemmBLayout::m_by_k : cuda::GatherGemmBLayout::k_by_m);
  const Tensor c = cuda::to_host(c_d, nullptr);
  const Tensor ref = reference(a, ids, off, b, N, bt);
  const std::int64_t lo = off.front(), hi = off.back();
  if (hi > lo) {
    EXPECT_LT(rel_error(c.to(DType::f32).view().rows(lo, hi), ref.view().rows(lo, hi)), 1e-2);
  }
  // Padding rows are exact zeros.
  for (std::int64_t i = lo; gather && i < hi; ++i) {
    if (ids[static_cast<std::size_t>(i)] >= 0) continue;
    for (std::int64_t m = 0; m < M; ++m) ASSERT_EQ(c.data<bf16>()[i * M + m].bits, 0) << "padding row " << i;
  }
  for (std::int64_t i = 0; i < N * M; ++i) {
    if (i >= lo * M && i < hi * M) continue;
    ASSERT_TRUE(testing::is_poison_bf16(c, i)) << "wrote element " << i << " outside the groups";
  }
}

// Every data test runs with both ways of sharing B (GatherGemmB); the setting is process-wide, so each
// test sets it and puts the default back.
class GatherGemm : public ::testing::TestWithParam<cuda::GatherGemmB> {
 protected:
  void SetUp() override { cuda::set_gather_gemm_b_sharing(GetParam()); }
  void TearDown() override { cuda::set_gather_gemm_b_sharing(cuda::GatherGemmB::pair_multicast); }
};

TEST_P(GatherGemm, RaggedGroupsWithEmptyOnesAndTails) {
  if (!testing::require_gpus(1)) return;
  // K and M not multiples of the tile (64, 256): the k and n tails; groups of 0, 1, 129 rows.
  check(300, 200, 264, {129, 0, 1, 70, 0, 200}, 420, true, 1);
}

TEST_P(GatherGemm, ContiguousRowsWithoutATable) {
  if (!testing::require_gpus(1)) return;
  check(520, 128, 512, {256, 128, 100}, 520, false, 2);
}

// Without a table A comes by TMA in 128-row boxes: the last tile reads past A's rows (zero-filled)
// and past its group's (never stored); K and M tails as above.
TEST_P(GatherGemm, ContiguousRowsWithTailsPastTheEnd) {
  if (!testing::require_gpus(1)) return;
  check(200, 200, 264, {129, 0, 71}, 200, false, 6);
}

TEST_P(GatherGemm, OneGroupManyColumnTiles) {
  if (!testing::require_gpus(1)) return;
  check(64, 72, 1032, {200}, 256, true, 3);
}

// Transposed B (K-major rows, one TMA box of 256 or, shared by a pair, 128 of them per stage): the
// k and n tails, empty groups, through a table and without one.
TEST_P(GatherGemm, TransposedBRaggedGroupsWithTails) {
  if (!testing::require_gpus(1)) return;
  check(300, 200, 264, {129, 0, 1, 70, 0, 200}, 420, true, 11, true);
  check(200, 200, 264, {129, 0, 71}, 200, false, 12, true);
  check(64, 72, 1032, {200}, 256, true, 13, true);
}

TEST_P(GatherGemm, NoRowsWritesNothing) {
  if (!testing::require_gpus(1)) return;
  check(16, 64, 64, {0, 0, 0}, 32, true, 4);
}

// The permute fused into the loads: the same numbers as cuBLAS's grouped GEMM on a copy of the rows in
// group order (both accumulate in fp32; only the summation order may differ), at a real expert size.
TEST_P(GatherGemm, MatchesCublasOnAPermutedCopy) {
  if (!testing::require_gpus(1)) return;
  const std::int64_t R = 1024, K = 2048, M = 1024;
  const std::vector<std::int64_t> counts{512, 300, 0, 700, 536};
  const std::int64_t N = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  std::vector<std::int32_t> ids(static_cast<std::size_t>(N));
  std::mt19937_64 rng(5);
  for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(R));
  const Tensor a = bf16_exact({R, K}, 6), b = bf16_exact({static_cast<std::int64_t>(counts.size()), K, M}, 7, 0.05);
  Tensor permuted = Tensor::empty({N, K}, DType::f32);
  for (std::int64_t i = 0; i < N; ++i)
    std::copy_n(a.data<float>() + ids[static_cast<std::size_t>(i)] * K, K, permuted.data<float>() + i * K);
  const Tensor b_d = testing::to_gpu_bf16(b);
  Tensor ours = Tensor::empty({N, M}, DType::bf16, Device::cuda(0));
  Tensor theirs = Tensor::empty({N, M}, DType::bf16, Device::cuda(0));
  cuda::gather_grouped_gemm(testing::to_gpu_bf16(a), device_i32(ids), device_i64(offsets_of(counts)), b_d, ours,
                            nullptr);
  cuda::grouped_gemm_forward(testing::to_gpu_bf16(permuted), b_d, counts, theirs, nullptr);
  EXPECT_LT(rel_error(testing::to_cpu_f32(ours), testing::to_cpu_f32(theirs)), 4e-3);
}

// The data gradient through the forward's weights (b [G, K, M] read as [M', K'] = [K, M]): the same
// numbers as cuBLAS's grouped dgrad (grouped_gemm.h), at DeepSeek-V3's down-projection width.
TEST_P(GatherGemm, TransposedBMatchesCublasDgrad) {
  if (!testing::require_gpus(1)) return;
  const std::int64_t K = 512, M = 7168;  // forward shapes: b [G, K, M]; the gradient d [N, M] -> c [N, K]
  const std::vector<std::int64_t> counts{512, 300, 0, 700, 536};
  const std::int64_t N = std::accumulate(counts.begin(), counts.end(), std::int64_t{0});
  const Tensor d = testing::to_gpu_bf16(bf16_exact({N, M}, 14));
  const Tensor b = testing::to_gpu_bf16(bf16_exact({static_cast<std::int64_t>(counts.size()), K, M}, 15, 0.05));
  Tensor ours = Tensor::empty({N, K}, DType::bf16, Device::cuda(0));
  Tensor theirs = Tensor::empty({N, K}, DType::bf16, Device::cuda(0));
  cuda::gather_grouped_gemm(d, TensorView(), device_i64(offsets_of(counts)), b, ours, nullptr, nullptr,
                            cuda::GatherGemmBLayout::m_by_k);
  cuda::grouped_gemm_dgrad(d, b, counts, theirs, nullptr);
  EXPECT_LT(rel_error(testing::to_cpu_f32(ours), testing::to_cpu_f32(theirs)), 4e-3);
}

TEST_P(GatherGemm, BadDeviceDataIsReportedByName) {
  if (!testing::require_gpus(1)) return;
  cuda::DeviceErrors errors(0);
  const Tensor a = testing::to_gpu_bf16(bf16_exact({8, 64}, 8)), b = testing::to_gpu_bf16(bf16_exact({2, 64, 64}, 9));
  Tensor c = testing::poisoned({8, 64}, DType::bf16);
  cuda::gather_grouped_gemm(a, device_i32({0, 1, 2, 8, 3, 4, 5, 6}), device_i64({0, 4, 8}), b, c, nullptr,
                            errors.record());
  expect_arg_error([&] { errors.check(nullptr, "gather_grouped_gemm"); }, "row_ids");
  cuda::gather_grouped_gemm(a, device_i32({0, 1, 2, 3, 4, 5, 6, 7}), device_i64({0, 5, 4}), b, c, nullptr,
                            errors.record());
  expect_arg_error([&] { errors.check(nullptr, "gather_grouped_gemm"); }, "offsets");
  cuda::gather_grouped_gemm(a, device_i32({0, 1, 2, 3, 4, 5, 6, 7}), device_i64({0, 4, 9}), b, c, nullptr,
                            errors.record());
  expect_arg_error([&] { errors.check(nullptr, "gather_grouped_gemm"); }, "offsets");
  // Good data after the errors: nothing reported.
  cuda::gather_grouped_gemm(a, device_i32({-1, 1, 2, 3, 4, 5, 6, 7}), device_i64({0, 4, 8}), b, c, nullptr,
                            errors.record());
  EXPECT_NO_THROW(errors.check(nullptr, "gather_grouped_gemm"));
}

TEST(GatherGemmArguments, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const auto a = fake_cuda({10, 16}, DType::bf16), b = fake_cuda({2, 16, 8}, DType::bf16);
  const auto c = fake_cuda({10, 8}, DType::bf16), ids = fake_cuda({10}, DType::i32), off = fake_cuda({3}, DType::i64);
  auto run = [](auto... t) { cuda::gather_grouped_gemm(t..., nullptr); };
  expect_arg_error([&] { run(fake_cuda({10, 12}, DType::bf16), ids, off, fake_cuda({2, 12, 8}, DType::bf16), c); }, "a");
  expect_arg_error([&] { run(a, ids, off, fake_cuda({2, 16, 12}, DType::bf16), fake_cuda({10, 12}, DType::bf16)); }, "b");
  expect_arg_error([&] { run(a, ids, off, fake_cuda({2, 8, 8}, DType::bf16), c); }, "b");
  expect_arg_error([&] { run(a, ids, off, b, fake_cuda({10, 16}, DType::bf16)); }, "c");
  expect_arg_error([&] { run(a, fake_cuda({9}, DType::i32), off, b, c); }, "row_ids");
  expect_arg_error([&] { run(a, fake_cuda({10}, DType::i64), off, b, c); }, "row_ids");
  expect_arg_error([&] { run(a, ids, fake_cuda({2}, DType::i64), b, c); }, "offsets");
  expect_arg_error([&] { run(a, ids, fake_cuda({3}, DType::i32), b, c); }, "offsets");
  expect_arg_error([&] { run(fake_cuda({10, 16}, DType::f32), ids, off, b, c); }, "a");
  expect_arg_error([&] { run(fake_cuda({4, 16}, DType::bf16), TensorView(), off, b, c); }, "a");
  expect_arg_error([&] { run(TensorView(nullptr, DType::bf16, Shape{10, 16}), ids, off, b, c); }, "a");
  // Transposed B is [G, M, K]: the forward's [G, K, M] is refused when K != M.
  expect_arg_error([&] { cuda::gather_grouped_gemm(a, ids, off, b, c, nullptr, nullptr, cuda::GatherGemmBLayout::m_by_k); },
                   "b");
}

INSTANTIATE_TEST_SUITE_P(BSharing, GatherGemm,
                         ::testing::Values(cuda::GatherGemmB::own, cuda::GatherGemmB::pair_multicast),
                         [](const ::testing::TestParamInfo<cuda::GatherGemmB>& info) {
                           return info.param == cuda::GatherGemmB::pair_multicast ? "PairMulticast" : "Own";
                         });

}  // namespace
}  // namespace flexep
