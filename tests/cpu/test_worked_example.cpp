// The worked example of docs/semantics.md ("A worked example"), reproduced literally through the host
// dispatcher: R = 2, E = 4, k = 2, H = 1. Every number asserted here is copied from the doc's tables,
// so a change of the documented semantics (or of the doc) makes this test fail.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/dispatch/host.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

constexpr int kRanks = 2, kExperts = 4, kTopk = 2;

// The input table of the doc: hidden, indices and weights per rank.
struct RankRows {
  std::vector<float> hidden;
  std::vector<std::int64_t> indices;
  std::vector<float> weights;
};
const RankRows kInput[kRanks] = {
    {{10.f, 11.f}, {1, 2, 0, 1}, {0.6f, 0.4f, 0.5f, 0.5f}},
    {{20.f, 21.f}, {3, 1, 2, -1}, {0.7f, 0.3f, 1.0f, 0.f}},
};

// One expected received row: hidden and prob (padding rows are 0 / 0).
struct Row {
  float hidden, prob;
};

struct Expected {
  std::vector<Row> rows;
  std::vector<std::int64_t> tokens_per_expert;
};

struct Received {
  std::vector<float> tokens, probs;
  std::vector<std::int64_t> tpe;
  std::vector<float> combined;  // combine of the received rows (identity experts)
};

// Runs dispatch on both ranks, then combine of the unchanged rows: identity experts that ignore p,
// which is the doc's "identity experts and p = 1".
std::vector<Received> run_example(std::int64_t pad_multiple) {
  auto world = std::make_shared<HostWorld>(kRanks, 10.0);
  std::vector<std::unique_ptr<TokenDispatcher>> d;
  for (int r = 0; r < kRanks; ++r) d.push_back(make_host_dispatcher(world, r, kExperts));
  std::vector<Received> out(kRanks);
  auto errors = run_ranks(kRanks, [&](int r) {
    const RankRows& in = kInput[r];
    Tensor hidden = Tensor::from_vector(in.hidden, {2, 1});
    Tensor indices = Tensor::from_vector(in.indices, {2, kTopk});
    Tensor weights = Tensor::from_vector(in.weights, {2, kTopk});
    DispatchInput di;
    di.hidden = hidden;
    di.indices = indices;
    di.weights = weights;
    DispatchOptions opt;
    opt.pad_multiple = pad_multiple;
    DispatchResult res = d[static_cast<std::size_t>(r)]->dispatch(di, opt);
    Received& o = out[static_cast<std::size_t>(r)];
    o.tokens.assign(res.tokens.data<float>(), res.tokens.data<float>() + res.tokens.numel());
    o.probs.assign(res.token_probs.data<float>(), res.token_probs.data<float>() + res.token_probs.numel());
    o.tpe.assign(res.tokens_per_expert.data<std::int64_t>(),
                 res.tokens_per_expert.data<std::int64_t>() + res.tokens_per_expert.numel());
    Tensor y = d[static_cast<std::size_t>(r)]->combine(res.handle, res.tokens);
    o.combined.assign(y.data<float>(), y.data<float>() + y.numel());
  });
  EXPECT_TRUE(all_ok(errors));
  return out;
}

void expect_rows(const Received& got, const Expected& want) {
  ASSERT_EQ(got.tokens.size(), want.rows.size());
  ASSERT_EQ(got.probs.size(), want.rows.size());
  for (std::size_t i = 0; i < want.rows.size(); ++i) {
    SCOPED_TRACE("row " + std::to_string(i));
    // Exact: rows are copied, never computed; the probs are the fp32 weights of the input table.
    EXPECT_EQ(got.tokens[i], want.rows[i].hidden);
    EXPECT_EQ(got.probs[i], want.rows[i].prob);
  }
  EXPECT_EQ(got.tpe, want.tokens_per_expert);
}

}  // namespace

// Rank 0 owns experts 0 and 1; rank 1 owns 2 and 3. Expert-major, then (source rank, token).
TEST(WorkedExample, ReceivedRowsWithoutPadding) {
  const auto got = run_example(1);
  ASSERT_EQ(got.size(), 2u);
  {
    SCOPED_TRACE("rank 0");
    // e0: (0,1) 11 p0.5 | e1: (0,0) 10 p0.6, (0,1) 11 p0.5, (1,0) 20 p0.3
    expect_rows(got[0], {{{11.f, 0.5f}, {10.f, 0.6f}, {11.f, 0.5f}, {20.f, 0.3f}}, {1, 3}});
  }
  {
    SCOPED_TRACE("rank 1");
    // e2: (0,0) 10 p0.4, (1,1) 21 p1.0 | e3: (1,0) 20 p0.7
    expect_rows(got[1], {{{10.f, 0.4f}, {21.f, 1.0f}, {20.f, 0.7f}}, {2, 1}});
  }
}

TEST(WorkedExample, ReceivedRowsWithPadMultipleTwo) {
  const auto got = run_example(2);
  ASSERT_EQ(got.size(), 2u);
  {
    SCOPED_TRACE("rank 0");
    // The doc: tokens_per_expert [2, 4], rows 1 and 5 are zero padding with prob 0.
    expect_rows(got[0], {{{11.f, 0.5f}, {0.f, 0.f}, {10.f, 0.6f}, {11.f, 0.5f}, {20.f, 0.3f}, {0.f, 0.f}}, {2, 4}});
  }
  {
    SCOPED_TRACE("rank 1");
    // [2, 2]: expert 2 is already even; expert 3's single row gets one padding row (row 3).
    expect_rows(got[1], {{{10.f, 0.4f}, {21.f, 1.0f}, {20.f, 0.7f}, {0.f, 0.f}}, {2, 2}});
  }
}

// The doc's send counts per (source rank, expert), recovered from what the receivers got: rank 0
// sends {e0: 1, e1: 2, e2: 1}, rank 1 sends {e1: 1, e2: 1, e3: 1}. Hidden values identify the source
// rank (10/11 from rank 0, 20/21 from rank 1), so counting them per expert group gives the table.
TEST(WorkedExample, SendCountsMatchTheDoc) {
  const auto got = run_example(1);
  ASSERT_EQ(got.size(), 2u);
  int sent[kRanks][kExperts] = {};
  for (int r = 0; r < kRanks; ++r) {
    const Received& g = got[static_cast<std::size_t>(r)];
    std::size_t row = 0;
    for (std::size_t le = 0; le < g.tpe.size(); ++le)
      for (std::int64_t i = 0; i < g.tpe[le]; ++i, ++row) {
        ASSERT_LT(row, g.tokens.size());
        const int src = g.tokens[row] >= 20.f ? 1 : 0;
        ++sent[src][r * 2 + static_cast<int>(le)];
      }
  }
  const int want[kRanks][kExperts] = {{1, 2, 1, 0}, {0, 1, 1, 1}};
  for (int s = 0; s < kRanks; ++s)
    for (int e = 0; e < kExperts; ++e) EXPECT_EQ(sent[s][e], want[s][e]) << "source rank " << s << " expert " << e;
}

// Identity experts: rank 0 token 0 = 10 + 10 = 20, token 1 = 22; rank 1 token 0 = 40, token 1 = 21
// (its -1 slot adds nothing). Padding rows must not change the sums.
TEST(WorkedExample, IdentityExpertCombine) {
  for (std::int64_t pad : {1, 2}) {
    SCOPED_TRACE("pad_multiple " + std::to_string(pad));
    const auto got = run_example(pad);
    ASSERT_EQ(got.size(), 2u);
    EXPECT_EQ(got[0].combined, (std::vector<float>{20.f, 22.f}));
    EXPECT_EQ(got[1].combined, (std::vector<float>{40.f, 21.f}));
  }
}
