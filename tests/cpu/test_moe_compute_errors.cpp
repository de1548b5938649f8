// MoECompute's argument checks: every weight of a configuration that has them all, made wrong one
// at a time (missing, wrong shape, wrong dtype, wrong device) in forward and in backward, raises an
// ArgumentError named after the weight's state_dict name that says what was given and what is
// expected; a weight the configuration lacks is refused; so are bad routing overrides and a saved
// state from another object. The weight specs name and shape what the layer takes.
#include <gtest/gtest.h>

#include <functional>
#include <optional>
#include <string>

#include "cpu/moe_compute_util.h"
#include "flexep/core/random.h"
#include "flexep/layer/moe_compute.h"
#include "flexep/layer/moe_layer.h"

using namespace flexep;
using namespace flexep::testing;

namespace {

// Every weight present: router bias, correction bias, expert biases, shared experts with their gate,
// latent projections with biases.
MoEConfig full_config() {
  MoEConfig c;
  c.n_routed_experts = 8;
  c.n_activated_experts = 2;
  c.dim = 8;
  c.moe_inter_dim = 6;
  c.score_func = ScoreFunc::sigmoid;
  c.gate_bias_update_factor = 0.01;
  c.router_bias = true;
  c.expert_bias = true;
  c.n_shared_experts = 1;
  c.shared_expert_inter_dim = 4;
  c.shared_expert_gate = true;
  c.moe_latent_size = 5;
  return c;
}

Tensor randn(Shape shape, std::uint64_t seed, DType dtype = DType::f32) {
  Tensor t = Tensor::empty(shape, dtype);
  if (t.numel() > 0) fill_normal(t, seed, stream_id("test.moe_compute_errors"), 0.0, 1.0);
  return t;
}

std::optional<ArgumentError> argument_error(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const ArgumentError& e) {
    return e;
  }
  return std::nullopt;
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

Shape grown(const Shape& s) {
  std::vector<std::int64_t> d;
  for (int i = 0; i < s.rank(); ++i) d.push_back(s[i] + (i == s.rank() - 1 ? 1 : 0));
  return Shape(d);
}

struct Fixture {
  MoEConfig c = full_config();
  MoELayerOptions o;
  MoELayer owner{c, BackendConfig{}, nullptr, o};
  HeldWeights good = owner_weights(owner);
  MoECompute compute{c, BackendConfig{}, nullptr};
  Tensor x = randn({5, c.dim}, 1), g = randn({5, c.dim}, 2);
};

}  // namespace

TEST(MoEComputeErrors, SpecsListEveryWeightWithItsShape) {
  Fixture f;
  const std::vector<MoEWeightSpec> specs = f.compute.weight_specs();
  ASSERT_EQ(specs.size(), moe_weight_names().size());  // this configuration has them all
  for (std::size_t i = 0; i < specs.size(); ++i) {
    SCOPED_TRACE(specs[i].name);
    EXPECT_EQ(specs[i].name, moe_weight_names()[i]);
    const TensorView& v = *f.good.w.find(specs[i].name);
    ASSERT_TRUE(v.defined());
    EXPECT_EQ(v.shape, specs[i].shape);
    EXPECT_EQ(specs[i].requires_grad, specs[i].name != "gate.e_score_correction_bias");
  }
  MoEConfig frozen = f.c;
  frozen.train_gate = false;
  frozen.gate_bias_update_factor = 0;
  for (const MoEWeightSpec& s : MoECompute(frozen, BackendConfig{}, nullptr).weight_specs())
    EXPECT_EQ(s.requires_grad, s.name.rfind("gate.", 0) != 0) << s.name;
  BackendConfig fake;
  fake.fake_balanced_gate = true;
  for (const MoEWeightSpec& s : MoECompute(f.c, fake, nullptr).weight_specs())
    EXPECT_NE(s.name.rfind("gate.", 0), 0u) << s.name << ": the fake gate has no weights";
}

TEST(MoEComputeErrors, EveryWrongWeightIsNamed) {
  Fixture f;
  const MoEOutput fwd = f.compute.forward(f.good.w, f.x, Tensor(), true);
  for (const MoEWeightSpec& spec : f.compute.weight_specs()) {
    SCOPED_TRACE(spec.name);
    // Each mistake once in forward, once in backward.
    auto expect_named = [&](const MoEWeights& bad, const std::vector<std::string>& parts) {
      for (bool in_backward : {false, true}) {
        const auto e = argument_error([&] {
          if (in_backward) f.compute.backward(bad, *fwd.saved, f.g);
          else f.compute.forward(bad, f.x, Tensor(), true);
        });
        ASSERT_TRUE(e.has_value()) << (in_backward ? "backward" : "forward") << " accepted it";
        EXPECT_EQ(e->argument(), spec.name) << e->what();
        for (const std::string& p : parts) EXPECT_TRUE(contains(e->what(), p)) << e->what() << " lacks " << p;
      }
    };
    const TensorView& good = *f.good.w.find(spec.name);

    MoEWeights missing = f.good.w;
    *missing.find(spec.name) = TensorView();
    expect_named(missing, {"missing", spec.shape.str()});

    const Tensor wrong_shape = randn(grown(spec.shape), 3);
    MoEWeights shaped = f.good.w;
    *shaped.find(spec.name) = wrong_shape;
    expect_named(shaped, {wrong_shape.shape().str(), spec.shape.str()});

    const Tensor ints = Tensor::zeros(spec.shape, DType::i32);
    MoEWeights typed = f.good.w;
    *typed.find(spec.name) = ints;
    expect_named(typed, {"i32"});

    MoEWeights placed = f.good.w;
    TensorView on_gpu = good;
    on_gpu.device = Device::cuda(0);  // never dereferenced: the check comes first
    *placed.find(spec.name) = on_gpu;
    expect_named(placed, {"cuda:0", "cpu"});
  }
  // A failed call leaves the object usable.
  EXPECT_NO_THROW(f.compute.backward(f.good.w, *fwd.saved, f.g));
}

TEST(MoEComputeErrors, AWeightTheConfigurationLacksIsRefused) {
  Fixture f;
  MoEConfig plain = f.c;
  plain.router_bias = false;
  plain.n_shared_experts = 0;
  MoECompute compute(plain, BackendConfig{}, nullptr);
  MoEWeights w = f.good.w;
  w.shared_experts = {};
  w.shared_expert_gate = TensorView();
  const auto e = argument_error([&] { compute.forward(w, f.x, Tensor(), true); });
  ASSERT_TRUE(e.has_value());
  EXPECT_EQ(e->argument(), "gate.bias");
  EXPECT_TRUE(contains(e->what(), "no such weight")) << e->what();
  w.gate.bias = TensorView();
  EXPECT_NO_THROW(compute.forward(w, f.x, Tensor(), true));
  w.shared_expert_gate = f.good.w.shared_expert_gate;
  const auto e2 = argument_error([&] { compute.forward(w, f.x, Tensor(), true); });
  ASSERT_TRUE(e2.has_value());
  EXPECT_EQ(e2->argument(), "shared_expert_gate.weight");
}

TEST(MoEComputeErrors, BadInputsAndRoutingAreNamed) {
  Fixture f;
  auto expect_arg = [](const std::function<void()>& fn, const std::string& arg) {
    const auto e = argument_error(fn);
    ASSERT_TRUE(e.has_value()) << "no ArgumentError for " << arg;
    EXPECT_EQ(e->argument(), arg) << e->what();
  };
  const std::int64_t T = f.x.size(0), k = f.c.n_activated_experts;
  expect_arg([&] { f.compute.forward(f.good.w, randn({T, f.c.dim + 1}, 1), Tensor(), true); }, "x");
  expect_arg([&] { f.compute.forward(f.good.w, Tensor::zeros({T, f.c.dim}, DType::f16), Tensor(), true); }, "x");
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor::zeros({T + 1}, DType::b8), true); }, "padding_mask");
  const Tensor idx = Tensor::zeros({T, k}, DType::i64), w = Tensor::zeros({T, k}, DType::f32);
  Tensor ok = Tensor::zeros({T, k}, DType::i64);
  for (std::int64_t i = 0; i < ok.numel(); ++i) ok.data<std::int64_t>()[i] = i % k;
  EXPECT_NO_THROW(f.compute.forward(f.good.w, f.x, Tensor(), true, {ok, w}));
  // Indices alone are a routing replay, which this configuration does not enable.
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {ok, Tensor()}); }, "routing.indices");
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {ok, w.to(DType::f64)}); }, "routing.weights");
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {Tensor(), w}); }, "routing.indices");
  // Expert 0 twice in a token, an expert id out of range, int32 ids.
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {idx, w}); }, "routing.indices");
  Tensor far = Tensor::zeros({T, k}, DType::i64);
  for (std::int64_t t = 0; t < T; ++t) {
    far.data<std::int64_t>()[t * k] = f.c.n_routed_experts;
    far.data<std::int64_t>()[t * k + 1] = -1;
  }
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {far, w}); }, "routing.indices");
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {idx.to(DType::i32), w}); }, "routing.indices");
  expect_arg([&] { f.compute.forward(f.good.w, f.x, Tensor(), true, {Tensor::zeros({T, k + 1}, DType::i64), w}); },
             "routing.indices");

  const MoEOutput fwd = f.compute.forward(f.good.w, f.x, Tensor(), true);
  expect_arg([&] { f.compute.backward(f.good.w, *fwd.saved, randn({T, f.c.dim}, 2, DType::f64)); }, "grad_out");
  expect_arg([&] { f.compute.backward(f.good.w, *fwd.saved, randn({T + 1, f.c.dim}, 2)); }, "grad_out");
  MoECompute other(f.c, BackendConfig{}, nullptr);
  expect_arg([&] { other.backward(f.good.w, *fwd.saved, f.g); }, "saved");
  EXPECT_NO_THROW(f.compute.backward(f.good.w, *fwd.saved, f.g));
}
