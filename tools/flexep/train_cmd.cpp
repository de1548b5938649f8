// `flexep train`: the main job. With no arguments it trains the embedded default (a 64-wide MoE
// layer, 16 experts, top-4, one shared expert, 4 simulated ranks on the CPU) and prints both checks.
#include <climits>
#include <cstdio>

#include <fmt/core.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "cli_checks.h"
#include "commands.h"
#include "flexep/core/checks.h"
#include "flexep/core/config_json.h"
#include "train.h"

namespace flexep::tools {

namespace {
int g_exit_code = 0;

struct TrainArgs {
  std::string config_file;
  std::vector<std::string> overrides;
  int ranks = 0, steps = 0, tokens = 0, dim = 0, experts = 0, topk = 0;
  long long seed = -1;
  double lr = 0;
  std::string backend, device;
  bool quiet = false, print_config = false;
};

// A field given both by its own option and by --set would be decided by the order of the code, not
// of the command line: refuse it.
void check_no_double_setting(const TrainArgs& a) {
  struct ByOption {
    const char* field;
    const char* option;
    bool given;
  };
  const ByOption by_option[] = {{"train.ranks", "--ranks", a.ranks != 0},
                                {"train.steps", "--steps", a.steps != 0},
                                {"train.tokens", "--tokens", a.tokens != 0},
                                {"moe.dim", "--dim", a.dim != 0},
                                {"moe.n_routed_experts", "--experts", a.experts != 0},
                                {"moe.n_activated_experts", "--topk", a.topk != 0},
                                {"train.seed", "--seed", a.seed >= 0},
                                {"train.lr", "--lr", a.lr > 0},
                                {"backend.dispatcher", "--backend", !a.backend.empty()},
                                {"train.device", "--device", !a.device.empty()}};
  for (const std::string& s : a.overrides) {
    const std::string key = s.substr(0, s.find('='));
    for (const ByOption& o : by_option)
      FLEXEP_CHECK_ARG(!o.given || key != o.field, "--set", "'", key, "' is also set by its own option (", o.option,
                       "); give it once");
  }
}

void run(const TrainArgs& a) {
  check_no_double_setting(a);
  TrainOptions o = default_train_options();
  if (!a.config_file.empty()) {
    ConfigFile base;
    base.moe = o.moe;
    base.backend = o.backend;
    const ConfigFile f = load_config_file(a.config_file, base);
    o.moe = f.moe;
    o.backend = f.backend;
    apply_train_json(o, f.extra_json);
  }
  for (const std::string& s : a.overrides) {
    if (s.rfind("train.", 0) == 0 && s.find('=') != std::string::npos) {  // the train section is this program's
      const std::size_t eq = s.find('=');
      check_json_depth(s.substr(eq + 1), s.substr(0, eq));
      nlohmann::json value = nlohmann::json::parse(s.substr(eq + 1), nullptr, /*allow_exceptions=*/false);
      if (value.is_discarded()) value = s.substr(eq + 1);  // a bare word (cuda) is meant as a string
      apply_train_json(o, nlohmann::json{{s.substr(6, eq - 6), value}}.dump());
    } else {
      apply_override(o.moe, o.backend, s);
    }
  }
  if (a.ranks) o.ranks = a.ranks;
  if (a.steps) o.steps = a.steps;
  if (a.tokens) o.tokens = a.tokens;
  if (a.dim) o.moe.dim = a.dim;
  if (a.experts) o.moe.n_routed_experts = a.experts;
  if (a.topk) o.moe.n_activated_experts = a.topk;
  if (a.seed >= 0) o.seed = static_cast<std::uint64_t>(a.seed);
  if (a.lr > 0) o.lr = a.lr;
  if (!a.backend.empty()) o.backend.dispatcher = parse_dispatcher(a.backend, "--backend");
  if (!a.device.empty()) o.device = a.device;
  o.quiet = a.quiet;
  if (a.print_config) {
    validate_train_options(o);  // an invalid configuration is an error, not a printout
    fmt::print("{{\n\"moe\": {},\n\"backend\": {},\n\"train\": {}\n}}\n", to_json(o.moe), to_json(o.backend),
               train_json(o));
    return;
  }

  fmt::print("flexep train: dim {}, {} experts (top-{}), {} shared, moe_inter {}, {} ranks, backend {}, "
             "device {}, {} steps x {} tokens\n",
             o.moe.dim, o.moe.n_routed_experts, o.moe.n_activated_experts, o.moe.n_shared_experts,
             o.moe.moe_inter_dim, o.ranks, to_string(o.backend.dispatcher), o.device, o.steps, o.tokens);
  std::fflush(stdout);  // the setup and the first check can take a while; say what runs first
  const TrainReport r = run_training(o);
  fmt::print("check 1, loss falls:   {:.4e} -> {:.4e} ({:.1f}% of the start; needs < 25%)  {}\n", r.first_loss,
             r.last_loss, 100.0 * r.last_loss / r.first_loss, r.loss_check ? "PASSED" : "FAILED");
  fmt::print("check 2, {}: max relative gradient difference {:.2e} ({}; needs < {:.0e})  {}\n",
             r.rank_check_label, r.max_grad_rel_diff, r.worst_parameter, r.rank_check_limit,
             r.rank_check ? "PASSED" : "FAILED");
  g_exit_code = r.loss_check && r.rank_check ? 0 : 1;
}
}  // namespace

int exit_code() { return g_exit_code; }
void set_exit_code(int code) { g_exit_code = code; }

void add_train_command(CLI::App& app) {
  auto args = std::make_shared<TrainArgs>();
  CLI::App* cmd = app.add_subcommand("train", "Train one MoE layer on a synthetic teacher task and check it");
  cmd->add_option("--config", args->config_file, "JSON file with moe/backend/train sections")->check(CLI::ExistingFile);
  cmd->add_option("--set", args->overrides, "Override a field, e.g. --set moe.score_func=softmax or train.steps=100");
  cmd->add_option("--ranks", args->ranks, "Expert-parallel ranks")->check(whole_number(1, 64));
  cmd->add_option("--steps", args->steps, "Training steps")->check(whole_number(1, 1000000000));
  cmd->add_option("--tokens", args->tokens, "Global tokens per step")->check(whole_number(1, 1 << 30));
  cmd->add_option("--dim", args->dim, "Hidden size")->check(whole_number(1, 1 << 20));
  cmd->add_option("--experts", args->experts, "Routed experts")->check(whole_number(1, 1 << 16));
  cmd->add_option("--topk", args->topk, "Experts per token")->check(whole_number(1, 1 << 16));
  cmd->add_option("--seed", args->seed, "Seed of data and initialisation")->check(whole_number(0, LLONG_MAX));
  cmd->add_option("--lr", args->lr, "Adam learning rate")->check(finite_number_above(0));
  const auto non_empty = [](const char* allowed) {
    return CLI::Validator(
        [allowed](std::string& v) { return v.empty() ? std::string("is empty; allowed: ") + allowed : std::string(); },
        "", "non-empty");
  };
  cmd->add_option("--backend", args->backend, "Dispatcher: host, alltoall (torch), hybridep, deepep")
      ->check(non_empty("host, alltoall (torch), hybridep, deepep"));
  cmd->add_option("--device", args->device, "cpu or cuda")->check(non_empty("cpu, cuda"));
  cmd->add_flag("--quiet", args->quiet, "No progress bar");
  cmd->add_flag("--print-config", args->print_config, "Print the configuration as JSON and exit");
  cmd->callback([args] { run(*args); });
}

}  // namespace flexep::tools
