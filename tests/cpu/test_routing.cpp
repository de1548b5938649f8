// Top-k <-> multihot conversions: Automodel's test_token_dispatcher cases (E = 8) for
// _HybridEPManager._indices_to_multihot, plus the backward, the inverse and the error paths.
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "flexep/core/error.h"
#include "flexep/core/routing.h"

using namespace flexep;

namespace {
constexpr int kE = 8;

void expect_arg_error(const std::function<void()>& f, const std::string& arg, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
  }
}

Tensor ids(const std::vector<std::int64_t>& v, std::int64_t T, std::int64_t k) {
  return Tensor::from_vector(v, {T, k});
}
Tensor probs(const std::vector<float>& v, std::int64_t T, std::int64_t k) { return Tensor::from_vector(v, {T, k}); }

std::vector<bool> map_of(const Multihot& m) {
  const bool* p = m.routing_map.data<bool>();
  return std::vector<bool>(p, p + m.routing_map.numel());
}
std::vector<float> probs_of(const Multihot& m) {
  const float* p = m.probs.data<float>();
  return std::vector<float>(p, p + m.probs.numel());
}
int count_true(const Multihot& m) {
  int n = 0;
  for (bool b : map_of(m)) n += b;
  return n;
}
}  // namespace

TEST(Multihot, BasicTopTwo) {
  const Multihot m = topk_to_multihot(ids({0, 3, 5, 7}, 2, 2), probs({0.6f, 0.4f, 0.7f, 0.3f}, 2, 2), kE);
  EXPECT_EQ(m.routing_map.shape(), Shape({2, kE}));
  EXPECT_EQ(m.routing_map.dtype(), DType::b8);
  EXPECT_EQ(m.probs.shape(), Shape({2, kE}));
  EXPECT_EQ(m.probs.dtype(), DType::f32);
  EXPECT_EQ(count_true(m), 4);
  const std::vector<bool> want_map = {1, 0, 0, 1, 0, 0, 0, 0,  //
                                      0, 0, 0, 0, 0, 1, 0, 1};
  EXPECT_EQ(map_of(m), want_map);
  const std::vector<float> want_probs = {0.6f, 0, 0, 0.4f, 0, 0,    0, 0,  //
                                         0,    0, 0, 0,    0, 0.7f, 0, 0.3f};
  EXPECT_EQ(probs_of(m), want_probs);
}

TEST(Multihot, TopOne) {
  const Multihot m = topk_to_multihot(ids({2, 6, 2}, 3, 1), probs({1.0f, 0.5f, 0.25f}, 3, 1), kE);
  EXPECT_EQ(m.routing_map.shape(), Shape({3, kE}));
  EXPECT_EQ(count_true(m), 3);
  const std::vector<float> p = probs_of(m);
  EXPECT_EQ(p[0 * kE + 2], 1.0f);
  EXPECT_EQ(p[1 * kE + 6], 0.5f);
  EXPECT_EQ(p[2 * kE + 2], 0.25f);
  float total = 0;
  for (float x : p) total += x;
  EXPECT_EQ(total, 1.75f);  // nothing written elsewhere
}

TEST(Multihot, AllMinusOneGivesEmptyMapAndZeroProbs) {
  const Multihot m = topk_to_multihot(ids({-1, -1, -1, -1}, 2, 2), probs({0.9f, 0.1f, 0.8f, 0.2f}, 2, 2), kE);
  EXPECT_EQ(m.routing_map.shape(), Shape({2, kE}));
  EXPECT_EQ(count_true(m), 0);
  EXPECT_EQ(probs_of(m), std::vector<float>(2 * kE, 0.0f));
}

TEST(Multihot, PartialMinusOne) {
  const Multihot m = topk_to_multihot(ids({1, -1, -1, 4}, 2, 2), probs({0.6f, 0.4f, 0.7f, 0.3f}, 2, 2), kE);
  EXPECT_EQ(count_true(m), 2);
  const std::vector<bool> mp = map_of(m);
  EXPECT_TRUE(mp[0 * kE + 1]);
  EXPECT_TRUE(mp[1 * kE + 4]);
  const std::vector<float> p = probs_of(m);
  EXPECT_EQ(p[0 * kE + 1], 0.6f);
  EXPECT_EQ(p[1 * kE + 4], 0.3f);  // the -1 slot's weight (0.4 / 0.7) goes nowhere
  float total = 0;
  for (float x : p) total += x;
  EXPECT_FLOAT_EQ(total, 0.9f);
}

TEST(Multihot, SingleToken) {
  const Multihot m = topk_to_multihot(ids({7, 0}, 1, 2), probs({0.75f, 0.25f}, 1, 2), kE);
  EXPECT_EQ(m.routing_map.shape(), Shape({1, kE}));
  EXPECT_EQ(map_of(m), (std::vector<bool>{1, 0, 0, 0, 0, 0, 0, 1}));
  EXPECT_EQ(probs_of(m), (std::vector<float>{0.25f, 0, 0, 0, 0, 0, 0, 0.75f}));
}

TEST(Multihot, Int32IndicesAndF64Weights) {
  const Tensor idx = Tensor::from_vector(std::vector<std::int32_t>{3, 1}, {1, 2});
  const Tensor w = Tensor::from_vector(std::vector<double>{0.125, 0.875}, {1, 2});
  const Multihot m = topk_to_multihot(idx, w, kE);
  EXPECT_EQ(m.probs.dtype(), DType::f64);
  EXPECT_EQ(m.probs.data<double>()[3], 0.125);
  EXPECT_EQ(m.probs.data<double>()[1], 0.875);
}

TEST(Multihot, ZeroTokens) {
  const Multihot m = topk_to_multihot(Tensor::empty({0, 2}, DType::i64), Tensor::empty({0, 2}, DType::f32), kE);
  EXPECT_EQ(m.routing_map.shape(), Shape({0, kE}));
  EXPECT_EQ(m.probs.shape(), Shape({0, kE}));
}

TEST(Multihot, BackwardGathersAtSlotsAndZeroForMinusOne) {
  std::vector<float> g(3 * kE);
  for (int t = 0; t < 3; ++t)
    for (int e = 0; e < kE; ++e) g[static_cast<std::size_t>(t * kE + e)] = static_cast<float>(10 * t + e) + 0.5f;
  const Tensor grad = Tensor::from_vector(g, {3, kE});
  const Tensor out = multihot_backward(grad, ids({5, 2, -1, 7, -1, -1}, 3, 2));
  EXPECT_EQ(out.shape(), Shape({3, 2}));
  EXPECT_EQ(out.dtype(), DType::f32);
  const float* o = out.data<float>();
  EXPECT_EQ(std::vector<float>(o, o + 6), (std::vector<float>{5.5f, 2.5f, 0.0f, 17.5f, 0.0f, 0.0f}));
}

TEST(Multihot, BackwardKeepsF64) {
  const Tensor grad = Tensor::from_vector(std::vector<double>{0, 1, 2, 3, 4, 5, 6, 0.1}, {1, kE});
  const Tensor out = multihot_backward(grad, ids({7, 3}, 1, 2));
  EXPECT_EQ(out.dtype(), DType::f64);
  EXPECT_EQ(out.data<double>()[0], 0.1);
  EXPECT_EQ(out.data<double>()[1], 3.0);
}

TEST(Multihot, ToTopkSortsExpertsAndPadsWithMinusOne) {
  const Multihot m =
      topk_to_multihot(ids({3, 1, -1, 5, -1, -1}, 3, 2), probs({0.3f, 0.7f, 0.4f, 0.6f, 0.5f, 0.5f}, 3, 2), kE);
  const TopK t = multihot_to_topk(m.routing_map, m.probs);
  EXPECT_EQ(t.indices.shape(), Shape({3, 2}));
  EXPECT_EQ(t.indices.dtype(), DType::i64);
  const std::int64_t* i = t.indices.data<std::int64_t>();
  EXPECT_EQ(std::vector<std::int64_t>(i, i + 6), (std::vector<std::int64_t>{1, 3, 5, -1, -1, -1}));
  const float* w = t.weights.data<float>();
  EXPECT_EQ(std::vector<float>(w, w + 6), (std::vector<float>{0.7f, 0.3f, 0.6f, 0.0f, 0.0f, 0.0f}));
}

TEST(Multihot, RoundTripThroughTopk) {
  const Multihot m = topk_to_multihot(ids({6, 0, 4, 2, 1, -1, 7, 3}, 4, 2),
                                      probs({0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f, 0.7f, 0.8f}, 4, 2), kE);
  const TopK t = multihot_to_topk(m.routing_map, m.probs);
  const Multihot back = topk_to_multihot(t.indices, t.weights, kE);
  EXPECT_EQ(map_of(back), map_of(m));
  EXPECT_EQ(probs_of(back), probs_of(m));
}

TEST(Multihot, ToTopkOfEmptyMapHasOneMinusOneColumn) {
  const Tensor map = Tensor::zeros({2, kE}, DType::b8);
  const TopK t = multihot_to_topk(map, Tensor::zeros({2, kE}, DType::f32));
  EXPECT_EQ(t.indices.shape(), Shape({2, 1}));
  EXPECT_EQ(t.indices.data<std::int64_t>()[0], -1);
  EXPECT_EQ(t.indices.data<std::int64_t>()[1], -1);
}

TEST(Routing, ExpertCounts) {
  const std::vector<std::int64_t> c = expert_counts(ids({0, 3, 3, 5, -1, 0, 7, -1}, 4, 2), kE);
  EXPECT_EQ(c, (std::vector<std::int64_t>{2, 0, 0, 2, 0, 1, 0, 1}));
  const Tensor i32 = Tensor::from_vector(std::vector<std::int32_t>{1, 1, 2}, {3, 1});
  EXPECT_EQ(expert_counts(i32, 3), (std::vector<std::int64_t>{0, 2, 1}));
}

TEST(Routing, TopkToMultihotErrors) {
  const Tensor w = probs({0.5f, 0.5f}, 1, 2);
  expect_arg_error([&] { topk_to_multihot(ids({0, 8}, 1, 2), w, kE); }, "indices", "allowed: -1 (no expert) <= id < 8");
  expect_arg_error([&] { topk_to_multihot(ids({-2, 1}, 1, 2), w, kE); }, "indices", "value -2 at [0, 0]");
  expect_arg_error([&] { topk_to_multihot(ids({4, 4}, 1, 2), w, kE); }, "indices", "lists expert 4 twice");
  expect_arg_error([&] { topk_to_multihot(ids({0, 1, 2, 3}, 2, 2), w, kE); }, "weights", "");
  expect_arg_error([&] { topk_to_multihot(ids({0, 1}, 1, 2), probs({0.5f, 0.25f, 0.25f}, 1, 3), kE); }, "weights", "");
  expect_arg_error([&] { topk_to_multihot(ids({0, 1}, 1, 2), w, 0); }, "num_experts", ">= 1");
  // Two -1 in one row are padding, not a duplicate.
  EXPECT_NO_THROW(topk_to_multihot(ids({-1, -1}, 1, 2), w, kE));
}

TEST(Routing, BackwardAndCountErrors) {
  const Tensor grad = Tensor::zeros({1, kE}, DType::f32);
  expect_arg_error([&] { multihot_backward(grad, ids({8, 0}, 1, 2)); }, "indices", "-1 <= id < 8");
  expect_arg_error([&] { multihot_backward(grad, ids({-3, 0}, 1, 2)); }, "indices", "value -3");
  expect_arg_error(
      [&] {
        multihot_backward(Tensor::zeros({2, kE}, DType::f32), ids({0, 1}, 1, 2));
      },
      "grad_probs", "has 2 rows");
  expect_arg_error([&] { expert_counts(ids({0, 8}, 1, 2), kE); }, "indices", "-1 <= id < 8");
  expect_arg_error([&] { expert_counts(ids({0, -5}, 1, 2), kE); }, "indices", "value -5");
  expect_arg_error([&] { expert_counts(ids({0, 1}, 1, 2), 0); }, "num_experts", ">= 1");
  expect_arg_error(
      [&] {
        multihot_to_topk(Tensor::zeros({2, kE}, DType::f32), Tensor::zeros({2, kE}, DType::f32));
      },
      "routing_map", "");
  expect_arg_error(
      [&] {
        multihot_to_topk(Tensor::zeros({2, kE}, DType::b8), Tensor::zeros({2, 4}, DType::f32));
      },
      "probs", "");
}
