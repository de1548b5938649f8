// The hybridep bit plan's arithmetic (src/dispatch/hybridep/bit_plan_math.h), run here the way
// bit_plan.cu runs it (bits set per (expert, token), one exclusive scan over the threads' runs of
// words, rows from the bits and the scan), against core/plan.cpp: the same counts, offsets and slot
// rows as DispatchPlan::build + slot_rows for one rank with pad 1 and no budget, the single-GPU plan
// every hybridep dispatch starts from. Many token counts, top-k, expert counts and thread counts
// (the run boundaries move with them).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"

// Internal header of the backend (pure C++, no CUDA); the tests' include path has no src/.
#include "../../src/dispatch/hybridep/bit_plan_math.h"

namespace flexep::hybridep {
namespace {

struct BitPlan {
  std::vector<long long> counts, begin, rows;
};

// bit_plan.cu's three steps, `threads` threads played one after another.
BitPlan run_bit_plan(const std::vector<int>& ids, long long T, int k, int E, int threads) {
  const long long W = bit_plan_words_per_expert(T), words = static_cast<long long>(E) * W;
  std::vector<std::uint32_t> bits(static_cast<std::size_t>(words), 0u);
  for (long long t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int id = ids[static_cast<std::size_t>(t * k + j)];
      if (id >= 0 && id < E) bits[static_cast<std::size_t>(bit_plan_word(id, t, W))] |= bit_plan_bit(t);
    }
  const long long per = bit_plan_per_thread(words, threads);
  std::vector<long long> run_prefix(static_cast<std::size_t>(threads) + 1, 0);
  long long total = 0;
  for (int r = 0; r < threads; ++r) {
    run_prefix[static_cast<std::size_t>(r)] = total;
    for (long long w = r * per; w < (r + 1) * per && w < words; ++w) total += popc32(bits[static_cast<std::size_t>(w)]);
  }
  run_prefix[static_cast<std::size_t>(threads)] = total;
  BitPlan out;
  for (int e = 0; e < E; ++e) {
    const long long lo = bit_plan_prefix(bits.data(), run_prefix.data(), per, words, e * W);
    const long long hi = bit_plan_prefix(bits.data(), run_prefix.data(), per, words, (e + 1) * W);
    out.begin.push_back(lo);
    out.counts.push_back(hi - lo);
  }
  for (long long t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int id = ids[static_cast<std::size_t>(t * k + j)];
      out.rows.push_back(id >= 0 && id < E ? bit_plan_row(bits.data(), run_prefix.data(), per, words, id, t, W) : -1);
    }
  return out;
}

// Top-k ids: distinct experts per token, about one slot in eight -1 (no expert).
std::vector<int> random_topk(long long T, int k, int E, std::mt19937& rng) {
  std::vector<int> ids;
  std::vector<int> experts(static_cast<std::size_t>(E));
  for (long long t = 0; t < T; ++t) {
    for (int e = 0; e < E; ++e) experts[static_cast<std::size_t>(e)] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int j = 0; j < k; ++j) ids.push_back(rng() % 8 == 0 ? -1 : experts[static_cast<std::size_t>(j)]);
  }
  return ids;
}

TEST(HybridEpBitPlan, MatchesDispatchPlanOfOneRank) {
  std::mt19937 rng(20261130);
  for (long long T : {0LL, 1LL, 31LL, 32LL, 33LL, 100LL, 1000LL, 4096LL}) {
    for (int E : {1, 2, 64, 256}) {
      for (int k : {1, 2, 8}) {
        if (k > E) continue;
        const std::vector<int> ids = random_topk(T, k, E, rng);
        std::vector<std::int64_t> counts(static_cast<std::size_t>(E), 0);
        for (int id : ids)
          if (id >= 0) ++counts[static_cast<std::size_t>(id)];
        PlanParams params;
        params.ranks = 1;
        params.experts = E;
        const DispatchPlan plan = DispatchPlan::build(counts, params);
        std::vector<int> ids_copy = ids;
        const TensorView view(ids_copy.data(), DType::i32, {T, k}, Device::cpu());
        const std::vector<std::int64_t> want_rows = slot_rows(plan, 0, view);
        for (int threads : {1024, 7, 1}) {
          if (threads == 1 && T > 100) continue;  // one run of every word: quadratic, slow
          SCOPED_TRACE("T " + std::to_string(T) + ", E " + std::to_string(E) + ", k " + std::to_string(k) +
                       ", threads " + std::to_string(threads));
          const BitPlan got = run_bit_plan(ids, T, k, E, threads);
          for (int e = 0; e < E; ++e) {
            ASSERT_EQ(got.counts[static_cast<std::size_t>(e)], plan.ranks[0].kept_rows[static_cast<std::size_t>(e)]);
            ASSERT_EQ(got.begin[static_cast<std::size_t>(e)], plan.ranks[0].expert_begin[static_cast<std::size_t>(e)]);
          }
          ASSERT_EQ(got.rows.size(), want_rows.size());
          for (std::size_t i = 0; i < want_rows.size(); ++i) ASSERT_EQ(got.rows[i], want_rows[i]) << "slot " << i;
        }
      }
    }
  }
}

TEST(HybridEpBitPlan, RowsOfATokenCountOnlyEarlierTokensOfTheSameExpert) {
  // Expert 3: tokens 0, 33, 64 (words 0, 1, 2); expert 0: token 40. Rows: expert 0 first.
  const long long T = 70;
  const int k = 1, E = 4;
  std::vector<int> ids(static_cast<std::size_t>(T), -1);
  ids[0] = 3, ids[33] = 3, ids[64] = 3, ids[40] = 0;
  const BitPlan got = run_bit_plan(ids, T, k, E, 2);
  EXPECT_EQ(got.counts, (std::vector<long long>{1, 0, 0, 3}));
  EXPECT_EQ(got.begin, (std::vector<long long>{0, 1, 1, 1}));
  EXPECT_EQ(got.rows[40], 0);
  EXPECT_EQ(got.rows[0], 1);
  EXPECT_EQ(got.rows[33], 2);
  EXPECT_EQ(got.rows[64], 3);
  EXPECT_EQ(got.rows[1], -1);
}

}  // namespace
}  // namespace flexep::hybridep
