// A one-line progress bar on stderr when it is a terminal (redrawn at most ten times a second),
// periodic lines otherwise (CI logs: the first step, every tenth of the work, at least one line every
// ten seconds, and the last step), with the time left at the rate so far.
#pragma once

#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <fmt/core.h>

namespace flexep::tools {

class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  Progress(std::int64_t total, std::string label)
      : total_(total), label_(std::move(label)), tty_(isatty(fileno(stderr))), start_(Clock::now()), shown_(start_) {}

  void update(std::int64_t done, const std::string& status) {
    const Clock::time_point now = Clock::now();
    const bool last = done >= total_;
    const double since_shown = std::chrono::duration<double>(now - shown_).count();
    const std::int64_t tenth = total_ / 10 > 0 ? total_ / 10 : 1;
    const bool due = tty_ ? since_shown >= 0.1 : (done == 1 || done / tenth != shown_done_ / tenth || since_shown >= 10);
    if (!last && !due) return;
    shown_ = now;
    shown_done_ = done;
    const std::string left = last ? "" : time_left(done, now);
    if (tty_) {
      const int width = 30;
      const int filled = total_ ? static_cast<int>(done * width / total_) : width;
      fmt::print(stderr, "\r{} [{}{}] {}/{} {}{}", label_, std::string(static_cast<std::size_t>(filled), '='),
                 std::string(static_cast<std::size_t>(width - filled), ' '), done, total_, status, left);
      if (last) fmt::print(stderr, "\n");
      std::fflush(stderr);
    } else {
      fmt::print(stderr, "{} {}/{} {}{}\n", label_, done, total_, status, left);
    }
  }

 private:
  // ", about 3 min left" at the average rate since the start.
  std::string time_left(std::int64_t done, Clock::time_point now) const {
    const double elapsed = std::chrono::duration<double>(now - start_).count();
    if (done <= 0 || elapsed < 1) return "";
    const double left = elapsed * static_cast<double>(total_ - done) / static_cast<double>(done);
    if (left < 90) return fmt::format(", about {:.0f} s left", left);
    if (left < 90 * 60) return fmt::format(", about {:.0f} min left", left / 60);
    return fmt::format(", about {:.1f} h left", left / 3600);
  }

  std::int64_t total_;
  std::string label_;
  bool tty_;
  Clock::time_point start_, shown_;
  std::int64_t shown_done_ = 0;
};

}  // namespace flexep::tools
