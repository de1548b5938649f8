// The experts' weight-gradient GEMM (cuda/wgrad_gemm.h) against a CPU fp32 loop on the same bf16
// inputs and against cuBLAS's grouped wgrads (grouped_gemm.h) on a permuted copy: f32 overwritten,
// f32 accumulated and bf16 overwritten; a's rows through a row table (with -1 padding rows) or
// without; groups whose last stage is partial, with NaN rows right behind them that must not leak in.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "experts_test_util.h"
#include "flexep/core/error.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/grouped_gemm.h"
#include "flexep/cuda/wgrad_gemm.h"
#include "gpu_test_util.h"

namespace flexep {
namespace {

using testing::bf16_exact;
using testing::expect_arg_error;
using testing::offsets_of;
using testing::on_device;
using testing::rel_error;

// c[g] = sum over the group's rows i of a[ids[i]]^T d[i] in fp32 (ids empty: a[i]; id -1: nothing).
Tensor reference(const Tensor& a, const std::vector<std::int32_t>& ids, const Tensor& d,
                 const std::vector<std::int64_t>& off) {
  const std::int64_t K = a.size(1), M = d.size(1), G = static_cast<std::int64_t>(off.size()) - 1;
  Tensor c = Tensor::zeros({G, K, M}, DType::f32);
  float* out = c.data<float>();
  for (std::int64_t g = 0; g < G; ++g)
    for (std::int64_t i = off[static_cast<std::size_t>(g)]; i < off[static_cast<std::size_t>(g) + 1]; ++i) {
      const std::int64_t id = ids.empty() ? i : ids[static_cast<std::size_t>(i)];
      if (id < 0) continue;
      const float* ar = a.data<float>() + id * K;
      const float* dr = d.data<float>() + i * M;
      for (std::int64_t k = 0; k < K; ++k)
        for (std::int64_t m = 0; m < M; ++m) out[(g * K + k) * M + m] += ar[k] * dr[m];
    }
  return c;
}

enum class Out { f32, f32_accumulate, bf16 };

// One shape: a [R, K] with a random row table (a's rows in any order, some -1) or none, d [N, M] whose
// rows past the groups' end are NaN (TMA boxes read them; they must not reach c), c poisoned (or, when
// accumulating, random values the result must be added to).
void check(std::int64_t R, std::int64_t K, std::int64_t M, const std::vector<std::int64_t>& counts, std::int64_t N,
           bool gather, Out out, std::uint64_t seed) {
  const auto off = offsets_of(counts);
  ASSERT_LE(off.back(), N);
  const std::int64_t G = static_cast<std::int64_t>(counts.size());
  Tensor a = bf16_exact({R, K}, seed);
  Tensor d = bf16_exact({N, M}, seed + 1);
  for (std::int64_t i = off.back() * M; i < N * M; ++i) d.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  if (!gather)  // a's rows past the groups are read by TMA boxes too
    for (std::int64_t i = off.back() * K; i < R * K; ++i) a.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
  std::vector<std::int32_t> ids;
  if (gather) {
    std::mt19937_64 rng(seed);
    ids.resize(static_cast<std::size_t>(N));
    for (auto& id : ids) id = static_cast<std::int32_t>(rng() % static_cast<std::uint64_t>(R + 1)) - 1;
  }
  const Tensor ref = reference(a, ids, d, off);
  const DType dtype = out == Out::bf16 ? DType::bf16 : DType::f32;
  Tensor start = bf16_exact({G, K, M}, seed + 2);
  Tensor c = out == Out::f32_accumulate ? testing::to_gpu(start) : testing::poisoned({G, K, M}, dtype);
  cuda::wgrad_grouped_gemm(testing::to_gpu_bf16(a), gather ? TensorView(on_device(ids)) : TensorView(),
                           testing::to_gpu_bf16(d), on_device(off), c, out == Out::f32_accumulate, nullptr);
  const Tensor got = testing::to_cpu_f32(c);
  Tensor want = ref;
  if (out == Out::f32_accumulate)
    for (std::int64_t i = 0; i < want.numel(); ++i) want.data<float>()[i] += start.data<float>()[i];
  // Per group: the empty ones exactly zero (overwritten) or exactly as they were (accumulated).
  for (std::int64_t g = 0; g < G; ++g) {
    const TensorView gv = got.view().rows(g, g + 1), wv = want.view().rows(g, g + 1);
    if (counts[static_cast<std::size_t>(g)] == 0) {
      for (std::int64_t i = 0; i < K * M; ++i)
        ASSERT_EQ(got.data<float>()[g * K * M + i], want.data<float>()[g * K * M + i]) << "empty group " << g;
      continue;
    }
    EXPECT_LT(rel_error(gv, wv), out == Out::bf16 ? 1e-2 : 1e-5) << "group " << g;
  }
}

// Every data test runs with both ways of sharing d's block (GatherGemmB, process-wide).
class WgradGemm : public ::testing::TestWithParam<cuda::GatherGemmB> {
 protected:
  void SetUp() override { cuda::set_gather_gemm_b_sharing(GetParam()); }
  void TearDown() override { cuda::set_gather_gemm_b_sharing(cuda::GatherGemmB::pair_multicast); }
};

// K and M not multiples of the tile (128, 256), an odd K tile count (a pair's second CTA past K),
// groups of 0, 1, 63, 64, 65 and 129 rows: partial last stages with the next group's rows behind them.
TEST_P(WgradGemm, RaggedGroupsThroughATable) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts{129, 0, 1, 63, 64, 0, 65};
  for (const Out out : {Out::f32, Out::f32_accumulate, Out::bf16}) {
    SCOPED_TRACE(static_cast<int>(out));
    check(300, 200, 264, counts, 400, true, out, 1);
  }
}

TEST_P(WgradGemm, RaggedGroupsWithoutATable) {
  if (!testing::require_gpus(1)) return;
  const std::vector<std::int64_t> counts{129, 0, 1, 63, 64, 0, 65};
  for (const Out out : {Out::f32, Out::f32_accumulate, Out::bf16}) {
    SCOPED_TRACE(static_cast<int>(out));
    check(400, 200, 264, counts, 400, false, out, 2);
  }
}

// Many K and M tiles of one group; then a call whose groups hold no rows at all.
TEST_P(WgradGemm, OneGroupManyTilesAndNoRows) {
  if (!testing::require_gpus(1)) return;
  check(300, 520, 1032, {300}, 300, true, Out::f32, 3);
  check(64, 72, 64, {0, 0, 0}, 32, true, Out::f32, 4);
  check(64, 72, 64, {0, 0}, 16, false, Out::f32_accumulate, 5);
  check(64, 72, 64, {0, 0}, 0, false, Out::bf16, 6);
}

// At an expert's real size, the same numbers as cuBLAS's grouped wgrads on a permuted copy of the
// rows (fp32 accumulation both; only the summation order differs).
TEST_P(WgradGemm, MatchesCublasOnAPermutedCopy) {
  if (!testing::require_gpus(1)) return;
  const std::int64_t R = 3000, K = 1024, M = 2048;
  const std::vector<std::int64_t> counts{512, 300, 0, 700, 536};
  const std::int64_t N = std::accumulate(counts.begin(), counts.end(), std::int64_t{0}), G = 5;
  std::vector<std::int32_t> ids(static_cast<std::size_t>(N));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(7));
  const Tensor a = bf16_exact({R, K}, 8), d = testing::to_gpu_bf16(bf16_exact({N, M}, 9));
  Tensor permuted = Tensor::empty({N, K}, DType::f32);
  for (std::int64_t i = 0; i < N; ++i)
    std::copy_n(a.data<float>() + ids[static_cast<std::size_t>(i)] * K, K, permuted.data<float>() + i * K);
  const Tensor a_d = testing::to_gpu_bf16(a), p_d = testing::to_gpu_bf16(permuted);
  const Tensor off = on_device(offsets_of(counts)), table = on_device(ids);
  {
    Tensor ours = Tensor::zeros({G, K, M}, DType::f32, Device::cuda(0));
    Tensor theirs = Tensor::zeros({G, K, M}, DType::f32, Device::cuda(0));
    for (int rep = 0; rep < 2; ++rep) {  // accumulate twice
      cuda::wgrad_grouped_gemm(a_d, table, d, off, ours, true, nullptr);
      cuda::grouped_gemm_wgrad(p_d, d, counts, theirs, nullptr, true);
    }
    EXPECT_LT(rel_error(testing::to_cpu_f32(ours), testing::to_cpu_f32(theirs)), 1e-5);
  }
  Tensor ours = testing::poisoned({G, K, M}, DType::bf16), theirs = testing::poisoned({G, K, M}, DType::bf16);
  cuda::wgrad_grouped_gemm(a_d, table, d, off, ours, false, nullptr);
  cuda::grouped_gemm_wgrad_bf16(p_d, d, counts, theirs, nullptr);
  EXPECT_LT(rel_error(testing::to_cpu_f32(ours), testing::to_cpu_f32(theirs)), 4e-3);
}

TEST_P(WgradGemm, BadDeviceDataIsReportedByName) {
  if (!testing::require_gpus(1)) return;
  cuda::DeviceErrors errors(0);
  const Tensor a = testing::to_gpu_bf16(bf16_exact({8, 64}, 10)), d = testing::to_gpu_bf16(bf16_exact({8, 64}, 11));
  Tensor c = testing::poisoned({2, 64, 64}, DType::f32);
  auto run = [&](const std::vector<std::int32_t>& ids, const std::vector<std::int64_t>& off) {
    cuda::wgrad_grouped_gemm(a, on_device(ids), d, on_device(off), c, false, nullptr, errors.record());
  };
  run({0, 1, 2, 8, 3, 4, 5, 6}, {0, 4, 8});
  expect_arg_error([&] { errors.check(nullptr, "wgrad_grouped_gemm"); }, "row_ids");
  run({0, 1, 2, 3, 4, 5, 6, 7}, {0, 5, 4});
  expect_arg_error([&] { errors.check(nullptr, "wgrad_grouped_gemm"); }, "offsets");
  run({0, 1, 2, 3, 4, 5, 6, 7}, {0, 4, 9});
  expect_arg_error([&] { errors.check(nullptr, "wgrad_grouped_gemm"); }, "offsets");
  run({-1, 1, 2, 3, 4, 5, 6, 7}, {0, 4, 8});  // good data after the errors: nothing reported
  EXPECT_NO_THROW(errors.check(nullptr, "wgrad_grouped_gemm"));
}

TEST(WgradGemmArguments, BadArguments) {
  if (!testing::require_gpus(1)) return;
  using testing::fake_cuda;
  const auto a = fake_cuda({10, 16}, DType::bf16), d = fake_cuda({10, 8}, DType::bf16);
  const auto c = fake_cuda({2, 16, 8}, DType::f32), ids = fake_cuda({10}, DType::i32), off = fake_cuda({3}, DType::i64);
  auto run = [](auto a_, auto ids_, auto d_, auto off_, auto c_, bool acc = false) {
    cuda::wgrad_grouped_gemm(a_, ids_, d_, off_, c_, acc, nullptr);
  };
  expect_arg_error([&] { run(fake_cuda({10, 12}, DType::bf16), ids, d, off, fake_cuda({2, 12, 8}, DType::f32)); }, "a");
  expect_arg_error([&] { run(fake_cuda({10, 16}, DType::f32), ids, d, off, c); }, "a");
  const auto c12 = fake_cuda({2, 16, 12}, DType::f32);
  expect_arg_error([&] { run(a, ids, fake_cuda({10, 12}, DType::bf16), off, c12); }, "d");
  expect_arg_error([&] { run(a, ids, d, off, fake_cuda({2, 8, 8}, DType::f32)); }, "c");
  expect_arg_error([&] { run(a, ids, d, off, fake_cuda({2, 16, 8}, DType::f16)); }, "c");
  expect_arg_error([&] { run(a, ids, d, off, fake_cuda({2, 16, 8}, DType::bf16), true); }, "c");
  expect_arg_error([&] { run(a, fake_cuda({9}, DType::i32), d, off, c); }, "row_ids");
  expect_arg_error([&] { run(a, fake_cuda({10}, DType::i64), d, off, c); }, "row_ids");
  expect_arg_error([&] { run(a, ids, d, fake_cuda({2}, DType::i64), c); }, "offsets");
  expect_arg_error([&] { run(a, ids, d, fake_cuda({3}, DType::i32), c); }, "offsets");
  expect_arg_error([&] { run(fake_cuda({4, 16}, DType::bf16), TensorView(), d, off, c); }, "a");
  const std::int64_t too_many = cuda::kGatherGemmMaxGroups + 1;
  const auto many_off = fake_cuda({too_many + 1}, DType::i64), many_c = fake_cuda({too_many, 16, 8}, DType::f32);
  expect_arg_error([&] { run(a, ids, d, many_off, many_c); }, "c");
}

INSTANTIATE_TEST_SUITE_P(BSharing, WgradGemm,
                         ::testing::Values(cuda::GatherGemmB::own, cuda::GatherGemmB::pair_multicast),
                         [](const ::testing::TestParamInfo<cuda::GatherGemmB>& info) {
                           return info.param == cuda::GatherGemmB::pair_multicast ? "PairMulticast" : "Own";
                         });

}  // namespace
}  // namespace flexep
