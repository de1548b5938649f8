#include "flexep/core/low_latency.h"

#include <cstring>

#include "flexep/core/error.h"

namespace flexep {

namespace {

std::int64_t index_at(const TensorView& idx, std::int64_t i) {
  return idx.dtype == DType::i32 ? idx.ptr<std::int32_t>()[i] : idx.ptr<std::int64_t>()[i];
}

}  // namespace

std::vector<char> low_latency_sending_slots(const TensorView& indices, int experts) {
  const std::int64_t T = indices.size(0), k = indices.size(1);
  std::vector<char> sends(static_cast<std::size_t>(T * k), 0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < k; ++j) {
      const std::int64_t e = index_at(indices, t * k + j);
      bool first = e >= 0 && e < experts;
      for (std::int64_t i = 0; i < j && first; ++i) first = index_at(indices, t * k + i) != e;
      sends[static_cast<std::size_t>(t * k + j)] = first ? 1 : 0;
    }
  return sends;
}

std::vector<LowLatencyReceiver> low_latency_layouts(const std::vector<TensorView>& indices, int experts,
                                                    std::int64_t max_tokens) {
  const int R = static_cast<int>(indices.size());
  FLEXEP_CHECK(R >= 1 && experts % R == 0, "low_latency_layouts: ", experts, " experts over ", R, " ranks");
  const int L = experts / R;
  const std::int64_t region = R * max_tokens;
  std::vector<LowLatencyReceiver> out(static_cast<std::size_t>(R));
  for (LowLatencyReceiver& d : out) {
    d.count.assign(static_cast<std::size_t>(L), 0);
    d.layout_range.assign(static_cast<std::size_t>(L) * R, 0);
    d.src_rank.assign(static_cast<std::size_t>(L * region), -1);
    d.src_token.assign(static_cast<std::size_t>(L * region), -1);
  }
  // Sources in ascending order, each one's tokens in ascending order: the (source, token) order.
  for (int s = 0; s < R; ++s) {
    const TensorView& idx = indices[static_cast<std::size_t>(s)];
    FLEXEP_CHECK(idx.size(0) <= max_tokens, "low_latency_layouts: rank ", s, " has ", idx.size(0), " tokens, more than ",
                 max_tokens);
    const std::int64_t T = idx.size(0), k = idx.size(1);
    const std::vector<char> sends = low_latency_sending_slots(idx, experts);
    std::vector<std::int32_t> begin(static_cast<std::size_t>(experts));
    for (int e = 0; e < experts; ++e) begin[static_cast<std::size_t>(e)] = out[static_cast<std::size_t>(e / L)].count[static_cast<std::size_t>(e % L)];
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t j = 0; j < k; ++j) {
        if (!sends[static_cast<std::size_t>(t * k + j)]) continue;
        const int e = static_cast<int>(index_at(idx, t * k + j));
        LowLatencyReceiver& d = out[static_cast<std::size_t>(e / L)];
        const std::int32_t i = d.count[static_cast<std::size_t>(e % L)]++;
        const std::size_t at = static_cast<std::size_t>((e % L) * region + i);
        d.src_rank[at] = s;
        d.src_token[at] = static_cast<std::int32_t>(t);
      }
    for (int e = 0; e < experts; ++e) {
      LowLatencyReceiver& d = out[static_cast<std::size_t>(e / L)];
      const std::int64_t b = begin[static_cast<std::size_t>(e)];
      const std::int64_t n = d.count[static_cast<std::size_t>(e % L)] - b;
      d.layout_range[static_cast<std::size_t>((e % L) * R + s)] = (b << 32) | n;
    }
  }
  return out;
}

Tensor low_latency_recv_x(const LowLatencyReceiver& layout, const std::vector<TensorView>& rows, int ranks,
                          std::int64_t max_tokens) {
  FLEXEP_CHECK(!rows.empty(), "low_latency_recv_x: no source rows");
  const DType dt = rows[0].dtype;
  const std::int64_t C = rows[0].size(1), L = static_cast<std::int64_t>(layout.count.size());
  const std::int64_t region = ranks * max_tokens;
  const std::size_t row_bytes = static_cast<std::size_t>(C) * element_size(dt);
  Tensor out = Tensor::zeros({L, region, C}, dt);
  auto* o = static_cast<char*>(out.raw());
  for (std::int64_t e = 0; e < L; ++e)
    for (std::int64_t i = 0; i < layout.count[static_cast<std::size_t>(e)]; ++i) {
      const std::size_t at = static_cast<std::size_t>(e * region + i);
      const TensorView& src = rows[static_cast<std::size_t>(layout.src_rank[at])];
      std::memcpy(o + at * row_bytes, static_cast<const char*>(src.data) + layout.src_token[at] * row_bytes, row_bytes);
    }
  return out;
}

Tensor low_latency_combine_reference(const std::vector<LowLatencyReceiver>& layouts, int source,
                                     const TensorView& indices, const TensorView& weights,
                                     const std::vector<TensorView>& expert_out, int experts, std::int64_t max_tokens) {
  const int R = static_cast<int>(layouts.size()), L = experts / R;
  const std::int64_t T = indices.size(0), k = indices.size(1), H = expert_out[0].size(2);
  const std::int64_t region = R * max_tokens;
  const std::vector<char> sends = low_latency_sending_slots(indices, experts);
  // Where each of this source's pairs landed: its rows in each expert's region, in token order.
  std::vector<std::int64_t> place(static_cast<std::size_t>(T * k), -1);
  for (int e = 0; e < experts; ++e) {
    const LowLatencyReceiver& d = layouts[static_cast<std::size_t>(e / L)];
    const std::int64_t range = d.layout_range[static_cast<std::size_t>((e % L) * R + source)];
    std::int64_t i = range >> 32;
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t j = 0; j < k; ++j)
        if (sends[static_cast<std::size_t>(t * k + j)] && index_at(indices, t * k + j) == e)
          place[static_cast<std::size_t>(t * k + j)] = (e % L) * region + i++;
  }
  Tensor out = Tensor::empty({T, H}, DType::bf16);
  std::vector<float> acc(static_cast<std::size_t>(H));
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (std::int64_t j = 0; j < k; ++j) {
      if (!sends[static_cast<std::size_t>(t * k + j)]) continue;
      const int e = static_cast<int>(index_at(indices, t * k + j));
      const bf16* y = expert_out[static_cast<std::size_t>(e / L)].ptr<bf16>() + place[static_cast<std::size_t>(t * k + j)] * H;
      const float w = weights.ptr<float>()[t * k + j];
      for (std::int64_t h = 0; h < H; ++h) {
        const volatile float product = w * y[h].to_float();  // rounded once: no fused multiply-add
        acc[static_cast<std::size_t>(h)] += product;
      }
    }
    for (std::int64_t h = 0; h < H; ++h) out.data<bf16>()[t * H + h] = bf16::from_float(acc[static_cast<std::size_t>(h)]);
  }
  return out;
}

}  // namespace flexep
