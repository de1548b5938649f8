// The deadline of a device wait: DispatcherOptions' timeout in seconds as the %globaltimer
// nanoseconds the kernels compare against, saturated below 2^64 so that a huge timeout means
// "practically never" rather than an overflow.
#pragma once

#include <cmath>

namespace flexep {

inline unsigned long long device_timeout_ns(double seconds) {
  const double ns = seconds * 1e9;
  return ns >= 1.8e19 ? 18000000000000000000ull : static_cast<unsigned long long>(std::llround(ns));
}

}  // namespace flexep
