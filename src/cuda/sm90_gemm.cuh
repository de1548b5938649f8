// Pieces the Hopper grouped GEMMs share (gather_gemm.cu, wgrad_gemm.cu): the stage ring of a loader /
// wgmma pipeline, the 16-byte cp.async of a gathered row chunk, the release of a stage to whoever
// refills it, and on the host the TMA map of a tensor and the persistent grid.
#pragma once

#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

#include <cute/arch/cluster_sm90.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/bfloat16.h>

#include "flexep/core/checks.h"
#include "flexep/core/error.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda::sm90 {

using Element = cutlass::bfloat16_t;
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;  // loads landed: arrivals and TMA bytes
using EmptyBarrier = cutlass::arch::ClusterBarrier;            // the wgmma warps are done reading
constexpr int kChunk = 8;                                      // bf16 per 16-byte copy

// A stage index of a ring of kStages and the parity of its barriers' current phase.
template <int kStages>
struct StageState {
  int index = 0;
  std::uint32_t phase = 0;
  __device__ void advance() {
    if (++index == kStages) {
      index = 0;
      phase ^= 1;
    }
  }
};

// 16 bytes global -> shared, bypassing L1; `valid` false writes zeros and reads nothing.
__device__ __forceinline__ void copy16(const Element* src, Element* dst, bool valid) {
  cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                                                               *reinterpret_cast<cute::uint128_t*>(dst), valid);
}

// A consumer warp is done reading a stage: one arrival per warp on the stage's empty barrier of every
// CTA whose loads fill it (this one; with kPair also the peer, whose multicast boxes land here too).
template <bool kPair>
__device__ __forceinline__ void release_stage(std::uint64_t* empty, int stage) {
  __syncwarp();
  if (threadIdx.x % 32 != 0) return;
  if constexpr (kPair) {
    EmptyBarrier::arrive(&empty[stage], 0u, 1u);
    EmptyBarrier::arrive(&empty[stage], 1u, 1u);
  } else {
    EmptyBarrier::arrive(&empty[stage]);
  }
}

// The driver's cuTensorMapEncodeTiled, looked up once (CUTLASS's adapter looks it up on every call,
// and every GEMM call encodes its maps).
using TensorMapEncoder = decltype(&cuTensorMapEncodeTiled);  // the type only: no link to libcuda
inline TensorMapEncoder tensor_map_encoder() {
  static const TensorMapEncoder encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found{};
    FLEXEP_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found));
    FLEXEP_CHECK(found == cudaDriverEntryPointSuccess && fn != nullptr,
                 "the CUDA driver has no cuTensorMapEncodeTiled (TMA needs a CUDA 12 driver)");
    return reinterpret_cast<TensorMapEncoder>(fn);
  }();
  return encode;
}

// Thread 0 at the kernel's start: a ring of `stages` full barriers (`full_arrivals` each: the loader
// threads' arrivals, the TMA bytes come on top) and empty barriers (`empty_arrivals`: the wgmma warps
// of every CTA that reads the stage), visible to the cluster before its first use.
__device__ __forceinline__ void init_stage_barriers(std::uint64_t* full, std::uint64_t* empty, int stages,
                                                    int full_arrivals, int empty_arrivals) {
  if (threadIdx.x != 0) return;
  for (int i = 0; i < stages; ++i) {
    FullBarrier::init(&full[i], full_arrivals);
    EmptyBarrier::init(&empty[i], empty_arrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// One stage's wgmmas by a warpgroup: every k-block of the stage into `accum` (the first one of a tile
// overwrites it: the caller sets accumulate_ to Zero per tile), committed as one batch; returns with
// this batch in flight and the previous one done reading its stage (which the caller may release).
template <class TiledMma, class FragA, class FragB, class Accum>
__device__ __forceinline__ void mma_stage(TiledMma& tiled_mma, const FragA& tCrA, const FragB& tCrB, int stage,
                                          Accum& accum) {
  cute::warpgroup_fence_operand(accum);
  cute::warpgroup_arrive();
#pragma unroll
  for (int kb = 0; kb < cute::size<2>(tCrA); ++kb) {
    cute::gemm(tiled_mma, tCrA(cute::_, cute::_, kb, stage), tCrB(cute::_, cute::_, kb, stage), accum);
    tiled_mma.accumulate_ = cute::GMMA::ScaleOut::One;
  }
  cute::warpgroup_commit_batch();
  cute::warpgroup_wait<1>();
  cute::warpgroup_fence_operand(accum);
}

// A kernel argument's checks: rank, dtype, on `device` (the device of 'a').
inline void check_operand(const TensorView& t, std::initializer_list<DType> dtypes, int rank, const char* arg,
                          Device device) {
  check::rank(t, rank, arg);
  check::dtype(t, dtypes, arg);
  FLEXEP_CHECK_ARG(t.device.is_cuda(), arg, "must be on a CUDA device, got ", t.device.str());
  FLEXEP_CHECK_ARG(t.device == device, arg, "is on ", t.device.str(), " but 'a' is on ", device.str());
}

// A packed row-major tensor (dims innermost first) of bf16 or f32 as a TMA map with the 128-byte
// swizzle (a box's innermost extent is then at most 128 bytes); reads outside it are zero-filled,
// stores outside it dropped. `who` names the operation in the error.
inline void encode_map(CUtensorMap& map, const TensorView& t, std::vector<cuuint64_t> dims, std::vector<cuuint32_t> box,
                       CUtensorMapL2promotion promotion, const char* who, const char* arg) {
  const bool f32 = t.dtype == DType::f32;
  const auto rank = static_cast<cuuint32_t>(dims.size());
  std::vector<cuuint64_t> strides(rank - 1);
  cuuint64_t stride = f32 ? sizeof(float) : sizeof(Element);
  for (cuuint32_t i = 0; i + 1 < rank; ++i) strides[i] = stride *= dims[i];
  const std::vector<cuuint32_t> unit(rank, 1);
  const CUresult made = tensor_map_encoder()(
      &map, f32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(t.data),
      dims.data(), strides.data(), box.data(), unit.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      promotion, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FLEXEP_CHECK(made == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed (", static_cast<int>(made), ") for ", arg,
               " ", t.shape.str());
}

// Persistent CTAs: one per SM; for clusters of two (pair) as many as fit at once (an SM left alone in
// its GPC cannot hold one), so that no cluster waits for another to finish. Asked once per kernel
// and device, not per call (`config` carries the cluster size and shared memory the query needs).
template <class Kernel>
int persistent_grid(Kernel kernel, int device, bool pair, const cudaLaunchConfig_t& config) {
  static std::mutex lock;
  static std::map<std::tuple<const void*, int, bool>, int> grids;
  const std::lock_guard<std::mutex> hold(lock);
  const auto key = std::make_tuple(reinterpret_cast<const void*>(kernel), device, pair);
  const auto known = grids.find(key);
  if (known != grids.end()) return known->second;
  int sms = 0;
  FLEXEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  int grid = sms;
  if (pair) {
    int clusters = 0;
    cudaLaunchConfig_t query = config;
    query.gridDim = dim3(static_cast<unsigned>(sms / 2 * 2));
    FLEXEP_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, kernel, &query));
    FLEXEP_CHECK(clusters >= 1, "no cluster of two CTAs fits on device ", device);
    grid = std::min(clusters, sms / 2) * 2;
  }
  grids[key] = grid;
  return grid;
}

// The launch configuration of a persistent kernel in clusters of `cluster` CTAs (1 or 2); `attr`
// must outlive the launch.
inline cudaLaunchConfig_t cluster_launch(int threads, std::size_t smem, int cluster, cudaStream_t stream,
                                         cudaLaunchAttribute& attr) {
  attr = cudaLaunchAttribute{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  cudaLaunchConfig_t config{};
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = &attr;
  config.numAttrs = 1;
  return config;
}

}  // namespace flexep::cuda::sm90
