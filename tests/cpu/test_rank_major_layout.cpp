// The rank-major layout math (core/rank_major.h) on worked examples, where every number can be
// checked by hand.
#include <gtest/gtest.h>

#include "flexep/core/error.h"
#include "flexep/core/rank_major.h"

using namespace flexep;

namespace {

using V = std::vector<std::int64_t>;

PlanParams params(int R, int E, std::optional<std::int64_t> budget = std::nullopt,
                  OverflowPolicy overflow = OverflowPolicy::error) {
  PlanParams p;
  p.ranks = R;
  p.experts = E;
  p.budget_rows = budget;
  p.overflow = overflow;
  return p;
}

// R = 2, E = 4 (rank 0: experts 0, 1; rank 1: 2, 3). Token 0 goes to rank 0 (twice: one row),
// token 1 to both, token 2 to rank 1, token 3 nowhere.
Tensor source0() { return Tensor::from_vector(V{0, 1, 0, 2, -1, 3, -1, -1}, {4, 2}); }

}  // namespace

TEST(RankMajorLayout, RowCountsSendATokenOncePerRank) {
  EXPECT_EQ(rank_major_row_counts(source0(), params(2, 4)), (V{2, 2}));
  EXPECT_EQ(rank_major_row_counts(Tensor::from_vector(V{}, {0, 2}), params(2, 4)), (V{0, 0}));
}

TEST(RankMajorLayout, ReceiversStackTheSourcesInRankOrder) {
  // rows[s][d]: source 0 sends 2 and 2, source 1 sends 1 and 3.
  const auto lay = rank_major_layouts(V{2, 2, 1, 3}, params(2, 4));
  ASSERT_EQ(lay.size(), 2u);
  EXPECT_EQ(lay[0].source_begin, (V{0, 2}));
  EXPECT_EQ(lay[0].source_rows, (V{2, 1}));
  EXPECT_EQ(lay[0].required_rows, 3);
  EXPECT_EQ(lay[0].out_rows, 3);
  EXPECT_EQ(lay[1].source_begin, (V{0, 2}));
  EXPECT_EQ(lay[1].required_rows, 5);
}

TEST(RankMajorLayout, BudgetOverflowRaisesOrKeepsAPrefix) {
  try {
    rank_major_layouts(V{2, 2, 1, 3}, params(2, 4, 4));
    FAIL() << "no overflow error";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("rank 1 receives 5 rank-major rows but budget_rows is 4"), std::string::npos) << what;
  }
  const auto lay = rank_major_layouts(V{2, 2, 1, 3}, params(2, 4, 4, OverflowPolicy::drop));
  EXPECT_EQ(lay[0].source_rows, (V{2, 1}));  // 3 rows fit
  EXPECT_EQ(lay[0].out_rows, 4);
  EXPECT_EQ(lay[1].source_rows, (V{2, 2}));  // source 1's last row is dropped
  EXPECT_EQ(lay[1].required_rows, 5);
  EXPECT_EQ(lay[1].out_rows, 4);
}

TEST(RankMajorLayout, EveryTokenGetsItsRowOnEachRank) {
  const auto lay = rank_major_layouts(V{2, 2, 1, 3}, params(2, 4));
  // [t * R + d]
  EXPECT_EQ(rank_major_rows(lay, 0, source0(), params(2, 4)), (V{0, -1, 1, 0, -1, 1, -1, -1}));
  // Source 1's rows start after source 0's: row 2 on rank 0, rows 2..4 on rank 1.
  const Tensor source1 = Tensor::from_vector(V{3, -1, 2, 0, 2, 3}, {3, 2});
  EXPECT_EQ(rank_major_rows(lay, 1, source1, params(2, 4)), (V{-1, 2, 2, 3, -1, 4}));
  // With the budget of 4 and the drop policy, source 1's third token loses its row on rank 1.
  const auto dropped = rank_major_layouts(V{2, 2, 1, 3}, params(2, 4, 4, OverflowPolicy::drop));
  EXPECT_EQ(rank_major_rows(dropped, 1, source1, params(2, 4)), (V{-1, 2, 2, 3, -1, -1}));
}

TEST(RankMajorLayout, ExpertRowsListEachExpertsRowsPadded) {
  // 4 received rows, k = 2, L = 2.
  const std::vector<std::int32_t> idx = {0, -1, 1, 0, -1, 1, 0, 1};
  const ExpertRows exact = expert_rows(idx.data(), 4, 2, 2, 2);
  EXPECT_EQ(exact.tokens_per_expert, (V{4, 4}));
  EXPECT_EQ(exact.rows, (std::vector<std::int32_t>{0, 1, 3, -1, 1, 2, 3, -1}));
  EXPECT_EQ(exact.pairs, 6);
  const ExpertRows unpadded = expert_rows(idx.data(), 4, 2, 2, 1);
  EXPECT_EQ(unpadded.tokens_per_expert, (V{3, 3}));
  EXPECT_EQ(unpadded.rows, (std::vector<std::int32_t>{0, 1, 3, 1, 2, 3}));
  // Budget sizing: 4 rows * min(k, L) + L * (pad - 1) = 10 entries, the tail -1.
  EXPECT_EQ(expert_rows_capacity(4, 2, 2, 2), 10);
  EXPECT_EQ(expert_rows_capacity(4, 8, 2, 1), 8);
  const ExpertRows sized = expert_rows(idx.data(), 4, 2, 2, 2, 10);
  EXPECT_EQ(sized.rows, (std::vector<std::int32_t>{0, 1, 3, -1, 1, 2, 3, -1, -1, -1}));
  EXPECT_EQ(sized.tokens_per_expert, (V{4, 4}));
}
