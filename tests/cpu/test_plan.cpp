#include <gtest/gtest.h>

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
