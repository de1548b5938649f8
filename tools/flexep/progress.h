// A one-line progress bar on stderr when it is a terminal, periodic lines otherwise (CI logs).
#pragma once

#include <unistd.h>

#include <cstdio>
#include <string>

#include <fmt/core.h>

namespace flexep::tools {

class Progress {
 public:
  Progress(int total, std::string label) : total_(total), label_(std::move(label)), tty_(isatty(fileno(stderr))) {}

  void update(int done, const std::string& status) {
    if (tty_) {
      const int width = 30;
      const int filled = total_ ? done * width / total_ : width;
      fmt::print(stderr, "\r{} [{}{}] {}/{} {}", label_, std::string(static_cast<std::size_t>(filled), '='),
                 std::string(static_cast<std::size_t>(width - filled), ' '), done, total_, status);
      if (done == total_) fmt::print(stderr, "\n");
      std::fflush(stderr);
    } else if (done == 1 || done == total_ || done % std::max(1, total_ / 10) == 0) {
      fmt::print(stderr, "{} {}/{} {}\n", label_, done, total_, status);
    }
  }

 private:
  int total_;
  std::string label_;
  bool tty_;
};

}  // namespace flexep::tools
