#include "run_program.h"

#include <spawn.h>
#include <sys/wait.h>

#include <cerrno>
#include <cstring>

#include "flexep/core/checks.h"

extern char** environ;

namespace flexep::tools {

int run_program(const std::vector<std::string>& argv) {
  FLEXEP_CHECK(!argv.empty(), "run_program: no program given");
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  pid_t pid = 0;
  const int err = posix_spawnp(&pid, args[0], nullptr, nullptr, args.data(), environ);
  FLEXEP_CHECK(err == 0, "cannot start '", argv[0], "': ", std::strerror(err));
  int status = 0;
  while (waitpid(pid, &status, 0) < 0)
    FLEXEP_CHECK(errno == EINTR, "waiting for '", argv[0], "': ", std::strerror(errno));
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

}  // namespace flexep::tools
