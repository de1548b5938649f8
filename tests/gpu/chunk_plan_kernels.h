// The hybridep chunk plan kernel (src/dispatch/hybridep/kernels/chunk_plan.cu) called from a test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/cuda/device_errors.h"

namespace flexep::testing {

// Whether the chunk plan takes `experts` experts (else the general plan), and its chunk size.
bool chunk_plan_takes(int experts);
std::int64_t chunk_plan_chunk_tokens();

// Runs the chunk plan on `grid` CTAs over device arrays: indices [tokens, k] (int32, or int64 with
// indices_i64), counts [experts] int64, chunk_base [chunks][experts] int32, slot_rank [tokens * k]
// int32, done: one zeroed uint32.
void run_chunk_plan(const void* indices, bool indices_i64, std::int64_t tokens, int k, int experts, int grid,
                    std::int64_t* counts, std::int32_t* chunk_base, std::int32_t* slot_rank, std::uint32_t* done,
                    cuda::DeviceErrorRecord* errors, cudaStream_t stream);

}  // namespace flexep::testing
