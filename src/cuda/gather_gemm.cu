// The gathered grouped GEMM (flexep/cuda/gather_gemm.h): the kernel and its launch.
//
// Roles in a CTA of three warpgroups:
//   warpgroup 0     loads: per stage, A's 128 gathered rows x 64 columns by 16-byte cp.async into the
//                   swizzled layout wgmma reads, and B's 64 x 256 block by four TMA boxes (64 x 64,
//                   128-byte swizzle: the same layout). The stage's full barrier completes when the
//                   128 threads' copies have landed (cp.async.mbarrier.arrive.noinc) and the TMA
//                   bytes have arrived (expect_tx);
//   warpgroups 1-2  wait for a stage, run 4 wgmma k-steps on it (64 x 256 each), release the stage
//                   once the next stage's wgmmas are issued (one batch in flight), then store the tile.
// GatherGemmB::pair_multicast: CTAs run in clusters of two on the two M tiles of one (group, B block);
// each loads two of B's four boxes and multicasts them to both, so each SM reads 32 KB a stage from
// L2 instead of 48. A stage may then be refilled only when both CTAs' consumers have released it:
// every consumer warp arrives on the empty barrier of both CTAs.
// kBT (GatherGemmBLayout::m_by_k): B stored [G][M][K] is read transposed, K-major like A, one TMA box
// of 256 rows (a pair: 128 each) per stage.
// The barriers are CUTLASS's mbarrier wrappers, the layouts, wgmma descriptors and TMA copies CuTe's,
// the TMA descriptor is made by the driver's cuTensorMapEncodeTiled (sm90_gemm.cuh).
// The loaders run ahead by up to four stages, also across tiles, so the next tile's loads overlap this
// tile's epilogue.
#include "flexep/cuda/gather_gemm.h"

#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include "flexep/core/checks.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"
#include "sm90_gemm.cuh"

namespace flexep::cuda {
namespace {

using namespace cute;
using sm90::copy16;
using sm90::Element;
using sm90::EmptyBarrier;
using sm90::FullBarrier;
using sm90::kChunk;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kLoadThreads = 128, kMmaThreads = 256, kThreads = kLoadThreads + kMmaThreads;

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                           make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
// B stored [K, M] (M contiguous) is "MN-major" for wgmma: atoms along K first, as CUTLASS lays it.
// B stored [M, K] (K contiguous: the transposed weights of a data gradient) is K-major, laid out as A.
template <bool kBT>
using SmemLayoutB = std::conditional_t<
    kBT, decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}))),
    decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}),
                           Step<_2, _1, _3>{}))>;
template <bool kBT>
using TiledMma = decltype(make_tiled_mma(
    SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<GMMA::Major::K, kBT ? GMMA::Major::K : GMMA::Major::MN>{},
    Layout<cute::Shape<_2, _1, _1>>{}));
constexpr int kBoxN = 64;                                  // one 128-byte swizzle span of B's rows
constexpr std::uint32_t kStageBBytes = kBN * kBK * sizeof(Element);
constexpr std::uint32_t kStageABytes = kBM * kBK * sizeof(Element);
constexpr int kMmaWarps = kMmaThreads / 32;

using StageState = sm90::StageState<kStages>;

static_assert(cosize_v<SmemLayoutB<false>> == cosize_v<SmemLayoutB<true>>);

struct SharedStorage {
  alignas(1024) Element a[cosize_v<SmemLayoutA>];
  alignas(1024) Element b[cosize_v<SmemLayoutB<false>>];  // both layouts: kBN x kBK x kStages
  std::uint64_t full[kStages];   // loads landed: 128 cp.async arrivals + 1 expect_tx arrival and B's bytes
  std::uint64_t empty[kStages];  // the 8 wgmma warps of each CTA sharing the stage are done reading it
  int tile_start[kGatherGemmMaxGroups + 1];  // the first work unit of each group; [G] = all units
  int row_begin[kGatherGemmMaxGroups + 1];   // the groups' rows, clamped to [0, N]
};

struct Params {
  CUtensorMap b_map;  // B as [G][K][M], boxes of 64 (M) x 64 (K); transposed: [G][M][K], boxes of 64 (K) x 256 or 128 rows
  CUtensorMap a_map;  // a_by_tma: A as [R][K], boxes of 64 (K) x 128 rows
  bool a_by_tma;      // no row table: a tile's rows are contiguous, so A comes by TMA as B does
  const Element* a;
  const std::int32_t* row_ids;  // null: row i reads a[i]
  const std::int64_t* offsets;
  const Element* b;
  Element* c;
  DeviceErrorRecord* errors;
  std::int64_t a_rows;
  int n, k, m, groups;
};

struct Tile {
  int group, m_tile, n_tile, row_begin, rows;
};

// kPair: clusters of two CTAs on the two M tiles 2j, 2j + 1 of one B block (one "work unit").
template <bool kPair>
constexpr int kCtasPerUnit = kPair ? 2 : 1;

// Each group's first work unit (one per M tile, kPair: per pair of M tiles, and N tile), by warp 0
// (one warp scan per 32 groups). Offsets are clamped so a bad table can only mean fewer rows, never an
// address outside c.
template <bool kPair>
__device__ void plan_tiles(const Params& p, SharedStorage& s) {
  if (threadIdx.x >= 32) return;
  const int lane = threadIdx.x;
  const int n_tiles = (p.m + kBN - 1) / kBN;
  int carry = 0;
  for (int base = 0; base < p.groups; base += 32) {
    const int g = base + lane;
    int tiles = 0;
    if (g < p.groups) {
      const std::int64_t lo = p.offsets[g], hi = p.offsets[g + 1];
      if (p.errors && (lo < 0 || lo > p.n || hi < lo || hi > p.n)) {
        const std::int64_t bad = (lo < 0 || lo > p.n) ? lo : hi;
        report_device_error(p.errors, DeviceArg::group_offsets, (lo < 0 || lo > p.n) ? g : g + 1, -1, bad, p.n);
      }
      const int b = static_cast<int>(min(max(lo, std::int64_t{0}), static_cast<std::int64_t>(p.n)));
      const int e = static_cast<int>(min(max(hi, static_cast<std::int64_t>(b)), static_cast<std::int64_t>(p.n)));
      s.row_begin[g] = b;
      if (g == p.groups - 1) s.row_begin[p.groups] = e;
      const int m_tiles = (e - b + kBM - 1) / kBM;
      tiles = (m_tiles + kCtasPerUnit<kPair> - 1) / kCtasPerUnit<kPair> * n_tiles;
    }
    int inclusive = tiles;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, d);
      if (lane >= d) inclusive += v;
    }
    if (g < p.groups) s.tile_start[g] = carry + inclusive - tiles;
    carry += __shfl_sync(0xffffffffu, inclusive, 31);
  }
  if (lane == 0) s.tile_start[p.groups] = carry;
}

// Work unit t -> this CTA's tile (group, m tile, n tile): the group is the last one starting at or
// before t (empty groups start where the next one does); inside a group the units of one N column are
// consecutive. With kPair the CTA of rank r in its cluster takes M tile 2j + r of unit j, which may lie
// past the group's rows (an odd M tile count): its rows are then zero and none is stored.
template <bool kPair>
__device__ Tile tile_at(const Params& p, const SharedStorage& s, int t) {
  int lo = 0, hi = p.groups;  // tile_start[lo] <= t < tile_start[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (s.tile_start[mid] <= t) lo = mid; else hi = mid;
  }
  Tile tile;
  tile.group = lo;
  tile.row_begin = s.row_begin[lo];
  tile.rows = s.row_begin[lo + 1] - tile.row_begin;
  const int units = ((tile.rows + kBM - 1) / kBM + kCtasPerUnit<kPair> - 1) / kCtasPerUnit<kPair>;
  const int local = t - s.tile_start[lo];
  tile.n_tile = local / units;
  tile.m_tile = (local % units) * kCtasPerUnit<kPair> + (kPair ? static_cast<int>(block_rank_in_cluster()) : 0);
  return tile;
}

// The source row of tile row `row` (-1: a zero row), checked before any address is formed from it.
__device__ __forceinline__ std::int64_t source_row(const Params& p, const Tile& tile, int row) {
  if (row >= tile.rows) return -1;
  const int at = tile.row_begin + row;
  const std::int64_t id = p.row_ids ? p.row_ids[at] : at;
  if (id < -1 || id >= p.a_rows) {
    if (p.errors) report_device_error(p.errors, DeviceArg::row_ids, at, -1, id, p.a_rows);
    return -1;
  }
  return id;
}

// Thread 0 of the loaders: announces the stage's 32 KB of B (plus `a_bytes` when A comes by TMA too),
// then issues B's 64 x 256 block as four TMA boxes (transposed B: one box of 256 K-major rows); with
// kPair only this CTA's half, multicast to both CTAs of the cluster (the other half comes from the
// peer, into this CTA's stage and onto its full barrier).
template <bool kPair, bool kBT>
__device__ __forceinline__ void load_b(const Params& p, SharedStorage& s, const Tile& tile, int stage, int k0,
                                       std::uint32_t a_bytes = 0) {
  FullBarrier::arrive_and_expect_tx(&s.full[stage], kStageBBytes + a_bytes);
  Element* b_stage = s.b + stage * (kBN * kBK);
  const int n0 = tile.n_tile * kBN;
  if constexpr (kBT) {  // rows of 128 bytes (64 K), one after another: a box fills a row range
    if constexpr (kPair) {
      const int rank = static_cast<int>(block_rank_in_cluster());
      constexpr int kHalf = kBN / 2;
      SM90_TMA_LOAD_MULTICAST_3D::copy(&p.b_map, &s.full[stage], std::uint16_t{0b11}, 0, b_stage + rank * (kHalf * kBK),
                                       k0, n0 + rank * kHalf, tile.group);
    } else {
      SM90_TMA_LOAD_3D::copy(&p.b_map, &s.full[stage], 0, b_stage, k0, n0, tile.group);
    }
  } else if constexpr (kPair) {
    const int rank = static_cast<int>(block_rank_in_cluster());
#pragma unroll
    for (int j = rank; j < kBN / kBoxN; j += 2)
      SM90_TMA_LOAD_MULTICAST_3D::copy(&p.b_map, &s.full[stage], std::uint16_t{0b11}, 0,
                                       b_stage + j * (kBoxN * kBK), n0 + j * kBoxN, k0, tile.group);
  } else {
#pragma unroll
    for (int j = 0; j < kBN / kBoxN; ++j)
      SM90_TMA_LOAD_3D::copy(&p.b_map, &s.full[stage], 0, b_stage + j * (kBoxN * kBK), n0 + j * kBoxN, k0,
                             tile.group);
  }
}

// Warpgroup 0. Thread t copies 16-byte column chunk t % 8 of A's rows t / 8 + 16 i (i < 8): a warp
// reads four rows' 128 bytes. Each thread's cp.async.mbarrier.arrive.noinc is one of the full barrier's
// 129 arrivals (the 129th is thread 0's expect_tx for B).
template <bool kPair, bool kBT>
__device__ void load_tiles(const Params& p, SharedStorage& s, int total_units) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  const int t = threadIdx.x;
  const int a_col = (t % 8) * kChunk, a_row0 = t / 8;
  const int k_tiles = (p.k + kBK - 1) / kBK;
  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState state;
  for (int unit = first; unit < total_units; unit += stride) {
    const Tile tile = tile_at<kPair>(p, s, unit);
    const Element* a_src[8];
    bool a_ok[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const std::int64_t id = source_row(p, tile, tile.m_tile * kBM + a_row0 + 16 * i);
      a_ok[i] = id >= 0;
      a_src[i] = p.a + (a_ok[i] ? id : 0) * p.k + a_col;
    }
    for (int kt = 0; kt < k_tiles; ++kt) {
      // A fresh barrier counts as having completed the phase before its first: the first pass waits
      // for nothing.
      EmptyBarrier::wait(&s.empty[state.index], state.phase ^ 1);
      const int stage = state.index;
      const int k0 = kt * kBK;
      if (t == 0) load_b<kPair, kBT>(p, s, tile, stage, k0);
      const bool a_k_ok = k0 + a_col < p.k;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool ok = a_ok[i] && a_k_ok;
        copy16(ok ? a_src[i] + k0 : p.a, &sA(a_row0 + 16 * i, a_col, stage), ok);
      }
      cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
      state.advance();
    }
  }
}

// Thread 0 of the loaders when there is no row table: a tile's 128 rows are contiguous, so A's stage
// is one TMA box too (K's tail and rows past A zero-filled; rows of the next group read but never
// stored), and the stage has a single arrival.
template <bool kPair, bool kBT>
__device__ void load_tiles_tma_a(const Params& p, SharedStorage& s, int total_units) {
  const int k_tiles = (p.k + kBK - 1) / kBK;
  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState state;
  for (int unit = first; unit < total_units; unit += stride) {
    const Tile tile = tile_at<kPair>(p, s, unit);
    const int row0 = tile.row_begin + tile.m_tile * kBM;
    for (int kt = 0; kt < k_tiles; ++kt) {
      EmptyBarrier::wait(&s.empty[state.index], state.phase ^ 1);
      const int stage = state.index;
      const int k0 = kt * kBK;
      load_b<kPair, kBT>(p, s, tile, stage, k0, kStageABytes);
      SM90_TMA_LOAD_2D::copy(&p.a_map, &s.full[stage], 0, s.a + stage * (kBM * kBK), k0, row0);
      state.advance();
    }
  }
}

// Warpgroups 1 and 2: rows [64 w, 64 w + 64) of each tile.
template <bool kPair, bool kBT>
__device__ void mma_tiles(const Params& p, SharedStorage& s, int total_units) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  auto sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB<kBT>{});
  const int mma_thread = threadIdx.x - kLoadThreads;
  TiledMma<kBT> tiled_mma;
  // The descriptors are per warpgroup (sliced at its first thread); the accumulator layout per thread.
  auto wg_mma = tiled_mma.get_slice(mma_thread / cutlass::NumThreadsPerWarpGroup * cutlass::NumThreadsPerWarpGroup);
  auto tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  auto tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  auto accum = partition_fragment_C(tiled_mma, make_shape(Int<kBM>{}, Int<kBN>{}));
  auto thr_mma = tiled_mma.get_slice(mma_thread);
  auto tCcC = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
  const int k_tiles = (p.k + kBK - 1) / kBK;

  const int first = blockIdx.x / kCtasPerUnit<kPair>, stride = gridDim.x / kCtasPerUnit<kPair>;
  StageState read;
  for (int unit = first; unit < total_units; unit += stride) {
    const Tile tile = tile_at<kPair>(p, s, unit);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    StageState release = read;
    for (int kt = 0; kt < k_tiles; ++kt) {
      FullBarrier::wait(&s.full[read.index], read.phase);
      // A's rows were written by cp.async (the generic proxy); wgmma reads them through the async proxy.
      cutlass::arch::fence_view_async_shared();
      const int stage = read.index;
      sm90::mma_stage(tiled_mma, tCrA, tCrB, stage, accum);
      if (kt > 0) {
        sm90::release_stage<kPair>(s.empty, release.index);
        release.advance();
      }
      read.advance();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    sm90::release_stage<kPair>(s.empty, release.index);

    // Epilogue: each thread holds pairs of adjacent columns; bf16x2 stores straight from registers.
    const int m_base = tile.m_tile * kBM, n_base = tile.n_tile * kBN;
#pragma unroll
    for (int i = 0; i < size(accum); i += 2) {
      const int r = get<0>(tCcC(i)) + m_base;
      const int col = get<1>(tCcC(i)) + n_base;
      if (r < tile.rows && col < p.m) {
        const std::int64_t out = static_cast<std::int64_t>(tile.row_begin + r) * p.m + col;
        *reinterpret_cast<__nv_bfloat162*>(p.c + out) = __floats2bfloat162_rn(accum(i), accum(i + 1));
      }
    }
  }
}

template <bool kPair, bool kBT>
__global__ void __launch_bounds__(kThreads, 1) gather_grouped_gemm_kernel(const __grid_constant__ Params p) {
  extern __shared__ char smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  sm90::init_stage_barriers(s.full, s.empty, kStages, p.a_by_tma ? 1 : kLoadThreads + 1,
                            kMmaWarps * kCtasPerUnit<kPair>);
  if (threadIdx.x == 32) cute::prefetch_tma_descriptor(&p.b_map);
  if (threadIdx.x == 64 && p.a_by_tma) cute::prefetch_tma_descriptor(&p.a_map);
  plan_tiles<kPair>(p, s);
  __syncthreads();
  // The peer multicasts into this CTA's shared memory and arrives on its barriers: both CTAs'
  // barriers are initialised before either starts, and neither leaves while the other may still do so.
  if constexpr (kPair) cute::cluster_sync();
  const int total_units = s.tile_start[p.groups];
  if (threadIdx.x < kLoadThreads) {
    if (!p.a_by_tma) load_tiles<kPair, kBT>(p, s, total_units);
    else if (threadIdx.x == 0) load_tiles_tma_a<kPair, kBT>(p, s, total_units);
  } else {
    mma_tiles<kPair, kBT>(p, s, total_units);
  }
  if constexpr (kPair) cute::cluster_sync();
}

constexpr std::size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + the 1024-byte alignment

std::atomic<GatherGemmB> g_b_sharing{GatherGemmB::pair_multicast};

}  // namespace

void set_gather_gemm_b_sharing(GatherGemmB sharing) { g_b_sharing.store(sharing, std::memory_order_relaxed); }
GatherGemmB gather_gemm_b_sharing() { return g_b_sharing.load(std::memory_order_relaxed); }

void gather_grouped_gemm(const TensorView& a, const TensorView& row_ids, const TensorView& offsets,
                         const TensorView& b, const TensorView& c, cudaStream_t stream, DeviceErrorRecord* errors,
                         GatherGemmBLayout b_layout) {
  const bool bt = b_layout == GatherGemmBLayout::m_by_k;
  sm90::check_operand(a, {DType::bf16}, 2, "a", a.device);
  const Device dev = a.device;
  sm90::check_operand(b, {DType::bf16}, 3, "b", dev);
  sm90::check_operand(c, {DType::bf16}, 2, "c", dev);
  sm90::check_operand(offsets, {DType::i64}, 1, "offsets", dev);
  const std::int64_t K = a.shape[1], G = b.shape[0], M = b.shape[bt ? 1 : 2], N = c.shape[0];
  if (bt) check::shape(b, {G, M, K}, "b");
  else check::shape(b, {G, K, M}, "b");
  check::shape(c, {N, M}, "c");
  check::shape(offsets, {G + 1}, "offsets");
  if (row_ids.shape.defined()) {
    sm90::check_operand(row_ids, {DType::i32}, 1, "row_ids", dev);
    check::shape(row_ids, {N}, "row_ids");
  } else {
    FLEXEP_CHECK_ARG(a.shape[0] >= N, "a", "has ", a.shape[0], " rows; without row_ids it needs one per row of c (", N,
                     ")");
  }
  FLEXEP_CHECK_ARG(G >= 1 && G <= kGatherGemmMaxGroups, "b", "must hold 1 to ", kGatherGemmMaxGroups,
                   " groups, got ", G);
  FLEXEP_CHECK_ARG(K >= 8 && K % 8 == 0, "a", "needs K (its columns) a positive multiple of 8, got ", K);
  FLEXEP_CHECK_ARG(M >= 8 && M % 8 == 0, "b", "needs M (c's columns) a positive multiple of 8, got ", M);
  FLEXEP_CHECK_ARG(K <= INT32_MAX && M <= INT32_MAX, "b", "K and M must be < 2^31, got ", K, " and ", M);
  // Tile ids are int: at most N / 128 + G row blocks per column of 256.
  FLEXEP_CHECK_ARG((N / kBM + G) * ((M + kBN - 1) / kBN) < (std::int64_t{1} << 31), "c", "has too many rows (", N,
                   ") for M = ", M, ": the tile count must stay below 2^31");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.data) % 16 == 0, "a", "must be 16-byte aligned");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(b.data) % 16 == 0, "b", "must be 16-byte aligned (TMA)");
  if (N == 0) return;

  DeviceGuard guard(dev.index);
  const bool pair = g_b_sharing.load(std::memory_order_relaxed) == GatherGemmB::pair_multicast;
  static const bool attributes_set = [] {  // every kernel, before any launch or occupancy query
    for (const auto k : {gather_grouped_gemm_kernel<false, false>, gather_grouped_gemm_kernel<false, true>,
                         gather_grouped_gemm_kernel<true, false>, gather_grouped_gemm_kernel<true, true>})
      FLEXEP_CUDA_CHECK(
          cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
    return true;
  }();
  (void)attributes_set;
  const auto kernel = pair ? (bt ? gather_grouped_gemm_kernel<true, true> : gather_grouped_gemm_kernel<true, false>)
                           : (bt ? gather_grouped_gemm_kernel<false, true> : gather_grouped_gemm_kernel<false, false>);
  Params p{};
  // B as a 3-D tensor, innermost first: [G][K][M], boxes of 64 M x 64 K, or transposed [G][M][K],
  // boxes of 64 K x 256 rows (a CTA pair: 128 each). Reads past K or M are zero-filled by the TMA unit.
  const auto g = static_cast<cuuint64_t>(G), k = static_cast<cuuint64_t>(K), m = static_cast<cuuint64_t>(M);
  constexpr auto kL2 = CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  constexpr const char* kWho = "gather_grouped_gemm";
  if (bt)
    sm90::encode_map(p.b_map, b, {k, m, g}, {kBK, static_cast<cuuint32_t>(pair ? kBN / 2 : kBN), 1}, kL2, kWho, "b");
  else
    sm90::encode_map(p.b_map, b, {m, k, g}, {kBoxN, kBK, 1}, kL2, kWho, "b");
  // Without a row table A's tiles are contiguous rows: boxes of 128 rows (row coordinates are int32).
  p.a_by_tma = !row_ids.shape.defined() && a.shape[0] <= INT32_MAX - 2 * kBM;
  if (p.a_by_tma)
    sm90::encode_map(p.a_map, a, {k, static_cast<cuuint64_t>(a.shape[0])}, {kBK, kBM}, kL2, kWho, "a");
  p.a = static_cast<const Element*>(a.data);
  p.row_ids = row_ids.shape.defined() ? static_cast<const std::int32_t*>(row_ids.data) : nullptr;
  p.offsets = static_cast<const std::int64_t*>(offsets.data);
  p.b = static_cast<const Element*>(b.data);
  p.c = static_cast<Element*>(c.data);
  p.errors = errors;
  p.a_rows = a.shape[0];
  p.n = static_cast<int>(N);
  p.k = static_cast<int>(K);
  p.m = static_cast<int>(M);
  p.groups = static_cast<int>(G);
  cudaLaunchAttribute cluster;
  cudaLaunchConfig_t config = sm90::cluster_launch(kThreads, kSmemBytes, pair ? 2 : 1, stream, cluster);
  config.gridDim = dim3(static_cast<unsigned>(sm90::persistent_grid(kernel, dev.index, pair, config)));
  FLEXEP_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
  FLEXEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flexep::cuda
