// `flexep bench CASE...`: runs named benchmark cases, prints a table and writes one JSON file per run
// to bench/results/ (docs/benchmarks.md). `flexep bench --plot FILES...` turns result files into PNG charts
// (through scripts/plot_bench.py and matplotlib).
#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include <fmt/core.h>

#include "bench_cases.h"
#include "cli_checks.h"
#include "bench_processes.h"
#include "commands.h"
#include "run_program.h"
#include "flexep/core/error.h"
#include "flexep/core/synthetic_routing.h"

namespace flexep::tools {

std::string device_description(int& gpus);  // bench_device.cpp

std::vector<BenchCase>& bench_cases() {
  static std::vector<BenchCase> cases;
  return cases;
}

namespace {
struct BenchCli {
  std::vector<std::string> cases, plot, sweep;
  std::string out = "bench/results", plot_out = "bench-plots";
  bool list = false;
  BenchArgs args;
};

// A swept value as the option of the same name takes it (the same validator, the same message).
template <class T>
T checked_value(const std::string& v, const CLI::Validator& check, const std::string& key) {
  std::string text = v;
  const std::string err = check(text);
  if (!err.empty()) throw_argument_error("--sweep", key, "=", v, ": ", err);
  return static_cast<T>(std::stod(text));
}

// One "key=v1,v2,..." sweep dimension applied to a copy of the arguments.
void apply_sweep_value(BenchArgs& a, const std::string& key, const std::string& v) {
  try {
    if (key == "tokens") a.tokens = checked_value<long long>(v, whole_number(0, 1 << 30), key);
    else if (key == "hidden") a.hidden = checked_value<int>(v, whole_number(0, 1 << 20), key);
    else if (key == "topk") a.topk = checked_value<int>(v, whole_number(0, 1 << 16), key);
    else if (key == "experts") a.experts = checked_value<int>(v, whole_number(0, 1 << 16), key);
    else if (key == "routing") a.routing = (parse_routing(v, "--sweep routing"), v);
    else if (key == "zipf_s") a.zipf_s = checked_value<double>(v, finite_number_above(0), key);
    else if (key == "backend") a.backend = v;
    else throw_argument_error("--sweep", "'", key, "' cannot be swept; allowed: tokens, hidden, topk, experts, routing, "
                              "zipf_s, backend (SM counts: --sms)");
  } catch (const std::logic_error&) {
    throw_argument_error("--sweep", "value '", v, "' of '", key, "' is not valid");
  }
}

// The cartesian product of the sweep dimensions over the base arguments.
std::vector<std::pair<BenchArgs, std::string>> expand_sweep(const BenchArgs& base, const std::vector<std::string>& sweep) {
  std::vector<std::pair<BenchArgs, std::string>> points{{base, ""}};
  for (const std::string& dim : sweep) {
    const std::size_t eq = dim.find('=');
    FLEXEP_CHECK_ARG(eq != std::string::npos && eq > 0, "--sweep", "'", dim, "' is not key=v1,v2,...");
    const std::string key = dim.substr(0, eq);
    std::vector<std::string> values;
    std::size_t start = eq + 1;
    while (start <= dim.size()) {
      const std::size_t comma = dim.find(',', start);
      values.push_back(dim.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
      if (comma == std::string::npos) break;
      start = comma + 1;
    }
    std::vector<std::pair<BenchArgs, std::string>> next;
    for (const auto& [args, label] : points)
      for (const std::string& v : values) {
        BenchArgs a = args;
        apply_sweep_value(a, key, v);
        next.emplace_back(a, label + (label.empty() ? "" : " ") + key + "=" + v);
      }
    points = std::move(next);
  }
  return points;
}

void run(const BenchCli& cli) {
  if (cli.list || (cli.cases.empty() && cli.plot.empty())) {
    fmt::print("benchmark cases:\n");
    for (const BenchCase& c : bench_cases()) fmt::print("  {:<16} {} ({} GPU{})\n", c.name, c.help, c.gpus, c.gpus > 1 ? "s" : "");
    return;
  }
  if (!cli.plot.empty()) {
    const std::string script = "scripts/plot_bench.py";
    FLEXEP_CHECK_ARG(std::filesystem::exists(script), "--plot", "needs ", script, ", which is not under ",
                     std::filesystem::current_path().string(), ": run it from the repository's root");
    // The file names go to the script as arguments, never through a shell.
    std::vector<std::string> argv{"python3", script, "--out", cli.plot_out};
    argv.insert(argv.end(), cli.plot.begin(), cli.plot.end());
    const int rc = run_program(argv);
    FLEXEP_CHECK(rc == 0, "plotting failed: ", script, " exited with status ", rc,
                 "; its message is above (it needs python3 with matplotlib)");
    return;
  }
  parse_routing(cli.args.routing, "--routing");  // before any case is looked at (or found to need GPUs)
  const auto points = expand_sweep(cli.args, cli.sweep);  // validated before anything runs
  int gpus = 0;  // on the machine; the run records how many its cases used
  const std::string device = device_description(gpus);
  BenchRun run = new_bench_run(device, 0);
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
    for (std::size_t i = 0; i < points.size(); ++i) {
      if (points.size() > 1 && !cli.args.quiet)
        fmt::print(stderr, "[{}/{}] {} {}\n", i + 1, points.size(), name, points[i].second);
      found->fn(points[i].first, run);
    }
    run.gpus = std::max(run.gpus, found->gpus);  // cases that use more (one rank per GPU) raise it themselves
  }
  if (process_rank().rank != 0) return;  // one rank per process: rank 0 reports for all
  fmt::print("{}", format_table(run.records));
  fmt::print("wrote {}\n", write_bench_run(run, cli.out));
}
}  // namespace

void add_bench_command(CLI::App& app) {
  auto cli = std::make_shared<BenchCli>();
  CLI::App* cmd = app.add_subcommand("bench", "Run benchmark cases (JSON to bench/results/), or plot results");
  cmd->add_option("cases", cli->cases, "Case names (see --list)");
  cmd->add_flag("--list", cli->list, "List the cases");
  cmd->add_option("--backend", cli->args.backend, "Backend to run, or all")
      ->check(CLI::IsMember({"all", "alltoall", "torch", "hybridep", "deepep"}));
  cmd->add_option("--routing", cli->args.routing, "uniform, zipf or hot");
  cmd->add_option("--zipf-s", cli->args.zipf_s, "Zipf exponent")->check(finite_number_above(0));
  cmd->add_option("--tokens", cli->args.tokens, "Tokens per rank (0 = case default)")->check(whole_number(0, 1 << 30));
  cmd->add_option("--hidden", cli->args.hidden, "Hidden size (0 = case default)")->check(whole_number(0, 1 << 20));
  cmd->add_option("--topk", cli->args.topk, "Experts per token (0 = case default)")->check(whole_number(0, 1 << 16));
  cmd->add_option("--experts", cli->args.experts, "Experts (0 = case default)")->check(whole_number(0, 1 << 16));
  // One argument, split here: a list option would take the case names that follow it as counts.
  cmd->add_option_function<std::string>(
         "--sms",
         [cli](const std::string& list) {
           cli->args.sms.clear();
           std::size_t start = 0;
           while (start <= list.size()) {
             const std::size_t comma = list.find(',', start);
             std::string item = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
             if (const std::string why = whole_number(1, 1024)(item); !why.empty()) throw CLI::ValidationError("--sms", why);
             cli->args.sms.push_back(std::stoi(item));
             if (comma == std::string::npos) break;
             start = comma + 1;
           }
         },
         "SM counts to sweep (backends with an SM setting), one comma-separated list, e.g. 16,32");
  cmd->add_option("--hybridep-part-tokens", cli->args.hybridep_part_tokens,
                  "tokens per work item of the hybridep kernels: 0 (chosen per call), 1, 2, 4, 8, 16 or 32")
      ->check(CLI::IsMember({0, 1, 2, 4, 8, 16, 32}));
  cmd->add_option("--sweep", cli->sweep, "Sweep a dimension: key=v1,v2,... (tokens, hidden, topk, experts, routing, "
                  "zipf_s, backend); repeat for a cartesian product");
  cmd->add_option("--warmup", cli->args.warmup, "Warm-up repetitions")->check(whole_number(0, 1000000));
  cmd->add_option("--reps", cli->args.reps, "Timed repetitions")->check(whole_number(1, 1000000));
  cmd->add_option("--out", cli->out, "Folder for the JSON result");
  cmd->add_option("--plot", cli->plot, "Result JSON files to plot (PNG)")->check(CLI::ExistingFile);
  cmd->add_option("--plot-out", cli->plot_out, "Folder for the PNG charts (docs/img: the charts of docs/)");
  cmd->add_flag("--quiet", cli->args.quiet, "No progress output");
  cmd->callback([cli] { run(*cli); });
}

}  // namespace flexep::tools
