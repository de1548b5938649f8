// Row-major GEMM on cublasGemmEx. A row-major X [r, c] is the column-major X^T (c x r, leading
// dimension c), so C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T: cuBLAS gets
// B first and A second with the same op flags, m and n swapped, and each leading dimension is the
// column count of the stored row-major matrix.
#include "flexep/cuda/dense.h"

#include <algorithm>
#include <climits>

#include "flexep/core/checks.h"
#include "flexep/cuda/cublas.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

namespace {
int as_int(std::int64_t v, const char* arg) {
  FLEXEP_CHECK_ARG(v <= INT_MAX, arg, "dimension ", v, " exceeds the int range cuBLAS takes");
  return static_cast<int>(std::max<std::int64_t>(v, 1));
}
}  // namespace

void gemm(const TensorView& a, bool trans_a, const TensorView& b, bool trans_b, const TensorView& c, float alpha,
          float beta, cudaStream_t stream) {
  check::rank(a, 2, "a");
  check::dtype(a, {DType::bf16}, "a");
  FLEXEP_CHECK_ARG(a.device.is_cuda(), "a", "must be a CUDA tensor, got one on ", a.device.str());
  check::rank(b, 2, "b");
  check::dtype(b, {DType::bf16}, "b");
  check::same_device(a, "a", b, "b");
  check::rank(c, 2, "c");
  check::dtype(c, {DType::bf16, DType::f32}, "c");
  check::same_device(a, "a", c, "c");
  const std::int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
  const std::int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
  FLEXEP_CHECK_ARG(kb == k, "b", "op(b) has ", kb, " rows but op(a) has ", k, " columns (a ", a.shape.str(),
                   trans_a ? " transposed" : "", ", b ", b.shape.str(), trans_b ? " transposed" : "", ")");
  check::shape(c, {m, n}, "c");
  const int lda = as_int(a.size(1), "a"), ldb = as_int(b.size(1), "b"), mm = as_int(m, "a"), nn = as_int(n, "b");
  as_int(k, "a");
  if (m == 0 || n == 0) return;
  DeviceGuard guard(a.device.index);
  if (k == 0) {
    FLEXEP_CHECK_ARG(beta == 0.f || beta == 1.f, "beta", "with k = 0 only beta 0 or 1 is supported, got ", beta);
    if (beta == 0.f) zero_async(c, stream);
    return;
  }
  cublasHandle_t handle = cublas_handle(stream);
  FLEXEP_CUBLAS_CHECK(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST));
  const cudaDataType_t ctype = c.dtype == DType::f32 ? CUDA_R_32F : CUDA_R_16BF;
  // Column-major: C^T (n x m, ld n) = op(B)^T (n x k) * op(A)^T (k x m).
  FLEXEP_CUBLAS_CHECK(cublasGemmEx(handle, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, nn,
                                   mm, static_cast<int>(k), &alpha, b.data, CUDA_R_16BF, ldb, a.data, CUDA_R_16BF, lda,
                                   &beta, c.data, ctype, nn, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace flexep::cuda
