#include "cli_checks.h"

#include <charconv>
#include <cmath>
#include <cstdlib>

#include <fmt/core.h>

namespace flexep::tools {

CLI::Validator whole_number(long long lo, long long hi) {
  const std::string allowed = fmt::format("a whole number from {} to {}", lo, hi);
  return CLI::Validator(
      [lo, hi, allowed](std::string& s) -> std::string {
        long long v = 0;
        const char* end = s.data() + s.size();
        const auto [p, ec] = std::from_chars(s.data(), end, v);
        if (ec == std::errc::result_out_of_range || (ec == std::errc() && p == end && (v < lo || v > hi)))
          return fmt::format("expected {}, got {}", allowed, s);
        if (ec != std::errc() || p != end) return fmt::format("expected {}, got '{}'", allowed, s);
        return "";
      },
      allowed);
}

CLI::Validator finite_number_above(double above) {
  const std::string allowed = fmt::format("a finite number above {}", above);
  return CLI::Validator(
      [above, allowed](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (s.empty() || end != s.c_str() + s.size()) return fmt::format("expected {}, got '{}'", allowed, s);
        if (!std::isfinite(v) || !(v > above)) return fmt::format("expected {}, got {}", allowed, s);
        return "";
      },
      allowed);
}

}  // namespace flexep::tools
