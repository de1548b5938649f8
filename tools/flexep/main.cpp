// The `flexep` program: train (the main job), plan, and (on GPU builds) bench.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>

#include "commands.h"
#include "flexep/core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"flexep: Mixture-of-Experts expert parallelism (router, token dispatchers, experts)"};
  app.require_subcommand(1);
  flexep::tools::add_train_command(app);
  flexep::tools::add_plan_command(app);
  flexep::tools::add_bench_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const flexep::Error& e) {
    spdlog::error("{}", e.what());
    return 2;
  }
  return flexep::tools::exit_code();
}
