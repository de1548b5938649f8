#include "flexep/core/plan.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "flexep/core/checks.h"

namespace flexep {

namespace {
std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

std::int64_t index_at(const TensorView& indices, std::int64_t i) {
  return indices.dtype == DType::i64 ? indices.ptr<std::int64_t>()[i]
                                     : static_cast<std::int64_t>(indices.ptr<std::int32_t>()[i]);
}
}  // namespace

void validate(const PlanParams& p) {
  FLEXEP_CHECK_ARG(p.ranks >= 1, "ranks", "must be >= 1, got ", p.ranks);
  FLEXEP_CHECK_ARG(p.experts >= 1, "num_experts", "must be >= 1, got ", p.experts);
  FLEXEP_CHECK_ARG(p.experts % p.ranks == 0, "num_experts", p.experts, " is not divisible by the ",
                   p.ranks, " ranks of the expert-parallel group; choose E = ranks * experts_per_rank");
  // Bounds far above any use that keep every row count of a plan (rows per expert padded, a
  // budget's buffers) inside 64-bit arithmetic and 32-bit row indices.
  constexpr std::int64_t kMaxPad = 1 << 16, kMaxBudget = (std::int64_t{1} << 31) - 1;
  FLEXEP_CHECK_ARG(p.pad_multiple >= 1 && p.pad_multiple <= kMaxPad, "pad_multiple", "is ", p.pad_multiple,
                   "; allowed: 1 to ", kMaxPad);
  if (p.budget_rows) {
    FLEXEP_CHECK_ARG(*p.budget_rows >= 0 && *p.budget_rows <= kMaxBudget, "budget_rows", "is ", *p.budget_rows,
                     "; allowed: 0 to ", kMaxBudget, " rows");
    FLEXEP_CHECK_ARG(*p.budget_rows % p.pad_multiple == 0, "budget_rows", *p.budget_rows,
                     " is not a multiple of pad_multiple ", p.pad_multiple);
  }
}

std::int64_t DispatchPlan::dropped() const {
  std::int64_t d = 0;
  for (const auto& r : ranks) d += r.dropped;
  return d;
}

DispatchPlan DispatchPlan::build(const std::vector<std::int64_t>& counts, const PlanParams& params) {
  validate(params);
  const int R = params.ranks, E = params.experts, L = params.local_experts();
  FLEXEP_CHECK(counts.size() == static_cast<std::size_t>(R) * static_cast<std::size_t>(E),
               "DispatchPlan::build: counts has ", counts.size(), " entries, expected ranks*experts = ", R * E);
  DispatchPlan plan;
  plan.params = params;
  plan.ranks.resize(static_cast<std::size_t>(R));
  for (int r = 0; r < R; ++r) {
    RankLayout& lay = plan.ranks[static_cast<std::size_t>(r)];
    lay.tokens_per_expert.assign(static_cast<std::size_t>(L), 0);
    lay.expert_begin.assign(static_cast<std::size_t>(L), 0);
    lay.kept_rows.assign(static_cast<std::size_t>(L), 0);
    lay.source_begin.assign(static_cast<std::size_t>(L) * static_cast<std::size_t>(R), 0);
    std::int64_t row = 0;
    for (int e = 0; e < L; ++e) {
      const int global = r * L + e;
      lay.expert_begin[static_cast<std::size_t>(e)] = row;
      std::int64_t real = 0;
      for (int s = 0; s < R; ++s) {
        lay.source_begin[static_cast<std::size_t>(e) * static_cast<std::size_t>(R) + static_cast<std::size_t>(s)] =
            row + real;
        real += counts[static_cast<std::size_t>(s) * static_cast<std::size_t>(E) + static_cast<std::size_t>(global)];
      }
      row += round_up(real, params.pad_multiple);
      lay.kept_rows[static_cast<std::size_t>(e)] = real;
    }
    lay.required_rows = row;
    lay.out_rows = row;
    if (params.budget_rows) {
      const std::int64_t budget = *params.budget_rows;
      lay.out_rows = budget;
      if (row > budget) {
        if (params.overflow == OverflowPolicy::error)
          throw_error("dispatch overflow: rank ", r, " needs ", row, " expert-major rows (padded to multiples of ",
                      params.pad_multiple, ") but budget_rows is ", budget,
                      "; raise budget_rows (or the capacity factor) or use the drop overflow policy");
        // Keep the deterministic prefix of rows below the budget.
        for (int e = 0; e < L; ++e) {
          const std::int64_t begin = lay.expert_begin[static_cast<std::size_t>(e)];
          const std::int64_t real = lay.kept_rows[static_cast<std::size_t>(e)];
          const std::int64_t kept = std::clamp<std::int64_t>(budget - begin, 0, real);
          lay.dropped += real - kept;
          lay.kept_rows[static_cast<std::size_t>(e)] = kept;
        }
      }
    }
    for (int e = 0; e < L; ++e) {
      const std::int64_t begin = lay.expert_begin[static_cast<std::size_t>(e)];
      const std::int64_t padded = round_up(lay.kept_rows[static_cast<std::size_t>(e)], params.pad_multiple);
      // A group cut by the budget keeps only rows below it (the budget is a multiple of the pad).
      lay.tokens_per_expert[static_cast<std::size_t>(e)] = std::clamp<std::int64_t>(lay.out_rows - begin, 0, padded);
    }
  }
  return plan;
}

std::vector<std::int64_t> slot_rows(const DispatchPlan& plan, int source, const TensorView& indices) {
  const PlanParams& p = plan.params;
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  check::device(indices, Device::cpu(), "indices");  // read here on the host
  FLEXEP_CHECK_ARG(source >= 0 && source < p.ranks, "source", source, " is out of range [0, ", p.ranks, ")");
  const std::int64_t T = indices.size(0), k = indices.size(1);
  const int R = p.ranks, L = p.local_experts();
  std::vector<std::int64_t> next(static_cast<std::size_t>(p.experts));  // next row per global expert
  for (int e = 0; e < p.experts; ++e) {
    const RankLayout& lay = plan.ranks[static_cast<std::size_t>(p.owner(e))];
    next[static_cast<std::size_t>(e)] =
        lay.source_begin[static_cast<std::size_t>(e % L) * static_cast<std::size_t>(R) + static_cast<std::size_t>(source)];
  }
  std::vector<std::int64_t> rows(static_cast<std::size_t>(T * k), -1);
  for (std::int64_t t = 0; t < T; ++t) {
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = index_at(indices, t * k + j);
      if (e == -1) continue;
      // Only -1 means "no expert"; other negatives are corrupt ids, not padding.
      FLEXEP_CHECK_ARG(e >= 0 && e < p.experts, "indices", "value ", e, " at [", t, ", ", j,
                       "] is out of range; allowed: -1 (no expert) <= id < ", p.experts);
      const std::int64_t row = next[static_cast<std::size_t>(e)]++;
      const RankLayout& lay = plan.ranks[static_cast<std::size_t>(p.owner(static_cast<int>(e)))];
      const int le = static_cast<int>(e) % L;
      const std::int64_t end = lay.expert_begin[static_cast<std::size_t>(le)] + lay.kept_rows[static_cast<std::size_t>(le)];
      rows[static_cast<std::size_t>(t * k + j)] = row < end ? row : -1;
    }
  }
  return rows;
}

namespace {
template <class Acc, class Elem>
void sum_rows(const TensorView& src, const std::vector<std::pair<std::int64_t, std::int64_t>>& order,
              std::int64_t H, Acc* acc) {
  const Elem* base = static_cast<const Elem*>(src.data);
  for (const auto& [expert, row] : order) {
    (void)expert;
    const Elem* r = base + row * H;
    for (std::int64_t h = 0; h < H; ++h) {
      if constexpr (std::is_same_v<Elem, bf16> || std::is_same_v<Elem, f16>) acc[h] += static_cast<Acc>(r[h].to_float());
      else acc[h] += static_cast<Acc>(r[h]);
    }
  }
}
}  // namespace

void permute(const TensorView& x, const TensorView& weights, const std::vector<std::int64_t>& rows,
             const TensorView& out_tokens, const TensorView& out_probs) {
  check::rank(x, 2, "hidden");
  check::rank(out_tokens, 2, "out_tokens");
  FLEXEP_CHECK_ARG(out_tokens.dtype == x.dtype && out_tokens.size(1) == x.size(1), "out_tokens",
                   "must have the hidden size and dtype of 'hidden'");
  const std::int64_t T = x.size(0), H = x.size(1), N = out_tokens.size(0);
  // rows and weights are indexed t*k + j below: a mismatch would read out of bounds.
  check::shape(weights, {T, -1}, "weights");
  const std::int64_t k = weights.size(1);
  FLEXEP_CHECK_ARG(static_cast<std::int64_t>(rows.size()) == T * k, "rows", "has ", rows.size(),
                   " entries, expected tokens*k = ", T * k);
  check::shape(out_probs, {N}, "out_probs");
  const std::size_t row_bytes = static_cast<std::size_t>(H) * element_size(x.dtype);
  std::memset(out_tokens.data, 0, out_tokens.nbytes());
  std::memset(out_probs.data, 0, out_probs.nbytes());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t row = rows[static_cast<std::size_t>(t * k + j)];
      if (row < 0) continue;
      FLEXEP_CHECK(row < N, "permute: row ", row, " outside the output of ", N, " rows");
      std::memcpy(static_cast<char*>(out_tokens.data) + static_cast<std::size_t>(row) * row_bytes,
                  static_cast<const char*>(x.data) + static_cast<std::size_t>(t) * row_bytes, row_bytes);
      write_from_double(out_probs, row, read_as_double(weights, t * k + j));
    }
}

void unpermute(const TensorView& expert_rows, const TensorView& indices, const std::vector<std::int64_t>& rows,
               const TensorView& out) {
  check::rank(expert_rows, 2, "expert_out");
  check::rank(out, 2, "out");
  check::rank(indices, 2, "indices");
  const std::int64_t T = out.size(0), H = out.size(1), k = indices.size(1);
  check::shape(indices, {T, k}, "indices");
  FLEXEP_CHECK_ARG(static_cast<std::int64_t>(rows.size()) == T * k, "rows", "has ", rows.size(),
                   " entries, expected tokens*k = ", T * k);
  FLEXEP_CHECK_ARG(expert_rows.size(1) == H, "expert_out", "has hidden size ", expert_rows.size(1), ", expected ", H);
  std::vector<double> acc64(static_cast<std::size_t>(H));
  std::vector<float> acc32(static_cast<std::size_t>(H));
  std::vector<std::pair<std::int64_t, std::int64_t>> order;
  for (std::int64_t t = 0; t < T; ++t) {
    order.clear();
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t row = rows[static_cast<std::size_t>(t * k + j)];
      if (row >= 0) order.emplace_back(index_at(indices, t * k + j), row);
    }
    std::sort(order.begin(), order.end());  // ascending expert id: the fixed summation order
    TensorView dst = out.rows(t, t + 1);
    if (out.dtype == DType::f64) {
      std::fill(acc64.begin(), acc64.end(), 0.0);
      FLEXEP_CHECK(expert_rows.dtype == DType::f64, "unpermute: f64 output needs f64 rows");
      sum_rows<double, double>(expert_rows, order, H, acc64.data());
      std::memcpy(dst.data, acc64.data(), static_cast<std::size_t>(H) * sizeof(double));
    } else {
      std::fill(acc32.begin(), acc32.end(), 0.0f);
      switch (expert_rows.dtype) {
        case DType::f32: sum_rows<float, float>(expert_rows, order, H, acc32.data()); break;
        case DType::bf16: sum_rows<float, bf16>(expert_rows, order, H, acc32.data()); break;
        case DType::f16: sum_rows<float, f16>(expert_rows, order, H, acc32.data()); break;
        default: throw_argument_error("expert_out", "dtype ", dtype_name(expert_rows.dtype), " is not supported");
      }
      for (std::int64_t h = 0; h < H; ++h) write_from_double(dst, h, acc32[static_cast<std::size_t>(h)]);
    }
  }
}

}  // namespace flexep
