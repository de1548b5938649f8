// The hybridep bit plan kernel (src/dispatch/hybridep/bit_plan.cu) called from a test.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/cuda/device_errors.h"

namespace flexep::testing {

// Whether the bit plan takes a rank of `tokens` tokens and `experts` experts (else the general plan).
bool bit_plan_takes(std::int64_t tokens, int experts);

// Runs the bit plan on device arrays: indices [tokens, k] (int32, or int64 with indices_i64),
// counts / begin [experts] int64, slot_rows [tokens * k] int32.
void run_bit_plan(const void* indices, bool indices_i64, std::int64_t tokens, int k, int experts, std::int64_t* counts,
                  std::int64_t* begin, std::int32_t* slot_rows, cuda::DeviceErrorRecord* errors, cudaStream_t stream);

}  // namespace flexep::testing
