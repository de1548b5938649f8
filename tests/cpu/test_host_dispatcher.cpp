// Forward semantics of the host dispatcher against the independent reference of
// host_dispatch_reference.h: layout, padding, budget, drop, multihot, combine.
#include <gtest/gtest.h>

#include "cpu/host_dispatch_reference.h"
#include "flexep/core/plan.h"
#include "flexep/core/routing.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

const int kRanks[] = {1, 2, 3, 4, 8};

struct Outcome {
  std::vector<DispatchResult> results;
  std::vector<Tensor> combined;
};

// Dispatches every rank's input, then combines `expert_out(rank, result)`.
Outcome dispatch_and_combine(const Spec& spec, const std::vector<RankInput>& in, const DispatchOptions& opt,
                             const std::function<Tensor(int, const DispatchResult&)>& expert_out,
                             bool multihot = false) {
  Group g(spec.ranks, spec.experts);
  Outcome o;
  o.results.resize(static_cast<std::size_t>(spec.ranks));
  o.combined.resize(static_cast<std::size_t>(spec.ranks));
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    const RankInput& x = in[static_cast<std::size_t>(r)];
    DispatchResult res = d.dispatch(multihot ? x.multihot() : x.topk(), opt);
    Tensor y = expert_out(r, res);
    o.combined[static_cast<std::size_t>(r)] = d.combine(res.handle, y);
    o.results[static_cast<std::size_t>(r)] = std::move(res);
  });
  EXPECT_TRUE(all_ok(errors));
  return o;
}

// Random values shaped and typed like `like`, reproducible from (seed, rank).
Tensor random_like(const Tensor& like, int r, std::uint32_t seed) {
  std::mt19937 rng(seed + 31u * static_cast<unsigned>(r));
  std::normal_distribution<double> normal;
  Tensor y = Tensor::empty(like.shape(), DType::f64);
  for (std::int64_t i = 0; i < y.numel(); ++i) y.data<double>()[i] = normal(rng);
  return y.to(like.dtype());
}
Tensor distinct_rows(int r, const DispatchResult& res, std::uint32_t seed) { return random_like(res.tokens, r, seed); }

void expect_matches_reference(const Outcome& o, const Reference& ref) {
  for (std::size_t r = 0; r < o.results.size(); ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const DispatchResult& res = o.results[r];
    EXPECT_TRUE(same_bits(res.tokens, ref.tokens[r]))
        << "tokens " << res.tokens.shape().str() << " vs " << ref.tokens[r].shape().str();
    EXPECT_TRUE(same_bits(res.token_probs, ref.probs[r]));
    ASSERT_EQ(res.tokens_per_expert.dtype(), DType::i64);
    ASSERT_TRUE(res.tokens_per_expert.device().is_cpu());
    const std::int64_t* tpe = res.tokens_per_expert.data<std::int64_t>();
    EXPECT_EQ(std::vector<std::int64_t>(tpe, tpe + res.tokens_per_expert.numel()), ref.tpe[r]);
    EXPECT_EQ(res.dropped, ref.dropped[r]);
    EXPECT_EQ(res.handle->rows, res.tokens.size(0));
  }
}

}  // namespace

TEST(HostDispatcher, DispatchMatchesReferenceRaggedPaddedMixedDtypes) {
  for (int R : kRanks)
    for (std::int64_t pad : {1, 16, 128}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " pad=" + std::to_string(pad));
      Spec s;
      s.ranks = R;
      s.experts = 3 * R;
      s.topk = std::min(3, s.experts);
      s.hidden = 5;
      s.hidden_dtype = pad == 16 ? DType::bf16 : DType::f32;
      s.index_dtype = pad == 1 ? DType::i32 : DType::i64;
      s.seed = static_cast<std::uint32_t>(R * 1000 + pad);
      auto in = make_inputs(s);
      DispatchOptions opt;
      opt.pad_multiple = pad;
      auto o =
          dispatch_and_combine(s, in, opt, [&](int r, const DispatchResult& res) { return distinct_rows(r, res, 5); });
      const Reference ref = reference_dispatch(in, s.experts, opt);
      expect_matches_reference(o, ref);
      // The reference's padding rows are zero with prob 0, so the bitwise match above covers them;
      // here only that every group really was padded.
      for (const auto& res : o.results) EXPECT_EQ(res.tokens.size(0) % pad, 0);
    }
}

TEST(HostDispatcher, CombineOfDistinctRowsMatchesReferenceSum) {
  for (int R : kRanks)
    for (DType dt : {DType::f32, DType::f64, DType::bf16}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " dtype=" + std::string(dtype_name(dt)));
      Spec s;
      s.ranks = R;
      s.experts = 2 * R;
      s.topk = std::min(4, s.experts);
      s.hidden = 6;
      s.hidden_dtype = dt;
      s.weight_dtype = dt == DType::f64 ? DType::f64 : DType::f32;
      s.seed = 17u + static_cast<std::uint32_t>(R);
      auto in = make_inputs(s);
      DispatchOptions opt;
      opt.pad_multiple = 2;
      auto o =
          dispatch_and_combine(s, in, opt, [&](int r, const DispatchResult& res) { return distinct_rows(r, res, 9); });
      const Reference ref = reference_dispatch(in, s.experts, opt);
      std::vector<Tensor> rows;
      for (int r = 0; r < R; ++r) rows.push_back(distinct_rows(r, o.results[static_cast<std::size_t>(r)], 9));
      for (int r = 0; r < R; ++r)
        EXPECT_TRUE(same_bits(o.combined[static_cast<std::size_t>(r)], reference_combine(in, ref, rows, r)))
            << "rank " << r;
    }
}

TEST(HostDispatcher, CombineOfIdentityExpertsIsCountTimesX) {
  for (int R : kRanks) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Spec s;
    s.ranks = R;
    s.experts = 2 * R;
    s.topk = std::min(3, s.experts);
    s.dyadic = true;  // count * x is then exact in f32, whatever the order
    s.p_none = 0.3;
    auto in = make_inputs(s);
    DispatchOptions opt;
    opt.pad_multiple = 4;
    auto o = dispatch_and_combine(s, in, opt, [](int, const DispatchResult& res) { return res.tokens.clone(); });
    for (int r = 0; r < R; ++r) {
      const RankInput& x = in[static_cast<std::size_t>(r)];
      const Tensor& out = o.combined[static_cast<std::size_t>(r)];
      ASSERT_EQ(out.shape(), x.hidden.shape());
      for (std::int64_t t = 0; t < x.hidden.size(0); ++t) {
        int count = 0;
        for (int j = 0; j < s.topk; ++j) count += index_value(x.indices, t * s.topk + j) >= 0;
        for (std::int64_t h = 0; h < s.hidden; ++h)
          EXPECT_EQ(out.data<float>()[t * s.hidden + h], count * x.hidden.data<float>()[t * s.hidden + h])
              << "rank " << r << " token " << t;
      }
    }
  }
}

TEST(HostDispatcher, AllTokensToOneExpert) {
  for (int R : kRanks) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Spec s;
    s.ranks = R;
    s.experts = 2 * R;
    s.topk = 2;
    s.only_expert = s.experts - 1;  // last rank's last expert; second slot -1
    auto in = make_inputs(s);
    DispatchOptions opt;
    auto o = dispatch_and_combine(s, in, opt, [](int, const DispatchResult& res) { return res.tokens.clone(); });
    const Reference ref = reference_dispatch(in, s.experts, opt);
    expect_matches_reference(o, ref);
    std::int64_t total = 0;
    for (const auto& x : in) total += x.hidden.size(0);
    for (int r = 0; r < R; ++r) {
      const DispatchResult& res = o.results[static_cast<std::size_t>(r)];
      EXPECT_EQ(res.tokens.size(0), r == R - 1 ? total : 0);
      EXPECT_EQ(res.tokens_per_expert.data<std::int64_t>()[1], r == R - 1 ? total : 0);
      EXPECT_TRUE(same_bits(o.combined[static_cast<std::size_t>(r)], in[static_cast<std::size_t>(r)].hidden));
    }
  }
}

TEST(HostDispatcher, AllSlotsMinusOneGiveEmptyOutputAndZeroCombine) {
  Spec s;
  s.ranks = 3;
  s.experts = 6;
  s.p_none = 1.0;
  auto in = make_inputs(s);
  auto o =
      dispatch_and_combine(s, in, DispatchOptions{}, [](int, const DispatchResult& res) { return res.tokens.clone(); });
  for (int r = 0; r < s.ranks; ++r) {
    EXPECT_EQ(o.results[static_cast<std::size_t>(r)].tokens.size(0), 0);
    const Tensor& c = o.combined[static_cast<std::size_t>(r)];
    for (std::int64_t i = 0; i < c.numel(); ++i) EXPECT_EQ(c.data<float>()[i], 0.0f);
  }
}

TEST(HostDispatcher, BudgetModeHasExactSizeAndZeroTail) {
  for (int R : kRanks) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Spec s;
    s.ranks = R;
    s.experts = 2 * R;
    s.topk = std::min(2, s.experts);
    s.seed = 3;
    auto in = make_inputs(s);
    DispatchOptions probe;
    probe.pad_multiple = 8;
    const Reference blocking = reference_dispatch(in, s.experts, probe);
    std::int64_t most = 0;
    for (auto n : blocking.required_rows) most = std::max(most, n);
    DispatchOptions opt = probe;
    opt.mode = DispatchMode::budget;
    opt.budget_rows = most + 16;  // room to spare: no drops, a zero tail on every rank
    auto o = dispatch_and_combine(s, in, opt, [](int, const DispatchResult& res) { return res.tokens.clone(); });
    const Reference ref = reference_dispatch(in, s.experts, opt);
    expect_matches_reference(o, ref);
    for (const auto& res : o.results) {
      EXPECT_EQ(res.tokens.size(0), opt.budget_rows);
      EXPECT_EQ(res.token_probs.size(0), opt.budget_rows);
      EXPECT_EQ(res.dropped, 0);
    }
  }
}

TEST(HostDispatcher, BudgetOverflowRaisesOnEveryRankAndLeavesWorldUsable) {
  for (int R : {2, 3, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Spec s;
    s.ranks = R;
    s.experts = R;
    s.topk = 1;
    s.p_none = 0.0;
    s.tokens.assign(static_cast<std::size_t>(R), 4);
    s.only_expert = 0;  // rank 0 receives 4R rows
    auto in = make_inputs(s);
    Group g(R, s.experts);
    DispatchOptions opt;
    opt.mode = DispatchMode::budget;
    opt.budget_rows = 4 * R - 2;
    auto errors = g.run([&](int r, TokenDispatcher& d) { d.dispatch(in[static_cast<std::size_t>(r)].topk(), opt); });
    const std::string expect = "needs " + std::to_string(4 * R) + " expert-major rows";
    EXPECT_TRUE(all_threw<Error>(errors, [&](const Error& e) {
      const std::string w = e.what();
      return w.find("budget_rows is " + std::to_string(4 * R - 2)) != std::string::npos &&
             w.find("rank 0") != std::string::npos && w.find(expect) != std::string::npos;
    }));
    EXPECT_FALSE(g.world->broken());
    opt.budget_rows = 4 * R;  // exactly enough
    std::vector<std::int64_t> rows(static_cast<std::size_t>(R));
    errors = g.run([&](int r, TokenDispatcher& d) {
      rows[static_cast<std::size_t>(r)] = d.dispatch(in[static_cast<std::size_t>(r)].topk(), opt).tokens.size(0);
    });
    EXPECT_TRUE(all_ok(errors));
    EXPECT_EQ(rows, std::vector<std::int64_t>(static_cast<std::size_t>(R), 4 * R));
  }
}

TEST(HostDispatcher, DropPolicyKeepsDeterministicPrefixAndCombineIgnoresDropped) {
  for (int R : kRanks)
    for (std::int64_t pad : {1, 4}) {
      SCOPED_TRACE("R=" + std::to_string(R) + " pad=" + std::to_string(pad));
      Spec s;
      s.ranks = R;
      s.experts = 2 * R;
      s.topk = std::min(3, s.experts);
      s.seed = 11u + static_cast<std::uint32_t>(R);
      s.dyadic = true;
      auto in = make_inputs(s);
      DispatchOptions opt;
      opt.pad_multiple = pad;
      const Reference blocking = reference_dispatch(in, s.experts, opt);
      std::int64_t most = 0;
      for (auto n : blocking.required_rows) most = std::max(most, n);
      opt.mode = DispatchMode::budget;
      opt.overflow = OverflowPolicy::drop;
      opt.budget_rows = round_up(std::max<std::int64_t>(most / 2, 1), pad);
      auto o =
          dispatch_and_combine(s, in, opt, [&](int r, const DispatchResult& res) { return distinct_rows(r, res, 2); });
      const Reference ref = reference_dispatch(in, s.experts, opt);
      expect_matches_reference(o, ref);
      std::int64_t total_dropped = 0;
      for (auto d : ref.dropped) total_dropped += d;
      if (R > 1) {
        EXPECT_GT(total_dropped, 0) << "the case must actually drop";
      }
      std::vector<Tensor> rows;
      for (int r = 0; r < R; ++r) rows.push_back(distinct_rows(r, o.results[static_cast<std::size_t>(r)], 2));
      for (int r = 0; r < R; ++r)
        EXPECT_TRUE(same_bits(o.combined[static_cast<std::size_t>(r)], reference_combine(in, ref, rows, r)));
    }
}

TEST(HostDispatcher, MultihotFormGivesSameRowsAsTopk) {
  for (int R : kRanks) {
    SCOPED_TRACE("R=" + std::to_string(R));
    Spec s;
    s.ranks = R;
    s.experts = 4 * R;
    s.topk = 3;
    s.seed = 23;
    auto in = make_inputs(s);
    DispatchOptions opt;
    opt.pad_multiple = 2;
    auto rows = [&](int r, const DispatchResult& res) { return distinct_rows(r, res, 4); };
    auto a = dispatch_and_combine(s, in, opt, rows, false);
    auto b = dispatch_and_combine(s, in, opt, rows, true);
    const Reference ref = reference_dispatch(in, s.experts, opt);
    expect_matches_reference(b, ref);
    for (int r = 0; r < R; ++r) {
      EXPECT_TRUE(same_bits(a.combined[static_cast<std::size_t>(r)], b.combined[static_cast<std::size_t>(r)]));
      EXPECT_TRUE(b.results[static_cast<std::size_t>(r)].handle->multihot);
      EXPECT_EQ(b.results[static_cast<std::size_t>(r)].handle->topk, s.experts);
    }
  }
}

TEST(HostDispatcher, BackwardsMoveGradientsAlongTheHandle) {
  // combine_backward is a dispatch of grad_out; dispatch_backward gathers probs back to slots and
  // sums grad rows like combine. Checked here against the reference layout directly, including
  // -1 and dropped slots (zero gradient).
  for (int R : kRanks)
    for (bool multihot : {false, true}) {
      SCOPED_TRACE("R=" + std::to_string(R) + (multihot ? " multihot" : " topk"));
      Spec s;
      s.ranks = R;
      s.experts = 2 * R;
      s.topk = std::min(2, s.experts);
      s.seed = 41;
      auto in = make_inputs(s);
      DispatchOptions opt;
      opt.pad_multiple = 2;
      const Reference blocking = reference_dispatch(in, s.experts, opt);
      std::int64_t most = 0;
      for (auto n : blocking.required_rows) most = std::max(most, n);
      opt.mode = DispatchMode::budget;
      opt.overflow = OverflowPolicy::drop;
      opt.budget_rows = round_up(std::max<std::int64_t>(most * 2 / 3, 2), 2);
      const Reference ref = reference_dispatch(in, s.experts, opt);
      std::vector<Tensor> grad_out(static_cast<std::size_t>(R)), gtok(static_cast<std::size_t>(R)),
          gprob(static_cast<std::size_t>(R)), cb(static_cast<std::size_t>(R));
      std::vector<DispatchGrads> db(static_cast<std::size_t>(R));
      Group g(R, s.experts);
      auto errors = g.run([&](int r, TokenDispatcher& d) {
        const std::size_t i = static_cast<std::size_t>(r);
        const RankInput& x = in[i];
        DispatchResult res = d.dispatch(multihot ? x.multihot() : x.topk(), opt);
        grad_out[i] = random_like(x.hidden, r, 100);
        gtok[i] = random_like(res.tokens, r, 200);
        gprob[i] = random_like(res.token_probs, r, 300);
        cb[i] = d.combine_backward(res.handle, grad_out[i]);
        db[i] = d.dispatch_backward(res.handle, gtok[i], gprob[i]);
      });
      ASSERT_TRUE(all_ok(errors));
      for (int r = 0; r < R; ++r) {
        SCOPED_TRACE("rank " + std::to_string(r));
        const std::size_t i = static_cast<std::size_t>(r);
        EXPECT_TRUE(same_bits(db[i].hidden, reference_combine(in, ref, gtok, r)));
        // combine_backward: rows get grad_out[t] at the reference destination, zero elsewhere.
        Tensor expect_cb = Tensor::zeros(cb[i].shape(), DType::f32);
        for (int src = 0; src < R; ++src) {
          const auto& dest = ref.dest[static_cast<std::size_t>(src)];
          for (std::size_t p = 0; p < dest.size(); ++p)
            if (dest[p].owner == r)
              for (std::int64_t h = 0; h < s.hidden; ++h)
                expect_cb.data<float>()[dest[p].row * s.hidden + h] =
                    grad_out[static_cast<std::size_t>(src)]
                        .data<float>()[static_cast<std::int64_t>(p) / s.topk * s.hidden + h];
        }
        EXPECT_TRUE(same_bits(cb[i], expect_cb));
        // dispatch_backward probs: [T, k] or [T, E] gathered at the destination rows.
        const std::int64_t T = in[i].hidden.size(0), width = multihot ? s.experts : s.topk;
        ASSERT_EQ(db[i].weights.shape(), Shape({T, width}));
        Tensor expect_w = Tensor::zeros({T, width}, DType::f32);
        for (std::int64_t t = 0; t < T; ++t)
          for (int j = 0; j < s.topk; ++j) {
            const Slot d = ref.dest[i][static_cast<std::size_t>(t * s.topk + j)];
            if (d.row < 0) continue;
            const std::int64_t col = multihot ? index_value(in[i].indices, t * s.topk + j) : j;
            expect_w.data<float>()[t * width + col] = gprob[static_cast<std::size_t>(d.owner)].data<float>()[d.row];
          }
        EXPECT_TRUE(same_bits(db[i].weights, expect_w));
      }
    }
}

TEST(HostDispatcher, SingleRankCombineEqualsCoreUnpermute) {
  // R = 1 is the local path: the host backend must agree with core permute/unpermute bit for bit.
  Spec s;
  s.ranks = 1;
  s.experts = 8;
  s.topk = 3;
  s.tokens = {11};
  s.hidden_dtype = DType::bf16;
  auto in = make_inputs(s);
  DispatchOptions opt;
  opt.pad_multiple = 4;
  auto o = dispatch_and_combine(s, in, opt, [](int r, const DispatchResult& res) { return distinct_rows(r, res, 8); });
  PlanParams p;
  p.experts = 8;
  p.pad_multiple = 4;
  auto plan = DispatchPlan::build(expert_counts(in[0].indices, 8), p);
  auto rows = slot_rows(plan, 0, in[0].indices);
  Tensor tok = Tensor::empty({plan.ranks[0].out_rows, s.hidden}, DType::bf16);
  Tensor pr = Tensor::empty({plan.ranks[0].out_rows}, DType::f32);
  permute(in[0].hidden, in[0].weights, rows, tok, pr);
  EXPECT_TRUE(same_bits(o.results[0].tokens, tok));
  EXPECT_TRUE(same_bits(o.results[0].token_probs, pr));
  Tensor out = Tensor::empty({11, s.hidden}, DType::bf16);
  unpermute(distinct_rows(0, o.results[0], 8), in[0].indices, rows, out);
  EXPECT_TRUE(same_bits(o.combined[0], out));
}

// make_sibling: a second dispatcher over the same ranks, whose calls interleave with the first's
// (what the MoE layer's chunks do: dispatch a, dispatch b, combine a, combine b) and give the same
// results as the two sequences run one after the other; each keeps its own handles.
TEST(HostDispatcher, SiblingsInterleaveAndKeepTheirOwnHandles) {
  const int R = 2;
  Spec s;
  s.ranks = R;
  s.experts = 4;
  s.topk = 2;
  s.hidden = 6;
  s.tokens = {5, 3};
  s.seed = 11;
  const auto in_a = make_inputs(s);
  s.seed = 12;
  s.tokens = {2, 7};
  const auto in_b = make_inputs(s);
  std::vector<Tensor> want_a(R), want_b(R), got_a(R), got_b(R);
  Group plain(R, s.experts);
  ASSERT_TRUE(all_ok(plain.run([&](int r, TokenDispatcher& d) {
    const auto i = static_cast<std::size_t>(r);
    const DispatchResult a = d.dispatch(in_a[i].topk(), {});
    want_a[i] = d.combine(a.handle, a.tokens);
    const DispatchResult b = d.dispatch(in_b[i].topk(), {});
    want_b[i] = d.combine(b.handle, b.tokens);
  })));
  Group g(R, s.experts);
  std::vector<std::exception_ptr> crossed(R);
  ASSERT_TRUE(all_ok(g.run([&](int r, TokenDispatcher& d) {
    const auto i = static_cast<std::size_t>(r);
    const std::unique_ptr<TokenDispatcher> sib = d.make_sibling(0);
    EXPECT_EQ(sib->backend(), "host");
    EXPECT_EQ(sib->rank(), r);
    const DispatchResult a = d.dispatch(in_a[i].topk(), {});
    const DispatchResult b = sib->dispatch(in_b[i].topk(), {});
    got_a[i] = d.combine(a.handle, a.tokens);
    got_b[i] = sib->combine(b.handle, b.tokens);
    try {  // every rank passes the other dispatcher's handle: each raises, naming it
      sib->combine(a.handle, a.tokens);
    } catch (...) {
      crossed[i] = std::current_exception();
    }
  })));
  for (int r = 0; r < R; ++r) {
    EXPECT_TRUE(same_bits(got_a[static_cast<std::size_t>(r)], want_a[static_cast<std::size_t>(r)]));
    EXPECT_TRUE(same_bits(got_b[static_cast<std::size_t>(r)], want_b[static_cast<std::size_t>(r)]));
  }
  EXPECT_TRUE(all_threw<ArgumentError>(crossed, [](const ArgumentError& e) { return e.argument() == "handle"; }));
}
