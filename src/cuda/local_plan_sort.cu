// The stable sort of plan_local: (expert id, pair index) pairs ordered by expert id, ties kept in
// pair-index order (CUB's radix sort is stable), which is exactly "by token index, then slot". Kept
// in its own file because CUB's radix sort is the slowest thing in the library to compile.
#include <cub/device/device_radix_sort.cuh>

#include "flexep/cuda/runtime.h"
#include "cuda/local_plan_launch.h"

namespace flexep::cuda::local_plan_detail {

std::size_t sort_temp_bytes(int n, int end_bit) {
  std::size_t bytes = 0;
  FLEXEP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, bytes, static_cast<const std::uint32_t*>(nullptr),
                                                    static_cast<std::uint32_t*>(nullptr),
                                                    static_cast<const std::int32_t*>(nullptr),
                                                    static_cast<std::int32_t*>(nullptr), n, 0, end_bit));
  return bytes;
}

void sort_pairs(const Workspace& ws, int n, int end_bit, cudaStream_t stream) {
  std::size_t bytes = ws.sort_temp_bytes;  // CUB takes it by reference; the plan's size must stay intact
  FLEXEP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(ws.sort_temp, bytes, ws.keys_in, ws.keys_out, ws.pairs_in,
                                                    ws.pairs_out, n, 0, end_bit, stream));
}

}  // namespace flexep::cuda::local_plan_detail
