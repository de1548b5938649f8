// Helpers of the expert GPU tests (grouped GEMM, activation/bias kernels, CudaGroupedExperts): random
// bf16-exact data, uploads, NaN poisoning, error norms.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "cpu/same_bytes.h"
#include "flexep/core/error.h"
#include "flexep/core/random.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/grouped_gemm.h"
#include "flexep/cuda/runtime.h"

namespace flexep::testing {

// An f32 host tensor of N(mean, std) values already rounded to bf16, so that the bf16 device copy
// holds exactly the numbers the CPU reference sees.
inline Tensor bf16_exact(Shape shape, std::uint64_t seed, double std = 1.0, double mean = 0.0) {
  Tensor t = Tensor::empty(shape, DType::f32);
  fill_normal(t, seed, 4242, mean, std);
  return t.to(DType::bf16).to(DType::f32);
}

// t's values rounded to multiples of `step` and clamped to [-limit, limit]. Clamped activations
// make gradients discontinuous at the limit: a pre-activation the GPU rounds to bf16 (its GEMM
// output) and the f32 CPU reference does not can fall on either side of it. Grid inputs ({-1, 0, 1}
// tokens) and grid gate/up weights (multiples of 1/32) make every pre-activation exact in bf16 on
// both sides, so the two take the same side of every clamp.
inline Tensor on_grid(const Tensor& t, double step, double limit) {
  Tensor out = t.clone();
  for (std::int64_t i = 0; i < out.numel(); ++i) {
    const double v = std::round(read_as_double(t, i) / step) * step;
    write_from_double(out, i, std::min(limit, std::max(-limit, v)));
  }
  return out;
}

// A host vector as a 1-D tensor on GPU 0 (row tables, group offsets).
template <class T>
Tensor on_device(const std::vector<T>& v) {
  return cuda::to_device(Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())}), 0, nullptr);
}

// Group offsets [G + 1] from the groups' row counts.
inline std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& counts) {
  std::vector<std::int64_t> off(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), off.begin() + 1);
  return off;
}

inline Tensor to_gpu_bf16(const Tensor& host) { return cuda::to_device(host.to(DType::bf16), 0, nullptr); }
inline Tensor to_gpu(const Tensor& host) { return cuda::to_device(host, 0, nullptr); }
inline Tensor to_cpu_f32(const TensorView& d) { return cuda::to_host(d, nullptr).to(DType::f32); }

// 0xFF bytes are a NaN in bf16 and in f32: anything a call forgets to write stays NaN.
inline void poison(const TensorView& t) {
  if (t.nbytes()) FLEXEP_CUDA_CHECK(cudaMemset(t.data, 0xFF, t.nbytes()));
}
inline Tensor poisoned(Shape shape, DType dtype) {
  Tensor t = Tensor::empty(shape, dtype, Device::cuda(0));
  poison(t);
  return t;
}
inline bool is_poison_bf16(const Tensor& host_bf16, std::int64_t i) { return host_bf16.data<bf16>()[i].bits == 0xFFFF; }

// ||a - b|| / ||b|| over all elements (same shape, any floating dtype); +inf when a has a NaN/Inf.
// With ||b|| = 0 it returns ||a||.
inline double rel_error(const TensorView& a, const TensorView& b) {
  EXPECT_EQ(a.shape, b.shape);
  if (a.shape != b.shape) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    const double x = read_as_double(a, i), y = read_as_double(b, i);
    if (!std::isfinite(x)) return std::numeric_limits<double>::infinity();
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// Element i of rows [begin, end) of a 2-D host tensor are all exactly v.
inline bool rows_equal(const TensorView& t, std::int64_t begin, std::int64_t end, double v) {
  const std::int64_t cols = t.dim() == 2 ? t.size(1) : 1;
  for (std::int64_t i = begin * cols; i < end * cols; ++i)
    if (read_as_double(t, i) != v) return false;
  return true;
}

// `got` is `want` rounded to bf16: every element within half a bf16 ulp (2^-8 relative) plus
// `slack` times the largest |want| (fp32 summation-order differences). Names the first element off.
inline ::testing::AssertionResult within_bf16_rounding(const Tensor& got, const Tensor& want, double slack) {
  if (got.numel() != want.numel())
    return ::testing::AssertionFailure() << got.numel() << " elements, want " << want.numel();
  double largest = 0;
  for (std::int64_t i = 0; i < want.numel(); ++i) largest = std::max(largest, std::fabs(read_as_double(want, i)));
  for (std::int64_t i = 0; i < want.numel(); ++i) {
    const double w = read_as_double(want, i), g = read_as_double(got, i);
    if (!(std::fabs(w - g) <= std::ldexp(std::fabs(w), -8) + slack * largest))
      return ::testing::AssertionFailure() << "element " << i << ": " << g << ", want " << w;
  }
  return ::testing::AssertionSuccess();
}

// Sets the grouped GEMM's own-GEMM threshold for one scope (0: every expert its own cublasGemmEx).
class OwnGemmThreshold {
 public:
  explicit OwnGemmThreshold(std::int64_t macs) : previous_(cuda::grouped_gemm_own_gemm_min_work()) {
    cuda::set_grouped_gemm_own_gemm_min_work(macs);
  }
  ~OwnGemmThreshold() { cuda::set_grouped_gemm_own_gemm_min_work(previous_); }
  OwnGemmThreshold(const OwnGemmThreshold&) = delete;
  OwnGemmThreshold& operator=(const OwnGemmThreshold&) = delete;

 private:
  std::int64_t previous_;
};

// A view of nothing on cuda:0, for argument-validation tests (never dereferenced).
inline TensorView fake_cuda(Shape shape, DType dtype) { return TensorView(nullptr, dtype, shape, Device::cuda(0)); }

// f() must throw an ArgumentError naming `arg`.
template <class F>
void expect_arg_error(F&& f, const std::string& arg) {
  try {
    f();
    ADD_FAILURE() << "expected an ArgumentError naming '" << arg << "'";
  } catch (const ArgumentError& e) {
    EXPECT_EQ(e.argument(), arg) << e.what();
  }
}

}  // namespace flexep::testing
