// BackendConfig / MoEConfig: Automodel's test_backend_config and TestMoEConfig ported, plus every
// validation rule (the argument named and the allowed range shown).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/core/config_json.h"
#include "flexep/core/error.h"

using namespace flexep;

namespace {
void expect_arg_error(const std::function<void()>& f, const std::string& arg, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << "'" << needle << "' not in: " << e.what();
  }
}

// The pair after Automodel's rewrite, with an EP size that triggers no local fallback.
std::pair<ExpertsKind, DispatcherKind> normalized(ExpertsKind x, DispatcherKind d) {
  BackendConfig c;
  c.experts = x;
  c.dispatcher = d;
  normalize(c, 2);
  return {c.experts, c.dispatcher};
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();
}  // namespace

// --- Automodel: TestBackendConfigGatePrecision ---

TEST(BackendConfig, GatePrecisionStringsMapToDtypes) {
  EXPECT_EQ(backend_config_from_json(R"({"gate_precision": "torch.float32"})").gate_precision, DType::f32);
  EXPECT_EQ(backend_config_from_json(R"({"gate_precision": "torch.float64"})").gate_precision, DType::f64);
  EXPECT_EQ(backend_config_from_json(R"({"gate_precision": "float32"})").gate_precision, DType::f32);
}

TEST(BackendConfig, GatePrecisionDefaultIsUnsetAndDtypePassesThrough) {
  BackendConfig c;
  EXPECT_FALSE(c.gate_precision.has_value());
  c.gate_precision = DType::f64;
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.gate_precision, DType::f64);
}

// --- Automodel: TestBackendConfigExpertsDispatcherValidation ---

TEST(BackendConfig, TeOrGmmWithoutEpDispatcherFallsBackToTorchMm) {
  using P = std::pair<ExpertsKind, DispatcherKind>;
  const DispatcherKind torch = parse_dispatcher("torch");
  EXPECT_EQ(torch, DispatcherKind::alltoall);
  EXPECT_EQ(normalized(ExpertsKind::te, torch), (P{ExpertsKind::torch_mm, DispatcherKind::alltoall}));
  EXPECT_EQ(normalized(ExpertsKind::gmm, torch), (P{ExpertsKind::torch_mm, DispatcherKind::alltoall}));
  // The host dispatcher is not an EP dispatcher either, and stays the host dispatcher.
  EXPECT_EQ(normalized(ExpertsKind::te, DispatcherKind::host), (P{ExpertsKind::torch_mm, DispatcherKind::host}));
}

TEST(BackendConfig, FallbackIsReportedNotSilent) {
  BackendConfig c;
  c.experts = ExpertsKind::te;
  c.dispatcher = DispatcherKind::alltoall;
  const Normalization n = normalize(c, 4);
  ASSERT_EQ(n.messages.size(), 1u);
  EXPECT_EQ(
      n.messages[0],
      "experts='te' needs an EP dispatcher (deepep or hybridep); using experts='torch_mm' with dispatcher='alltoall'");
  EXPECT_FALSE(n.local_fallback);
}

TEST(BackendConfig, ValidCombinationsAreKept) {
  using P = std::pair<ExpertsKind, DispatcherKind>;
  const std::vector<P> kept = {
      {ExpertsKind::te, DispatcherKind::deepep},         {ExpertsKind::gmm, DispatcherKind::deepep},
      {ExpertsKind::torch, DispatcherKind::alltoall},    {ExpertsKind::torch, DispatcherKind::deepep},
      {ExpertsKind::torch_mm, DispatcherKind::alltoall}, {ExpertsKind::torch_mm, DispatcherKind::deepep}};
  for (const auto& [x, d] : kept) {
    SCOPED_TRACE(std::string(to_string(x)) + "+" + std::string(to_string(d)));
    BackendConfig c;
    c.experts = x;
    c.dispatcher = d;
    EXPECT_TRUE(normalize(c, 2).messages.empty());
    EXPECT_EQ((P{c.experts, c.dispatcher}), (P{x, d}));
  }
}

// --- Automodel: TestBackendConfigFakeGateNoise ---

TEST(BackendConfig, FakeGateNoiseDefaultAndCustom) {
  EXPECT_EQ(BackendConfig{}.fake_gate_noise, 0.0);
  BackendConfig c;
  c.fake_balanced_gate = true;
  c.fake_gate_noise = 0.3;
  EXPECT_NO_THROW(validate(c));
  const BackendConfig j = backend_config_from_json(R"({"fake_balanced_gate": true, "fake_gate_noise": 0.3})");
  EXPECT_TRUE(j.fake_balanced_gate);
  EXPECT_DOUBLE_EQ(j.fake_gate_noise, 0.3);
}

// --- Automodel: TestBackendConfigHybridEP ---

TEST(BackendConfig, HybridepDispatcherValid) {
  BackendConfig c;
  c.dispatcher = parse_dispatcher("hybridep");
  EXPECT_EQ(c.dispatcher, DispatcherKind::hybridep);
  EXPECT_TRUE(is_ep_dispatcher(c.dispatcher));
  EXPECT_NO_THROW(validate(c));
  EXPECT_TRUE(normalize(c, 8).messages.empty());
  EXPECT_EQ(c.dispatcher, DispatcherKind::hybridep);
}

TEST(BackendConfig, DispatcherNumSmsDefaultAndCustom) {
  BackendConfig c;
  c.dispatcher = DispatcherKind::hybridep;
  EXPECT_EQ(c.dispatcher_num_sms, 20);
  EXPECT_EQ(c.dispatch_sms(), 20);
  c.dispatcher_num_sms = 24;
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.dispatch_sms(), 24);
  EXPECT_EQ(c.combine_sms(), 24);
}

TEST(BackendConfig, TeAndGmmExpertsKeptWithHybridep) {
  using P = std::pair<ExpertsKind, DispatcherKind>;
  EXPECT_EQ(normalized(ExpertsKind::te, DispatcherKind::hybridep), (P{ExpertsKind::te, DispatcherKind::hybridep}));
  EXPECT_EQ(normalized(ExpertsKind::gmm, DispatcherKind::hybridep), (P{ExpertsKind::gmm, DispatcherKind::hybridep}));
  EXPECT_EQ(normalized(ExpertsKind::torch, DispatcherKind::hybridep),
            (P{ExpertsKind::torch, DispatcherKind::hybridep}));
}

// --- EP-size fallback ---

TEST(BackendConfig, EpDispatcherWithEpSizeOneFallsBackToLocal) {
  BackendConfig c;
  c.dispatcher = DispatcherKind::hybridep;
  Normalization n = normalize(c, 1);
  EXPECT_TRUE(n.local_fallback);
  ASSERT_EQ(n.messages.size(), 1u);
  EXPECT_EQ(
      n.messages[0],
      "'hybridep' dispatcher is enabled in config, but the expert-parallel size is 1; falling back to the local path");
  EXPECT_EQ(c.dispatcher, DispatcherKind::hybridep);  // the config keeps what the user asked for

  c.dispatcher = DispatcherKind::deepep;
  n = normalize(c, 1);
  EXPECT_TRUE(n.local_fallback);
  ASSERT_EQ(n.messages.size(), 1u);
  EXPECT_NE(n.messages[0].find("'deepep' dispatcher"), std::string::npos);

  for (DispatcherKind d : {DispatcherKind::host, DispatcherKind::alltoall}) {
    c.dispatcher = d;
    n = normalize(c, 1);
    EXPECT_FALSE(n.local_fallback);
    EXPECT_TRUE(n.messages.empty());
  }
  expect_arg_error([&] { normalize(c, 0); }, "ep_size", ">= 1");
}

TEST(BackendConfig, ExpertsRewriteWithHostAtEpOneIsTheOnlyMessage) {
  BackendConfig c;
  c.experts = ExpertsKind::gmm;
  c.dispatcher = DispatcherKind::host;
  Normalization n = normalize(c, 1);
  EXPECT_FALSE(n.local_fallback);  // host is not an EP dispatcher
  ASSERT_EQ(n.messages.size(), 1u);
  EXPECT_NE(n.messages[0].find("experts='gmm'"), std::string::npos);
  EXPECT_EQ(c.experts, ExpertsKind::torch_mm);
}

// rows_in_place: parsed and written as a JSON boolean, kept at EP size 1, turned off with a message
// above it; anything but a boolean is a named error.
TEST(BackendConfig, RowsInPlaceNeedsOneGpuOrDeepEpAndSaysSo) {
  EXPECT_FALSE(BackendConfig{}.rows_in_place);
  BackendConfig c = backend_config_from_json(R"({"rows_in_place": true, "dispatcher": "hybridep"})");
  EXPECT_TRUE(c.rows_in_place);
  EXPECT_TRUE(backend_config_from_json(to_json(c)).rows_in_place);
  Normalization n = normalize(c, 1);
  EXPECT_TRUE(c.rows_in_place);
  EXPECT_TRUE(n.local_fallback);
  n = normalize(c, 4);
  EXPECT_FALSE(c.rows_in_place);
  ASSERT_EQ(n.messages.size(), 1u);
  EXPECT_EQ(n.messages[0],
            "rows_in_place reads the rows in place on one GPU or with the deepep dispatcher; with "
            "dispatcher='hybridep' and an expert-parallel size of 4 the experts take the dispatcher's rows");
  // deepep hands the experts its received rows and their table at any EP size.
  BackendConfig d = backend_config_from_json(R"({"rows_in_place": true, "dispatcher": "deepep"})");
  EXPECT_TRUE(normalize(d, 4).messages.empty());
  EXPECT_TRUE(d.rows_in_place);
  expect_arg_error([] { backend_config_from_json(R"({"rows_in_place": 1})"); }, "backend.rows_in_place", "");
}

// --- SM count resolution ---

TEST(BackendConfig, SmCountResolution) {
  BackendConfig c;
  EXPECT_EQ(c.dispatch_sms(), 20);
  EXPECT_EQ(c.combine_sms(), 20);
  EXPECT_EQ(c.preprocess_sms(), 20);

  c.dispatcher = DispatcherKind::deepep;
  c.deepep_num_sms = 24;
  c.hybridep_num_sms = 12;  // not the configured backend's: ignored
  EXPECT_EQ(c.dispatch_sms(), 24);
  EXPECT_EQ(c.combine_sms(), 24);

  c.dispatcher = DispatcherKind::hybridep;
  EXPECT_EQ(c.dispatch_sms(), 12);
  c.hybridep_dispatch_sms = 8;
  c.hybridep_preprocess_sms = 4;
  EXPECT_EQ(c.dispatch_sms(), 8);
  EXPECT_EQ(c.combine_sms(), 12);
  EXPECT_EQ(c.preprocess_sms(), 4);

  c.hybridep_num_sms = 0;
  EXPECT_EQ(c.combine_sms(), 20);

  c.dispatcher = DispatcherKind::alltoall;  // no per-backend count
  c.hybridep_dispatch_sms = 0;
  EXPECT_EQ(c.dispatch_sms(), 20);
}

// --- Enum names ---

TEST(Config, EnumNamesRoundTrip) {
  for (auto d : {DispatcherKind::host, DispatcherKind::alltoall, DispatcherKind::deepep, DispatcherKind::hybridep})
    EXPECT_EQ(parse_dispatcher(to_string(d)), d);
  for (auto x : {ExpertsKind::torch, ExpertsKind::torch_mm, ExpertsKind::gmm, ExpertsKind::te})
    EXPECT_EQ(parse_experts(to_string(x)), x);
  for (auto s : {ScoreFunc::softmax, ScoreFunc::softmax_with_bias, ScoreFunc::sigmoid, ScoreFunc::sigmoid_with_bias,
                 ScoreFunc::sqrtsoftplus})
    EXPECT_EQ(parse_score_func(to_string(s)), s);
  for (auto a : {Activation::swiglu, Activation::swigluoai, Activation::quick_geglu, Activation::geglu,
                 Activation::relu2})
    EXPECT_EQ(parse_activation(to_string(a)), a);
  for (auto m : {GroupMask::automodel, GroupMask::neg_inf}) EXPECT_EQ(parse_group_mask(to_string(m)), m);
  EXPECT_EQ(to_string(ScoreFunc::sigmoid_with_bias), "sigmoid_with_bias");
  EXPECT_EQ(to_string(ScoreFunc::sqrtsoftplus), "sqrtsoftplus");
  EXPECT_EQ(to_string(Activation::swigluoai), "swigluoai");
  EXPECT_EQ(to_string(Activation::geglu), "geglu");
  EXPECT_EQ(to_string(GroupMask::neg_inf), "neg_inf");
  EXPECT_EQ(to_string(DispatcherKind::alltoall), "alltoall");
  EXPECT_EQ(to_string(ExpertsKind::torch_mm), "torch_mm");
  EXPECT_EQ(to_string(ScoreFunc::softmax_with_bias), "softmax_with_bias");
  EXPECT_EQ(to_string(Activation::quick_geglu), "quick_geglu");
}

TEST(Config, ParseErrorsListAllowedValues) {
  expect_arg_error([] { parse_dispatcher("nccl"); }, "backend.dispatcher",
                   "'nccl'; allowed: 'host', 'alltoall', 'torch', 'deepep', 'hybridep'");
  expect_arg_error([] { parse_experts("cutlass"); }, "backend.experts", "allowed: 'torch', 'torch_mm', 'gmm', 'te'");
  expect_arg_error([] { parse_score_func("topk_sigmoid"); }, "moe.score_func",
                   "'topk_sigmoid'; allowed: 'softmax', 'softmax_with_bias', 'sigmoid', 'sigmoid_with_bias', "
                   "'sqrtsoftplus'");
  expect_arg_error([] { parse_activation("gelu"); }, "moe.expert_activation",
                   "allowed: 'swiglu', 'swigluoai', 'quick_geglu', 'geglu', 'relu2'");
  expect_arg_error([] { parse_group_mask("zero"); }, "moe.group_mask", "'zero'; allowed: 'automodel', 'neg_inf'");
  // Automodel's two dispatchers flexep does not have: named, with what flexep offers instead.
  expect_arg_error([] { parse_dispatcher("uccl_ep"); }, "backend.dispatcher",
                   "is 'uccl_ep', Automodel's UCCL-EP dispatcher, which flexep does not provide; use 'alltoall' "
                   "(alias 'torch'), 'hybridep', 'deepep' or 'host'");
  expect_arg_error(
      [] { parse_dispatcher("mok"); }, "backend.dispatcher",
      "is 'mok', Automodel's Mixture-of-Kittens dispatcher, which flexep does not provide; use 'alltoall'");
  expect_arg_error([] { backend_config_from_json(R"({"dispatcher": "uccl_ep"})"); }, "backend.dispatcher",
                   "'uccl_ep'");
  expect_arg_error([] { parse_activation("gelu", "moe.shared_expert_activation"); }, "moe.shared_expert_activation",
                   "'gelu'");
  expect_arg_error([] { parse_dispatcher("HybridEP"); }, "backend.dispatcher", "'HybridEP'");  // case matters
}

// --- BackendConfig validation ---

TEST(BackendConfig, ValidateBoundariesAccepted) {
  BackendConfig c;
  c.dispatcher_num_sms = 1;
  c.fake_gate_noise = 1.0;
  EXPECT_NO_THROW(validate(c));
  // Automodel takes both: 0 SMs means the backend's default, noise beyond 1 is more random still.
  c.dispatcher_num_sms = 0;
  c.fake_gate_noise = 3.0;
  EXPECT_NO_THROW(validate(c));
  c.dispatcher_num_sms = 1024;
  c.hybridep_dispatch_sms = 1024;
  c.fake_gate_noise = 0.0;
  c.gate_precision = DType::f32;
  EXPECT_NO_THROW(validate(c));
}

TEST(BackendConfig, ValidateRejectsEachField) {
  struct Case {
    std::function<void(BackendConfig&)> mutate;
    std::string arg, needle;
  };
  const std::vector<Case> cases = {
      {[](BackendConfig& c) { c.dispatcher_num_sms = -1; }, "backend.dispatcher_num_sms",
       "is -1; allowed: 0 <= value <= 1024 (0 = the backend's default)"},
      {[](BackendConfig& c) { c.dispatcher_num_sms = 1025; }, "backend.dispatcher_num_sms", "0 <= value <= 1024"},
      {[](BackendConfig& c) { c.deepep_num_sms = -1; }, "backend.deepep_num_sms", "is -1; allowed: 0 <= value <= 1024"},
      {[](BackendConfig& c) { c.hybridep_num_sms = 2000; }, "backend.hybridep_num_sms", "0 <= value <= 1024"},
      {[](BackendConfig& c) { c.hybridep_dispatch_sms = -3; }, "backend.hybridep_dispatch_sms", "0 <= value <= 1024"},
      {[](BackendConfig& c) { c.hybridep_combine_sms = -1; }, "backend.hybridep_combine_sms", "0 <= value <= 1024"},
      {[](BackendConfig& c) { c.hybridep_preprocess_sms = 1025; }, "backend.hybridep_preprocess_sms",
       "0 <= value <= 1024"},
      {[](BackendConfig& c) { c.fake_gate_noise = -0.1; }, "backend.fake_gate_noise",
       "is -0.1; allowed: 0 to 10000"},
      {[](BackendConfig& c) { c.fake_gate_noise = kInf; }, "backend.fake_gate_noise", "allowed: 0 to 10000"},
      {[](BackendConfig& c) { c.fake_gate_noise = kNaN; }, "backend.fake_gate_noise", "allowed: 0 to 10000"},
      {[](BackendConfig& c) { c.fake_gate_noise = 1e308; }, "backend.fake_gate_noise", "allowed: 0 to 10000"},
      {[](BackendConfig& c) { c.gate_precision = DType::bf16; }, "backend.gate_precision",
       "is bf16; allowed: f32 (float32), f64 (float64) or unset"},
  };
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.arg);
    BackendConfig c;
    tc.mutate(c);
    expect_arg_error([&] { validate(c); }, tc.arg, tc.needle);
  }
}

// --- Automodel: TestMoEConfig ---

TEST(MoEConfig, DtypeStrings) {
  EXPECT_EQ(moe_config_from_json(R"({"dtype": "torch.float16"})").dtype, DType::f16);
  EXPECT_EQ(moe_config_from_json(R"({"dtype": "bfloat16"})").dtype, DType::bf16);
  EXPECT_EQ(moe_config_from_json(R"({"dtype": "torch.float32"})").dtype, DType::f32);
  EXPECT_EQ(MoEConfig{}.dtype, DType::bf16);
}

TEST(MoEConfig, OptionalFieldDefaults) {
  const MoEConfig c;
  EXPECT_EQ(c.expert_activation, Activation::swiglu);
  EXPECT_DOUBLE_EQ(c.activation_alpha, 1.702);
  EXPECT_DOUBLE_EQ(c.activation_limit, 7.0);
  EXPECT_FALSE(c.router_bias);
  EXPECT_FALSE(c.expert_bias);
  EXPECT_FALSE(c.softmax_before_topk);
  EXPECT_FALSE(c.shared_expert_gate);
  EXPECT_EQ(c.shared_expert_inter_dim, 0);
  EXPECT_EQ(c.shared_expert_activation, Activation::swiglu);
  EXPECT_FALSE(c.force_e_score_correction_bias);
  EXPECT_FALSE(c.apply_router_weight_after_down);
  EXPECT_EQ(c.swiglu_limit, 0.0);
  EXPECT_FALSE(c.router_weights_fp32);
  EXPECT_FALSE(c.router_weight_uses_score_correction_bias);
  EXPECT_FALSE(c.gate_dtype.has_value());
  EXPECT_EQ(c.gate_storage_dtype(), DType::bf16);
  EXPECT_EQ(c.moe_latent_size, 0);
  EXPECT_FALSE(c.enable_routing_replay);
  EXPECT_EQ(c.group_mask, GroupMask::automodel);
  EXPECT_NO_THROW(validate(c));
}

TEST(MoEConfig, NewActivationsAndScoreFunctionsAccepted) {
  for (Activation a : {Activation::swigluoai, Activation::geglu}) {
    MoEConfig c;
    c.expert_activation = a;
    EXPECT_NO_THROW(validate(c));
    EXPECT_EQ(c.up_dim(), 2 * c.moe_inter_dim);  // both read [gate | up] halves
  }
  MoEConfig oai;
  oai.expert_activation = Activation::swigluoai;
  oai.activation_limit = 0;  // swigluoai clamps only when limit > 0: 0 and below mean "no clamp"
  EXPECT_NO_THROW(validate(oai));
  oai.activation_limit = -1;
  EXPECT_NO_THROW(validate(oai));
  oai.activation_limit = kNaN;
  expect_arg_error([&] { validate(oai); }, "moe.activation_limit", "any number for 'swigluoai'");
  MoEConfig limited;
  limited.swiglu_limit = 10.0;
  limited.gate_dtype = DType::f32;
  limited.moe_latent_size = 128;  // accepted by the config; the layers refuse it
  limited.enable_routing_replay = true;
  EXPECT_NO_THROW(validate(limited));
  EXPECT_EQ(limited.gate_storage_dtype(), DType::f32);
  for (ScoreFunc f : {ScoreFunc::sigmoid_with_bias, ScoreFunc::sqrtsoftplus}) {
    MoEConfig c;
    c.score_func = f;
    c.force_e_score_correction_bias = true;
    EXPECT_NO_THROW(validate(c));
  }
}

TEST(MoEConfig, QuickGegluAccepted) {
  MoEConfig c = moe_config_from_json(R"({"expert_activation": "quick_geglu"})");
  EXPECT_EQ(c.expert_activation, Activation::quick_geglu);
  EXPECT_NO_THROW(validate(c));
  EXPECT_EQ(c.up_dim(), 2 * c.moe_inter_dim);
  c.expert_activation = Activation::relu2;
  EXPECT_EQ(c.up_dim(), c.moe_inter_dim);
}

// --- MoEConfig validation ---

TEST(MoEConfig, ValidGroupingsAccepted) {
  MoEConfig c;
  c.n_expert_groups = 0;  // 0 and 1 both mean "no grouping", also under plain softmax
  EXPECT_NO_THROW(validate(c));
  c.n_expert_groups = 1;
  c.n_limited_groups = 7;  // ignored without grouping
  EXPECT_NO_THROW(validate(c));
  c.score_func = ScoreFunc::softmax_with_bias;
  c.n_expert_groups = 4;
  c.n_limited_groups = 2;
  c.n_activated_experts = 8;  // exactly n_limited_groups * group size
  EXPECT_NO_THROW(validate(c));
  // sigmoid without a correction bias scores a group by its max: single-expert groups are fine.
  c.score_func = ScoreFunc::sigmoid;
  c.n_expert_groups = 16;
  c.n_limited_groups = 8;
  EXPECT_NO_THROW(validate(c));
  // softmax and sqrtsoftplus ignore groups (Automodel's branches never read them), so any group
  // settings pass, even ones that would be invalid for a grouped score function.
  for (ScoreFunc f : {ScoreFunc::softmax, ScoreFunc::sqrtsoftplus}) {
    MoEConfig g;
    g.score_func = f;
    g.n_expert_groups = 3;  // does not divide 16
    g.n_limited_groups = 9;
    EXPECT_FALSE(g.group_limited());
    EXPECT_NO_THROW(validate(g));
  }
  // 0 groups (Qwen3-MoE, GPT-OSS write it) under a grouped score function: no grouping, limited ignored.
  MoEConfig zero;
  zero.score_func = ScoreFunc::sigmoid_with_bias;
  zero.n_expert_groups = 0;
  zero.n_limited_groups = 0;
  EXPECT_FALSE(zero.group_limited());
  EXPECT_NO_THROW(validate(zero));
}

TEST(MoEConfig, GroupRulesPerScoreFunction) {
  MoEConfig c;
  c.n_expert_groups = 4;
  c.n_limited_groups = 2;
  struct Row {
    ScoreFunc f;
    bool corrected, limited, top2, neg_inf;
  };
  for (const Row& r : {Row{ScoreFunc::softmax, false, false, true, false},
                       Row{ScoreFunc::softmax_with_bias, false, true, true, false},
                       Row{ScoreFunc::sigmoid, false, true, false, false},
                       Row{ScoreFunc::sigmoid, true, true, true, false},
                       Row{ScoreFunc::sigmoid_with_bias, false, true, true, true},
                       Row{ScoreFunc::sqrtsoftplus, true, false, true, false}}) {
    SCOPED_TRACE(std::string(to_string(r.f)) + (r.corrected ? " corrected" : ""));
    c.score_func = r.f;
    c.force_e_score_correction_bias = r.corrected;
    c.group_mask = GroupMask::automodel;
    EXPECT_EQ(c.group_limited(), r.limited);
    if (r.limited) {
      EXPECT_EQ(c.top2_group_score(), r.top2);
    }
    EXPECT_EQ(c.group_mask_neg_inf(), r.neg_inf);
    c.group_mask = GroupMask::neg_inf;
    EXPECT_TRUE(c.group_mask_neg_inf());
  }
}

TEST(MoEConfig, ValidateRejectsEachField) {
  struct Case {
    std::function<void(MoEConfig&)> mutate;
    std::string arg, needle;
  };
  auto grouped = [](MoEConfig& c, ScoreFunc s, int groups, int limited) {
    c.score_func = s;
    c.n_expert_groups = groups;
    c.n_limited_groups = limited;
  };
  const std::vector<Case> cases = {
      {[](MoEConfig& c) { c.n_routed_experts = 0; }, "moe.n_routed_experts", "is 0; allowed: >= 1"},
      {[](MoEConfig& c) { c.n_activated_experts = 0; }, "moe.n_activated_experts",
       "is 0; allowed: 1 <= value <= n_routed_experts (16)"},
      {[](MoEConfig& c) { c.n_activated_experts = 17; }, "moe.n_activated_experts",
       "is 17; allowed: 1 <= value <= n_routed_experts (16)"},
      {[](MoEConfig& c) { c.n_shared_experts = -1; }, "moe.n_shared_experts", "is -1; allowed: 0 to 1024"},
      {[](MoEConfig& c) { c.n_shared_experts = 100000; }, "moe.n_shared_experts", "is 100000; allowed: 0 to 1024"},
      {[](MoEConfig& c) { c.n_routed_experts = 100000; }, "moe.n_routed_experts", "is 100000; allowed: <= 65536"},
      {[](MoEConfig& c) { c.n_shared_experts = 1000, c.moe_inter_dim = 100000; }, "moe.n_shared_experts",
       "make a shared MLP 100000000 wide; allowed: <= 16777216"},
      {[](MoEConfig& c) { c.n_expert_groups = -2; }, "moe.n_expert_groups", "allowed: >= 0 (0 or 1 = no grouping)"},
      {[&](MoEConfig& c) { grouped(c, ScoreFunc::sigmoid_with_bias, 16, 4); }, "moe.n_expert_groups",
       "top-2"},
      {[&](MoEConfig& c) { grouped(c, ScoreFunc::sigmoid, 3, 1); }, "moe.n_expert_groups",
       "does not divide n_routed_experts (16)"},
      {[&](MoEConfig& c) { grouped(c, ScoreFunc::sigmoid, 4, 0); }, "moe.n_limited_groups",
       "is 0; allowed: 1 <= value <= n_expert_groups (4)"},
      {[&](MoEConfig& c) { grouped(c, ScoreFunc::sigmoid, 4, 5); }, "moe.n_limited_groups",
       "allowed: 1 <= value <= n_expert_groups (4)"},
      {[&](MoEConfig& c) {
         grouped(c, ScoreFunc::sigmoid, 4, 1);
         c.n_activated_experts = 5;
       },
       "moe.n_activated_experts", "allowed: 1 <= value <= 4"},
      {[&](MoEConfig& c) { grouped(c, ScoreFunc::softmax_with_bias, 16, 4); }, "moe.n_expert_groups",
       "allowed: n_expert_groups <= n_routed_experts / 2 (8)"},
      {[&](MoEConfig& c) {
         grouped(c, ScoreFunc::sigmoid, 16, 4);
         c.force_e_score_correction_bias = true;
       },
       "moe.n_expert_groups", "top-2"},
      {[](MoEConfig& c) { c.gate_bias_update_factor = -0.1; }, "moe.gate_bias_update_factor",
       "allowed: finite and >= 0"},
      {[](MoEConfig& c) {
         c.gate_bias_update_factor = 0.001;
         c.train_gate = false;
       },
       "moe.gate_bias_update_factor", "allowed: 0 unless train_gate is true"},
      {[](MoEConfig& c) { c.aux_loss_coeff = -1e-3; }, "moe.aux_loss_coeff", "allowed: 0 to 10000"},
      {[](MoEConfig& c) { c.aux_loss_coeff = kNaN; }, "moe.aux_loss_coeff", "allowed: 0 to 10000"},
      {[](MoEConfig& c) { c.aux_loss_coeff = 1e308; }, "moe.aux_loss_coeff", "allowed: 0 to 10000"},
      {[](MoEConfig& c) { c.route_scale = 0; }, "moe.route_scale", "allowed: above 0, up to 10000"},
      {[](MoEConfig& c) { c.route_scale = kInf; }, "moe.route_scale", "allowed: above 0, up to 10000"},
      {[](MoEConfig& c) { c.route_scale = kNaN; }, "moe.route_scale", "allowed: above 0, up to 10000"},
      {[](MoEConfig& c) { c.route_scale = 1e308; }, "moe.route_scale", "allowed: above 0, up to 10000"},
      {[](MoEConfig& c) { c.dim = 0; }, "moe.dim", "is 0; allowed: 1 to 1048576"},
      {[](MoEConfig& c) { c.dim = 2000000000; }, "moe.dim", "is 2000000000; allowed: 1 to 1048576"},
      {[](MoEConfig& c) { c.inter_dim = -1; }, "moe.inter_dim", "allowed: 0 to 16777216"},
      {[](MoEConfig& c) { c.moe_inter_dim = 0; }, "moe.moe_inter_dim", "allowed: 1 to 16777216"},
      {[](MoEConfig& c) { c.moe_inter_dim = 2000000000; }, "moe.moe_inter_dim", "is 2000000000; allowed: 1 to 16777216"},
      {[](MoEConfig& c) { c.activation_limit = 0; }, "moe.activation_limit", "allowed: > 0"},
      {[](MoEConfig& c) { c.activation_limit = kNaN; }, "moe.activation_limit", "allowed: > 0"},
      {[](MoEConfig& c) { c.activation_alpha = kInf; }, "moe.activation_alpha", "allowed: any finite value"},
      {[](MoEConfig& c) { c.shared_expert_activation = Activation::quick_geglu; }, "moe.shared_expert_activation",
       "allowed: 'swiglu', 'relu2'"},
      {[](MoEConfig& c) { c.shared_expert_inter_dim = -1; }, "moe.shared_expert_inter_dim", "allowed: >= 0"},
      {[](MoEConfig& c) { c.dtype = DType::i32; }, "moe.dtype", "is i32; allowed: bf16, f16, f32, f64"},
      {[](MoEConfig& c) { c.swiglu_limit = -1; }, "moe.swiglu_limit", "is -1; allowed: >= 0"},
      {[](MoEConfig& c) { c.swiglu_limit = kNaN; }, "moe.swiglu_limit", "allowed: >= 0"},
      {[](MoEConfig& c) { c.gate_dtype = DType::i64; }, "moe.gate_dtype", "is i64; allowed: bf16, f16, f32, f64"},
      {[](MoEConfig& c) { c.moe_latent_size = -4; }, "moe.moe_latent_size", "is -4; allowed: 1 to 1048576, or 0"},
  };
  for (const auto& tc : cases) {
    SCOPED_TRACE(tc.arg + " / " + tc.needle);
    MoEConfig c;
    tc.mutate(c);
    expect_arg_error([&] { validate(c); }, tc.arg, tc.needle);
  }
}

TEST(MoEConfig, InfiniteActivationLimitMeansNoClamp) {
  MoEConfig c;
  c.activation_limit = kInf;
  EXPECT_NO_THROW(validate(c));
}

TEST(MoEConfig, ValidateEp) {
  MoEConfig c;  // 16 experts
  EXPECT_NO_THROW(validate_ep(c, 1));
  EXPECT_NO_THROW(validate_ep(c, 4));
  EXPECT_NO_THROW(validate_ep(c, 16));
  expect_arg_error([&] { validate_ep(c, 3); }, "moe.n_routed_experts",
                   "n_routed_experts (16) must be divisible by ep_size (3)");
  expect_arg_error([&] { validate_ep(c, 32); }, "moe.n_routed_experts",
                   "n_routed_experts (16) must be divisible by ep_size (32)");
  expect_arg_error([&] { validate_ep(c, 0); }, "ep_size", "is 0; allowed: >= 1");
}

TEST(MoEConfig, DerivedSizes) {
  MoEConfig c;
  c.n_shared_experts = 2;
  EXPECT_EQ(c.shared_inter(), 2 * 64);
  c.shared_expert_inter_dim = 96;
  EXPECT_EQ(c.shared_inter(), 2 * 96);
  EXPECT_FALSE(c.has_correction_bias());
  c.gate_bias_update_factor = 1e-3;
  EXPECT_TRUE(c.has_correction_bias());
}
