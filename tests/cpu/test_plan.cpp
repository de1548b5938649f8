#include <gtest/gtest.h>

#include <limits>

#include "flexep/core/plan.h"

using namespace flexep;

TEST(Plan, TwoRanksLayoutIsExpertMajorBySourceRank) {
  // R=2, E=4 (2 local experts). counts[s][e].
  std::vector<std::int64_t> counts = {1, 2, 0, 3,   // source 0
                                      2, 0, 1, 1};  // source 1
  PlanParams p;
  p.ranks = 2;
  p.experts = 4;
  p.pad_multiple = 1;
  auto plan = DispatchPlan::build(counts, p);
  EXPECT_EQ(plan.ranks[0].tokens_per_expert, (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(plan.ranks[1].tokens_per_expert, (std::vector<std::int64_t>{1, 4}));
  EXPECT_EQ(plan.ranks[0].source_begin, (std::vector<std::int64_t>{0, 1, 3, 5}));
}

namespace {
PlanParams params(int R, int E, std::int64_t pad = 1) {
  PlanParams p;
  p.ranks = R;
  p.experts = E;
  p.pad_multiple = pad;
  return p;
}
}  // namespace

TEST(Plan, PaddingRoundsEachGroupAndReportsPaddedSizes) {
  // counts[s][e], R=2, E=4, pad 4: rank 0 groups 3 -> 4 and 2 -> 4; rank 1 groups 1 -> 4, 4 -> 4.
  std::vector<std::int64_t> counts = {1, 2, 0, 3,
                                      2, 0, 1, 1};
  auto plan = DispatchPlan::build(counts, params(2, 4, 4));
  EXPECT_EQ(plan.ranks[0].tokens_per_expert, (std::vector<std::int64_t>{4, 4}));
  EXPECT_EQ(plan.ranks[0].expert_begin, (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(plan.ranks[0].kept_rows, (std::vector<std::int64_t>{3, 2}));
  EXPECT_EQ(plan.ranks[0].source_begin, (std::vector<std::int64_t>{0, 1, 4, 6}));
  EXPECT_EQ(plan.ranks[1].expert_begin, (std::vector<std::int64_t>{0, 4}));
  EXPECT_EQ(plan.ranks[1].out_rows, 8);
  EXPECT_EQ(plan.dropped(), 0);
}

TEST(Plan, EmptyGroupsTakeNoRowsEvenWhenPadded) {
  std::vector<std::int64_t> counts = {0, 5, 0, 0};
  auto plan = DispatchPlan::build(counts, params(1, 4, 16));
  EXPECT_EQ(plan.ranks[0].tokens_per_expert, (std::vector<std::int64_t>{0, 16, 0, 0}));
  EXPECT_EQ(plan.ranks[0].expert_begin, (std::vector<std::int64_t>{0, 0, 16, 16}));
  EXPECT_EQ(plan.ranks[0].required_rows, 16);
}

TEST(Plan, BudgetOverflowNamesRankRowsAndBudget) {
  std::vector<std::int64_t> counts = {1, 2, 0, 3,
                                      2, 0, 1, 1};
  PlanParams p = params(2, 4, 2);
  p.budget_rows = 6;  // rank 0 needs 4 + 2 = 6 rows, rank 1 needs 2 + 4 = 6: fits exactly
  auto plan = DispatchPlan::build(counts, p);
  EXPECT_EQ(plan.ranks[0].out_rows, 6);
  EXPECT_EQ(plan.dropped(), 0);
  p.budget_rows = 4;
  try {
    DispatchPlan::build(counts, p);
    ADD_FAILURE() << "overflow not reported";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("rank 0 needs 6"), std::string::npos) << w;
    EXPECT_NE(w.find("budget_rows is 4"), std::string::npos) << w;
  }
}

TEST(Plan, DropKeepsTheRowPrefixBelowTheBudget) {
  // Rank 0 of R=1, E=3, pad 2, budget 6: groups of 3, 4, 2 real rows occupy [0,4), [4,8), [8,10).
  // Kept: 3 of expert 0, 2 of expert 1 (rows 4, 5), none of expert 2: 2 + 2 = 4 dropped.
  std::vector<std::int64_t> counts = {3, 4, 2};
  PlanParams p = params(1, 3, 2);
  p.budget_rows = 6;
  p.overflow = OverflowPolicy::drop;
  auto plan = DispatchPlan::build(counts, p);
  const RankLayout& lay = plan.ranks[0];
  EXPECT_EQ(lay.out_rows, 6);
  EXPECT_EQ(lay.kept_rows, (std::vector<std::int64_t>{3, 2, 0}));
  EXPECT_EQ(lay.tokens_per_expert, (std::vector<std::int64_t>{4, 2, 0}));
  EXPECT_EQ(lay.dropped, 4);
  EXPECT_EQ(plan.dropped(), 4);
  // Slots in token order: expert 1 appears at tokens 0..3, only the first two are kept.
  std::vector<std::int64_t> idx = {0, 1, 0, 1, 0, 1, 2, 1, 2, -1};
  Tensor indices = Tensor::from_vector(idx, {5, 2});
  EXPECT_EQ(slot_rows(plan, 0, indices), (std::vector<std::int64_t>{0, 4, 1, 5, 2, -1, -1, -1, -1, -1}));
}

TEST(Plan, SlotRowsFollowSourceThenTokenOrder) {
  // R=2, E=2 (one expert per rank). Source 0 sends tokens 0 and 2 to expert 1, source 1 sends
  // token 0; on rank 1, source 0's rows come first.
  Tensor idx0 = Tensor::from_vector(std::vector<std::int32_t>{1, 0, -1, 1}, {4, 1});
  Tensor idx1 = Tensor::from_vector(std::vector<std::int32_t>{1, 0}, {2, 1});
  std::vector<std::int64_t> counts = {1, 2,
                                      1, 1};
  auto plan = DispatchPlan::build(counts, params(2, 2));
  EXPECT_EQ(slot_rows(plan, 0, idx0), (std::vector<std::int64_t>{0, 0, -1, 1}));
  EXPECT_EQ(slot_rows(plan, 1, idx1), (std::vector<std::int64_t>{2, 1}));
}

TEST(Plan, SlotRowsRejectIdsOtherThanMinusOne) {
  // Regression: ids below -1 were silently treated as "no expert".
  auto plan = DispatchPlan::build({1, 0}, params(1, 2));
  for (std::int64_t bad : {std::int64_t{-2}, std::int64_t{2}}) {
    Tensor idx = Tensor::from_vector(std::vector<std::int64_t>{0, bad}, {1, 2});
    try {
      slot_rows(plan, 0, idx);
      ADD_FAILURE() << "id " << bad << " accepted";
    } catch (const ArgumentError& e) {
      EXPECT_EQ(e.argument(), "indices");
    }
  }
}

TEST(Plan, ValidateNamesTheArgument) {
  auto arg_of = [](const PlanParams& p) {
    try {
      validate(p);
    } catch (const ArgumentError& e) {
      return e.argument();
    }
    return std::string("(none)");
  };
  EXPECT_EQ(arg_of(params(3, 4)), "num_experts");
  EXPECT_EQ(arg_of(params(2, 4, 0)), "pad_multiple");
  PlanParams p = params(2, 4, 8);
  p.budget_rows = 12;
  EXPECT_EQ(arg_of(p), "budget_rows");
  p.budget_rows = 16;
  EXPECT_EQ(arg_of(p), "(none)");
  // Sizes whose row counts would overflow (a crash once, at budget_rows 2^62) are refused.
  EXPECT_EQ(arg_of(params(2, 4, 65536)), "(none)");
  EXPECT_EQ(arg_of(params(2, 4, 65537)), "pad_multiple");
  EXPECT_EQ(arg_of(params(2, 4, std::numeric_limits<std::int64_t>::max())), "pad_multiple");
  p = params(2, 4, 1);
  p.budget_rows = (std::int64_t{1} << 31) - 1;
  EXPECT_EQ(arg_of(p), "(none)");
  p.budget_rows = std::int64_t{1} << 62;
  EXPECT_EQ(arg_of(p), "budget_rows");
}

TEST(Plan, PermuteAndUnpermuteRejectMismatchedRows) {
  // Regression: a rows vector of the wrong length used to be indexed out of bounds.
  Tensor x = Tensor::zeros({2, 3}, DType::f32), w = Tensor::zeros({2, 2}, DType::f32);
  Tensor tok = Tensor::zeros({4, 3}, DType::f32), pr = Tensor::zeros({4}, DType::f32);
  EXPECT_THROW(permute(x, w, {0, 1, 2}, tok, pr), ArgumentError);
  Tensor idx = Tensor::from_vector(std::vector<std::int64_t>{0, 1, 0, 1}, {2, 2});
  Tensor out = Tensor::zeros({2, 3}, DType::f32);
  EXPECT_THROW(unpermute(tok, idx, {0, 1, 2}, out), ArgumentError);
  EXPECT_NO_THROW(unpermute(tok, idx, {0, 1, 2, 3}, out));
}
