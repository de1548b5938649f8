#include "flexep/cuda/cublas.h"

#include <map>
#include <memory>

#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

void throw_cublas_error(cublasStatus_t st, const char* expr, const char* file, int line) {
  throw_error("cuBLAS error ", cublasGetStatusName(st), " (", cublasGetStatusString(st), ") in ", expr, " at ", file,
              ":", line);
}

namespace {
struct HandleDeleter {
  void operator()(cublasHandle_t h) const { cublasDestroy(h); }
};
using HandlePtr = std::unique_ptr<std::remove_pointer_t<cublasHandle_t>, HandleDeleter>;
}  // namespace

cublasHandle_t cublas_handle(cudaStream_t stream) {
  thread_local std::map<int, HandlePtr> handles;
  int device = 0;
  FLEXEP_CUDA_CHECK(cudaGetDevice(&device));
  HandlePtr& h = handles[device];
  if (!h) {
    cublasHandle_t raw = nullptr;
    FLEXEP_CUBLAS_CHECK(cublasCreate(&raw));
    h.reset(raw);
  }
  FLEXEP_CUBLAS_CHECK(cublasSetStream(h.get(), stream));
  return h.get();
}

}  // namespace flexep::cuda
