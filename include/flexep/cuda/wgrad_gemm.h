// The experts' weight gradient for Hopper (sm_90a), its input rows gathered through a row table, on
// CuTe's wgmma atoms and CUTLASS's shared-memory pipeline, like gather_gemm.h:
//
//   c[g] = sum over i in [offsets[g], offsets[g + 1]) of a[row_ids[i]]^T d[i]        c [G, K, M]
//
// a [R, K] bf16 (the forward's input rows, read where they are: the layer's tokens, deepep's receive
// rows), row_ids [N] int32 (undefined: row i reads a[i]; -1 reads a zero row), d [N, M] bf16 (the
// output gradient, rows in group order), offsets [G + 1] int64 on the device. c is f32 (overwritten,
// or with `accumulate` added to: Megatron's main_grad) or bf16 (overwritten, one rounding); fp32
// accumulation either way. A group with no rows writes zeros (adds nothing). The group sizes stay on
// the device: no host sync, capturable in a CUDA graph. Device data is checked as it is read (bad row
// ids and offsets are reported to `errors` by name, as gather_grouped_gemm does, and read as zero
// rows / empty groups).
//
// How it runs: every group has the same output, [K, M] in 128 x 256 tiles, so the work is G times
// that many tiles, walked by persistent CTAs in group order, the K tiles of one column of d next to
// each other. A tile's reduction runs over its group's rows, 64 a stage: a's 128 columns of them
// (by TMA, or by 16-byte cp.async through the row table) and d's 256 columns (by TMA, shared by CTA
// pairs as gather_gemm.h's B), both "MN-major" for wgmma (the reduced dimension is the rows). A
// group's last stage holds rows of the next group (TMA reads whole boxes): the wgmma warps zero them
// before reading it. The epilogue stores from registers (f32 pairs, read and added first when
// accumulating).
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::cuda {

// K and M must be multiples of 8 (16-byte rows); G <= kGatherGemmMaxGroups (the groups' rows are
// planned in shared memory); G * ceil(K / 128) * ceil(M / 256) < 2^31. B sharing
// (own / pair_multicast) follows set_gather_gemm_b_sharing (gather_gemm.h).
void wgrad_grouped_gemm(const TensorView& a, const TensorView& row_ids, const TensorView& d,
                        const TensorView& offsets, const TensorView& c, bool accumulate, cudaStream_t stream,
                        DeviceErrorRecord* errors = nullptr);

}  // namespace flexep::cuda
