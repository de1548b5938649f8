// Host side of launching hybridep kernels: how many ring stages of the kernels fit the shared
// memory of the device, and the launch itself (dynamic shared memory, optional programmatic
// dependent launch).
// Included by the kernel .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>

#include "dispatch/hybridep/device/ring.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

// Dynamic shared memory one CTA of `kernel` may use on the current device: the opt-in maximum per
// block (227 KB on H100/H200) less the kernel's static shared memory.
template <class Kernel>
std::size_t dynamic_smem_budget(Kernel kernel) {
  int device = 0, optin = 0;
  FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
  FLEXEP_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  FLEXEP_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const std::size_t fixed = attr.sharedSizeBytes;
  return static_cast<std::size_t>(optin) > fixed ? static_cast<std::size_t>(optin) - fixed : 0;
}

// dynamic_smem_budget() of one kernel, remembered per device (it never changes), so that a launch
// costs no attribute queries. One instance per kernel, at namespace scope next to it.
class SmemBudget {
 public:
  SmemBudget() {
    for (auto& c : cache_) c.store(-1, std::memory_order_relaxed);
  }
  template <class Kernel>
  std::size_t get(Kernel kernel) {
    int device = 0;
    FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
    const bool cached = device >= 0 && device < kDevices;
    if (cached) {
      const long long known = cache_[device].load(std::memory_order_relaxed);
      if (known >= 0) return static_cast<std::size_t>(known);
    }
    const std::size_t budget = dynamic_smem_budget(kernel);
    if (cached) cache_[device].store(static_cast<long long>(budget), std::memory_order_relaxed);
    return budget;
  }

 private:
  static constexpr int kDevices = 64;
  std::atomic<long long> cache_[kDevices];
};

// Raises `kernel`'s dynamic shared-memory limit to the budget (cudaFuncSetAttribute: per device,
// not a stream operation; called when a buffer is created, never during a capture).
template <class Kernel>
void raise_smem_limit(Kernel kernel) {
  FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(dynamic_smem_budget(kernel))));
}

// The deepest rings (at most max_stages stages each) that fit `budget`; stages = 0 when not even
// `min_stages` fit.
inline RingLayout fit_rings(int rings, std::size_t payload_bytes, std::size_t extra_bytes, int min_stages,
                            int max_stages, std::size_t budget) {
  RingLayout l;
  l.rings = rings;
  l.stage_bytes = static_cast<int>((payload_bytes + 127) / 128 * 128);
  l.extra_bytes = extra_bytes;
  for (int s = max_stages; s >= min_stages; --s) {
    l.stages = s;
    if (l.total_bytes() <= budget) return l;
  }
  l.stages = 0;
  return l;
}

// Launches `kernel` with `smem` bytes of dynamic shared memory; `programmatic`: it may start while
// the previous kernel on the stream finishes (the kernel calls tma::grid_dependency_wait() first).
template <class Kernel, class... Args>
void launch_kernel(Kernel kernel, int grid, int threads, std::size_t smem, cudaStream_t stream, bool programmatic,
                   const Args&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(threads));
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = programmatic ? 1 : 0;
  FLEXEP_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, args...));
}

}  // namespace flexep::hybridep
