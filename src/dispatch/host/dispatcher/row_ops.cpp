#include "dispatch/host/dispatcher/row_ops.h"

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <utility>

#include "dispatch/host/dispatcher/wire_values.h"
#include "flexep/core/error.h"

namespace flexep::host {

void pull_rows(int me, int local_experts, const std::vector<SenderRows>& senders, const TensorView& out_tokens,
               const TensorView& out_probs) {
  const std::int64_t N = out_tokens.size(0);
  const std::size_t row_bytes = static_cast<std::size_t>(out_tokens.size(1)) * element_size(out_tokens.dtype);
  const std::size_t prob_bytes = out_probs.defined() ? element_size(out_probs.dtype) : 0;
  for (const SenderRows& s : senders) {
    const std::int64_t n = s.tokens * s.slots;
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t e = s.indices[i], row = s.slot_rows[i];
      if (e < 0 || row < 0 || e / local_experts != me) continue;
      FLEXEP_CHECK(row < N, "host dispatch: row ", row, " outside the ", N, " rows of rank ", me);
      const std::int64_t t = i / s.slots;
      if (row_bytes)
        std::memcpy(static_cast<char*>(out_tokens.data) + static_cast<std::size_t>(row) * row_bytes,
                    static_cast<const char*>(s.hidden.data) + static_cast<std::size_t>(t) * row_bytes, row_bytes);
      if (prob_bytes)
        std::memcpy(static_cast<char*>(out_probs.data) + static_cast<std::size_t>(row) * prob_bytes,
                    static_cast<const char*>(s.weights.data) + static_cast<std::size_t>(i) * prob_bytes, prob_bytes);
    }
  }
}

namespace {

// Two-level sum (docs/semantics.md, "Combine"): per owner rank, the token's rows summed in fp32 over
// ascending local experts and rounded to the hidden dtype (what crosses the wire), then these partials
// summed in fp32 over ascending owner rank and rounded. GPU backends do exactly these operations, so
// they agree with this reference bit for bit.
template <class Acc, class Elem>
void sum_typed(int local_experts, const std::int64_t* indices, const std::int64_t* slot_rows, std::int64_t slots,
               const std::vector<TensorView>& rows, const TensorView& out) {
  const std::int64_t T = out.size(0), H = out.size(1);
  std::vector<Acc> part(static_cast<std::size_t>(H)), total(static_cast<std::size_t>(H));
  std::vector<std::pair<std::int64_t, std::int64_t>> order;  // (expert, row)
  Elem* dst = static_cast<Elem*>(out.data);
  for (std::int64_t t = 0; t < T; ++t) {
    order.clear();
    for (std::int64_t j = 0; j < slots; ++j) {
      const std::int64_t i = t * slots + j;
      if (indices[i] >= 0 && slot_rows[i] >= 0) order.emplace_back(indices[i], slot_rows[i]);
    }
    std::sort(order.begin(), order.end());  // ascending expert id: ascending owner, then local expert
    std::fill(total.begin(), total.end(), Acc(0));
    std::fill(part.begin(), part.end(), Acc(0));
    std::int64_t owner = -1;
    auto flush = [&] {
      for (std::int64_t h = 0; h < H; ++h) {
        total[static_cast<std::size_t>(h)] += round_to<Elem>(part[static_cast<std::size_t>(h)]);
        part[static_cast<std::size_t>(h)] = Acc(0);
      }
    };
    for (const auto& [e, row] : order) {
      if (e / local_experts != owner) {
        if (owner >= 0) flush();
        owner = e / local_experts;
      }
      const TensorView& src = rows[static_cast<std::size_t>(owner)];
      FLEXEP_CHECK(row < src.size(0), "host combine: row ", row, " outside the ", src.size(0), " rows of rank ", owner);
      const Elem* r = static_cast<const Elem*>(src.data) + row * H;
      for (std::int64_t h = 0; h < H; ++h) part[static_cast<std::size_t>(h)] += widen<Acc>(r[h]);
    }
    if (owner >= 0) flush();
    for (std::int64_t h = 0; h < H; ++h) dst[t * H + h] = narrow<Elem>(total[static_cast<std::size_t>(h)]);
  }
}
}  // namespace

void sum_rows(int local_experts, const std::int64_t* indices, const std::int64_t* slot_rows, std::int64_t slots,
              const std::vector<TensorView>& rows, const TensorView& out) {
  const bool known = with_row_types(out.dtype, [&]<class Acc, class Elem>() {
    sum_typed<Acc, Elem>(local_experts, indices, slot_rows, slots, rows, out);
  });
  if (!known) throw_error("host combine: dtype ", dtype_name(out.dtype), " is not supported");
}

void gather_probs(int local_experts, const std::int64_t* indices, const std::int64_t* slot_rows, std::int64_t slots,
                  bool multihot, const std::vector<TensorView>& probs, const TensorView& out) {
  const std::int64_t T = out.size(0), width = out.size(1);
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t j = 0; j < slots; ++j) {
      const std::int64_t i = t * slots + j, e = indices[i], row = slot_rows[i];
      if (e < 0 || row < 0) continue;
      const TensorView& src = probs[static_cast<std::size_t>(e / local_experts)];
      FLEXEP_CHECK(row < src.size(0), "host dispatch_backward: row ", row, " outside the ", src.size(0),
                   " rows of rank ", e / local_experts);
      write_from_double(out, t * width + (multihot ? e : j), read_as_double(src, row));
    }
}

}  // namespace flexep::host
