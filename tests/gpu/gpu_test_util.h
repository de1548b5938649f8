// Shared helpers of the GPU tests. These tests run only on the device machine (ctest label gpu);
// without enough GPUs they fail with a clear message rather than skip, so a misconfigured run is
// never reported as a pass.
#pragma once

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "flexep/cuda/runtime.h"

namespace flexep::testing {

// Use as: if (!require_gpus(2)) return;
inline bool require_gpus(int n) {
  const int have = cuda::device_count();
  if (have < n) {
    ADD_FAILURE() << "this test needs " << n << " GPU(s), found " << have;
    return false;
  }
  cuda::init();
  return true;
}

// A device tensor's elements on the host, as T (synchronises `s`).
template <class T>
std::vector<T> host_vector(const TensorView& d, cudaStream_t s) {
  const Tensor h = cuda::to_host(d, s);
  std::vector<T> v(static_cast<std::size_t>(h.numel()));
  if (h.nbytes()) std::memcpy(v.data(), h.raw(), h.nbytes());
  return v;
}

}  // namespace flexep::testing
