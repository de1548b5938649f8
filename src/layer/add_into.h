// acc += x, element by element, for the CPU reference layer (f32 or f64, the same count): the
// shared experts' output into the routed one, a backward's gradients into those already there.
#pragma once

#include "flexep/core/error.h"
#include "flexep/core/tensor.h"

namespace flexep::ref {

inline void add_into(const Tensor& acc, const TensorView& x) {
  FLEXEP_CHECK(acc.dtype() == x.dtype && acc.numel() == x.numel(), "add_into: mismatched tensors");
  if (acc.dtype() == DType::f64) {
    double* a = acc.data<double>();
    const double* b = x.ptr<double>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] += b[i];
  } else {
    float* a = acc.data<float>();
    const float* b = x.ptr<float>();
    for (std::int64_t i = 0; i < acc.numel(); ++i) a[i] += b[i];
  }
}

}  // namespace flexep::ref
