#include "layer/rank_major_rows.h"

#include <cstring>

#include "flexep/core/error.h"

namespace flexep::ref {

ExpertMajorRows gather_expert_major(const DispatchResult& r) {
  const std::int64_t N = r.tokens.size(0), H = r.tokens.size(1), k = r.topk_indices.size(1);
  const std::int64_t L = r.tokens_per_expert.numel();
  ExpertMajorRows m;
  m.recv_rows = N;
  m.k = k;
  std::int64_t M = 0;
  for (std::int64_t le = 0; le < L; ++le) M += r.tokens_per_expert.data<std::int64_t>()[le];
  FLEXEP_CHECK(M <= r.expert_rows.numel(), "rank-major rows: tokens_per_expert sums to ", M, " but expert_rows has ",
               r.expert_rows.numel(), " entries (internal error)");
  m.tokens = Tensor::zeros({M, H}, r.tokens.dtype());
  m.probs = Tensor::zeros({M}, r.topk_weights.dtype());
  m.slot.assign(static_cast<std::size_t>(M), -1);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * element_size(r.tokens.dtype());
  const std::int32_t* rows = r.expert_rows.data<std::int32_t>();
  const std::int32_t* idx = r.topk_indices.data<std::int32_t>();
  std::int64_t i = 0;
  for (std::int64_t le = 0; le < L; ++le)
    for (std::int64_t n = 0; n < r.tokens_per_expert.data<std::int64_t>()[le]; ++n, ++i) {
      const std::int32_t row = rows[i];
      if (row < 0) continue;
      std::int64_t j = 0;
      while (j < k && idx[row * k + j] != le) ++j;
      FLEXEP_CHECK(j < k, "rank-major rows: row ", row, " is listed for local expert ", le,
                   " but none of its slots names it (internal error)");
      m.slot[static_cast<std::size_t>(i)] = row * k + j;
      std::memcpy(static_cast<char*>(m.tokens.raw()) + static_cast<std::size_t>(i) * row_bytes,
                  static_cast<const char*>(r.tokens.raw()) + static_cast<std::size_t>(row) * row_bytes, row_bytes);
      write_from_double(m.probs, i, read_as_double(r.topk_weights, row * k + j));
    }
  return m;
}

namespace {

// out[slot / k] += rows[i] over the entries in ascending order, accumulated in fp32 (f64 for f64).
Tensor sum_rows(const TensorView& rows, const ExpertMajorRows& m) {
  const std::int64_t H = rows.size(1);
  const bool f64 = rows.dtype == DType::f64;
  std::vector<double> acc64(f64 ? static_cast<std::size_t>(m.recv_rows * H) : 0, 0.0);
  std::vector<float> acc32(f64 ? 0 : static_cast<std::size_t>(m.recv_rows * H), 0.0f);
  for (std::size_t i = 0; i < m.slot.size(); ++i) {
    if (m.slot[i] < 0) continue;
    const std::int64_t row = m.slot[i] / m.k;
    for (std::int64_t h = 0; h < H; ++h) {
      const double v = read_as_double(rows, static_cast<std::int64_t>(i) * H + h);
      if (f64)
        acc64[static_cast<std::size_t>(row * H + h)] += v;
      else
        acc32[static_cast<std::size_t>(row * H + h)] += static_cast<float>(v);
    }
  }
  Tensor out = Tensor::empty({m.recv_rows, H}, rows.dtype);
  for (std::int64_t i = 0; i < m.recv_rows * H; ++i)
    write_from_double(out, i, f64 ? acc64[static_cast<std::size_t>(i)] : acc32[static_cast<std::size_t>(i)]);
  return out;
}

}  // namespace

Tensor sum_per_received_row(const TensorView& expert_out, const ExpertMajorRows& m) {
  FLEXEP_CHECK(expert_out.size(0) == static_cast<std::int64_t>(m.slot.size()), "rank-major rows: ",
               expert_out.size(0), " expert rows for ", m.slot.size(), " entries (internal error)");
  return sum_rows(expert_out, m);
}

Tensor gather_rows(const TensorView& received, const ExpertMajorRows& m) {
  const std::int64_t H = received.size(1), M = static_cast<std::int64_t>(m.slot.size());
  Tensor out = Tensor::zeros({M, H}, received.dtype);
  const std::size_t row_bytes = static_cast<std::size_t>(H) * element_size(received.dtype);
  for (std::int64_t i = 0; i < M; ++i)
    if (m.slot[static_cast<std::size_t>(i)] >= 0)
      std::memcpy(static_cast<char*>(out.raw()) + static_cast<std::size_t>(i) * row_bytes,
                  static_cast<const char*>(received.data) +
                      static_cast<std::size_t>(m.slot[static_cast<std::size_t>(i)] / m.k) * row_bytes,
                  row_bytes);
  return out;
}

RankMajorGrads scatter_to_received(const TensorView& grad_rows, const TensorView& grad_probs,
                                   const ExpertMajorRows& m, DType weight_dtype) {
  RankMajorGrads g;
  g.rows = sum_rows(grad_rows, m);
  g.topk_weights = Tensor::zeros({m.recv_rows, m.k}, weight_dtype);
  for (std::size_t i = 0; i < m.slot.size(); ++i)
    if (m.slot[i] >= 0)
      write_from_double(g.topk_weights, m.slot[i], read_as_double(grad_probs, static_cast<std::int64_t>(i)));
  return g;
}

}  // namespace flexep::ref
