// Argument validation shared by every entry point: shapes, dtypes and devices are checked before
// any work starts, and the error names the argument as the user called it.
#pragma once

#include <initializer_list>
#include <string>

#include "flexep/core/tensor.h"

namespace flexep::check {

void defined(const TensorView& t, const std::string& arg);
void rank(const TensorView& t, int rank, const std::string& arg);
// shape must equal `expected`; a -1 in `expected` accepts any size in that dimension.
void shape(const TensorView& t, std::initializer_list<std::int64_t> expected, const std::string& arg);
void dtype(const TensorView& t, std::initializer_list<DType> allowed, const std::string& arg);
void device(const TensorView& t, Device expected, const std::string& arg);
void same_device(const TensorView& a, const std::string& arg_a, const TensorView& b, const std::string& arg_b);
// No NaN or Inf anywhere in a floating CPU tensor; names the first bad element.
void finite(const TensorView& t, const std::string& arg);
// Expert ids in [-1, num_experts) and no expert repeated within a row (CPU tensor [T, k]).
void expert_indices(const TensorView& indices, int num_experts, const std::string& arg);

}  // namespace flexep::check
