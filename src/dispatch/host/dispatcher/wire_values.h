// Element conversions of the host backend's sums: rows cross the wire in the hidden dtype (Elem)
// and are accumulated in fp32 (fp64 for f64), exactly as the GPU backends do.
#pragma once

#include <type_traits>

#include "flexep/core/dtype.h"

namespace flexep::host {

template <class Acc, class Elem>
Acc widen(Elem v) {
  if constexpr (std::is_same_v<Elem, Acc>)
    return v;
  else
    return v.to_float();
}

// `v` stored as Elem.
template <class Elem, class Acc>
Elem narrow(Acc v) {
  if constexpr (std::is_same_v<Elem, bf16>)
    return bf16::from_float(v);
  else if constexpr (std::is_same_v<Elem, f16>)
    return f16::from_float(v);
  else
    return v;
}

// The value of `v` after a round trip through the wire dtype Elem.
template <class Elem, class Acc>
Acc round_to(Acc v) {
  return widen<Acc>(narrow<Elem>(v));
}

// fn.template operator()<Acc, Elem>() for the dtype of the rows; false when it has none.
template <class Fn>
bool with_row_types(DType dt, Fn&& fn) {
  switch (dt) {
    case DType::f64:
      fn.template operator()<double, double>();
      return true;
    case DType::f32:
      fn.template operator()<float, float>();
      return true;
    case DType::bf16:
      fn.template operator()<float, bf16>();
      return true;
    case DType::f16:
      fn.template operator()<float, f16>();
      return true;
    default:
      return false;
  }
}

}  // namespace flexep::host
