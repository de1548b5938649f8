// What machine a benchmark ran on ("2x NVIDIA H200"), for the JSON record.
#include <string>

#ifdef FLEXEP_WITH_CUDA
#include <cuda_runtime.h>

#include "flexep/cuda/runtime.h"
#endif

namespace flexep::tools {

std::string device_description(int& gpus) {
#ifdef FLEXEP_WITH_CUDA
  gpus = cuda::device_count();
  if (gpus > 0) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, 0) == cudaSuccess) return std::to_string(gpus) + "x " + p.name;
  }
#endif
  gpus = 0;
  return "cpu";
}

}  // namespace flexep::tools
