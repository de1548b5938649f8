// Errors of the host dispatcher: every rank must fail together with a message that names the
// argument and the rank at fault, and a missing rank must surface as a TimeoutError.
#include <gtest/gtest.h>

#include <chrono>
#include <limits>

#include "cpu/host_dispatch_reference.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

bool has(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// Runs one dispatch per rank with a per-rank input hook and returns what each rank threw.
std::vector<std::exception_ptr> dispatch_all(Group& g, const std::vector<RankInput>& in, const DispatchOptions& opt,
                                             const std::function<DispatchInput(int, const RankInput&)>& input) {
  return g.run([&](int r, TokenDispatcher& d) { d.dispatch(input(r, in[static_cast<std::size_t>(r)]), opt); });
}

// After a consistent failure the group must still work: a plain dispatch + combine succeeds.
void expect_group_still_works(Group& g, const std::vector<RankInput>& in) {
  EXPECT_FALSE(g.world->broken());
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    auto res = d.dispatch(in[static_cast<std::size_t>(r)].topk(), DispatchOptions{});
    d.combine(res.handle, res.tokens);
  });
  EXPECT_TRUE(all_ok(errors));
}

Spec base(int R) {
  Spec s;
  s.ranks = R;
  s.experts = 2 * R;
  s.topk = 2;
  s.hidden = 32;
  return s;
}

}  // namespace

TEST(HostDispatcher, HiddenSizeMismatchFailsOnEveryRank) {
  for (int R : {2, 3, 4, 8}) {
    SCOPED_TRACE("R=" + std::to_string(R));
    auto in = make_inputs(base(R));
    Spec wide = base(R);
    wide.hidden = 64;
    auto in64 = make_inputs(wide);
    Group g(R, 2 * R, 5.0);
    auto errors =
        dispatch_all(g, in, {}, [&](int r, const RankInput& x) { return r == 1 ? in64[1].topk() : x.topk(); });
    EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
      return e.argument() == "hidden" && has(e.what(), "rank 1 has H=64 but rank 0 has H=32") &&
             has(e.what(), "same hidden size");
    }));
    expect_group_still_works(g, in);
  }
}

TEST(HostDispatcher, TopkAndDtypeAndFormMismatchesFailOnEveryRank) {
  const int R = 3;
  auto in = make_inputs(base(R));
  Spec k3 = base(R);
  k3.topk = 3;
  auto in_k3 = make_inputs(k3);
  Group g(R, 2 * R, 5.0);
  auto errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) { return r == 2 ? in_k3[2].topk() : x.topk(); });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "indices" && has(e.what(), "rank 2 has k=3 but rank 0 has k=2");
  }));
  Spec bf = base(R);
  bf.hidden_dtype = DType::bf16;
  auto in_bf = make_inputs(bf);
  errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) { return r == 1 ? in_bf[1].topk() : x.topk(); });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "hidden" && has(e.what(), "dtype bf16") && has(e.what(), "dtype f32");
  }));
  errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) { return r == 1 ? x.multihot() : x.topk(); });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "routing_map" && has(e.what(), "rank 1") && has(e.what(), "multihot");
  }));
  DispatchOptions pad16;
  pad16.pad_multiple = 16;
  errors = g.run([&](int r, TokenDispatcher& d) {
    d.dispatch(in[static_cast<std::size_t>(r)].topk(), r == 2 ? pad16 : DispatchOptions{});
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "options.pad_multiple" && has(e.what(), "pad_multiple=16");
  }));
  expect_group_still_works(g, in);
}

TEST(HostDispatcher, NumExpertsMismatchFailsOnEveryRank) {
  const int R = 2;
  auto world = std::make_shared<HostWorld>(R, 30.0);
  std::vector<std::unique_ptr<TokenDispatcher>> d;
  d.push_back(make_host_dispatcher(world, 0, 4));
  d.push_back(make_host_dispatcher(world, 1, 8));
  Spec s = base(R);
  s.experts = 4;  // ids valid for both
  auto in = make_inputs(s);
  auto errors = run_ranks(
      R, [&](int r) { d[static_cast<std::size_t>(r)]->dispatch(in[static_cast<std::size_t>(r)].topk(), {}); });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "num_experts" && has(e.what(), "rank 1 has E=8 but rank 0 has E=4");
  }));
  EXPECT_THROW(make_host_dispatcher(world, 0, 3), ArgumentError);  // 3 experts over 2 ranks
  EXPECT_THROW(make_host_dispatcher(world, 2, 4), ArgumentError);
}

TEST(HostDispatcher, MissingRankTimesOutNamingPhaseAndRank) {
  const int R = 3;
  auto in = make_inputs(base(R));
  Group g(R, 2 * R, 0.2);
  const auto start = std::chrono::steady_clock::now();
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    if (r == 1) return;  // never calls dispatch
    d.dispatch(in[static_cast<std::size_t>(r)].topk(), {});
  });
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 5.0);
  EXPECT_EQ(errors[1], nullptr);
  for (int r : {0, 2}) {
    try {
      std::rethrow_exception(errors[static_cast<std::size_t>(r)]);
    } catch (const TimeoutError& e) {
      EXPECT_EQ(e.phase(), "dispatch:count-exchange");
      EXPECT_EQ(e.peer(), 1);
    } catch (...) {
      ADD_FAILURE() << "rank " << r << ": " << what_of(errors[static_cast<std::size_t>(r)]);
    }
  }
  // The world is broken: the next call fails at once on every rank, the late one included.
  errors = g.run([&](int r, TokenDispatcher& d) { d.dispatch(in[static_cast<std::size_t>(r)].topk(), {}); });
  EXPECT_TRUE(all_threw<Error>(errors, [](const Error& e) { return has(e.what(), "broken"); }));
}

TEST(HostDispatcher, NonFiniteInputsFailOnEveryRank) {
  const int R = 3;
  auto in = make_inputs(base(R));
  Group g(R, 2 * R, 5.0);
  Tensor bad_hidden = in[2].hidden.clone();
  bad_hidden.data<float>()[1 * 32 + 3] = std::numeric_limits<float>::quiet_NaN();
  ASSERT_GE(in[2].hidden.size(0), 2);
  auto errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) {
    DispatchInput d = x.topk();
    if (r == 2) d.hidden = bad_hidden;
    return d;
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) {
    return e.argument() == "hidden" && has(e.what(), "NaN") && has(e.what(), "row 1, column 3");
  }));
  // The others also learn who failed.
  try {
    std::rethrow_exception(errors[0]);
  } catch (const ArgumentError& e) {
    EXPECT_TRUE(has(e.what(), "rank 2")) << e.what();
  }
  Tensor bad_w = in[0].weights.clone();
  bad_w.data<float>()[1] = std::numeric_limits<float>::infinity();
  errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) {
    DispatchInput d = x.topk();
    if (r == 0) d.weights = bad_w;
    return d;
  });
  EXPECT_TRUE(all_threw<ArgumentError>(
      errors, [](const ArgumentError& e) { return e.argument() == "weights" && has(e.what(), "Inf"); }));
  // check_finite = false lets them through (no hidden copy inspection: the dispatch just runs).
  DispatchOptions unchecked;
  unchecked.check_finite = false;
  errors = dispatch_all(g, in, unchecked, [&](int r, const RankInput& x) {
    DispatchInput d = x.topk();
    if (r == 0) d.weights = bad_w;
    return d;
  });
  EXPECT_TRUE(all_ok(errors));
  expect_group_still_works(g, in);
}

TEST(HostDispatcher, OutOfRangeIndicesFailOnEveryRank) {
  const int R = 2;
  auto in = make_inputs(base(R));
  Group g(R, 2 * R, 5.0);
  for (std::int64_t bad : {std::int64_t{4}, std::int64_t{100}, std::int64_t{-2}}) {
    SCOPED_TRACE("bad id " + std::to_string(bad));
    Tensor idx = in[0].indices.clone();
    idx.data<std::int64_t>()[0] = bad;
    auto errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) {
      DispatchInput d = x.topk();
      if (r == 0) d.indices = idx;
      return d;
    });
    EXPECT_TRUE(all_threw<ArgumentError>(errors, [&](const ArgumentError& e) {
      return e.argument() == "indices" && has(e.what(), std::to_string(bad)) && has(e.what(), "< 4");
    }));
  }
  expect_group_still_works(g, in);
}

TEST(HostDispatcher, InvalidOptionsAndShapesAreNamed) {
  const int R = 2;
  auto in = make_inputs(base(R));
  Group g(R, 2 * R, 5.0);
  DispatchOptions opt;
  opt.mode = DispatchMode::budget;
  opt.pad_multiple = 16;
  opt.budget_rows = 40;  // not a multiple of 16
  auto errors = dispatch_all(g, in, opt, [](int, const RankInput& x) { return x.topk(); });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) { return e.argument() == "budget_rows"; }));
  ASSERT_GT(in[0].weights.size(0), 0);
  errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) {
    DispatchInput d = x.topk();
    if (r == 0) d.weights = in[0].weights.view().rows(0, in[0].weights.size(0) - 1);
    return d;
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) { return e.argument() == "weights"; }));
  errors = dispatch_all(g, in, {}, [&](int r, const RankInput& x) {
    DispatchInput d = x.topk();
    if (r == 0) d.routing_map = x.routing_map;  // both forms at once
    return d;
  });
  EXPECT_TRUE(all_threw<ArgumentError>(errors, [](const ArgumentError& e) { return e.argument() == "indices"; }));
  expect_group_still_works(g, in);
}

TEST(HostDispatcher, HandleAndArgumentChecksNameTheArgument) {
  const int R = 2;
  auto in = make_inputs(base(R));
  Group g(R, 2 * R, 5.0), other(R, 2 * R, 5.0);
  std::vector<DispatchResult> mine(R), foreign(R);
  auto errors = g.run([&](int r, TokenDispatcher& d) {
    mine[static_cast<std::size_t>(r)] = d.dispatch(in[static_cast<std::size_t>(r)].topk(), {});
  });
  ASSERT_TRUE(all_ok(errors));
  errors = other.run([&](int r, TokenDispatcher& d) {
    foreign[static_cast<std::size_t>(r)] = d.dispatch(in[static_cast<std::size_t>(r)].topk(), {});
  });
  ASSERT_TRUE(all_ok(errors));
  auto expect_all = [](const std::vector<std::exception_ptr>& errs, const std::string& arg, const std::string& part) {
    EXPECT_TRUE(all_threw<ArgumentError>(
        errs, [&](const ArgumentError& e) { return e.argument() == arg && has(e.what(), part); }));
  };
  // A handle of another dispatcher, on one rank only: all ranks fail.
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = (r == 1 ? foreign : mine)[static_cast<std::size_t>(r)];
    d.combine(res.handle, res.tokens);
  });
  expect_all(errors, "handle", "another dispatcher");
  errors = g.run([&](int r, TokenDispatcher& d) { d.combine(r == 0 ? Handle() : mine[1].handle, mine[1].tokens); });
  expect_all(errors, "handle", "empty");
  // Wrong expert_out rows on rank 1.
  const std::int64_t n1 = mine[1].tokens.size(0);
  ASSERT_GT(n1, 1);
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.combine(res.handle, r == 1 ? res.tokens.view().rows(0, n1 - 1) : res.tokens.view());
  });
  expect_all(errors, "expert_out",
             "expected shape [*, 32] with " + std::to_string(n1) + " rows from the handle, got [" +
                 std::to_string(n1 - 1) + ", 32]");
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.combine(res.handle, res.tokens.to(DType::f64));
  });
  expect_all(errors, "expert_out", "dtype f32");
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.combine_backward(res.handle, Tensor::zeros({in[static_cast<std::size_t>(r)].hidden.size(0), 31}, DType::f32));
  });
  expect_all(errors, "grad_out", "[*, 32]");
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.dispatch_backward(res.handle, res.tokens, Tensor::zeros({res.tokens.size(0) + 1}, DType::f32));
  });
  expect_all(errors, "grad_token_probs", "rows of the handle");
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.dispatch_backward(res.handle, res.tokens.to(DType::bf16), res.token_probs);
  });
  expect_all(errors, "grad_tokens", "dtype");
  // Handles of two different dispatch calls across ranks.
  std::vector<DispatchResult> second(R);
  errors = g.run([&](int r, TokenDispatcher& d) {
    second[static_cast<std::size_t>(r)] = d.dispatch(in[static_cast<std::size_t>(r)].topk(), {});
  });
  ASSERT_TRUE(all_ok(errors));
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = (r == 0 ? mine : second)[static_cast<std::size_t>(r)];
    d.combine(res.handle, res.tokens);
  });
  expect_all(errors, "handle", "same dispatch");
  // None of this broke the group, and the old handles are still valid.
  EXPECT_FALSE(g.world->broken());
  errors = g.run([&](int r, TokenDispatcher& d) {
    const auto& res = mine[static_cast<std::size_t>(r)];
    d.combine(res.handle, res.tokens);
  });
  EXPECT_TRUE(all_ok(errors));
}
