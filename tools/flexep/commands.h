// Subcommands of the flexep program. Each registers its options and a callback on the CLI11 app.
#pragma once

#include <CLI/CLI.hpp>

namespace flexep::tools {

void add_train_command(CLI::App& app);
void add_plan_command(CLI::App& app);
void add_bench_command(CLI::App& app);
// Exit status set by the command that ran (0 = success, 1 = a check failed).
int exit_code();
void set_exit_code(int code);

}  // namespace flexep::tools
