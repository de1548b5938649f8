// JSON form of the configuration: round trips, Automodel's spellings, and the errors a user meets
// when editing a config file or a command line.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

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

// Every field away from its default, so a field that is not written or not read shows up.
BackendConfig custom_backend() {
  BackendConfig c;
  c.dispatcher = DispatcherKind::hybridep;
  c.experts = ExpertsKind::gmm;
  c.dispatcher_num_sms = 24;
  c.deepep_num_sms = 30;
  c.hybridep_num_sms = 16;
  c.hybridep_dispatch_sms = 8;
  c.hybridep_combine_sms = 12;
  c.hybridep_preprocess_sms = 4;
  c.fake_balanced_gate = true;
  c.fake_gate_noise = 0.125;
  c.gate_precision = DType::f64;
  c.rows_in_place = true;
  c.dispatch_chunks = 3;
  return c;
}

MoEConfig custom_moe() {
  MoEConfig c;
  c.n_routed_experts = 64;
  c.n_shared_experts = 2;
  c.n_activated_experts = 8;
  c.n_expert_groups = 8;
  c.n_limited_groups = 4;
  c.train_gate = false;
  c.gate_bias_update_factor = 0.001;
  c.aux_loss_coeff = 0.01;
  c.score_func = ScoreFunc::sigmoid;
  c.route_scale = 2.5;
  c.dim = 7168;
  c.inter_dim = 18432;
  c.moe_inter_dim = 2048;
  c.norm_topk_prob = true;
  c.router_bias = true;
  c.expert_bias = true;
  c.expert_activation = Activation::quick_geglu;
  c.activation_alpha = 1.5;
  c.activation_limit = 6.25;
  c.softmax_before_topk = true;
  c.shared_expert_gate = true;
  c.shared_expert_inter_dim = 1024;
  c.shared_expert_activation = Activation::relu2;
  c.force_e_score_correction_bias = true;
  c.dtype = DType::f16;
  c.apply_router_weight_after_down = true;
  c.swiglu_limit = 10.0;
  c.router_weights_fp32 = true;
  c.router_weight_uses_score_correction_bias = true;
  c.gate_dtype = DType::f32;
  c.moe_latent_size = 512;
  c.enable_routing_replay = true;
  c.group_mask = GroupMask::neg_inf;
  return c;
}

void expect_same(const BackendConfig& a, const BackendConfig& b) {
  EXPECT_EQ(a.dispatcher, b.dispatcher);
  EXPECT_EQ(a.experts, b.experts);
  EXPECT_EQ(a.dispatcher_num_sms, b.dispatcher_num_sms);
  EXPECT_EQ(a.deepep_num_sms, b.deepep_num_sms);
  EXPECT_EQ(a.hybridep_num_sms, b.hybridep_num_sms);
  EXPECT_EQ(a.hybridep_dispatch_sms, b.hybridep_dispatch_sms);
  EXPECT_EQ(a.hybridep_combine_sms, b.hybridep_combine_sms);
  EXPECT_EQ(a.hybridep_preprocess_sms, b.hybridep_preprocess_sms);
  EXPECT_EQ(a.fake_balanced_gate, b.fake_balanced_gate);
  EXPECT_EQ(a.fake_gate_noise, b.fake_gate_noise);
  EXPECT_EQ(a.gate_precision, b.gate_precision);
  EXPECT_EQ(a.rows_in_place, b.rows_in_place);
  EXPECT_EQ(a.dispatch_chunks, b.dispatch_chunks);
}

void expect_same(const MoEConfig& a, const MoEConfig& b) {
  EXPECT_EQ(a.n_routed_experts, b.n_routed_experts);
  EXPECT_EQ(a.n_shared_experts, b.n_shared_experts);
  EXPECT_EQ(a.n_activated_experts, b.n_activated_experts);
  EXPECT_EQ(a.n_expert_groups, b.n_expert_groups);
  EXPECT_EQ(a.n_limited_groups, b.n_limited_groups);
  EXPECT_EQ(a.train_gate, b.train_gate);
  EXPECT_EQ(a.gate_bias_update_factor, b.gate_bias_update_factor);
  EXPECT_EQ(a.aux_loss_coeff, b.aux_loss_coeff);
  EXPECT_EQ(a.score_func, b.score_func);
  EXPECT_EQ(a.route_scale, b.route_scale);
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.inter_dim, b.inter_dim);
  EXPECT_EQ(a.moe_inter_dim, b.moe_inter_dim);
  EXPECT_EQ(a.norm_topk_prob, b.norm_topk_prob);
  EXPECT_EQ(a.router_bias, b.router_bias);
  EXPECT_EQ(a.expert_bias, b.expert_bias);
  EXPECT_EQ(a.expert_activation, b.expert_activation);
  EXPECT_EQ(a.activation_alpha, b.activation_alpha);
  EXPECT_EQ(a.activation_limit, b.activation_limit);
  EXPECT_EQ(a.softmax_before_topk, b.softmax_before_topk);
  EXPECT_EQ(a.shared_expert_gate, b.shared_expert_gate);
  EXPECT_EQ(a.shared_expert_inter_dim, b.shared_expert_inter_dim);
  EXPECT_EQ(a.shared_expert_activation, b.shared_expert_activation);
  EXPECT_EQ(a.force_e_score_correction_bias, b.force_e_score_correction_bias);
  EXPECT_EQ(a.dtype, b.dtype);
  EXPECT_EQ(a.apply_router_weight_after_down, b.apply_router_weight_after_down);
  EXPECT_EQ(a.swiglu_limit, b.swiglu_limit);
  EXPECT_EQ(a.router_weights_fp32, b.router_weights_fp32);
  EXPECT_EQ(a.router_weight_uses_score_correction_bias, b.router_weight_uses_score_correction_bias);
  EXPECT_EQ(a.gate_dtype, b.gate_dtype);
  EXPECT_EQ(a.moe_latent_size, b.moe_latent_size);
  EXPECT_EQ(a.enable_routing_replay, b.enable_routing_replay);
  EXPECT_EQ(a.group_mask, b.group_mask);
}

// A temporary file removed at scope exit. ctest runs each test in its own process, in parallel: the
// test's name plus a counter keeps the names apart.
struct TempFile {
  std::filesystem::path path;
  explicit TempFile(const std::string& text) {
    static int counter = 0;
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path = std::filesystem::temp_directory_path() /
           ("flexep_" + std::string(info->name()) + "_" + std::to_string(counter++) + ".json");
    std::ofstream(path) << text;
  }
  ~TempFile() { std::filesystem::remove(path); }
};
}  // namespace

TEST(ConfigJson, BackendRoundTripOfNonDefaults) {
  const BackendConfig c = custom_backend();
  expect_same(backend_config_from_json(to_json(c)), c);
}

TEST(ConfigJson, MoERoundTripOfNonDefaults) {
  const MoEConfig c = custom_moe();
  expect_same(moe_config_from_json(to_json(c)), c);
}

TEST(ConfigJson, DefaultsRoundTripAndUnsetPrecisionIsNull) {
  expect_same(backend_config_from_json(to_json(BackendConfig{})), BackendConfig{});
  expect_same(moe_config_from_json(to_json(MoEConfig{})), MoEConfig{});
  expect_same(moe_config_from_json("{}"), MoEConfig{});
  const auto j = nlohmann::json::parse(to_json(BackendConfig{}));
  EXPECT_TRUE(j.at("gate_precision").is_null());
}

TEST(ConfigJson, WritesEveryFieldWithEnumsAsStrings) {
  const auto b = nlohmann::json::parse(to_json(custom_backend()));
  EXPECT_EQ(b.size(), 13u);
  EXPECT_EQ(b.at("dispatcher"), "hybridep");
  EXPECT_EQ(b.at("experts"), "gmm");
  EXPECT_EQ(b.at("gate_precision"), "float64");
  EXPECT_EQ(b.at("hybridep_combine_sms"), 12);
  EXPECT_EQ(b.at("rows_in_place"), true);
  EXPECT_EQ(b.at("dispatch_chunks"), 3);
  const auto m = nlohmann::json::parse(to_json(custom_moe()));
  EXPECT_EQ(m.size(), 33u);
  EXPECT_EQ(m.at("gate_dtype"), "float32");
  EXPECT_EQ(m.at("moe_latent_size"), 512);
  EXPECT_EQ(m.at("group_mask"), "neg_inf");
  EXPECT_EQ(m.at("swiglu_limit"), 10.0);
  const auto d = nlohmann::json::parse(to_json(MoEConfig{}));
  EXPECT_TRUE(d.at("gate_dtype").is_null());       // None: inherit dtype
  EXPECT_TRUE(d.at("moe_latent_size").is_null());  // None: no latent projection
  EXPECT_EQ(d.at("group_mask"), "automodel");
  EXPECT_EQ(m.at("score_func"), "sigmoid");
  EXPECT_EQ(m.at("expert_activation"), "quick_geglu");
  EXPECT_EQ(m.at("shared_expert_activation"), "relu2");
  EXPECT_EQ(m.at("dtype"), "float16");
  EXPECT_EQ(nlohmann::json::parse(to_json(MoEConfig{})).at("dtype"), "bfloat16");
  // Pretty-printed: one field per line.
  EXPECT_NE(to_json(MoEConfig{}).find("\n  \"n_routed_experts\": 16,\n"), std::string::npos);
}

TEST(ConfigJson, AutomodelSpellingsAccepted) {
  const BackendConfig b = backend_config_from_json(R"({"dispatcher": "torch", "gate_precision": "torch.float64"})");
  EXPECT_EQ(b.dispatcher, DispatcherKind::alltoall);
  EXPECT_EQ(b.gate_precision, DType::f64);
  EXPECT_FALSE(backend_config_from_json(R"({"gate_precision": null})").gate_precision.has_value());
  EXPECT_EQ(moe_config_from_json(R"({"dtype": "torch.bfloat16"})").dtype, DType::bf16);
  EXPECT_EQ(moe_config_from_json(R"({"dtype": "float64"})").dtype, DType::f64);
  // Automodel's shared_expert_inter_dim: None means "use moe_inter_dim", our 0.
  EXPECT_EQ(moe_config_from_json(R"({"shared_expert_inter_dim": null})").shared_expert_inter_dim, 0);
  // Integers are numbers too.
  EXPECT_EQ(moe_config_from_json(R"({"route_scale": 2})").route_scale, 2.0);
  // Automodel 0.7.0's later fields, as its configs write them.
  const MoEConfig m = moe_config_from_json(
      R"({"gate_dtype": "torch.float32", "moe_latent_size": null, "swiglu_limit": 10, "score_func": "sqrtsoftplus",
          "expert_activation": "swigluoai", "router_weights_fp32": true, "enable_routing_replay": true,
          "n_expert_groups": 0})");
  EXPECT_EQ(m.gate_dtype, DType::f32);
  EXPECT_EQ(m.moe_latent_size, 0);
  EXPECT_EQ(m.swiglu_limit, 10.0);
  EXPECT_EQ(m.score_func, ScoreFunc::sqrtsoftplus);
  EXPECT_EQ(m.expert_activation, Activation::swigluoai);
  EXPECT_TRUE(m.router_weights_fp32);
  EXPECT_TRUE(m.enable_routing_replay);
  EXPECT_NO_THROW(validate(m));
  EXPECT_FALSE(moe_config_from_json(R"({"gate_dtype": null})").gate_dtype.has_value());
  EXPECT_EQ(moe_config_from_json(R"({"moe_latent_size": 64})").moe_latent_size, 64);
  // An explicit 0 would be a zero-width projection in Automodel: null is how "none" is written.
  expect_arg_error([] { moe_config_from_json(R"({"moe_latent_size": 0})"); }, "moe.moe_latent_size",
                   "is 0; allowed: 1 to 1048576, or null for none");
  expect_arg_error([] { moe_config_from_json(R"({"group_mask": "zeros"})"); }, "moe.group_mask",
                   "allowed: 'automodel', 'neg_inf'");
}

TEST(ConfigJson, OnlyGivenKeysChange) {
  const MoEConfig c = moe_config_from_json(R"({"n_activated_experts": 8, "score_func": "softmax_with_bias"})");
  EXPECT_EQ(c.n_activated_experts, 8);
  EXPECT_EQ(c.score_func, ScoreFunc::softmax_with_bias);
  EXPECT_EQ(c.n_routed_experts, 16);
  EXPECT_EQ(c.moe_inter_dim, 64);
}

TEST(ConfigJson, NoValidationWhenParsing) {
  const MoEConfig c = moe_config_from_json(R"({"n_activated_experts": 99})");
  EXPECT_EQ(c.n_activated_experts, 99);
  expect_arg_error([&] { validate(c); }, "moe.n_activated_experts", "n_routed_experts (16)");
}

TEST(ConfigJson, UnknownKeyNamesItAndListsKnownKeys) {
  expect_arg_error([] { moe_config_from_json(R"({"n_experts": 8})"); }, "moe.n_experts",
                   "unknown key; known keys: n_routed_experts, n_shared_experts, n_activated_experts");
  expect_arg_error([] { backend_config_from_json(R"({"enable_deepep": true})", "cfg.backend"); },
                   "cfg.backend.enable_deepep", "dispatcher, experts, dispatcher_num_sms");
}

TEST(ConfigJson, WrongTypeNamesKeyAndExpectedType) {
  expect_arg_error([] { moe_config_from_json(R"({"dim": "7168"})"); }, "moe.dim",
                   "expected an integer, got string \"7168\"");
  expect_arg_error([] { moe_config_from_json(R"({"dim": 7168.5})"); }, "moe.dim", "expected an integer, got number");
  expect_arg_error([] { moe_config_from_json(R"({"dim": 5000000000})"); }, "moe.dim", "does not fit a 32-bit integer");
  expect_arg_error([] { moe_config_from_json(R"({"train_gate": 1})"); }, "moe.train_gate", "expected a boolean");
  expect_arg_error([] { moe_config_from_json(R"({"route_scale": "2"})"); }, "moe.route_scale", "expected a number");
  expect_arg_error([] { moe_config_from_json(R"({"score_func": 3})"); }, "moe.score_func", "expected a string");
  expect_arg_error([] { moe_config_from_json(R"({"dtype": "float7"})"); }, "moe.dtype", "unknown dtype 'float7'");
  expect_arg_error([] { backend_config_from_json(R"({"dispatcher": "nvshmem"})"); }, "backend.dispatcher",
                   "allowed: 'host', 'alltoall', 'torch', 'deepep', 'hybridep'");
  expect_arg_error([] { backend_config_from_json(R"([1, 2])"); }, "backend", "expected a JSON object, got array");
}

TEST(ConfigJson, SyntaxErrorNamesWhereAndPosition) {
  expect_arg_error([] { moe_config_from_json("{\n  \"dim\": 64,\n  \"n_routed_experts\" 8\n}", "model.json"); },
                   "model.json",
                   "JSON syntax error at line 3, column 22 (byte 37): syntax error while parsing object separator");
}

TEST(ConfigJson, LoadConfigFile) {
  const TempFile f(R"({
    // comments are allowed in hand-written files
    "moe": {"n_routed_experts": 64, "n_activated_experts": 8, "dtype": "torch.bfloat16"},
    "backend": {"dispatcher": "hybridep", "experts": "te", "dispatcher_num_sms": 16},
    "train": {"steps": 10, "lr": 0.001}
  })");
  const ConfigFile cf = load_config_file(f.path.string());
  EXPECT_EQ(cf.moe.n_routed_experts, 64);
  EXPECT_EQ(cf.moe.n_activated_experts, 8);
  EXPECT_EQ(cf.moe.dim, 64);  // default kept
  EXPECT_EQ(cf.backend.dispatcher, DispatcherKind::hybridep);
  EXPECT_EQ(cf.backend.experts, ExpertsKind::te);
  EXPECT_EQ(cf.backend.dispatch_sms(), 16);
  EXPECT_EQ(nlohmann::json::parse(cf.extra_json), nlohmann::json::parse(R"({"steps": 10, "lr": 0.001})"));
}

TEST(ConfigJson, LoadConfigFileSectionsOptional) {
  const TempFile f(R"({"backend": {"dispatcher": "deepep"}})");
  const ConfigFile cf = load_config_file(f.path.string());
  EXPECT_EQ(cf.backend.dispatcher, DispatcherKind::deepep);
  expect_same(cf.moe, MoEConfig{});
  EXPECT_EQ(cf.extra_json, "{}");
}

TEST(ConfigJson, LoadConfigFileErrors) {
  {
    const TempFile f(R"({"moe": {}, "model": {}})");
    expect_arg_error([&] { load_config_file(f.path.string()); }, "model", "allowed: moe, backend, train");
  }
  {
    const TempFile f(R"({"moe": {"topk": 2}})");
    expect_arg_error([&] { load_config_file(f.path.string()); }, "moe.topk", "unknown key");
  }
  {
    const TempFile f(R"({"train": [1]})");
    expect_arg_error([&] { load_config_file(f.path.string()); }, "train", "expected a JSON object");
  }
  {
    const TempFile f("{\"moe\": {,}}");
    expect_arg_error([&] { load_config_file(f.path.string()); }, f.path.string(), "JSON syntax error at line 1");
  }
  expect_arg_error([] { load_config_file("/nonexistent/flexep.json"); }, "config_file",
                   "'/nonexistent/flexep.json' does not exist");
  // A device would be read forever; a directory is no file.
  expect_arg_error([] { load_config_file("/dev/zero"); }, "config_file", "not a regular file");
  expect_arg_error([] { load_config_file("/tmp"); }, "config_file", "not a regular file");
  {  // a key given twice, at any level
    const TempFile f(R"({"moe": {"dim": 8, "n_routed_experts": 4, "dim": 16}})");
    expect_arg_error([&] { load_config_file(f.path.string()); }, f.path.string(), "key 'dim' appears twice");
  }
  // The same key in two objects is fine.
  EXPECT_NO_THROW(parse_config(R"({"moe": {"dim": 8}, "train": {"dim": 8}})", "x"));
  {  // nesting past kMaxJsonDepth is refused before parsing; brackets inside strings do not count
    const std::string deep = std::string(100000, '[') + std::string(100000, ']');
    expect_arg_error([&] { parse_config(deep, "deep.json"); }, "deep.json", "nested deeper than 64 levels");
    EXPECT_NO_THROW(check_json_depth("{\"a\": \"" + std::string(1000, '[') + "\"}", "x"));
    expect_arg_error([] { check_json_depth(std::string(65, '{'), "x"); }, "x", "deeper than 64");
    EXPECT_NO_THROW(check_json_depth(std::string(64, '['), "x"));
  }
  {  // a NUL byte ends no document silently
    const std::string text = std::string("{\"moe\": {}}") + '\0' + "garbage";
    expect_arg_error([&] { parse_config(text, "nul.json"); }, "nul.json", "NUL byte at byte 11");
  }
  // Values are echoed cut to a readable length.
  const std::string shown = describe_json_value("string", "\"" + std::string(1000000, 'x') + "\"");
  EXPECT_LT(shown.size(), 200u);
  EXPECT_NE(shown.find("(1000002 characters)"), std::string::npos) << shown;
  EXPECT_EQ(describe_json_value("null", "null"), "null");
}

TEST(ConfigJson, ApplyOverride) {
  MoEConfig m;
  BackendConfig b;
  apply_override(m, b, "moe.n_activated_experts=8");
  apply_override(m, b, "moe.score_func=sigmoid");  // bare word: a string
  apply_override(m, b, "moe.route_scale=2.5");
  apply_override(m, b, "moe.norm_topk_prob=true");
  apply_override(m, b, "moe.dtype=torch.float32");  // not JSON, taken as a string
  apply_override(m, b, "backend.dispatcher=hybridep");
  apply_override(m, b, "backend.dispatcher_num_sms=16");
  apply_override(m, b, "backend.gate_precision=\"float64\"");  // a JSON string works as well
  EXPECT_EQ(m.n_activated_experts, 8);
  EXPECT_EQ(m.score_func, ScoreFunc::sigmoid);
  EXPECT_EQ(m.route_scale, 2.5);
  EXPECT_TRUE(m.norm_topk_prob);
  EXPECT_EQ(m.dtype, DType::f32);
  EXPECT_EQ(b.dispatcher, DispatcherKind::hybridep);
  EXPECT_EQ(b.dispatcher_num_sms, 16);
  EXPECT_EQ(b.gate_precision, DType::f64);
  apply_override(m, b, "backend.gate_precision=null");
  EXPECT_FALSE(b.gate_precision.has_value());
  EXPECT_EQ(m.n_routed_experts, 16);  // untouched
}

TEST(ConfigJson, ApplyOverrideErrorsNameTheKey) {
  MoEConfig m;
  BackendConfig b;
  expect_arg_error([&] { apply_override(m, b, "moe.topk=8"); }, "moe.topk", "unknown key; known keys:");
  expect_arg_error([&] { apply_override(m, b, "moe.dim=big"); }, "moe.dim", "expected an integer, got string \"big\"");
  expect_arg_error([&] { apply_override(m, b, "backend.dispatcher=nccl"); }, "backend.dispatcher", "allowed:");
  expect_arg_error([&] { apply_override(m, b, "train.steps=3"); }, "train.steps", "unknown section");
  expect_arg_error([&] { apply_override(m, b, "n_activated_experts=8"); }, "n_activated_experts", "unknown section");
  expect_arg_error([&] { apply_override(m, b, "moe.dim"); }, "moe.dim", "is not an assignment");
  EXPECT_EQ(m.dim, 64);
}
