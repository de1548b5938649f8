// Pieces of the dispatch tests' inputs shared by the CPU layout tests (test_alltoall_layout.cpp,
// test_hybridep_layout.cpp) and the GPU backends' harness (tests/gpu/dispatch_harness.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "flexep/core/plan.h"
#include "flexep/core/random.h"
#include "flexep/core/routing.h"
#include "flexep/core/tensor.h"

namespace flexep::testing {

// N(0, 1) values, a stream per (what, rank) of `seed`.
inline Tensor random_tensor(Shape shape, DType dt, std::uint64_t seed, const char* what, int rank) {
  Tensor t = Tensor::empty(shape, dt);
  fill_normal(t, seed, stream_id(what) + static_cast<std::uint64_t>(rank), 0.0, 1.0);
  return t;
}

// Random bf16 rows [N, H] scaled by 2^-24 .. 2^24 (by row and rank): the partial sums of a token then
// differ widely in magnitude, so that adding them in another order than the host's changes the bits
// and a combine's order of additions is checked, not only its set of addends.
inline Tensor wide_range_rows(std::int64_t N, std::int64_t H, std::uint64_t seed, const char* what, int rank) {
  Tensor t = random_tensor({N, H}, DType::bf16, seed, what, rank);
  for (std::int64_t i = 0; i < N; ++i) {
    const float scale = std::ldexp(1.0f, static_cast<int>((i * 7 + rank * 13) % 49) - 24);
    for (std::int64_t h = 0; h < H; ++h) {
      bf16& x = t.data<bf16>()[i * H + h];
      x = bf16::from_float(x.to_float() * scale);
    }
  }
  return t;
}

// Some -1 entries (no expert) in top-k indices [T, k] int64: every 5th token loses its last slot,
// every 11th token all of them.
inline void drop_some_slots(Tensor& indices) {
  const std::int64_t T = indices.size(0), k = indices.size(1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j)
      if ((t % 5 == 3 && j == k - 1) || t % 11 == 6) indices.data<std::int64_t>()[t * k + j] = -1;
}

// Rows every receiver needs in blocking mode (RankLayout::required_rows) for each rank's indices.
inline std::vector<std::int64_t> required_rows_of(const std::vector<Tensor>& indices, int experts,
                                                  std::int64_t pad) {
  std::vector<std::int64_t> counts;
  for (const Tensor& idx : indices) {
    const auto v = expert_counts(idx, experts);
    counts.insert(counts.end(), v.begin(), v.end());
  }
  PlanParams p;
  p.ranks = static_cast<int>(indices.size());
  p.experts = experts;
  p.pad_multiple = pad;
  std::vector<std::int64_t> rows;
  for (const auto& lay : DispatchPlan::build(counts, p).ranks) rows.push_back(lay.required_rows);
  return rows;
}

}  // namespace flexep::testing
