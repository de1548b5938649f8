#include "flexep/core/warn_once.h"

#include <mutex>
#include <set>

#include <spdlog/spdlog.h>

namespace flexep {

bool warn_once(const std::string& message) {
  static std::mutex lock;
  static std::set<std::string> seen;
  {
    const std::lock_guard<std::mutex> hold(lock);
    if (!seen.insert(message).second) return false;
  }
  spdlog::warn("flexep: {}", message);
  return true;
}

}  // namespace flexep
