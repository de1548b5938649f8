// `flexep bench CASE...`: runs named benchmark cases, prints a table and writes one JSON file per run
// to bench/results/ (DESIGN §5). `flexep bench --plot FILES...` turns result files into PNG charts
// (through scripts/plot_bench.py and matplotlib).
#include <cstdlib>
#include <filesystem>

#include <fmt/core.h>

#include "bench_cases.h"
#include "commands.h"
#include "flexep/core/error.h"

namespace flexep::tools {

std::string device_description(int& gpus);  // bench_device.cpp

std::vector<BenchCase>& bench_cases() {
  static std::vector<BenchCase> cases;
  return cases;
}

namespace {
struct BenchCli {
  std::vector<std::string> cases, plot;
  std::string out = "bench/results", plot_out = "docs/img";
  bool list = false;
  BenchArgs args;
};

void run(const BenchCli& cli) {
  if (cli.list || (cli.cases.empty() && cli.plot.empty())) {
    fmt::print("benchmark cases:\n");
    for (const BenchCase& c : bench_cases()) fmt::print("  {:<16} {} ({} GPU{})\n", c.name, c.help, c.gpus, c.gpus > 1 ? "s" : "");
    return;
  }
  if (!cli.plot.empty()) {
    std::string cmd = "python3 scripts/plot_bench.py --out '" + cli.plot_out + "'";
    for (const std::string& f : cli.plot) cmd += " '" + f + "'";
    const int rc = std::system(cmd.c_str());
    FLEXEP_CHECK(rc == 0, "plotting failed (", cmd, "); it needs python3 with matplotlib");
    return;
  }
  int gpus = 0;
  BenchRun run = new_bench_run(device_description(gpus), gpus);
  for (const std::string& name : cli.cases) {
    const BenchCase* found = nullptr;
    for (const BenchCase& c : bench_cases())
      if (c.name == name) found = &c;
    if (!found) {
      std::string known;
      for (const BenchCase& c : bench_cases()) known += (known.empty() ? "" : ", ") + c.name;
      throw_argument_error("case", "'", name, "' is not a benchmark case; known: ", known.empty() ? "(none in this build)" : known);
    }
    FLEXEP_CHECK_ARG(gpus >= found->gpus, "case", "'", name, "' needs ", found->gpus, " GPU(s), this machine has ", gpus);
    found->fn(cli.args, run);
  }
  fmt::print("{}", format_table(run.records));
  fmt::print("wrote {}\n", write_bench_run(run, cli.out));
}
}  // namespace

void add_bench_command(CLI::App& app) {
  auto cli = std::make_shared<BenchCli>();
  CLI::App* cmd = app.add_subcommand("bench", "Run benchmark cases (JSON to bench/results/), or plot results");
  cmd->add_option("cases", cli->cases, "Case names (see --list)");
  cmd->add_flag("--list", cli->list, "List the cases");
  cmd->add_option("--backend", cli->args.backend, "Backend to run, or all");
  cmd->add_option("--routing", cli->args.routing, "uniform, zipf or hot");
  cmd->add_option("--zipf-s", cli->args.zipf_s, "Zipf exponent");
  cmd->add_option("--tokens", cli->args.tokens, "Tokens per rank (0 = case default)");
  cmd->add_option("--hidden", cli->args.hidden, "Hidden size (0 = case default)");
  cmd->add_option("--topk", cli->args.topk, "Experts per token (0 = case default)");
  cmd->add_option("--experts", cli->args.experts, "Experts (0 = case default)");
  cmd->add_option("--sms", cli->args.sms, "SM counts to sweep (backends with an SM setting)");
  cmd->add_option("--warmup", cli->args.warmup, "Warm-up repetitions")->check(CLI::NonNegativeNumber);
  cmd->add_option("--reps", cli->args.reps, "Timed repetitions")->check(CLI::PositiveNumber);
  cmd->add_option("--out", cli->out, "Folder for the JSON result");
  cmd->add_option("--plot", cli->plot, "Result JSON files to plot (PNG)");
  cmd->add_option("--plot-out", cli->plot_out, "Folder for the PNG charts");
  cmd->add_flag("--quiet", cli->args.quiet, "No progress output");
  cmd->callback([cli] { run(*cli); });
}

}  // namespace flexep::tools
