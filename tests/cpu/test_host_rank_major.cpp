// The host backend's rank-major layout (DispatchLayout::rank_major, core/rank_major.h) against an
// independent reference written with plain loops, and against the host's own expert-major layout:
// reading recv_x through expert_rows gives the expert-major rows, and the rank-major combine of
// the per-rank partial sums gives the expert-major combine bit for bit.
#include <gtest/gtest.h>

#include "cpu/dispatch_inputs.h"
#include "cpu/host_dispatch_reference.h"
#include "flexep/core/error.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

DispatchOptions rank_major(std::int64_t pad = 1) {
  DispatchOptions o;
  o.layout = DispatchLayout::rank_major;
  o.pad_multiple = pad;
  return o;
}

struct RankMajorReference {
  std::vector<Tensor> recv_x, idx, weights;        // per receiver
  std::vector<std::vector<std::int64_t>> tpe;      // per receiver
  std::vector<std::vector<std::int32_t>> lists;    // per receiver: expert_rows
  std::vector<std::int64_t> dropped;               // per receiver
  std::vector<std::vector<std::int64_t>> row_of;   // per source [T * R]: row on rank d or -1
};

// docs/semantics.md, "Rank-major dispatch", with loops: receiver d walks the sources in rank order
// and their tokens in order, keeping each token that names one of d's experts.
RankMajorReference reference(const std::vector<RankInput>& in, int E, const DispatchOptions& opt) {
  const int R = static_cast<int>(in.size()), L = E / R;
  const std::int64_t H = in[0].hidden.size(1), k = in[0].indices.size(1);
  const bool budget = opt.mode == DispatchMode::budget;
  RankMajorReference ref;
  for (int s = 0; s < R; ++s) ref.row_of.emplace_back(static_cast<std::size_t>(in[s].hidden.size(0) * R), -1);
  for (int d = 0; d < R; ++d) {
    std::vector<std::pair<int, std::int64_t>> rows;  // (source, token)
    std::int64_t pairs = 0;
    for (int s = 0; s < R; ++s)
      for (std::int64_t t = 0; t < in[s].hidden.size(0); ++t) {
        int here = 0;
        for (std::int64_t j = 0; j < k; ++j) {
          const std::int64_t e = index_value(in[s].indices, t * k + j);
          here += e >= 0 && e / L == d;
        }
        if (here == 0) continue;
        pairs += here;
        rows.emplace_back(s, t);
      }
    const std::int64_t N = budget ? opt.budget_rows : static_cast<std::int64_t>(rows.size());
    Tensor x = Tensor::zeros({N, H}, in[0].hidden.dtype());
    Tensor idx = Tensor::empty({N, k}, DType::i32);
    for (std::int64_t i = 0; i < N * k; ++i) idx.data<std::int32_t>()[i] = -1;
    Tensor w = Tensor::zeros({N, k}, in[0].weights.dtype());
    std::vector<std::vector<std::int32_t>> per_expert(static_cast<std::size_t>(L));
    std::int64_t kept_pairs = 0;
    for (std::int64_t i = 0; i < static_cast<std::int64_t>(rows.size()) && i < N; ++i) {
      const auto [s, t] = rows[static_cast<std::size_t>(i)];
      ref.row_of[s][static_cast<std::size_t>(t * R + d)] = i;
      for (std::int64_t h = 0; h < H; ++h) write_from_double(x, i * H + h, read_as_double(in[s].hidden, t * H + h));
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = index_value(in[s].indices, t * k + j);
        if (e < 0 || e / L != d) continue;
        idx.data<std::int32_t>()[i * k + j] = static_cast<std::int32_t>(e - d * L);
        write_from_double(w, i * k + j, read_as_double(in[s].weights, t * k + j));
        per_expert[static_cast<std::size_t>(e - d * L)].push_back(static_cast<std::int32_t>(i));
        ++kept_pairs;
      }
    }
    std::vector<std::int64_t> tpe;
    std::vector<std::int32_t> list;
    for (auto& rows_e : per_expert) {
      while (rows_e.size() % static_cast<std::size_t>(opt.pad_multiple) != 0) rows_e.push_back(-1);
      tpe.push_back(static_cast<std::int64_t>(rows_e.size()));
      list.insert(list.end(), rows_e.begin(), rows_e.end());
    }
    if (budget) list.resize(static_cast<std::size_t>(N * std::min<std::int64_t>(k, L) + L * (opt.pad_multiple - 1)), -1);
    ref.recv_x.push_back(x);
    ref.idx.push_back(idx);
    ref.weights.push_back(w);
    ref.tpe.push_back(tpe);
    ref.lists.push_back(list);
    ref.dropped.push_back(pairs - kept_pairs);
  }
  return ref;
}

std::vector<DispatchResult> dispatch_all(Group& g, const std::vector<RankInput>& in, const DispatchOptions& opt) {
  std::vector<DispatchResult> out(in.size());
  EXPECT_TRUE(all_ok(g.run([&](int r, TokenDispatcher& d) { out[r] = d.dispatch(in[r].topk(), opt); })));
  return out;
}

std::vector<std::int64_t> as_vector(const Tensor& t) {
  return std::vector<std::int64_t>(t.data<std::int64_t>(), t.data<std::int64_t>() + t.numel());
}

void expect_matches(const std::vector<DispatchResult>& res, const RankMajorReference& ref) {
  for (std::size_t r = 0; r < res.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    EXPECT_TRUE(same_bits(res[r].tokens, ref.recv_x[r])) << res[r].tokens.shape().str() << " vs "
                                                         << ref.recv_x[r].shape().str();
    EXPECT_TRUE(same_bits(res[r].topk_indices, ref.idx[r]));
    EXPECT_TRUE(same_bits(res[r].topk_weights, ref.weights[r]));
    EXPECT_EQ(as_vector(res[r].tokens_per_expert), ref.tpe[r]);
    const Tensor& lists = res[r].expert_rows;
    ASSERT_EQ(lists.dtype(), DType::i32);
    EXPECT_EQ(std::vector<std::int32_t>(lists.data<std::int32_t>(), lists.data<std::int32_t>() + lists.numel()),
              ref.lists[r]);
    EXPECT_EQ(res[r].dropped, ref.dropped[r]);
    EXPECT_FALSE(res[r].token_probs.defined());
  }
}

}  // namespace

TEST(HostRankMajor, MatchesTheReference) {
  for (int R : {1, 2, 3, 4, 8})
    for (std::int64_t pad : {1, 4})
      for (DType dt : {DType::f32, DType::bf16}) {
        SCOPED_TRACE("R " + std::to_string(R) + ", pad " + std::to_string(pad) + ", " + std::string(dtype_name(dt)));
        Spec spec;
        spec.ranks = R;
        spec.experts = 2 * R;
        spec.topk = std::min(3, spec.experts);
        spec.hidden_dtype = dt;
        spec.seed = static_cast<std::uint32_t>(R * 10 + pad);
        const auto in = make_inputs(spec);
        Group g(R, spec.experts);
        expect_matches(dispatch_all(g, in, rank_major(pad)), reference(in, spec.experts, rank_major(pad)));
      }
}

TEST(HostRankMajor, AllTokensToOneExpertAndRanksWithoutTokens) {
  Spec spec;
  spec.ranks = 4;
  spec.experts = 8;
  spec.topk = 2;
  spec.only_expert = 5;
  spec.tokens = {6, 0, 9, 0};
  const auto in = make_inputs(spec);
  Group g(4, 8);
  const auto res = dispatch_all(g, in, rank_major(2));
  expect_matches(res, reference(in, 8, rank_major(2)));
  EXPECT_EQ(res[2].tokens.size(0), 15);  // every token, on the owner of expert 5
  EXPECT_EQ(res[0].tokens.size(0), 0);
}

TEST(HostRankMajor, ExpertRowsReadTheExpertMajorRows) {
  Spec spec;
  spec.ranks = 3;
  spec.experts = 6;
  spec.topk = 3;
  const auto in = make_inputs(spec);
  Group g(3, 6);
  DispatchOptions em;
  em.pad_multiple = 4;
  const auto expert_major = dispatch_all(g, in, em);
  const auto ranked = dispatch_all(g, in, rank_major(4));
  for (int r = 0; r < 3; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const DispatchResult &a = expert_major[r], &b = ranked[r];
    EXPECT_EQ(as_vector(a.tokens_per_expert), as_vector(b.tokens_per_expert));
    ASSERT_EQ(b.expert_rows.numel(), a.tokens.size(0));
    const std::int64_t H = a.tokens.size(1), k = b.topk_indices.size(1);
    std::int64_t i = 0;
    for (int le = 0; le < 2; ++le)
      for (std::int64_t n = 0; n < a.tokens_per_expert.data<std::int64_t>()[le]; ++n, ++i) {
        const std::int32_t row = b.expert_rows.data<std::int32_t>()[i];
        double prob = 0;  // the weight of the slot that names expert le in that row
        if (row >= 0)
          for (std::int64_t j = 0; j < k; ++j)
            if (b.topk_indices.data<std::int32_t>()[row * k + j] == le) prob = read_as_double(b.topk_weights, row * k + j);
        EXPECT_EQ(read_as_double(a.token_probs, i), prob) << "entry " << i;
        for (std::int64_t h = 0; h < H; ++h)
          ASSERT_EQ(read_as_double(a.tokens, i * H + h), row >= 0 ? read_as_double(b.tokens, row * H + h) : 0.0)
              << "entry " << i;
      }
  }
}

TEST(HostRankMajor, CombineOfThePerRankSumsIsTheExpertMajorCombine) {
  for (DType dt : {DType::f32, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dt)));
    Spec spec;
    spec.ranks = 4;
    spec.experts = 8;
    spec.topk = 4;
    spec.hidden_dtype = dt;
    const auto in = make_inputs(spec);
    Group g(4, 8);
    std::vector<Tensor> y(4), expected(4), partials(4), got(4);
    EXPECT_TRUE(all_ok(g.run([&](int r, TokenDispatcher& d) {
      DispatchOptions em;
      em.pad_multiple = 2;
      const DispatchResult a = d.dispatch(in[r].topk(), em);
      y[r] = wide_range_rows(a.tokens.size(0), a.tokens.size(1), 7, "expert_out", r).to(dt);
      expected[r] = d.combine(a.handle, y[r]);
      const DispatchResult b = d.dispatch(in[r].topk(), rank_major(2));
      // The experts' side of the rank-major contract: each received row's outputs summed over this
      // rank's experts in ascending order, in fp32, rounded once to the rows' dtype.
      const std::int64_t N = b.tokens.size(0), H = b.tokens.size(1);
      std::vector<float> acc(static_cast<std::size_t>(N * H), 0.0f);
      for (std::int64_t i = 0; i < b.expert_rows.numel(); ++i) {
        const std::int32_t row = b.expert_rows.data<std::int32_t>()[i];
        if (row < 0) continue;
        for (std::int64_t h = 0; h < H; ++h)
          acc[static_cast<std::size_t>(row * H + h)] += static_cast<float>(read_as_double(y[r], i * H + h));
      }
      partials[r] = Tensor::empty({N, H}, dt);
      for (std::int64_t i = 0; i < N * H; ++i) write_from_double(partials[r], i, acc[static_cast<std::size_t>(i)]);
      got[r] = d.combine(b.handle, partials[r]);
    })));
    for (int r = 0; r < 4; ++r) EXPECT_TRUE(same_bits(got[r], expected[r])) << "rank " << r;
  }
}

TEST(HostRankMajor, BackwardsFollowTheHandle) {
  Spec spec;
  spec.ranks = 3;
  spec.experts = 6;
  spec.topk = 2;
  spec.dyadic = true;  // sums of a few values are exact: compare with plain loops
  const auto in = make_inputs(spec);
  const auto ref = reference(in, 6, rank_major());
  Group g(3, 6);
  std::vector<Tensor> grad_rows(3), grad_w(3), gx(3), gw(3), cb(3), grad_out(3);
  EXPECT_TRUE(all_ok(g.run([&](int r, TokenDispatcher& d) {
    const DispatchResult b = d.dispatch(in[r].topk(), rank_major());
    grad_rows[r] = random_tensor(b.tokens.shape(), DType::f32, 3, "grad_rows", r);
    grad_w[r] = random_tensor(b.topk_weights.shape(), DType::f32, 3, "grad_w", r);
    const DispatchGrads dg = d.dispatch_backward(b.handle, grad_rows[r], grad_w[r]);
    gx[r] = dg.hidden;
    gw[r] = dg.weights;
    grad_out[r] = random_tensor(in[r].hidden.shape(), DType::f32, 3, "grad_out", r);
    cb[r] = d.combine_backward(b.handle, grad_out[r]);
  })));
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE("rank " + std::to_string(s));
    const std::int64_t T = in[s].hidden.size(0), H = 8, k = 2;
    for (std::int64_t t = 0; t < T; ++t) {
      for (std::int64_t h = 0; h < H; ++h) {
        float sum = 0;  // ascending rank
        for (int d = 0; d < 3; ++d)
          if (const std::int64_t row = ref.row_of[s][t * 3 + d]; row >= 0) sum += grad_rows[d].data<float>()[row * H + h];
        EXPECT_EQ(gx[s].data<float>()[t * H + h], sum);
      }
      for (std::int64_t j = 0; j < k; ++j) {
        const std::int64_t e = in[s].indices.data<std::int64_t>()[t * k + j];
        const float want = e < 0 ? 0.0f : grad_w[e / 2].data<float>()[ref.row_of[s][t * 3 + e / 2] * k + j];
        EXPECT_EQ(gw[s].data<float>()[t * k + j], want) << "token " << t << " slot " << j;
      }
    }
  }
  for (int d = 0; d < 3; ++d) {  // combine_backward: every received row gets its source token's grad_out
    for (int s = 0; s < 3; ++s) {
      for (std::int64_t t = 0; t < in[s].hidden.size(0); ++t) {
        const std::int64_t row = ref.row_of[s][t * 3 + d];
        if (row < 0) continue;
        for (std::int64_t h = 0; h < 8; ++h)
          EXPECT_EQ(cb[d].data<float>()[row * 8 + h], grad_out[s].data<float>()[t * 8 + h]);
      }
    }
  }
}

TEST(HostRankMajor, BudgetRaisesOnEveryRankOrDropsThePrefix) {
  Spec spec;
  spec.ranks = 2;
  spec.experts = 4;
  spec.topk = 2;
  spec.tokens = {9, 7};
  spec.p_none = 0.0;
  const auto in = make_inputs(spec);
  Group g(2, 4);
  DispatchOptions opt = rank_major(2);
  opt.mode = DispatchMode::budget;
  opt.budget_rows = 6;
  const auto errors = g.run([&](int r, TokenDispatcher& d) { d.dispatch(in[r].topk(), opt); });
  EXPECT_TRUE(all_threw<Error>(errors, [](const Error& e) {
    return std::string(e.what()).find("rank-major rows but budget_rows is 6") != std::string::npos;
  }));
  opt.overflow = OverflowPolicy::drop;
  const auto res = dispatch_all(g, in, opt);
  const auto ref = reference(in, 4, opt);
  expect_matches(res, ref);
  EXPECT_GT(res[0].dropped + res[1].dropped, 0);
  EXPECT_EQ(res[0].expert_rows.numel(), 6 * 2 + 2 * 1);
  opt.budget_rows = 20;  // room for all: the blocking rows, then zero rows
  const auto roomy = dispatch_all(g, in, opt);
  expect_matches(roomy, reference(in, 4, opt));
}

TEST(HostRankMajor, ErrorsNameTheArgument) {
  Spec spec;
  spec.ranks = 2;
  spec.experts = 4;
  const auto in = make_inputs(spec);
  Group g(2, 4);
  auto names = [](const char* arg) {
    return [arg](const ArgumentError& e) { return e.argument() == arg; };
  };
  EXPECT_TRUE(all_threw<ArgumentError>(g.run([&](int r, TokenDispatcher& d) { d.dispatch(in[r].multihot(), rank_major()); }),
                                       names("routing_map")));
  EXPECT_TRUE(all_threw<ArgumentError>(g.run([&](int r, TokenDispatcher& d) {
    d.dispatch(in[r].topk(), r == 0 ? DispatchOptions() : rank_major());
  }), names("options.layout")));
  EXPECT_TRUE(all_threw<ArgumentError>(g.run([&](int r, TokenDispatcher& d) {
    const DispatchResult b = d.dispatch(in[r].topk(), rank_major());
    const Tensor probs = Tensor::zeros({b.tokens.size(0)}, DType::f32);  // the expert-major shape
    d.dispatch_backward(b.handle, Tensor::zeros(b.tokens.shape(), DType::f32), probs);
  }), names("grad_token_probs")));
}
