// Internal: the kernels of plan_local (local_plan.cu, local_plan_sort.cu) as seen by the host glue
// (local_plan_cuda.cpp). Arguments are validated by the caller; these only enqueue work.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "flexep/core/dtype.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::cuda::local_plan_detail {

// Scratch of one plan, carved out of LocalPlan::workspace.
struct Workspace {
  std::uint32_t* keys_in = nullptr;     // [n] expert id of each pair, E for "no expert"
  std::uint32_t* keys_out = nullptr;    // [n] the same, sorted
  std::int32_t* pairs_in = nullptr;     // [n] pair index t*k + j
  std::int32_t* pairs_out = nullptr;    // [n] pair indices in (expert, pair index) order
  std::int64_t* sorted_begin = nullptr; // [E] first sorted position of each expert
  void* sort_temp = nullptr;            // CUB's temporary storage
  std::size_t sort_temp_bytes = 0;
};

// The plan's outputs on the device.
struct Outputs {
  std::int64_t* tokens_per_expert = nullptr;  // [E]
  std::int64_t* used_rows = nullptr;          // [1]
  std::int64_t* dropped = nullptr;            // [1]
  std::int64_t* expert_begin = nullptr;       // [E]
  std::int64_t* kept_rows = nullptr;          // [E]
  std::int32_t* slot_rows = nullptr;          // [n]
};

struct Layout {
  int experts = 1;
  std::int64_t pad_multiple = 1;
  std::int64_t budget = -1;  // < 0: blocking mode
  bool drop = false;         // overflow policy drop (else error)
};

// Bits that hold every key in [0, experts] (experts itself marks "no expert").
int sort_key_bits(int experts);

// CUB's storage for sorting n pairs on `end_bit` key bits (host query, no work enqueued).
std::size_t sort_temp_bytes(int n, int end_bit);

// keys_in / pairs_in from the indices; reports bad ids (out of range, repeated in a token).
void launch_make_sort_keys(const void* indices, DType index_dtype, std::int64_t tokens, int topk, int experts,
                           const Workspace& ws, DeviceErrorRecord* errors, cudaStream_t stream);

// Stable sort of (keys_in, pairs_in) into (keys_out, pairs_out).
void sort_pairs(const Workspace& ws, int n, int end_bit, cudaStream_t stream);

// Group sizes, offsets, kept rows, used rows, drops and the budget check, from the sorted keys.
void launch_build_layout(const Workspace& ws, std::int64_t n, const Layout& layout, const Outputs& out,
                         DeviceErrorRecord* errors, cudaStream_t stream);

// slot_rows of every pair from its sorted position.
void launch_write_slot_rows(const Workspace& ws, std::int64_t n, int experts, const Outputs& out, cudaStream_t stream);

}  // namespace flexep::cuda::local_plan_detail
