// The configuration every rank must agree on before a dispatch can move data. Ranks exchange it
// first and compare; a difference is a user error reported on every rank with both values.
#pragma once

#include <cstdint>
#include <exception>
#include <vector>

#include "flexep/dispatch/dispatcher.h"

namespace flexep::host {

struct DispatchSignature {
  int experts = 0;
  bool multihot = false;
  std::int64_t hidden = 0;
  DType hidden_dtype = DType::f32;
  std::int64_t topk = 0;  // compared only in the top-k form (multihot derives k from the data)
  DType weight_dtype = DType::f32;
  // Options that shape the output layout. check_finite only affects local validation, so ranks
  // may differ in it.
  DispatchMode mode = DispatchMode::blocking;
  std::int64_t pad_multiple = 1;
  std::int64_t budget_rows = 0;  // compared in budget mode only
  OverflowPolicy overflow = OverflowPolicy::error;
};

// Null when every rank agrees with rank 0; otherwise an ArgumentError naming the first field
// that differs, the first rank that differs and both values.
std::exception_ptr compare_signatures(const std::vector<const DispatchSignature*>& sigs);

}  // namespace flexep::host
