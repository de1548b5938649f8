// The low-latency layout's CPU oracle (core/low_latency.h) on small worked examples, by hand.
#include <gtest/gtest.h>

#include "flexep/core/low_latency.h"

namespace flexep::testing {
namespace {

Tensor ids(std::vector<std::int64_t> v, std::int64_t T, std::int64_t k) { return Tensor::from_vector(v, {T, k}); }

TEST(LowLatencyLayout, SendingSlotsSkipNoneOutOfRangeAndRepeats) {
  const Tensor i = ids({0, -1, 3, 3, 2, 4, -2, 1}, 2, 4);  // E = 4
  const std::vector<char> sends = low_latency_sending_slots(i, 4);
  EXPECT_EQ(sends, (std::vector<char>{1, 0, 1, 0, 1, 0, 0, 1}));
}

// Two ranks, E = 4 (L = 2), T_max = 3. Rank 0: t0 -> {1, 2}, t1 -> {1}, t2 -> {3, 0}; rank 1:
// t0 -> {2, 1}, t1 -> {-1, 2}.
TEST(LowLatencyLayout, RowsLieInSourceThenTokenOrder) {
  const Tensor r0 = ids({1, 2, 1, -1, 3, 0}, 3, 2), r1 = ids({2, 1, -1, 2}, 2, 2);
  const std::vector<LowLatencyReceiver> lay = low_latency_layouts({r0, r1}, 4, 3);
  ASSERT_EQ(lay.size(), 2u);
  const std::int64_t region = 2 * 3;
  // Rank 0 holds experts 0 and 1: expert 0 <- (0, t2); expert 1 <- (0, t0), (0, t1), (1, t0).
  EXPECT_EQ(lay[0].count, (std::vector<std::int32_t>{1, 3}));
  EXPECT_EQ(lay[0].src_rank[0], 0);
  EXPECT_EQ(lay[0].src_token[0], 2);
  EXPECT_EQ(lay[0].src_token[region + 0], 0);
  EXPECT_EQ(lay[0].src_token[region + 1], 1);
  EXPECT_EQ(lay[0].src_rank[region + 2], 1);
  EXPECT_EQ(lay[0].src_token[region + 2], 0);
  EXPECT_EQ(lay[0].src_token[region + 3], -1);
  // layout_range[e * R + s] = begin << 32 | count.
  EXPECT_EQ(lay[0].layout_range, (std::vector<std::int64_t>{1, 1ll << 32, 2, (2ll << 32) | 1}));
  // Rank 1 holds experts 2 and 3: expert 2 <- (0, t0), (1, t0), (1, t1); expert 3 <- (0, t2).
  EXPECT_EQ(lay[1].count, (std::vector<std::int32_t>{3, 1}));
  EXPECT_EQ(lay[1].layout_range, (std::vector<std::int64_t>{1, (1ll << 32) | 2, 1, 1ll << 32}));
  EXPECT_EQ(lay[1].src_token[1], 0);
  EXPECT_EQ(lay[1].src_rank[1], 1);
  EXPECT_EQ(lay[1].src_token[2], 1);
}

TEST(LowLatencyLayout, RecvXCopiesTheRowsZeroPastTheCounts) {
  const Tensor r0 = ids({1, 0}, 2, 1), r1 = ids({1}, 1, 1);  // E = 2, one expert per rank
  const Tensor x0 = Tensor::from_vector<float>({10, 11, 20, 21}, {2, 2}), x1 = Tensor::from_vector<float>({30, 31}, {1, 2});
  const std::vector<LowLatencyReceiver> lay = low_latency_layouts({r0, r1}, 2, 2);
  const Tensor on1 = low_latency_recv_x(lay[1], {x0, x1}, 2, 2);  // expert 1 <- (0, t0), (1, t0)
  ASSERT_EQ(on1.shape(), Shape({1, 4, 2}));
  EXPECT_EQ(std::vector<float>(on1.data<float>(), on1.data<float>() + 8),
            (std::vector<float>{10, 11, 30, 31, 0, 0, 0, 0}));
}

// out[t] = sum over t's sending slots, ascending, of w * y, each product and sum rounded to fp32,
// then to bf16; a token without a sending slot gets zeros.
TEST(LowLatencyLayout, CombineIsTheWeightedSumInSlotOrder) {
  const Tensor r0 = ids({1, 0, -1, -1}, 2, 2), r1 = ids({0, 0}, 1, 2);  // r1's repeated 0 sends once
  const Tensor w0 = Tensor::from_vector<float>({0.5f, 2.0f, 1.0f, 1.0f}, {2, 2});
  const Tensor w1 = Tensor::from_vector<float>({3.0f, 100.0f}, {1, 2});
  const std::vector<LowLatencyReceiver> lay = low_latency_layouts({r0, r1}, 2, 2);
  // Expert 0 (rank 0) rows: (0, t0), (1, t0); expert 1 (rank 1): (0, t0).
  auto rows = [](std::vector<float> v) {
    Tensor t = Tensor::empty({1, 4, 1}, DType::bf16);
    for (std::size_t i = 0; i < 4; ++i) t.data<bf16>()[i] = bf16::from_float(i < v.size() ? v[i] : 0.0f);
    return t;
  };
  const Tensor y0 = rows({4.0f, 256.0f}), y1 = rows({1.0f});
  const Tensor out0 = low_latency_combine_reference(lay, 0, r0, w0, {y0, y1}, 2, 2);
  const Tensor out1 = low_latency_combine_reference(lay, 1, r1, w1, {y0, y1}, 2, 2);
  EXPECT_EQ(out0.data<bf16>()[0].to_float(), 0.5f * 1.0f + 2.0f * 4.0f);
  EXPECT_EQ(out0.data<bf16>()[1].to_float(), 0.0f);
  EXPECT_EQ(out1.data<bf16>()[0].to_float(), 3.0f * 256.0f);
  // Rounded to bf16 once, at the end: 1 + 2^-8 + 2^-8 is 1 + 2^-7 in fp32, a bf16; rounding the
  // running sum to bf16 after each addition would give 1 (1 + 2^-8 ties to even).
  const Tensor r2 = ids({0, 1, 2}, 1, 3);
  const Tensor w2 = Tensor::from_vector<float>({1.0f, 1.0f, 1.0f}, {1, 3});
  const std::vector<LowLatencyReceiver> lay2 = low_latency_layouts({r2}, 3, 1);
  Tensor y = Tensor::empty({3, 1, 1}, DType::bf16);
  y.data<bf16>()[0] = bf16::from_float(1.0f);
  y.data<bf16>()[1] = bf16::from_float(1.0f / 256);
  y.data<bf16>()[2] = bf16::from_float(1.0f / 256);
  const Tensor out2 = low_latency_combine_reference(lay2, 0, r2, w2, {y}, 3, 1);
  EXPECT_EQ(out2.data<bf16>()[0].to_float(), 1.0f + 1.0f / 128);
}

}  // namespace
}  // namespace flexep::testing
