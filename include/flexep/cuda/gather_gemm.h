// A grouped GEMM whose A rows are gathered through a row table, for Hopper (sm_90a), on CuTe's
// wgmma atoms and CUTLASS's shared-memory pipeline. The experts read the dispatch's buffer in place:
// no permuted copy of the tokens is made and none is kept for backward.
//
//   c [N, M] bf16     c[i] = a[row_ids[i]] * b[g]   for every i in [offsets[g], offsets[g + 1])
//
// a [R, K] bf16 (any row table: deepep's rank-major receive rows, the layer's tokens), b [G, K, M]
// bf16 row-major (the experts' weights as grouped_gemm.h takes them; [G, M, K] with
// GatherGemmBLayout::m_by_k, c[i] = a[row_ids[i]] * b[g]^T), row_ids [N] int32 (undefined:
// row i reads a[i], the plain grouped GEMM), offsets [G + 1] int64 on the device. fp32 accumulation,
// one rounding to bf16. The group sizes stay on the device: no host sync, capturable in a CUDA graph.
// Rows of c outside [offsets[0], offsets[G]) are not written.
//
// Device data is checked as it is read, never trusted for an address: a row id of -1 reads a zero
// row (a padding row); an id outside [-1, R) or offsets that decrease or leave [0, N] are reported
// to `errors` (device_errors.h: DeviceArg::row_ids / group_offsets) when it is given, and read as
// zero rows / empty groups either way.
//
// How it runs: persistent CTAs (one per SM) walk 128 x 256 output tiles, expert by expert, the M
// tiles of one column of B next to each other so that B's column block is read from L2 by all of
// them. Each CTA has one loading warpgroup and two wgmma warpgroups (64 rows each). The loaders
// copy A's rows with 16-byte cp.async into the 128-byte-swizzled layout wgmma reads (each thread
// holds eight row addresses for the whole tile, so the gather costs one table read per row and
// tile); without row_ids a tile's rows are contiguous and come as one TMA box instead. B's block
// comes by TMA into the same layout (transposed B: K-major, as A), shared by pairs of CTAs (below);
// four stages of 48 KB. The
// epilogue converts the fp32 accumulators to bf16 and stores them from registers. a and b must be
// 16-byte aligned.
#pragma once

#include <cuda_runtime.h>

#include "flexep/core/tensor.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::cuda {

// K and M must be multiples of 8 (16-byte rows); G <= kGatherGemmMaxGroups.
inline constexpr int kGatherGemmMaxGroups = 1024;

// How the CTAs get B's blocks: CTAs run in clusters of two on the two M tiles of one B block and each
// loads half of it for both (pair_multicast, the default: TMA multicast, a third less L2 traffic per
// SM; on an H100 its gathered GEMM's median time is 3-18% lower and far steadier), or each CTA loads
// its own (own). Process-wide, for measuring the two side by side (flexep bench gather-gemm, layer).
enum class GatherGemmB { own, pair_multicast };
void set_gather_gemm_b_sharing(GatherGemmB sharing);
GatherGemmB gather_gemm_b_sharing();

// How b holds each group's matrix: [K, M] (c = a b: the forward GEMMs), or [M, K] (c = a b^T: the
// data gradients, which read the forward's weights transposed; wgmma takes B K-major then).
enum class GatherGemmBLayout { k_by_m, m_by_k };

void gather_grouped_gemm(const TensorView& a, const TensorView& row_ids, const TensorView& offsets,
                         const TensorView& b, const TensorView& c, cudaStream_t stream,
                         DeviceErrorRecord* errors = nullptr, GatherGemmBLayout b_layout = GatherGemmBLayout::k_by_m);

}  // namespace flexep::cuda
