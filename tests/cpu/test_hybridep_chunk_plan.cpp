// The hybridep chunk plan's arithmetic (src/dispatch/hybridep/kernels/chunk_plan_math.h), run here the way
// chunk_plan.cu runs it (bits per (expert, chunk token), chunk counts, their exclusive scan over the
// chunks, each slot's rank in its chunk), against core/plan.cpp: the same counts and, with the
// expert's offset added, the same slot rows as DispatchPlan::build + slot_rows for one rank with
// pad 1 and no budget, the single-GPU plan every hybridep dispatch starts from.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"

// Internal header of the backend (pure C++, no CUDA); the tests' include path has no src/.
#include "dispatch/hybridep/kernels/chunk_plan_math.h"

namespace flexep::hybridep {
namespace {

struct ChunkPlan {
  std::vector<long long> counts;  // [E]
  std::vector<long long> rank;    // [T * k]: chunk_base(chunk, e) + rank in the chunk, or -1
};

// chunk_plan.cu's steps, the chunk's threads played one after another.
ChunkPlan run_chunk_plan(const std::vector<int>& ids, long long T, int k, int E) {
  const long long chunks = plan_chunks(T);
  std::vector<long long> chunk_base(static_cast<std::size_t>(chunks * E), 0);
  std::vector<int> in_chunk(ids.size(), -1);
  for (long long g = 0; g < chunks; ++g) {
    std::vector<std::uint32_t> bits(static_cast<std::size_t>(E) * kPlanChunkWords, 0u);
    auto id_of = [&](long long t, int j) { return ids[static_cast<std::size_t>(t * k + j)]; };
    for (int i = 0; i < kPlanChunkTokens && g * kPlanChunkTokens + i < T; ++i)
      for (int j = 0; j < k; ++j) {
        const int id = id_of(g * kPlanChunkTokens + i, j);
        if (id >= 0 && id < E) bits[static_cast<std::size_t>(id * kPlanChunkWords + plan_word(i))] |= plan_bit(i);
      }
    for (int e = 0; e < E; ++e)
      chunk_base[static_cast<std::size_t>(g * E + e)] = plan_word_prefix(bits.data(), e, kPlanChunkWords);
    for (int i = 0; i < kPlanChunkTokens && g * kPlanChunkTokens + i < T; ++i)
      for (int j = 0; j < k; ++j) {
        const long long t = g * kPlanChunkTokens + i;
        const int id = id_of(t, j);
        if (id >= 0 && id < E)
          in_chunk[static_cast<std::size_t>(t * k + j)] =
              plan_rank_in_chunk(bits.data(), plan_word_prefix(bits.data(), id, plan_word(i)), id, i);
      }
  }
  ChunkPlan out;
  out.counts.assign(static_cast<std::size_t>(E), 0);
  for (int e = 0; e < E; ++e)  // the last CTA's scan
    for (long long g = 0; g < chunks; ++g) {
      const long long n = chunk_base[static_cast<std::size_t>(g * E + e)];
      chunk_base[static_cast<std::size_t>(g * E + e)] = out.counts[static_cast<std::size_t>(e)];
      out.counts[static_cast<std::size_t>(e)] += n;
    }
  for (long long t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const int id = ids[static_cast<std::size_t>(t * k + j)];
      const int r = in_chunk[static_cast<std::size_t>(t * k + j)];
      out.rank.push_back(r < 0 ? -1 : chunk_base[static_cast<std::size_t>((t / kPlanChunkTokens) * E + id)] + r);
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

TEST(HybridEpChunkPlan, MatchesDispatchPlanOfOneRank) {
  std::mt19937 rng(20261130);
  for (long long T : {0LL, 1LL, 31LL, 32LL, 33LL, 255LL, 256LL, 257LL, 1000LL, 4096LL}) {
    for (int E : {1, 2, 64, 256}) {
      for (int k : {1, 2, 8}) {
        if (k > E) continue;
        SCOPED_TRACE("T " + std::to_string(T) + ", E " + std::to_string(E) + ", k " + std::to_string(k));
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
        const ChunkPlan got = run_chunk_plan(ids, T, k, E);
        for (int e = 0; e < E; ++e)
          ASSERT_EQ(got.counts[static_cast<std::size_t>(e)], plan.ranks[0].kept_rows[static_cast<std::size_t>(e)]);
        ASSERT_EQ(got.rank.size(), want_rows.size());
        for (std::size_t i = 0; i < want_rows.size(); ++i) {
          const int id = ids[i];
          const long long want = want_rows[i] < 0 ? -1 : want_rows[i] - plan.ranks[0].expert_begin[static_cast<std::size_t>(id)];
          ASSERT_EQ(got.rank[i], want) << "slot " << i;
        }
      }
    }
  }
}

TEST(HybridEpChunkPlan, RanksCountOnlyEarlierTokensOfTheSameExpertAcrossChunks) {
  // Expert 3: tokens 0, 33 (chunk 0, words 0 and 1), 300 and 600 (chunks 1 and 2); expert 0: token 40.
  const long long T = 700;
  const int k = 1, E = 4;
  std::vector<int> ids(static_cast<std::size_t>(T), -1);
  ids[0] = 3, ids[33] = 3, ids[300] = 3, ids[600] = 3, ids[40] = 0;
  const ChunkPlan got = run_chunk_plan(ids, T, k, E);
  EXPECT_EQ(got.counts, (std::vector<long long>{1, 0, 0, 4}));
  EXPECT_EQ(got.rank[40], 0);
  EXPECT_EQ(got.rank[0], 0);
  EXPECT_EQ(got.rank[33], 1);
  EXPECT_EQ(got.rank[300], 2);
  EXPECT_EQ(got.rank[600], 3);
  EXPECT_EQ(got.rank[1], -1);
}

TEST(HybridEpChunkPlan, ChunksCoverEveryTokenAndAtLeastOne) {
  EXPECT_EQ(plan_chunks(0), 1);
  EXPECT_EQ(plan_chunks(1), 1);
  EXPECT_EQ(plan_chunks(kPlanChunkTokens), 1);
  EXPECT_EQ(plan_chunks(kPlanChunkTokens + 1), 2);
  EXPECT_EQ(plan_chunks(4096), 4096 / kPlanChunkTokens);
}

}  // namespace
}  // namespace flexep::hybridep
