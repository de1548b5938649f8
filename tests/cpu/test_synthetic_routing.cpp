// synthetic_topk against the Gumbel top-k it implements, written out here: every expert's key
// from uniform01 (u itself for equal popularities, log p - log(-log u) for Zipf, +inf for the hot
// expert), the k largest first, the lower id on a tie; weights 0.5 + u normalised. The routine
// takes a shortcut for equal popularities and k <= 32 (the draws' bits, a small sorted array):
// the ids must be the same, token for token.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/core/random.h"
#include "flexep/core/synthetic_routing.h"

using namespace flexep;

namespace {

std::vector<std::int64_t> reference_ids(std::int64_t tokens, int k, int experts, const RoutingSpec& spec,
                                        std::uint64_t seed, int rank) {
  const std::uint64_t stream = splitmix64(stream_id("synthetic_routing") + static_cast<std::uint64_t>(rank));
  std::vector<std::int64_t> ids;
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::uint64_t base = static_cast<std::uint64_t>(t) * static_cast<std::uint64_t>(experts + k);
    std::vector<std::pair<double, int>> keys;
    for (int e = 0; e < experts; ++e) {
      const double u = uniform01(seed, stream, base + static_cast<std::uint64_t>(e)) + 1e-300;
      double key = spec.kind == RoutingKind::zipf ? -spec.zipf_s * std::log(e + 1.0) - std::log(-std::log(u)) : u;
      if (spec.kind == RoutingKind::hot && e == spec.hot_expert) key = HUGE_VAL;
      keys.emplace_back(-key, e);
    }
    std::sort(keys.begin(), keys.end());
    for (int j = 0; j < k; ++j) ids.push_back(keys[static_cast<std::size_t>(j)].second);
  }
  return ids;
}

TEST(SyntheticRouting, TopKIsTheGumbelTopKOfItsDraws) {
  struct Case {
    RoutingKind kind;
    int experts, k;
  };
  for (const Case c : {Case{RoutingKind::uniform, 64, 8}, Case{RoutingKind::uniform, 1024, 8},
                       Case{RoutingKind::uniform, 7, 7}, Case{RoutingKind::uniform, 256, 32},
                       Case{RoutingKind::uniform, 256, 33}, Case{RoutingKind::hot, 64, 8},
                       Case{RoutingKind::hot, 16, 1}, Case{RoutingKind::zipf, 64, 8}}) {
    RoutingSpec spec;
    spec.kind = c.kind;
    spec.hot_expert = c.experts / 3;
    for (int rank : {0, 5}) {
      SCOPED_TRACE(std::string(to_string(c.kind)) + " E " + std::to_string(c.experts) + " k " + std::to_string(c.k) +
                   " rank " + std::to_string(rank));
      const std::int64_t T = 300;
      const TopK got = synthetic_topk(T, c.k, c.experts, spec, 42, rank);
      const std::vector<std::int64_t> want = reference_ids(T, c.k, c.experts, spec, 42, rank);
      const std::vector<std::int64_t> ids(got.indices.data<std::int64_t>(), got.indices.data<std::int64_t>() + T * c.k);
      EXPECT_EQ(ids, want);
      for (std::int64_t t = 0; t < T; ++t) {  // the weights: 0.5 + u, normalised per token
        double sum = 0;
        for (int j = 0; j < c.k; ++j) sum += got.weights.data<float>()[t * c.k + j];
        EXPECT_NEAR(sum, 1.0, 1e-5);
      }
    }
  }
}

// A routing drawn in pieces (first_token) is the same routing, ids and weights, bit for bit.
TEST(SyntheticRouting, PiecesFromFirstTokenMatchTheWhole) {
  for (const RoutingKind kind : {RoutingKind::uniform, RoutingKind::zipf, RoutingKind::hot}) {
    RoutingSpec spec;
    spec.kind = kind;
    spec.hot_expert = 3;
    SCOPED_TRACE(std::string(to_string(kind)));
    const int k = 6, E = 40;
    const std::int64_t T = 257;
    const TopK whole = synthetic_topk(T, k, E, spec, 9, 2);
    for (const std::int64_t cut : {std::int64_t{0}, std::int64_t{1}, std::int64_t{100}, T}) {
      const TopK head = synthetic_topk(cut, k, E, spec, 9, 2, 0);
      const TopK tail = synthetic_topk(T - cut, k, E, spec, 9, 2, cut);
      for (std::int64_t i = 0; i < T * k; ++i) {
        const bool in_head = i < cut * k;
        const TopK& part = in_head ? head : tail;
        const std::int64_t j = in_head ? i : i - cut * k;
        ASSERT_EQ(part.indices.data<std::int64_t>()[j], whole.indices.data<std::int64_t>()[i]) << "slot " << i;
        ASSERT_EQ(part.weights.data<float>()[j], whole.weights.data<float>()[i]) << "slot " << i;
      }
    }
  }
  EXPECT_THROW(synthetic_topk(4, 2, 8, RoutingSpec{}, 1, 0, -1), ArgumentError);
}

}  // namespace
