// Internal: the kernels of permute.h (permute.cu, permute_unpermute.cu) as seen by the host glue
// (permute_cuda.cpp). Arguments are validated by the caller; these only enqueue work.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/core/dtype.h"

namespace flexep::cuda::permute_detail {

// What the kernels read from a LocalPlan.
struct PlanRefs {
  const std::int32_t* slot_rows = nullptr;       // [T, k]
  const std::int64_t* expert_begin = nullptr;    // [E]
  const std::int64_t* kept_rows = nullptr;       // [E]
  const std::int64_t* tokens_per_expert = nullptr;  // [E]
  const std::int64_t* used_rows = nullptr;       // [1]
  std::int64_t tokens = 0, topk = 0, out_rows = 0, pad_multiple = 1;
  int experts = 1;
  bool budget_mode = false;
};

// Copies x's rows to their slots (row_bytes a multiple of 16) and the weights to out_probs, then zeroes
// every row no slot lands on.
void launch_permute(const void* x, const float* weights, const PlanRefs& plan, std::int64_t row_bytes, void* out_tokens,
                    float* out_probs, int sm_count, cudaStream_t stream);

// H a multiple of 8.
void launch_unpermute(const void* expert_rows, DType rows_dtype, const PlanRefs& plan, std::int64_t hidden, void* out,
                      DType out_dtype, cudaStream_t stream);

void launch_gather_slot_values(const float* values, const PlanRefs& plan, float* out, cudaStream_t stream);

// permute_rows.cu: sources [out_rows] int32 = the token of each row, -1 where no slot lands.
void launch_row_sources(const PlanRefs& plan, std::int32_t* sources, cudaStream_t stream);
// out[r] = src[ids[r]] (row_bytes a multiple of 16), zeros where ids[r] is -1.
void launch_gather_rows(const void* src, std::int64_t src_rows, const std::int32_t* ids, std::int64_t rows,
                        std::int64_t row_bytes, void* out, cudaStream_t stream);

}  // namespace flexep::cuda::permute_detail
