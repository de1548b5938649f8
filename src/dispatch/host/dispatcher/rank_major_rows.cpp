#include "dispatch/host/dispatcher/rank_major_rows.h"

#include <algorithm>
#include <cstring>

#include "dispatch/host/dispatcher/wire_values.h"
#include "flexep/core/error.h"

namespace flexep::host {

void pull_rank_rows(int me, int ranks, int local_experts, const std::vector<RankMajorSender>& senders,
                    const TensorView& out_rows, std::int32_t* out_idx, const TensorView& out_weights) {
  const std::int64_t N = out_rows.size(0);
  const std::size_t row_bytes = static_cast<std::size_t>(out_rows.size(1)) * element_size(out_rows.dtype);
  const std::size_t weight_bytes = out_weights.defined() ? element_size(out_weights.dtype) : 0;
  for (const RankMajorSender& s : senders)
    for (std::int64_t t = 0; t < s.tokens; ++t) {
      const std::int64_t row = s.dest_rows[t * ranks + me];
      if (row < 0) continue;
      FLEXEP_CHECK(row < N, "host dispatch: row ", row, " outside the ", N, " rows of rank ", me);
      if (row_bytes)
        std::memcpy(static_cast<char*>(out_rows.data) + static_cast<std::size_t>(row) * row_bytes,
                    static_cast<const char*>(s.hidden.data) + static_cast<std::size_t>(t) * row_bytes, row_bytes);
      if (!out_idx) continue;
      for (std::int64_t j = 0; j < s.slots; ++j) {
        const std::int64_t e = s.indices[t * s.slots + j], at = row * s.slots + j;
        const bool here = e >= 0 && e / local_experts == me;
        out_idx[at] = here ? static_cast<std::int32_t>(e % local_experts) : -1;
        if (here && weight_bytes)
          std::memcpy(static_cast<char*>(out_weights.data) + static_cast<std::size_t>(at) * weight_bytes,
                      static_cast<const char*>(s.weights.data) +
                          static_cast<std::size_t>(t * s.slots + j) * weight_bytes,
                      weight_bytes);
      }
    }
}

namespace {

template <class Acc, class Elem>
void sum_typed(int ranks, const std::int64_t* dest_rows, const std::vector<TensorView>& rows, const TensorView& out) {
  const std::int64_t T = out.size(0), H = out.size(1);
  std::vector<Acc> total(static_cast<std::size_t>(H));
  Elem* dst = static_cast<Elem*>(out.data);
  for (std::int64_t t = 0; t < T; ++t) {
    std::fill(total.begin(), total.end(), Acc(0));
    for (int d = 0; d < ranks; ++d) {
      const std::int64_t row = dest_rows[t * ranks + d];
      if (row < 0) continue;
      const TensorView& src = rows[static_cast<std::size_t>(d)];
      FLEXEP_CHECK(row < src.size(0), "host combine: row ", row, " outside the ", src.size(0), " rows of rank ", d);
      const Elem* r = static_cast<const Elem*>(src.data) + row * H;
      for (std::int64_t h = 0; h < H; ++h) total[static_cast<std::size_t>(h)] += widen<Acc>(r[h]);
    }
    for (std::int64_t h = 0; h < H; ++h) dst[t * H + h] = narrow<Elem>(total[static_cast<std::size_t>(h)]);
  }
}

}  // namespace

void sum_rank_rows(int ranks, const std::int64_t* dest_rows, const std::vector<TensorView>& rows,
                   const TensorView& out) {
  const bool known = with_row_types(out.dtype, [&]<class Acc, class Elem>() {
    sum_typed<Acc, Elem>(ranks, dest_rows, rows, out);
  });
  if (!known) throw_error("host combine: dtype ", dtype_name(out.dtype), " is not supported");
}

void gather_rank_weights(int ranks, int local_experts, const std::int64_t* indices, const std::int64_t* dest_rows,
                         std::int64_t slots, const std::vector<TensorView>& grads, const TensorView& out) {
  const std::int64_t T = out.size(0);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < slots; ++j) {
      const std::int64_t e = indices[t * slots + j];
      if (e < 0) continue;
      const int d = static_cast<int>(e / local_experts);
      const std::int64_t row = dest_rows[t * ranks + d];
      if (row < 0) continue;
      const TensorView& src = grads[static_cast<std::size_t>(d)];
      FLEXEP_CHECK(row < src.size(0), "host dispatch_backward: row ", row, " outside the ", src.size(0),
                   " rows of rank ", d);
      write_from_double(out, t * slots + j, read_as_double(src, row * slots + j));
    }
}

}  // namespace flexep::host
