#include "flexep/core/checks.h"

#include <cmath>
#include <vector>

namespace flexep::check {

namespace {
std::string list_dtypes(std::initializer_list<DType> allowed) {
  std::string s;
  for (DType t : allowed) s += detail::concat(s.empty() ? "" : ", ", dtype_name(t));
  return s;
}
}  // namespace

void defined(const TensorView& t, const std::string& arg) {
  FLEXEP_CHECK_ARG(t.defined(), arg, "is required but was not given");
}

void rank(const TensorView& t, int r, const std::string& arg) {
  defined(t, arg);
  FLEXEP_CHECK_ARG(t.dim() == r, arg, "expected a ", r, "-D tensor, got shape ", t.shape.str());
}

void shape(const TensorView& t, std::initializer_list<std::int64_t> expected, const std::string& arg) {
  rank(t, static_cast<int>(expected.size()), arg);
  int i = 0;
  for (std::int64_t e : expected) {
    if (e >= 0 && t.size(i) != e) {
      std::string want = "[";
      for (std::int64_t x : expected) {
        if (want.size() > 1) want += ", ";
        want += x >= 0 ? detail::concat(x) : "*";
      }
      want += "]";
      throw_argument_error(arg, "expected shape ", want, ", got ", t.shape.str(), " (dimension ", i,
                           " must be ", e, ")");
    }
    ++i;
  }
}

void dtype(const TensorView& t, std::initializer_list<DType> allowed, const std::string& arg) {
  for (DType a : allowed)
    if (t.dtype == a) return;
  throw_argument_error(arg, "dtype ", dtype_name(t.dtype), " is not supported; allowed: ", list_dtypes(allowed));
}

void device(const TensorView& t, Device expected, const std::string& arg) {
  FLEXEP_CHECK_ARG(t.device == expected, arg, "is on device ", t.device.str(), ", expected ", expected.str());
}

void same_device(const TensorView& a, const std::string& arg_a, const TensorView& b, const std::string& arg_b) {
  FLEXEP_CHECK_ARG(a.device == b.device, arg_b, "is on device ", b.device.str(), " but '", arg_a, "' is on ",
                   a.device.str(), "; both must be on the same device");
}

void finite(const TensorView& t, const std::string& arg) {
  if (!t.defined() || !is_floating(t.dtype)) return;
  FLEXEP_CHECK(t.device.is_cpu(), "check::finite is CPU only");
  const std::int64_t n = t.numel();
  const std::int64_t cols = t.dim() >= 2 ? t.size(t.dim() - 1) : 1;
  for (std::int64_t i = 0; i < n; ++i) {
    const double v = read_as_double(t, i);
    if (!std::isfinite(v))
      throw_argument_error(arg, "contains ", std::isnan(v) ? "NaN" : "Inf", " at ",
                           t.dim() >= 2 ? "row " + std::to_string(i / cols) + ", column " + std::to_string(i % cols)
                                        : "element " + std::to_string(i),
                           "; inputs must be finite (disable with check_finite=false)");
  }
}

void expert_indices(const TensorView& indices, int num_experts, const std::string& arg) {
  rank(indices, 2, arg);
  dtype(indices, {DType::i32, DType::i64}, arg);
  FLEXEP_CHECK(indices.device.is_cpu(), "check::expert_indices is CPU only");
  const std::int64_t T = indices.size(0), k = indices.size(1);
  std::vector<std::int64_t> row(static_cast<std::size_t>(k));
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = static_cast<std::int64_t>(read_as_double(indices, t * k + j));
      FLEXEP_CHECK_ARG(e >= -1 && e < num_experts, arg, "value ", e, " at [", t, ", ", j,
                       "] is out of range; allowed: -1 (no expert) <= id < ", num_experts, " (number of experts)");
      if (e >= 0)
        for (std::int64_t i = 0; i < j; ++i)
          FLEXEP_CHECK_ARG(row[static_cast<std::size_t>(i)] != e, arg, "token ", t, " lists expert ", e,
                           " twice (slots ", i, " and ", j, "); each expert may appear once per token");
      row[static_cast<std::size_t>(j)] = e;
    }
  }
}

}  // namespace flexep::check
