// The experts' weight gradient (flexep/cuda/wgrad_gemm.h): the kernel and its launch.
//
// Roles in a CTA of three warpgroups, as in gather_gemm.cu:
//   warpgroup 0     loads: per stage, 64 of the group's rows: a's 128 columns of them (two TMA boxes
//                   of 64 x 64, or through the row table by 16-byte cp.async, a warp reading two rows'
//                   256 bytes) and d's 256 columns (four TMA boxes; with pairs two, multicast to both
//                   CTAs). Both land in the 128-byte-swizzled "MN-major" layout wgmma reads: the
//                   reduced dimension, the rows, is the outer one in memory;
//   warpgroups 1-2  wait for a stage, run 4 wgmma k-steps on it (64 x 256 each), release the stage
//                   once the next stage's wgmmas are issued, then hand their 64 x 256 of the tile
//                   to the TMA unit through shared memory (stored, or added to c in L2 by TMA's
//                   reduce-add) and go on to the next tile while it writes.
// A tile's stages run over its group's rows only; the last one may hold rows of the next group (a
// TMA box is whole), which the wgmma warps overwrite with zeros first (the gathered a's are already
// zero: cp.async zero-fills rows past the group). Pairs (GatherGemmB::pair_multicast) are clusters of
// two CTAs on two K tiles of one (group, M tile): the same rows of d, loaded half by each.
#include "flexep/cuda/wgrad_gemm.h"

#include <cuda_bf16.h>

#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include "flexep/core/checks.h"
#include "flexep/core/error.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/runtime.h"
#include "sm90_epilogue.h"
#include "sm90_gemm.cuh"

namespace flexep::cuda {
namespace {

using namespace cute;
using sm90::copy16;
using sm90::Element;
using sm90::EmptyBarrier;
using sm90::FullBarrier;
using sm90::kChunk;

// A tile is 128 rows of c (columns of a) x 256 columns of c (columns of d); a stage is 64 group rows.
// Three stages leave room for the epilogue's buffers (32 KB per warpgroup).
constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 3;
constexpr int kLoadThreads = 128, kMmaThreads = 256, kThreads = kLoadThreads + kMmaThreads;
constexpr int kMmaWarps = kMmaThreads / 32;
constexpr int kBox = 64;  // one 128-byte swizzle span of a row
constexpr std::uint32_t kStageABytes = kBM * kBK * sizeof(Element), kStageBBytes = kBN * kBK * sizeof(Element);
using StageState = sm90::StageState<kStages>;

// Both operands are stored rows x columns with the columns contiguous and reduced over the rows:
// "MN-major" for wgmma, atoms along the rows first (as CUTLASS lays an MN-major operand).
template <int kCols>
using SmemLayoutMN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                            make_shape(Int<kCols>{}, Int<kBK>{}, Int<kStages>{}), Step<_2, _1, _3>{}));
using SmemLayoutA = SmemLayoutMN<kBM>;
using SmemLayoutB = SmemLayoutMN<kBN>;
using TiledMma = decltype(make_tiled_mma(
    SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{}, Layout<cute::Shape<_2, _1, _1>>{}));

// The epilogue: a warpgroup's 64 x 256 piece of the tile passes through 32 KB of shared memory as
// TMA boxes (sm90_epilogue.h).
template <class T>
using OutBoxes = sm90::EpilogueBoxes<static_cast<int>(sizeof(T))>;
constexpr int kOutBytes = OutBoxes<float>::kBufferBytes;
static_assert(OutBoxes<__nv_bfloat16>::kBufferBytes == kOutBytes, "one buffer size for both");

struct SharedStorage {
  alignas(1024) Element a[cosize_v<SmemLayoutA>];
  alignas(1024) Element b[cosize_v<SmemLayoutB>];
  alignas(1024) unsigned char out[kMmaThreads / 128][kOutBytes];  // per warpgroup
  std::uint64_t full[kStages];   // loads landed: (128 cp.async arrivals +) 1 expect_tx arrival and the TMA bytes
  std::uint64_t empty[kStages];  // the 8 wgmma warps of each CTA sharing the stage are done reading it
  int first[kGatherGemmMaxGroups];  // each group's rows [first, first + rows), clamped to [0, N]
  int rows[kGatherGemmMaxGroups];
};

struct Params {
  CUtensorMap d_map;  // d as [N][M], boxes of 64 (M) x 64 rows
  CUtensorMap a_map;  // a_by_tma: a as [R][K], boxes of 64 (K) x 64 rows
  CUtensorMap c_map;  // c as [G][K][M], boxes of OutBoxes<c's type>::kCols (M) x kRows (K) x 1
  bool a_by_tma;      // no row table: row i of a is group row i, so a comes by TMA as d does
  bool accumulate;    // c += (f32 only); else c =
  bool c_f32;
  const Element* a;
  const std::int32_t* row_ids;  // null: row i reads a[i]
  const std::int64_t* offsets;
  void* c;
  DeviceErrorRecord* errors;
  std::int64_t a_rows;
  int n, k, m, groups;
  int k_units, m_tiles;  // per group: work units along K (a pair's two tiles are one), tiles along M
};

struct Tile {
  int group, k_tile, m_tile, first, rows;  // c[group]'s tile (k_tile, m_tile); the group's rows [first, first + rows)
  __device__ int steps() const { return (rows + kBK - 1) / kBK; }
};

template <bool kPair>
constexpr int kCtasPerUnit = kPair ? 2 : 1;

// Each group's rows from the offsets, by all threads at the kernel's start: clamped so that a bad
// offset can only mean fewer rows (never a negative count or an address outside d), and reported.
__device__ void plan_groups(const Params& p, SharedStorage& s) {
  for (int g = threadIdx.x; g < p.groups; g += blockDim.x) {
    const std::int64_t lo = p.offsets[g], hi = p.offsets[g + 1];
    if (p.errors && (lo < 0 || lo > p.n || hi < lo || hi > p.n)) {
      const bool low_bad = lo < 0 || lo > p.n;
      report_device_error(p.errors, DeviceArg::group_offsets, low_bad ? g : g + 1, -1, low_bad ? lo : hi, p.n);
    }
    const std::int64_t first = min(max(lo, std::int64_t{0}), static_cast<std::int64_t>(p.n));
    s.first[g] = static_cast<int>(first);
    s.rows[g] = static_cast<int>(min(max(hi, first), static_cast<std::int64_t>(p.n)) - first);
  }
}

// Work unit u -> this CTA's tile: groups in order, inside a group the K tiles of one M column next to
// each other (they read the same rows of d). With kPair the CTA of rank r takes K tile 2j + r of
// unit j, which may lie past K (an odd K tile count): it then reads zeros and stores nothing, but
// runs the stages its peer's multicasts need.
template <bool kPair>
__device__ Tile tile_at(const Params& p, const SharedStorage& s, int unit) {
  const int per_group = p.k_units * p.m_tiles;
  Tile t;
  t.group = unit / per_group;
  const int local = unit % per_group;
  t.m_tile = local / p.k_units;
  t.k_tile = (local % p.k_units) * kCtasPerUnit<kPair> + (kPair ? static_cast<int>(block_rank_in_cluster()) : 0);
  t.first = s.first[t.group];
  t.rows = s.rows[t.group];
  return t;
}

// An accumulating call leaves an empty group's gradient as it is: no loads, no stores.
__device__ __forceinline__ bool skipped(const Params& p, const Tile& t) { return p.accumulate && t.rows == 0; }

// The source row of group row `row` (-1: a zero row), checked before any address is formed from it.
__device__ __forceinline__ std::int64_t source_row(const Params& p, const Tile& t, int row) {
  if (row >= t.rows) return -1;
  const int at = t.first + row;
  const std::int64_t id = p.row_ids ? p.row_ids[at] : at;
  if (id < -1 || id >= p.a_rows) {
    if (p.errors) report_device_error(p.errors, DeviceArg::row_ids, at, -1, id, p.a_rows);
    return -1;
  }
  return id;
}

// Thread 0 of the loaders: announces the stage's 32 KB of d (plus `a_bytes` when a comes by TMA too),
// then issues d's 64 rows x 256 columns from `row` as four TMA boxes; with kPair only this CTA's two,
// multicast to both CTAs of the cluster (the other two come from the peer onto this CTA's barrier).
template <bool kPair>
__device__ __forceinline__ void load_d(const Params& p, SharedStorage& s, const Tile& t, int stage, int row,
                                       std::uint32_t a_bytes) {
  FullBarrier::arrive_and_expect_tx(&s.full[stage], kStageBBytes + a_bytes);
  Element* b_stage = s.b + stage * (kBN * kBK);
  const int m0 = t.m_tile * kBN;
  if constexpr (kPair) {
    const int rank = static_cast<int>(block_rank_in_cluster());
#pragma unroll
    for (int j = rank; j < kBN / kBox; j += 2)
      SM90_TMA_LOAD_MULTICAST_2D::copy(&p.d_map, &s.full[stage], std::uint16_t{0b11}, 0, b_stage + j * (kBox * kBK),
                                       m0 + j * kBox, row);
  } else {
#pragma unroll
    for (int j = 0; j < kBN / kBox; ++j)
      SM90_TMA_LOAD_2D::copy(&p.d_map, &s.full[stage], 0, b_stage + j * (kBox * kBK), m0 + j * kBox, row);
  }
}

// Thread 0 of the loaders, when accumulating, with the tile's last stage: asks L2 for the tile's old
// gradient (one bulk prefetch per row of c, its columns in the tile), so that the epilogue's reads,
// a few stages later, hit L2 instead of waiting for HBM with the wgmma warps idle.
__device__ __forceinline__ void prefetch_old_tile(const Params& p, const Tile& t) {
  if (!p.accumulate) return;
  const int k0 = t.k_tile * kBM, m0 = t.m_tile * kBN;
  const int rows = min(kBM, p.k - k0), bytes = min(kBN, p.m - m0) * static_cast<int>(sizeof(float));
  const float* c = static_cast<const float*>(p.c) + static_cast<std::int64_t>(t.group) * p.k * p.m;
  for (int r = 0; r < rows; ++r)
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(c + static_cast<std::int64_t>(k0 + r) * p.m + m0),
                 "r"(bytes)
                 : "memory");
}

// Thread 0 of the loaders without a row table: a's 64 rows x 128 columns as two TMA boxes beside d's.
template <bool kPair>
__device__ void load_tiles_tma(const Params& p, SharedStorage& s, int total_units) {
  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState state;
  for (int unit = first; unit < total_units; unit += stride) {
    const Tile t = tile_at<kPair>(p, s, unit);
    if (skipped(p, t)) continue;
    for (int step = 0; step < t.steps(); ++step) {
      // A fresh barrier counts as having completed the phase before its first: the first pass waits
      // for nothing.
      EmptyBarrier::wait(&s.empty[state.index], state.phase ^ 1);
      const int stage = state.index, row = t.first + step * kBK;
      load_d<kPair>(p, s, t, stage, row, kStageABytes);
      if (step == t.steps() - 1) prefetch_old_tile(p, t);
#pragma unroll
      for (int j = 0; j < kBM / kBox; ++j)
        SM90_TMA_LOAD_2D::copy(&p.a_map, &s.full[stage], 0, s.a + stage * (kBM * kBK) + j * (kBox * kBK),
                               t.k_tile * kBM + j * kBox, row);
      state.advance();
    }
  }
}

// Warpgroup 0 with a row table. Thread t copies 16-byte column chunk t % 16 of the stage's rows
// t / 16 + 8 i (i < 8); each thread's cp.async.mbarrier.arrive.noinc is one of the full barrier's 129
// arrivals (the 129th is thread 0's expect_tx for d).
template <bool kPair>
__device__ void load_tiles_gathered(const Params& p, SharedStorage& s, int total_units) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  constexpr int kChunksPerRow = kBM / kChunk, kRowsPerPass = kLoadThreads / kChunksPerRow;
  const int t = threadIdx.x;
  const int chunk = t % kChunksPerRow, row0 = t / kChunksPerRow;
  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState state;
  for (int unit = first; unit < total_units; unit += stride) {
    const Tile tile = tile_at<kPair>(p, s, unit);
    if (skipped(p, tile)) continue;
    const int col = tile.k_tile * kBM + chunk * kChunk;
    const bool col_ok = col < p.k;
    // This thread's rows of a stage, read from the table one stage ahead: the reads' latency then
    // overlaps the wait for the next free stage instead of delaying its copies.
    constexpr int kIds = kBK / kRowsPerPass;
    std::int64_t ids[kIds];
    auto read_ids = [&](int step) {
#pragma unroll
      for (int i = 0; i < kIds; ++i) ids[i] = col_ok ? source_row(p, tile, step * kBK + row0 + kRowsPerPass * i) : -1;
    };
    read_ids(0);
    for (int step = 0; step < tile.steps(); ++step) {
      EmptyBarrier::wait(&s.empty[state.index], state.phase ^ 1);
      const int stage = state.index;
      if (t == 0) {
        load_d<kPair>(p, s, tile, stage, tile.first + step * kBK, 0);
        if (step == tile.steps() - 1) prefetch_old_tile(p, tile);
      }
#pragma unroll
      for (int i = 0; i < kIds; ++i)
        copy16(ids[i] >= 0 ? p.a + ids[i] * p.k + col : p.a, &sA(chunk * kChunk, row0 + kRowsPerPass * i, stage),
               ids[i] >= 0);
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
      state.advance();
      if (step + 1 < tile.steps()) read_ids(step + 1);
    }
  }
}

// The wgmma warps on a group's last, partial stage: rows [valid, 64) hold the next group's rows (or
// zeros past the tensors) and become zeros in d's block, and in a's when a came by TMA. The generic
// writes are made visible to wgmma (the async proxy) before any warp of the two warpgroups reads.
__device__ void zero_tail(const Params& p, SharedStorage& s, int stage, int valid) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  auto sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
  constexpr int kBChunks = kBN / kChunk, kAChunks = kBM / kChunk;
  const int per_row = kBChunks + (p.a_by_tma ? kAChunks : 0);
  const int total = (kBK - valid) * per_row;
  for (int i = static_cast<int>(threadIdx.x) - kLoadThreads; i < total; i += kMmaThreads) {
    const int row = valid + i / per_row, c = i % per_row;
    Element* dst = c < kBChunks ? &sB(c * kChunk, row, stage) : &sA((c - kBChunks) * kChunk, row, stage);
    *reinterpret_cast<uint4*>(dst) = make_uint4(0u, 0u, 0u, 0u);
  }
  cutlass::arch::fence_view_async_shared();
  cutlass::arch::NamedBarrier::sync(kMmaThreads, 0);
}

// This warpgroup's rows of a tile (`empty`: zeros, the tile ran no step) to c by TMA: each round's
// rows written into the warpgroup's buffer as swizzled boxes (sm90_epilogue.h), made visible to the
// async proxy, then stored (or, when accumulating, added to c in L2) by one thread, which first waits
// until the previous round's boxes have been read out of the buffer. The TMA unit drops what lies past
// c's rows or columns. The accumulators are only read here: writing them on a divergent path would
// make ptxas serialise the next tile's wgmmas.
template <class T, class Accum>
__device__ __forceinline__ void store_tile(const Params& p, SharedStorage& s, const Tile& tile, const Accum& accum,
                                           bool empty) {
  using Boxes = OutBoxes<T>;
  const int wg = (threadIdx.x - kLoadThreads) / 128, t = threadIdx.x % 128, warp = t / 32, lane = t % 32;
  const bool leader = t == 0;
  const int swizzle = Boxes::swizzle(lane);
  auto sync_warpgroup = [&] { cutlass::arch::NamedBarrier::sync(128, 1 + wg); };
#pragma unroll
  for (int round = 0; round < Boxes::kRounds; ++round) {
    // The buffer is free once the TMA unit has read the previous round's (or tile's) boxes.
    if (leader) tma_store_wait<0>();
    sync_warpgroup();
    if (Boxes::round_of(warp) == round) {
      // 32-bit shared-memory addresses: a generic pointer would cost a register pair.
      const std::uint32_t base = cast_smem_ptr_to_uint(s.out[wg]) + Boxes::thread_base(warp, lane);
#pragma unroll
      for (int j = 0; j < kBN / 8; ++j) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const std::uint32_t at = base + Boxes::pair_offset(j, h, swizzle);
          const int i = 2 * h + 4 * j;
          const float v0 = empty ? 0.f : accum(i), v1 = empty ? 0.f : accum(i + 1);
          if constexpr (sizeof(T) == 4) {
            asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(v0), "f"(v1) : "memory");
          } else {
            const __nv_bfloat162 v = __floats2bfloat162_rn(v0, v1);
            const std::uint32_t bits = *reinterpret_cast<const std::uint32_t*>(&v);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(bits) : "memory");
          }
        }
      }
    }
    tma_store_fence();  // the generic writes above, before the async proxy reads them
    sync_warpgroup();
    const int k = tile.k_tile * kBM + 64 * wg + round * Boxes::kRows;
    if (leader && k < p.k) {  // a pair's CTA past the last K tile stores nothing
#pragma unroll
      for (int b = 0; b < Boxes::kBoxes; ++b) {
        const int m = tile.m_tile * kBN + b * Boxes::kCols;
        if (m >= p.m) break;
        if (p.accumulate) SM90_TMA_REDUCE_ADD_3D::copy(&p.c_map, s.out[wg] + b * Boxes::kBytes, m, k, tile.group);
        else SM90_TMA_STORE_3D::copy(&p.c_map, s.out[wg] + b * Boxes::kBytes, m, k, tile.group);
      }
      tma_store_arrive();
    }
  }
}

// Warpgroups 1 and 2: rows [64 w, 64 w + 64) of each tile.
template <bool kPair>
__device__ void mma_tiles(const Params& p, SharedStorage& s, int total_units) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  auto sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
  const int mma_thread = threadIdx.x - kLoadThreads;
  TiledMma tiled_mma;
  auto wg_mma = tiled_mma.get_slice(mma_thread / cutlass::NumThreadsPerWarpGroup * cutlass::NumThreadsPerWarpGroup);
  auto tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  auto tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  auto accum = partition_fragment_C(tiled_mma, make_shape(Int<kBM>{}, Int<kBN>{}));

  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState read;
  for (int unit = first; unit < total_units; unit += stride) {
    Tile tile = tile_at<kPair>(p, s, unit);
    // The same for every thread, but read from global memory: broadcast, so that ptxas sees the loop
    // below as warp-uniform (a divergent path around wgmma serialises it).
    tile.first = __shfl_sync(0xffffffffu, tile.first, 0);
    tile.rows = __shfl_sync(0xffffffffu, tile.rows, 0);
    if (skipped(p, tile)) continue;
    const int steps = tile.steps();
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    StageState release = read;
    for (int step = 0; step < steps; ++step) {
      FullBarrier::wait(&s.full[read.index], read.phase);
      const int stage = read.index;
      const int valid = tile.rows - step * kBK;
      if (valid < kBK) {
        zero_tail(p, s, stage, valid);
      } else if (!p.a_by_tma) {
        // a's rows were written by cp.async (the generic proxy); wgmma reads them through the async proxy.
        cutlass::arch::fence_view_async_shared();
      }
      sm90::mma_stage(tiled_mma, tCrA, tCrB, stage, accum);
      if (step > 0) {
        sm90::release_stage<kPair>(s.empty, release.index);
        release.advance();
      }
      read.advance();
    }
    // Unconditional (nothing is in flight after no step): a wgmma wait on a divergent path would
    // serialise the wgmmas.
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    if (steps > 0) sm90::release_stage<kPair>(s.empty, release.index);
    if (p.c_f32) store_tile<float>(p, s, tile, accum, steps == 0);
    else store_tile<__nv_bfloat16>(p, s, tile, accum, steps == 0);
  }
  // The last tile's stores complete before the CTA (and its shared memory) goes.
  if (threadIdx.x % 128 == 0) asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

template <bool kPair>
__global__ void __launch_bounds__(kThreads, 1) wgrad_grouped_gemm_kernel(const __grid_constant__ Params p) {
  extern __shared__ char smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage*>((reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  sm90::init_stage_barriers(s.full, s.empty, kStages, p.a_by_tma ? 1 : kLoadThreads + 1,
                            kMmaWarps * kCtasPerUnit<kPair>);
  if (threadIdx.x == 32) cute::prefetch_tma_descriptor(&p.d_map);
  if (threadIdx.x == 64 && p.a_by_tma) cute::prefetch_tma_descriptor(&p.a_map);
  if (threadIdx.x == kLoadThreads) cute::prefetch_tma_descriptor(&p.c_map);
  plan_groups(p, s);
  __syncthreads();
  // The peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs'
  // barriers are initialised before either starts, and neither leaves while the other may still do so.
  if constexpr (kPair) cute::cluster_sync();
  const int total_units = p.groups * p.k_units * p.m_tiles;
  if (threadIdx.x < kLoadThreads) {
    if (!p.a_by_tma) load_tiles_gathered<kPair>(p, s, total_units);
    else if (threadIdx.x == 0) load_tiles_tma<kPair>(p, s, total_units);
  } else {
    mma_tiles<kPair>(p, s, total_units);
  }
  if constexpr (kPair) cute::cluster_sync();
}

constexpr std::size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + the 1024-byte alignment

// Shapes are checked by the caller; TMA and 16-byte copies need 16-byte aligned addresses.
void check_on(const TensorView& t, std::initializer_list<DType> dtypes, int rank, const char* arg, Device device) {
  sm90::check_operand(t, dtypes, rank, arg, device);
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg, "must be 16-byte aligned");
}

}  // namespace

void wgrad_grouped_gemm(const TensorView& a, const TensorView& row_ids, const TensorView& d,
                        const TensorView& offsets, const TensorView& c, bool accumulate, cudaStream_t stream,
                        DeviceErrorRecord* errors) {
  check_on(a, {DType::bf16}, 2, "a", a.device);
  const Device dev = a.device;
  check_on(d, {DType::bf16}, 2, "d", dev);
  check_on(c, {DType::f32, DType::bf16}, 3, "c", dev);
  check_on(offsets, {DType::i64}, 1, "offsets", dev);
  const std::int64_t R = a.shape[0], K = a.shape[1], N = d.shape[0], M = d.shape[1], G = c.shape[0];
  check::shape(c, {G, K, M}, "c");
  check::shape(offsets, {G + 1}, "offsets");
  const bool table = row_ids.shape.defined();
  if (table) {
    check_on(row_ids, {DType::i32}, 1, "row_ids", dev);
    check::shape(row_ids, {N}, "row_ids");
  } else {
    FLEXEP_CHECK_ARG(R >= N, "a", "has ", R, " rows; without row_ids it needs one per row of d (", N, ")");
  }
  FLEXEP_CHECK_ARG(!accumulate || c.dtype == DType::f32, "c", "is ", dtype_name(c.dtype),
                   "; accumulating into it needs f32 (bf16 gradients are overwritten)");
  FLEXEP_CHECK_ARG(G >= 1 && G <= kGatherGemmMaxGroups, "c", "must hold 1 to ", kGatherGemmMaxGroups,
                   " groups, got shape ", c.shape.str());
  FLEXEP_CHECK_ARG(K >= 8 && K % 8 == 0, "a", "needs K (its columns) a positive multiple of 8, got ", K);
  FLEXEP_CHECK_ARG(M >= 8 && M % 8 == 0, "d", "needs M (its columns) a positive multiple of 8, got ", M);
  FLEXEP_CHECK_ARG(K <= INT32_MAX && M <= INT32_MAX, "a", "K and M must be < 2^31, got ", K, " and ", M);
  // TMA row coordinates are int32 and reach a box past the last row.
  FLEXEP_CHECK_ARG(N <= INT32_MAX - kBK, "d", "has ", N, " rows; at most ", INT32_MAX - kBK, " are supported");
  const bool pair = gather_gemm_b_sharing() == GatherGemmB::pair_multicast;
  const std::int64_t k_tiles = (K + kBM - 1) / kBM, k_units = (k_tiles + (pair ? 1 : 0)) / (pair ? 2 : 1),
                     m_tiles = (M + kBN - 1) / kBN;
  FLEXEP_CHECK_ARG(G * k_units * m_tiles < (std::int64_t{1} << 31), "c", "has shape ", c.shape.str(),
                   ": its tile count must stay below 2^31");
  DeviceGuard guard(dev.index);
  if (N == 0) {  // no rows at all: every group empty
    if (!accumulate) FLEXEP_CUDA_CHECK(cudaMemsetAsync(c.data, 0, c.numel() * element_size(c.dtype), stream));
    return;
  }

  static const bool attributes_set = [] {  // every kernel, before any launch or occupancy query
    for (const auto k : {wgrad_grouped_gemm_kernel<false>, wgrad_grouped_gemm_kernel<true>})
      FLEXEP_CUDA_CHECK(
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
    return true;
  }();
  (void)attributes_set;
  const auto kernel = pair ? wgrad_grouped_gemm_kernel<true> : wgrad_grouped_gemm_kernel<false>;
  Params p{};
  // d as [N][M] (innermost first), boxes of 64 columns x 64 rows; a without a table likewise. Reads past
  // the last row or column are zero-filled by the TMA unit.
  sm90::encode_map(p.d_map, d, {static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(N)}, {kBox, kBK},
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "wgrad_grouped_gemm", "d");
  // c as [G][K][M]: a box never crosses into the next group's gradient.
  const bool c_f32 = c.dtype == DType::f32;
  sm90::encode_map(p.c_map, c, {static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(G)},
                   {static_cast<cuuint32_t>(c_f32 ? OutBoxes<float>::kCols : OutBoxes<__nv_bfloat16>::kCols),
                    static_cast<cuuint32_t>(c_f32 ? OutBoxes<float>::kRows : OutBoxes<__nv_bfloat16>::kRows), 1},
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "wgrad_grouped_gemm", "c");
  p.a_by_tma = !table;
  if (p.a_by_tma)
    sm90::encode_map(p.a_map, a, {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(R)}, {kBox, kBK},
                     CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "wgrad_grouped_gemm", "a");
  p.accumulate = accumulate;
  p.c_f32 = c_f32;
  p.a = static_cast<const Element*>(a.data);
  p.row_ids = table ? static_cast<const std::int32_t*>(row_ids.data) : nullptr;
  p.offsets = static_cast<const std::int64_t*>(offsets.data);
  p.c = c.data;
  p.errors = errors;
  p.a_rows = R;
  p.n = static_cast<int>(N);
  p.k = static_cast<int>(K);
  p.m = static_cast<int>(M);
  p.groups = static_cast<int>(G);
  p.k_units = static_cast<int>(k_units);
  p.m_tiles = static_cast<int>(m_tiles);
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t config = sm90::cluster_launch(kThreads, kSmemBytes, pair ? 2 : 1, stream, cluster);
  config.gridDim = dim3(static_cast<unsigned>(sm90::persistent_grid(kernel, dev.index, pair, config)));
  FLEXEP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  FLEXEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flexep::cuda
