#include "core/gate_rules.h"

#include "flexep/core/checks.h"
#include "flexep/core/error.h"

namespace flexep::gate_rules {

void validate_precision_and_groups(const MoEConfig& c, std::optional<DType> precision) {
  const int E = c.n_routed_experts, k = c.n_activated_experts;
  if (precision)
    FLEXEP_CHECK_ARG(*precision == DType::f32 || *precision == DType::f64, "backend.gate_precision", "dtype ",
                     dtype_name(*precision), " is not supported; allowed: f32, f64 (or unset)");
  FLEXEP_CHECK_ARG(c.n_expert_groups >= 0, "moe.n_expert_groups", "must be >= 0 (0 or 1 = no grouping), got ",
                   c.n_expert_groups);
  if (!uses_groups(c)) return;
  const int G = c.n_expert_groups;
  FLEXEP_CHECK_ARG(E % G == 0, "moe.n_expert_groups", G, " does not divide moe.n_routed_experts = ", E);
  FLEXEP_CHECK_ARG(!top2_group_score(c) || E / G >= 2, "moe.n_expert_groups", G, " groups of ", E / G,
                   " expert(s): the group score sums the top-2 experts of a group, so each group needs >= 2 "
                   "experts (at most ", E / 2, " groups)");
  FLEXEP_CHECK_ARG(c.n_limited_groups >= 1 && c.n_limited_groups <= G, "moe.n_limited_groups",
                   "must be in [1, moe.n_expert_groups = ", G, "], got ", c.n_limited_groups);
  FLEXEP_CHECK_ARG(k <= c.n_limited_groups * (E / G), "moe.n_activated_experts", k,
                   " exceeds the experts of the kept groups (moe.n_limited_groups * experts per group = ",
                   c.n_limited_groups * (E / G), ")");
}

std::vector<std::int64_t> read_replay_indices(const TensorView& r, std::int64_t T, int k, int E) {
  check::shape(r, {T, k}, "replay_indices");
  check::dtype(r, {DType::i32, DType::i64}, "replay_indices");
  check::device(r, Device::cpu(), "replay_indices");
  std::vector<std::int64_t> v(static_cast<std::size_t>(T * k));
  for (std::int64_t t = 0; t < T; ++t)
    for (int j = 0; j < k; ++j) {
      const std::int64_t i = t * k + j;
      const std::int64_t e = r.dtype == DType::i64 ? r.ptr<std::int64_t>()[i] : r.ptr<std::int32_t>()[i];
      FLEXEP_CHECK_ARG(e >= 0 && e < E, "replay_indices", "token ", t, " slot ", j, " is ", e, "; allowed: 0 <= id < ",
                       E);
      for (int q = 0; q < j; ++q)
        FLEXEP_CHECK_ARG(v[static_cast<std::size_t>(t * k + q)] != e, "replay_indices", "token ", t,
                         " selects expert ", e, " twice (slots ", q, " and ", j, "); an expert at most once per token");
      v[static_cast<std::size_t>(i)] = e;
    }
  return v;
}

}  // namespace flexep::gate_rules
