// cuBLAS handles: one per (thread, device), created on first use and bound to the caller's stream
// at each call, so kernels of different threads never share a handle's workspace.
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#define FLEXEP_CUBLAS_CHECK(expr)                                                                   \
  do {                                                                                              \
    const cublasStatus_t flexep_st_ = (expr);                                                       \
    if (flexep_st_ != CUBLAS_STATUS_SUCCESS) ::flexep::cuda::throw_cublas_error(flexep_st_, #expr, __FILE__, __LINE__); \
  } while (0)

namespace flexep::cuda {

[[noreturn]] void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line);

// The calling thread's handle for the current device, set to `stream`.
cublasHandle_t cublas_handle(cudaStream_t stream);

}  // namespace flexep::cuda
