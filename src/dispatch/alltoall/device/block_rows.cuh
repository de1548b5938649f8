// Device helpers shared by the alltoall kernels: launch sizes and a block-wide row copy.
#pragma once

#include <algorithm>
#include <cstdint>

namespace flexep::alltoall {

constexpr int kThreads = 256;     // element-wise kernels: one thread per item, grid-stride
constexpr int kRowThreads = 128;  // row kernels: one block per row, grid-stride over rows
constexpr std::int64_t kMaxBlocks = 8192;

inline unsigned blocks_for_items(std::int64_t items) {
  return static_cast<unsigned>(std::min<std::int64_t>((items + kThreads - 1) / kThreads, kMaxBlocks));
}
inline unsigned blocks_for_rows(std::int64_t rows) { return static_cast<unsigned>(std::min(rows, kMaxBlocks)); }

// The block copies one row of `elems` 16-bit elements. 16-byte vectors when both rows allow them
// (the test is the same for every thread of the block, so there is no divergence).
__device__ inline void copy_row(std::uint16_t* dst, const std::uint16_t* src, std::int64_t elems) {
  const bool vec = elems % 8 == 0 &&
                   (reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src)) % 16 == 0;
  if (vec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (std::int64_t i = threadIdx.x; i < elems / 8; i += blockDim.x) d[i] = s[i];
  } else {
    for (std::int64_t i = threadIdx.x; i < elems; i += blockDim.x) dst[i] = src[i];
  }
}

}  // namespace flexep::alltoall
