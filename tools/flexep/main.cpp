// The `flexep` program: train (the main job), plan, and (on GPU builds) bench.
//
// Exit codes: 0 success; 1 a training check failed (`flexep train`); 2 invalid input (a command
// line, a config file, or an argument the library refused: the message names it); 3 any other
// error (a timeout naming the phase and the peer, a device or library failure: the message says
// what failed).
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include <exception>
#include <string>

#include "commands.h"
#include "flexep/core/error.h"

namespace {

constexpr int kInvalidInput = 2, kInternal = 3;

// CLI11 answers an unknown first word with "A subcommand is required": name it and the choices.
bool unknown_command(const CLI::App& app, int argc, char** argv) {
  if (argc < 2 || argv[1][0] == '-') return false;
  const std::string word = argv[1];
  std::string names;
  for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
    if (sub->get_name() == word) return false;
    names += (names.empty() ? "" : ", ") + sub->get_name();
  }
  spdlog::error("unknown command '{}'; allowed: {}", word, names);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"flexep: Mixture-of-Experts expert parallelism (router, token dispatchers, experts)"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "flexep " FLEXEP_VERSION);
  flexep::tools::add_train_command(app);
  flexep::tools::add_plan_command(app);
  flexep::tools::add_bench_command(app);
  if (unknown_command(app, argc, argv)) return kInvalidInput;
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);  // prints the message (or the help)
    return code == 0 ? 0 : kInvalidInput;
  } catch (const flexep::ArgumentError& e) {
    spdlog::error("{}", e.what());
    return kInvalidInput;
  } catch (const flexep::Error& e) {
    spdlog::error("{}", e.what());
    return kInternal;
  } catch (const std::exception& e) {
    spdlog::error("internal error: {}", e.what());
    return kInternal;
  }
  return flexep::tools::exit_code();
}
