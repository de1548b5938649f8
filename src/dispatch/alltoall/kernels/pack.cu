// Sender-side packing: each token is written once per destination rank into a send buffer ordered
// (destination rank, token), with its (local expert, prob) metadata. Also the copy of grad_out
// rows along the same layout (combine_backward).
#include "dispatch/alltoall/device/block_rows.cuh"
#include "dispatch/alltoall/kernels/kernels.h"
#include "flexep/cuda/runtime.h"

namespace flexep::alltoall {

namespace {

// One thread per token: it owns the token's send positions, metadata entries and slots.
__global__ void __launch_bounds__(kThreads)
    pack_meta_kernel(const int* slot_expert, const float* slot_weight, std::int64_t tokens, int slots,
                     int local_experts, int ranks, int meta_width, const int* dest_flag, const int* dest_scan,
                     int* send_pos, int* slot_entry, SlotMeta* send_meta) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    for (int d = 0; d < ranks; ++d) {
      const std::int64_t f = static_cast<std::int64_t>(d) * tokens + t;
      const int p = dest_flag[f] ? dest_scan[f] : -1;
      send_pos[f] = p;
      if (p >= 0)
        for (int m = 0; m < meta_width; ++m)
          send_meta[static_cast<std::int64_t>(p) * meta_width + m] = SlotMeta{-1, 0.0f};
    }
    const std::int64_t base = t * slots;
    for (int j = 0; j < slots; ++j) {
      const int e = slot_expert[base + j];
      if (e < 0) {
        slot_entry[base + j] = -1;
        continue;
      }
      const int d = e / local_experts;
      // Entry = rank of e among t's experts on d: entries ascend with the expert id. Experts are
      // distinct per token (count_slots removed repeats), so m < min(slots, local_experts).
      int m = 0;
      for (int q = 0; q < slots; ++q) {
        const int o = slot_expert[base + q];
        if (o >= 0 && o / local_experts == d && o < e) ++m;
      }
      const int p = send_pos[static_cast<std::int64_t>(d) * tokens + t];  // set above: t has an expert on d
      if (p < 0 || m >= meta_width) {  // cannot happen (see above); never write out of bounds
        slot_entry[base + j] = -1;
        continue;
      }
      const std::int64_t entry = static_cast<std::int64_t>(p) * meta_width + m;
      send_meta[entry] = SlotMeta{e - d * local_experts, slot_weight[base + j]};
      slot_entry[base + j] = static_cast<int>(entry);
    }
  }
}

__global__ void __launch_bounds__(kRowThreads)
    pack_rows_kernel(const std::uint16_t* src, std::int64_t tokens, std::int64_t hidden, int ranks,
                     const int* send_pos, std::uint16_t* dst) {
  for (std::int64_t t = blockIdx.x; t < tokens; t += gridDim.x)
    for (int d = 0; d < ranks; ++d) {
      const int p = send_pos[static_cast<std::int64_t>(d) * tokens + t];
      if (p >= 0) copy_row(dst + static_cast<std::int64_t>(p) * hidden, src + t * hidden, hidden);
    }
}

}  // namespace

void launch_pack_meta(const int* slot_expert, const float* slot_weight, std::int64_t tokens, int slots,
                      int local_experts, int ranks, int meta_width, const int* dest_flag, const int* dest_scan,
                      int* send_pos, int* slot_entry, SlotMeta* send_meta, cudaStream_t stream) {
  if (tokens == 0) return;
  pack_meta_kernel<<<blocks_for_items(tokens), kThreads, 0, stream>>>(slot_expert, slot_weight, tokens, slots,
                                                                      local_experts, ranks, meta_width, dest_flag,
                                                                      dest_scan, send_pos, slot_entry, send_meta);
  FLEXEP_CUDA_CHECK_LAUNCH("pack_meta_kernel");
}

void launch_pack_rows(const void* src, std::int64_t tokens, std::int64_t hidden, int ranks, const int* send_pos,
                      void* dst, cudaStream_t stream) {
  if (tokens == 0 || hidden == 0) return;
  pack_rows_kernel<<<blocks_for_rows(tokens), kRowThreads, 0, stream>>>(
      static_cast<const std::uint16_t*>(src), tokens, hidden, ranks, send_pos, static_cast<std::uint16_t*>(dst));
  FLEXEP_CUDA_CHECK_LAUNCH("pack_rows_kernel");
}

}  // namespace flexep::alltoall
