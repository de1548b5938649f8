// The backwards of the host dispatcher are the exact adjoints of its forwards: checked by central
// finite differences in f64 over every input element of every rank.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>

#include "cpu/host_dispatch_reference.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

constexpr double kEps = 1e-2;  // the objectives are linear: the difference quotient is exact up to rounding
constexpr double kTol = 1e-9;

Tensor random_f64(Shape shape, std::uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<double> normal;
  Tensor t = Tensor::empty(shape, DType::f64);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<double>()[i] = normal(rng);
  return t;
}

double dot(const Tensor& a, const Tensor& b) {
  double s = 0.0;
  for (std::int64_t i = 0; i < a.numel(); ++i) s += a.data<double>()[i] * b.data<double>()[i];
  return s;
}

// One perturbed element: which rank, which tensor (0: hidden, 1: weights or probs), which index.
struct Probe {
  int rank;
  int tensor;
  std::int64_t index;
};

// f = sum over ranks of <tokens_r, R1_r> + <token_probs_r, R2_r>; its gradient w.r.t. hidden and
// weights must be dispatch_backward(R1, R2).
void check_dispatch_gradient(const Spec& s, const DispatchOptions& opt, bool multihot) {
  auto in = make_inputs(s);
  const int R = s.ranks;
  std::vector<Probe> probes;
  for (int r = 0; r < R; ++r) {
    const RankInput& x = in[static_cast<std::size_t>(r)];
    for (std::int64_t i = 0; i < x.hidden.numel(); ++i) probes.push_back({r, 0, i});
    const Tensor& w = multihot ? x.probs : x.weights;
    for (std::int64_t i = 0; i < w.numel(); ++i) probes.push_back({r, 1, i});
  }
  // f_parts[(p * 2 + side) * R + r]: rank r's part of the objective for probe p, side -/+.
  std::vector<double> f_parts(probes.size() * 2 * static_cast<std::size_t>(R));
  std::vector<DispatchGrads> analytic(static_cast<std::size_t>(R));
  std::atomic<std::int64_t> dropped{0};
  Group g(R, s.experts);
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    RankInput x = in[static_cast<std::size_t>(r)];
    x.hidden = x.hidden.clone();
    x.weights = x.weights.clone();
    x.probs = x.probs.clone();
    auto input = [&] { return multihot ? x.multihot() : x.topk(); };
    DispatchResult res = d.dispatch(input(), opt);
    dropped += res.dropped;
    const Tensor r1 = random_f64(res.tokens.shape(), 1000u + static_cast<unsigned>(r));
    const Tensor r2 = random_f64(res.token_probs.shape(), 2000u + static_cast<unsigned>(r));
    analytic[static_cast<std::size_t>(r)] = d.dispatch_backward(res.handle, r1, r2);
    for (std::size_t p = 0; p < probes.size(); ++p)
      for (int side = 0; side < 2; ++side) {
        const Probe& pr = probes[p];
        double* target = nullptr;
        if (pr.rank == r)
          target = (pr.tensor == 0 ? x.hidden : (multihot ? x.probs : x.weights)).data<double>() + pr.index;
        const double saved = target ? *target : 0.0;
        if (target) *target = saved + (side ? kEps : -kEps);
        DispatchResult out = d.dispatch(input(), opt);
        if (target) *target = saved;
        f_parts[(p * 2 + static_cast<std::size_t>(side)) * static_cast<std::size_t>(R) + static_cast<std::size_t>(r)] =
            dot(out.tokens, r1) + dot(out.token_probs, r2);
      }
  });
  ASSERT_TRUE(all_ok(errors));
  if (opt.mode == DispatchMode::budget && opt.overflow == OverflowPolicy::drop) {
    EXPECT_GT(dropped.load(), 0) << "the case must actually drop";
  }
  int checked_nonzero = 0;
  for (std::size_t p = 0; p < probes.size(); ++p) {
    double f[2] = {0.0, 0.0};
    for (int side = 0; side < 2; ++side)
      for (int r = 0; r < R; ++r)
        f[side] += f_parts[(p * 2 + static_cast<std::size_t>(side)) * static_cast<std::size_t>(R) +
                           static_cast<std::size_t>(r)];
    const double fd = (f[1] - f[0]) / (2 * kEps);
    const Probe& pr = probes[p];
    const DispatchGrads& a = analytic[static_cast<std::size_t>(pr.rank)];
    const double got = (pr.tensor == 0 ? a.hidden : a.weights).data<double>()[pr.index];
    EXPECT_NEAR(got, fd, kTol * (1.0 + std::abs(fd)))
        << "rank " << pr.rank << (pr.tensor ? " weights[" : " hidden[") << pr.index << "]";
    checked_nonzero += std::abs(fd) > 1e-6;
  }
  EXPECT_GT(checked_nonzero, 0) << "the check must see some non-zero gradient";
}

// f = sum over ranks of <combine_r(y), G_r>; its gradient w.r.t. expert_out y must be
// combine_backward(G).
void check_combine_gradient(const Spec& s, const DispatchOptions& opt) {
  auto in = make_inputs(s);
  const int R = s.ranks;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(R));
  std::vector<Tensor> analytic(static_cast<std::size_t>(R));
  Group g(R, s.experts);
  // Pass 1 learns each rank's row count, so that every rank can list all probes in pass 2.
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    rows[static_cast<std::size_t>(r)] = d.dispatch(in[static_cast<std::size_t>(r)].topk(), opt).tokens.size(0);
  });
  ASSERT_TRUE(all_ok(errors));
  std::vector<Probe> probes;
  for (int r = 0; r < R; ++r)
    for (std::int64_t i = 0; i < rows[static_cast<std::size_t>(r)] * s.hidden; ++i) probes.push_back({r, 0, i});
  std::vector<double> f_parts(probes.size() * 2 * static_cast<std::size_t>(R));
  errors = g.run([&](int r, TokenDispatcher& d) {
    const RankInput& x = in[static_cast<std::size_t>(r)];
    DispatchResult res = d.dispatch(x.topk(), opt);
    Tensor y = random_f64(res.tokens.shape(), 3000u + static_cast<unsigned>(r));
    const Tensor G = random_f64(x.hidden.shape(), 4000u + static_cast<unsigned>(r));
    analytic[static_cast<std::size_t>(r)] = d.combine_backward(res.handle, G);
    for (std::size_t p = 0; p < probes.size(); ++p)
      for (int side = 0; side < 2; ++side) {
        double* target = probes[p].rank == r ? y.data<double>() + probes[p].index : nullptr;
        const double saved = target ? *target : 0.0;
        if (target) *target = saved + (side ? kEps : -kEps);
        Tensor out = d.combine(res.handle, y);
        if (target) *target = saved;
        f_parts[(p * 2 + static_cast<std::size_t>(side)) * static_cast<std::size_t>(R) + static_cast<std::size_t>(r)] =
            dot(out, G);
      }
  });
  ASSERT_TRUE(all_ok(errors));
  for (std::size_t p = 0; p < probes.size(); ++p) {
    double f[2] = {0.0, 0.0};
    for (int side = 0; side < 2; ++side)
      for (int r = 0; r < R; ++r)
        f[side] += f_parts[(p * 2 + static_cast<std::size_t>(side)) * static_cast<std::size_t>(R) +
                           static_cast<std::size_t>(r)];
    const double fd = (f[1] - f[0]) / (2 * kEps);
    const double got = analytic[static_cast<std::size_t>(probes[p].rank)].data<double>()[probes[p].index];
    EXPECT_NEAR(got, fd, kTol * (1.0 + std::abs(fd)))
        << "rank " << probes[p].rank << " expert_out[" << probes[p].index << "]";
  }
}

Spec small_spec(int R, std::uint32_t seed) {
  Spec s;
  s.ranks = R;
  s.experts = 2 * R;
  s.topk = std::min(3, s.experts);
  s.hidden = 3;
  s.hidden_dtype = DType::f64;
  s.weight_dtype = DType::f64;
  s.tokens.clear();
  for (int r = 0; r < R; ++r) s.tokens.push_back(r % 3 == 1 ? 0 : 2 + r % 2);  // ragged, some ranks empty
  s.seed = seed;
  return s;
}

}  // namespace

TEST(HostDispatcher, DispatchBackwardIsAdjointOfDispatch) {
  for (int R : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    DispatchOptions opt;
    opt.pad_multiple = 2;
    check_dispatch_gradient(small_spec(R, 51), opt, false);
  }
}

TEST(HostDispatcher, DispatchBackwardIsAdjointInMultihotFormAndWithDrops) {
  for (int R : {1, 2, 4}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    DispatchOptions opt;
    check_dispatch_gradient(small_spec(R, 52), opt, true);
    opt.mode = DispatchMode::budget;
    opt.overflow = OverflowPolicy::drop;
    opt.budget_rows = 2;  // most ranks drop some pairs: their weights get exactly zero gradient
    check_dispatch_gradient(small_spec(R, 53), opt, false);
    check_dispatch_gradient(small_spec(R, 54), opt, true);
  }
}

TEST(HostDispatcher, CombineBackwardIsAdjointOfCombine) {
  for (int R : {1, 2, 3, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    DispatchOptions opt;
    opt.pad_multiple = 2;  // padding rows must get zero gradient
    check_combine_gradient(small_spec(R, 61), opt);
    opt.mode = DispatchMode::budget;
    opt.overflow = OverflowPolicy::drop;
    opt.budget_rows = 4;
    check_combine_gradient(small_spec(R, 62), opt);
  }
}
