// Sums of bf16 rows in fp32, 8 values (one 16-byte word) at a time: the arithmetic of the combine's
// two-level sum (docs/semantics.md), exact to the host backend's bits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace flexep::hybridep {

// Adds the 8 bf16 values of `v` to acc[0..8) in fp32.
__device__ __forceinline__ void add_bf16x8(float* acc, uint4 v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] += __uint_as_float(w[i] << 16);
    acc[2 * i + 1] += __uint_as_float(w[i] & 0xffff0000u);
  }
}

// acc[0..8) = +0.0f + the 8 bf16 values of `v`: the first add_bf16x8 of a sum from +0.0f, without
// zeroing the sums first. Bitwise the same (+0.0f + -0.0f is +0.0f, so it is an addition, not a copy).
__device__ __forceinline__ void first_bf16x8(float* acc, uint4 v) {
  const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    acc[2 * i] = 0.0f + __uint_as_float(w[i] << 16);
    acc[2 * i + 1] = 0.0f + __uint_as_float(w[i] & 0xffff0000u);
  }
}

// Rounds acc[0..8) to bf16 (round to nearest even, as flexep::bf16::from_float for every non-NaN).
__device__ __forceinline__ uint4 to_bf16x8(const float* acc) {
  unsigned w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned lo = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i]));
    const unsigned hi = __bfloat16_as_ushort(__float2bfloat16_rn(acc[2 * i + 1]));
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// acc[0..8) = +0.0f + bf16(acc[0..8)): a sum rounded as to_bf16x8 stores it, then added to +0.0f
// as first_bf16x8 would add it back after loading it (-0.0f becomes +0.0f). Bitwise the same as
// storing the row and starting a sum from it.
__device__ __forceinline__ void round_bf16x8(float* acc) {
#pragma unroll
  for (int i = 0; i < 8; ++i) acc[i] = 0.0f + __bfloat162float(__float2bfloat16_rn(acc[i]));
}

}  // namespace flexep::hybridep
