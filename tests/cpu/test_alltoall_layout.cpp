// The host-side logic of the alltoall backend (src/dispatch/alltoall/dispatcher/layout.h), which needs no GPU:
// the count-exchange header, the agreement rules every rank applies to the gathered headers, and
// the per-rank plan. The placement rule of the GPU kernels is emulated here in plain loops and
// checked against core slot_rows: a received entry of local expert e lands at
//   expert_begin[e] + (exclusive scan over expert-major flags) - pairs_before[e]
// when that is below expert_begin[e] + kept_rows[e], with rows travelling in (rank, token) order.
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/dispatch_inputs.h"
#include "flexep/core/error.h"
#include "flexep/core/plan.h"
#include "flexep/core/synthetic_routing.h"
// Internal header of the backend (pure C++, no CUDA); the tests' include path has no src/.
#include "dispatch/alltoall/dispatcher/layout.h"

namespace flexep::alltoall {
namespace {

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

std::string argument_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const ArgumentError& a) {
    return a.argument();
  } catch (...) {
    return "(not an ArgumentError)";
  }
}

RankHeader header(std::int64_t H = 8, std::int64_t k = 2) {
  RankHeader h;
  h.experts = 8;
  h.hidden = H;
  h.topk = k;
  h.tokens = 5;
  return h;
}

TEST(AlltoallLayout, HeaderRoundTripsThroughWords) {
  RankHeader h = header(7168, 8);
  h.failed = true;
  h.argument = "a_very_long_argument_name_that_is_longer_than_32";
  h.device_arg = 1;
  h.device_row = 12;
  h.device_column = 3;
  h.device_value = -7;
  h.device_limit = 64;
  h.multihot = true;
  h.mode = DispatchMode::budget;
  h.pad_multiple = 128;
  h.budget_rows = 4096;
  h.overflow = OverflowPolicy::drop;
  const std::vector<std::int64_t> w = encode(h);
  ASSERT_EQ(static_cast<int>(w.size()), word::count);
  const RankHeader d = decode(w.data());
  EXPECT_TRUE(d.failed);
  EXPECT_EQ(d.argument, h.argument.substr(0, 32));  // truncated to the 4 words
  EXPECT_EQ(d.device_arg, 1);
  EXPECT_EQ(d.device_row, 12);
  EXPECT_EQ(d.device_column, 3);
  EXPECT_EQ(d.device_value, -7);
  EXPECT_EQ(d.device_limit, 64);
  EXPECT_EQ(d.experts, 8);
  EXPECT_TRUE(d.multihot);
  EXPECT_EQ(d.hidden, 7168);
  EXPECT_EQ(d.topk, 8);
  EXPECT_EQ(d.mode, DispatchMode::budget);
  EXPECT_EQ(d.pad_multiple, 128);
  EXPECT_EQ(d.budget_rows, 4096);
  EXPECT_EQ(d.overflow, OverflowPolicy::drop);
  EXPECT_EQ(d.tokens, 5);
  EXPECT_EQ(decode(encode(header()).data()).argument, "");
}

TEST(AlltoallLayout, MismatchNamesFieldRankAndBothValues) {
  std::vector<RankHeader> h = {header(7168), header(7168), header(4096)};
  auto err = compare_headers(h);
  ASSERT_TRUE(err);
  EXPECT_EQ(argument_of(err), "hidden");
  EXPECT_NE(what_of(err).find("rank 2 has H=4096 but rank 0 has H=7168"), std::string::npos) << what_of(err);

  h = {header(8, 2), header(8, 4)};
  EXPECT_EQ(argument_of(compare_headers(h)), "indices");
  EXPECT_NE(what_of(compare_headers(h)).find("rank 1 has k=4 but rank 0 has k=2"), std::string::npos);
  h[0].multihot = h[1].multihot = true;  // k is not compared in the multihot form
  EXPECT_FALSE(compare_headers(h));

  h = {header(), header()};
  h[1].experts = 16;
  EXPECT_EQ(argument_of(compare_headers(h)), "num_experts");
  h = {header(), header()};
  h[1].multihot = true;
  EXPECT_EQ(argument_of(compare_headers(h)), "routing_map");
  h = {header(), header()};
  h[1].pad_multiple = 16;
  EXPECT_EQ(argument_of(compare_headers(h)), "options.pad_multiple");
  h = {header(), header()};
  h[1].budget_rows = 64;  // ignored in blocking mode
  EXPECT_FALSE(compare_headers(h));
  h[0].mode = h[1].mode = DispatchMode::budget;
  EXPECT_EQ(argument_of(compare_headers(h)), "options.budget_rows");
  h[1].budget_rows = 0;
  h[1].overflow = OverflowPolicy::drop;
  EXPECT_EQ(argument_of(compare_headers(h)), "options.overflow");
  h[1].mode = DispatchMode::blocking;
  EXPECT_EQ(argument_of(compare_headers(h)), "options.mode");
  // T may differ.
  h = {header(), header()};
  h[1].tokens = 0;
  EXPECT_FALSE(compare_headers(h));
}

TEST(AlltoallLayout, PeerFailuresAreQuotedOnTheOtherRanks) {
  Exchange ex;
  ex.headers = {header(), header(), header()};
  EXPECT_FALSE(peer_failure(ex, 0));
  ex.headers[1].failed = true;
  ex.headers[1].argument = "weights";
  EXPECT_FALSE(peer_failure(ex, 1));  // the failing rank raises its own error
  auto err = peer_failure(ex, 0);
  EXPECT_EQ(argument_of(err), "weights");
  EXPECT_NE(what_of(err).find("rank 1 failed its checks"), std::string::npos);

  ex.headers[1] = header();
  ex.headers[2].device_arg = 1;
  ex.headers[2].device_row = 4;
  ex.headers[2].device_column = 1;
  ex.headers[2].device_value = 9;
  ex.headers[2].device_limit = 8;
  err = peer_failure(ex, 0);
  EXPECT_EQ(argument_of(err), "indices");
  EXPECT_NE(what_of(err).find("value 9 at [4, 1] is out of range"), std::string::npos) << what_of(err);
  ex.headers[2].device_value = 3;  // in range: a repeated expert
  EXPECT_NE(what_of(peer_failure(ex, 1)).find("token 4 lists expert 3 twice"), std::string::npos);

  ex.headers[2] = header();
  ex.headers[0].failed = true;  // not an argument error
  err = peer_failure(ex, 2);
  EXPECT_EQ(argument_of(err), "(not an ArgumentError)");
  EXPECT_NE(what_of(err).find("rank 0 failed its checks"), std::string::npos);
}

TEST(AlltoallLayout, ParseSplitsPayloads) {
  const int R = 2, E = 4;
  std::vector<std::int64_t> gathered;
  for (int s = 0; s < R; ++s) {
    RankHeader h = header();
    h.tokens = 10 + s;
    const auto w = encode(h);
    gathered.insert(gathered.end(), w.begin(), w.end());
    for (int e = 0; e < E; ++e) gathered.push_back(100 * s + e);
    for (int d = 0; d < R; ++d) gathered.push_back(1000 * s + d);
  }
  ASSERT_EQ(static_cast<std::int64_t>(gathered.size()), R * payload_words(E, R));
  const Exchange ex = parse_exchange(gathered, R, E);
  EXPECT_EQ(ex.headers[1].tokens, 11);
  EXPECT_EQ(ex.counts, (std::vector<std::int64_t>{0, 1, 2, 3, 100, 101, 102, 103}));
  EXPECT_EQ(ex.dest, (std::vector<std::int64_t>{0, 1, 1000, 1001}));
  EXPECT_THROW(parse_exchange(std::vector<std::int64_t>(5), R, E), Error);
}

TEST(AlltoallLayout, MetaWidthIsAtMostTheLocalExperts) {
  EXPECT_EQ(meta_width(8, 32), 8);
  EXPECT_EQ(meta_width(8, 2), 2);
  EXPECT_EQ(meta_width(64, 16), 16);  // multihot: slots = E
  EXPECT_EQ(meta_width(0, 4), 1);
}

// ---- the placement rule, emulated, against core slot_rows ----------------------------------------

struct Emulated {
  DispatchPlan plan;
  Exchange ex;
  std::vector<std::vector<std::int64_t>> rows;  // [source][t * k + j], as slot_rows
};

std::int64_t id_at(const Tensor& idx, std::int64_t i) { return idx.data<std::int64_t>()[i]; }

Emulated emulate(const std::vector<Tensor>& indices, const PlanParams& p) {
  const int R = p.ranks, E = p.experts, L = p.local_experts();
  const std::int64_t k = indices[0].size(1);
  Emulated em;
  em.ex.headers.assign(static_cast<std::size_t>(R), header());
  em.ex.counts.assign(static_cast<std::size_t>(R * E), 0);
  em.ex.dest.assign(static_cast<std::size_t>(R * R), 0);
  // The count kernel: pairs per expert, tokens once per destination.
  for (int s = 0; s < R; ++s)
    for (std::int64_t t = 0; t < indices[s].size(0); ++t) {
      std::vector<bool> seen(static_cast<std::size_t>(R), false);
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = id_at(indices[s], t * k + j);
        if (e < 0) continue;
        ++em.ex.counts[static_cast<std::size_t>(s * E + e)];
        if (!seen[static_cast<std::size_t>(e / L)]) ++em.ex.dest[static_cast<std::size_t>(s * R + e / L)];
        seen[static_cast<std::size_t>(e / L)] = true;
      }
    }
  em.plan = DispatchPlan::build(em.ex.counts, p);
  std::vector<RankPlan> rp;
  for (int r = 0; r < R; ++r) rp.push_back(rank_plan(em.plan, em.ex, r));
  for (int s = 0; s < R; ++s)
    for (int d = 0; d < R; ++d) EXPECT_EQ(rp[s].send_count[d], rp[d].recv_count[s]);
  // Each receiver d: its rows arrive ordered (source, token), each with entries (local expert,
  // source slot) sorted by expert. The rank of an entry among the received entries of its expert
  // is the exclusive scan of expert-major flags.
  em.rows.resize(static_cast<std::size_t>(R));
  for (int s = 0; s < R; ++s) em.rows[s].assign(static_cast<std::size_t>(indices[s].size(0) * k), -1);
  for (int d = 0; d < R; ++d) {
    struct Entry { int source; std::int64_t slot; int expert; };
    std::vector<std::vector<Entry>> received;  // one per received row
    for (int s = 0; s < R; ++s) {
      const std::int64_t before = static_cast<std::int64_t>(received.size());
      for (std::int64_t t = 0; t < indices[s].size(0); ++t) {
        std::vector<Entry> row;
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t e = id_at(indices[s], t * k + j);
          if (e >= 0 && e / L == d) row.push_back({s, t * k + j, static_cast<int>(e % L)});
        }
        std::sort(row.begin(), row.end(), [](const Entry& a, const Entry& b) { return a.expert < b.expert; });
        if (!row.empty()) received.push_back(row);
      }
      EXPECT_EQ(static_cast<std::int64_t>(received.size()) - before, rp[d].recv_count[s]);
      EXPECT_EQ(before, rp[d].recv_offset[s]);
    }
    const std::int64_t N = static_cast<std::int64_t>(received.size());
    EXPECT_EQ(N, rp[d].total_recv);
    std::vector<std::int64_t> flags(static_cast<std::size_t>(L * N), 0), scan(flags.size(), 0);
    for (std::int64_t i = 0; i < N; ++i)
      for (const Entry& en : received[i]) flags[static_cast<std::size_t>(en.expert * N + i)] = 1;
    for (std::size_t i = 1; i < flags.size(); ++i) scan[i] = scan[i - 1] + flags[i - 1];
    for (std::int64_t i = 0; i < N; ++i)
      for (const Entry& en : received[i]) {
        const std::int64_t q = scan[static_cast<std::size_t>(en.expert * N + i)] - rp[d].pairs_before[en.expert];
        if (q < rp[d].kept_rows[en.expert]) em.rows[en.source][en.slot] = rp[d].expert_begin[en.expert] + q;
      }
  }
  return em;
}

struct Case {
  int R, E, k;
  std::vector<std::int64_t> tokens;
  RoutingKind kind;
  std::int64_t pad;
  std::int64_t budget;  // < 0: blocking
  OverflowPolicy overflow = OverflowPolicy::drop;
};

TEST(AlltoallLayout, EmulatedPlacementEqualsCoreSlotRows) {
  const std::vector<Case> cases = {
      {1, 4, 2, {17}, RoutingKind::uniform, 1, -1},
      {2, 4, 1, {37, 0}, RoutingKind::uniform, 1, -1},
      {2, 32, 8, {64, 41}, RoutingKind::zipf, 128, -1},
      {3, 6, 3, {20, 9, 33}, RoutingKind::hot, 4, -1},
      {4, 64, 8, {50, 0, 23, 70}, RoutingKind::zipf, 1, -1},
      {4, 8, 2, {50, 31, 23, 70}, RoutingKind::uniform, 16, -1},
      {2, 8, 4, {60, 45}, RoutingKind::zipf, 4, 48},   // drops
      {3, 6, 2, {40, 40, 40}, RoutingKind::hot, 1, 20},  // the hot expert overflows
      {2, 4, 2, {30, 30}, RoutingKind::uniform, 2, 1000},  // budget, no drops
  };
  for (const Case& c : cases) {
    SCOPED_TRACE("R=" + std::to_string(c.R) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k));
    PlanParams p;
    p.ranks = c.R;
    p.experts = c.E;
    p.pad_multiple = c.pad;
    if (c.budget >= 0) p.budget_rows = c.budget;
    p.overflow = c.overflow;
    RoutingSpec spec;
    spec.kind = c.kind;
    spec.hot_expert = c.E - 1;
    std::vector<Tensor> indices;
    for (int r = 0; r < c.R; ++r) {
      Tensor idx = synthetic_topk(c.tokens[r], c.k, c.E, spec, 7, r).indices;
      testing::drop_some_slots(idx);
      indices.push_back(idx);
    }
    const Emulated em = emulate(indices, p);
    for (int s = 0; s < c.R; ++s) EXPECT_EQ(em.rows[s], slot_rows(em.plan, s, indices[s])) << "source " << s;
    if (c.budget == 48 || c.budget == 20) {
      EXPECT_GT(em.plan.dropped(), 0);
    }
  }
}

TEST(AlltoallLayout, IndexRangeIsCheckedForEveryRank) {
  PlanParams p;
  p.ranks = 2;
  p.experts = 4;
  const DispatchPlan plan = DispatchPlan::build({1, 0, 0, 0, 0, 0, 0, 1}, p);
  Exchange ex;
  ex.dest = {1, 0, 0, 1};
  EXPECT_NO_THROW(check_index_range(plan, ex, 8));
  ex.dest = {1, 0, INT_MAX / 4, 1};  // rank 1 sends too many rows to rank 0 for 8 entries each
  try {
    check_index_range(plan, ex, 8);
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 would send"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flexep::alltoall
