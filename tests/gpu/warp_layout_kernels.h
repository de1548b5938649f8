// hybridep's warp_receiver_layout (src/dispatch/hybridep/kernels/warp_layout.cuh) run by one warp, for a test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flexep::testing {

// Device arrays: pairs [experts / ranks] (each group's pairs from all sources); begin, kept, tpe of
// the same length; totals [5]: required, out_rows, used, dropped, overflow (0 / 1).
void run_warp_receiver_layout(const std::int64_t* pairs, int ranks, int experts, std::int64_t pad_multiple,
                              std::int64_t budget, bool drop, std::int64_t* begin, std::int64_t* kept,
                              std::int64_t* tpe, std::int64_t* totals, cudaStream_t stream);

}  // namespace flexep::testing
