#include "flexep/core/rank_major.h"

#include <algorithm>

#include "flexep/core/error.h"

namespace flexep {

namespace {

std::int64_t round_up(std::int64_t x, std::int64_t m) { return (x + m - 1) / m * m; }

std::int64_t index_at(const TensorView& idx, std::int64_t i) {
  return idx.dtype == DType::i32 ? idx.ptr<std::int32_t>()[i] : idx.ptr<std::int64_t>()[i];
}

// The ranks token t sends to, as flags [R] (a token is sent once per rank, whatever its slots).
void token_ranks(const TensorView& idx, std::int64_t t, const PlanParams& p, std::vector<char>& to) {
  std::fill(to.begin(), to.end(), 0);
  const std::int64_t k = idx.size(1);
  for (std::int64_t j = 0; j < k; ++j) {
    const std::int64_t e = index_at(idx, t * k + j);
    if (e >= 0) to[static_cast<std::size_t>(p.owner(static_cast<int>(e)))] = 1;
  }
}

}  // namespace

std::vector<std::int64_t> rank_major_row_counts(const TensorView& indices, const PlanParams& params) {
  const int R = params.ranks;
  std::vector<std::int64_t> rows(static_cast<std::size_t>(R), 0);
  std::vector<char> to(static_cast<std::size_t>(R));
  for (std::int64_t t = 0; t < indices.size(0); ++t) {
    token_ranks(indices, t, params, to);
    for (int d = 0; d < R; ++d) rows[static_cast<std::size_t>(d)] += to[static_cast<std::size_t>(d)];
  }
  return rows;
}

std::vector<RankMajorLayout> rank_major_layouts(const std::vector<std::int64_t>& rows, const PlanParams& params) {
  validate(params);
  const int R = params.ranks;
  FLEXEP_CHECK(rows.size() == static_cast<std::size_t>(R) * static_cast<std::size_t>(R),
               "rank_major_layouts: rows has ", rows.size(), " entries, expected ranks*ranks = ", R * R);
  std::vector<RankMajorLayout> out(static_cast<std::size_t>(R));
  for (int d = 0; d < R; ++d) {
    RankMajorLayout& lay = out[static_cast<std::size_t>(d)];
    lay.source_begin.assign(static_cast<std::size_t>(R), 0);
    lay.source_rows.assign(static_cast<std::size_t>(R), 0);
    std::int64_t row = 0;
    for (int s = 0; s < R; ++s) {
      lay.source_begin[static_cast<std::size_t>(s)] = row;
      lay.source_rows[static_cast<std::size_t>(s)] = rows[static_cast<std::size_t>(s * R + d)];
      row += rows[static_cast<std::size_t>(s * R + d)];
    }
    lay.required_rows = lay.out_rows = row;
    if (!params.budget_rows) continue;
    const std::int64_t budget = *params.budget_rows;
    lay.out_rows = budget;
    if (row <= budget) continue;
    if (params.overflow == OverflowPolicy::error)
      throw_error("dispatch overflow: rank ", d, " receives ", row, " rank-major rows but budget_rows is ", budget,
                  "; raise budget_rows (or the capacity factor) or use the drop overflow policy");
    for (int s = 0; s < R; ++s) {  // the deterministic prefix below the budget
      auto& kept = lay.source_rows[static_cast<std::size_t>(s)];
      kept = std::clamp<std::int64_t>(budget - lay.source_begin[static_cast<std::size_t>(s)], 0, kept);
    }
  }
  return out;
}

std::vector<std::int64_t> rank_major_rows(const std::vector<RankMajorLayout>& layouts, int source,
                                          const TensorView& indices, const PlanParams& params) {
  const int R = params.ranks;
  const std::int64_t T = indices.size(0);
  std::vector<std::int64_t> where(static_cast<std::size_t>(T * R), -1);
  std::vector<std::int64_t> next(static_cast<std::size_t>(R), 0);
  std::vector<char> to(static_cast<std::size_t>(R));
  for (std::int64_t t = 0; t < T; ++t) {
    token_ranks(indices, t, params, to);
    for (int d = 0; d < R; ++d) {
      if (!to[static_cast<std::size_t>(d)]) continue;
      const RankMajorLayout& lay = layouts[static_cast<std::size_t>(d)];
      const std::int64_t n = next[static_cast<std::size_t>(d)]++;
      if (n < lay.source_rows[static_cast<std::size_t>(source)])
        where[static_cast<std::size_t>(t * R + d)] = lay.source_begin[static_cast<std::size_t>(source)] + n;
    }
  }
  return where;
}

std::int64_t expert_rows_capacity(std::int64_t recv_rows, std::int64_t k, int local_experts, std::int64_t pad) {
  return recv_rows * std::min<std::int64_t>(k, local_experts) + static_cast<std::int64_t>(local_experts) * (pad - 1);
}

ExpertRows expert_rows(const std::int32_t* local_idx, std::int64_t rows, std::int64_t k, int local_experts,
                       std::int64_t pad, std::int64_t capacity) {
  const auto L = static_cast<std::size_t>(local_experts);
  std::vector<std::vector<std::int32_t>> lists(L);
  ExpertRows out;
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int32_t e = local_idx[i * k + j];
      if (e < 0) continue;
      FLEXEP_CHECK(e < local_experts, "expert_rows: local expert ", e, " at row ", i, " outside [0, ", local_experts,
                   ") (internal error)");
      lists[static_cast<std::size_t>(e)].push_back(static_cast<std::int32_t>(i));
      ++out.pairs;
    }
  out.tokens_per_expert.resize(L);
  for (std::size_t e = 0; e < L; ++e) {
    const auto padded = round_up(static_cast<std::int64_t>(lists[e].size()), pad);
    out.tokens_per_expert[e] = padded;
    out.rows.insert(out.rows.end(), lists[e].begin(), lists[e].end());
    out.rows.resize(out.rows.size() + static_cast<std::size_t>(padded) - lists[e].size(), -1);
  }
  if (capacity >= 0) {
    FLEXEP_CHECK(static_cast<std::int64_t>(out.rows.size()) <= capacity, "expert_rows: ", out.rows.size(),
                 " entries exceed the capacity ", capacity, " (internal error)");
    out.rows.resize(static_cast<std::size_t>(capacity), -1);
  }
  return out;
}

}  // namespace flexep
