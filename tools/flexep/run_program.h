// Runs a program with its arguments as given, no shell in between (a file name is never parsed as
// shell syntax), and waits for it. Returns its exit status; a program killed by signal s gives
// 128 + s, as shells report it. Throws when the program cannot be started.
#pragma once

#include <string>
#include <vector>

namespace flexep::tools {

int run_program(const std::vector<std::string>& argv);

}  // namespace flexep::tools
