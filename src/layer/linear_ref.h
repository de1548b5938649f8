// Row-major matrix products for the CPU references (grouped and shared experts), in float or
// double. Every product is arranged so that the innermost loop walks contiguous memory: the
// "axpy" forms (C += a * row) vectorise directly, and the dot products keep eight independent
// partial sums so the compiler can vectorise them without reassociating (no -ffast-math needed).
// The summation order is fixed, so results are deterministic run to run.
#pragma once

#include <cstdint>

namespace flexep::ref {

template <class T>
inline void axpy(std::int64_t n, T alpha, const T* x, T* y) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

template <class T>
inline T dot(std::int64_t n, const T* x, const T* y) {
  T s[8] = {};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) s[l] += x[i + l] * y[i + l];
  T r = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
  for (; i < n; ++i) r += x[i] * y[i];
  return r;
}

// C[M, N] += A[M, K] * B[K, N]
template <class T>
inline void gemm_nn_acc(std::int64_t M, std::int64_t K, std::int64_t N, const T* A, const T* B, T* C) {
  for (std::int64_t m = 0; m < M; ++m) {
    const T* a = A + m * K;
    T* c = C + m * N;
    for (std::int64_t k = 0; k < K; ++k) axpy(N, a[k], B + k * N, c);
  }
}

// C[M, N] += A[M, K] * B[N, K]^T  (B given row-major as [N, K], e.g. an nn.Linear weight)
template <class T>
inline void gemm_nt_acc(std::int64_t M, std::int64_t K, std::int64_t N, const T* A, const T* B, T* C) {
  for (std::int64_t m = 0; m < M; ++m) {
    const T* a = A + m * K;
    T* c = C + m * N;
    for (std::int64_t n = 0; n < N; ++n) c[n] += dot(K, a, B + n * K);
  }
}

// C[M, N] += A[K, M]^T * B[K, N]  (weight gradients: a sum of outer products over the K rows)
template <class T>
inline void gemm_tn_acc(std::int64_t K, std::int64_t M, std::int64_t N, const T* A, const T* B, T* C) {
  for (std::int64_t k = 0; k < K; ++k) {
    const T* a = A + k * M;
    const T* b = B + k * N;
    for (std::int64_t m = 0; m < M; ++m) axpy(N, a[m], b, C + m * N);
  }
}

// out[N] += sum over the M rows of A[M, N]
template <class T>
inline void sum_rows_acc(std::int64_t M, std::int64_t N, const T* A, T* out) {
  for (std::int64_t m = 0; m < M; ++m) axpy(N, T(1), A + m * N, out);
}

}  // namespace flexep::ref
