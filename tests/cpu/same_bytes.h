// Bitwise equality of two CPU tensors for gtest, naming the first differing element.
#pragma once

#include <gtest/gtest.h>

#include <cstring>

#include "flexep/core/tensor.h"

namespace flexep::testing {

inline ::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.dtype() != b.dtype()) return ::testing::AssertionFailure() << "dtypes differ";
  if (a.shape() != b.shape())
    return ::testing::AssertionFailure() << "shapes differ: " << a.shape().str() << " vs " << b.shape().str();
  // Empty tensors may have null data: memcmp must not see them (UBSan).
  if (a.nbytes() != 0 && std::memcmp(a.raw(), b.raw(), a.nbytes()) != 0) {
    const std::size_t es = element_size(a.dtype());
    for (std::int64_t i = 0; i < a.numel(); ++i)
      if (std::memcmp(static_cast<const char*>(a.raw()) + i * es, static_cast<const char*>(b.raw()) + i * es, es))
        return ::testing::AssertionFailure() << "first difference at element " << i << " of " << a.numel() << ": "
                                             << read_as_double(a, i) << " vs " << read_as_double(b, i);
  }
  return ::testing::AssertionSuccess();
}

}  // namespace flexep::testing
