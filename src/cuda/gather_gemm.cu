// The gathered grouped GEMM (flexep/cuda/gather_gemm.h): the kernel and its launch.
//
// Roles in a CTA of three warpgroups:
//   warpgroup 0     loads: per stage, A's 128 gathered rows x 64 columns by 16-byte cp.async into the
//                   swizzled layout wgmma reads, and B's 64 x 256 block by four TMA boxes (64 x 64,
//                   128-byte swizzle: the same layout). The stage's full barrier completes when the
//                   128 threads' copies have landed (cp.async.mbarrier.arrive.noinc) and the TMA
//                   bytes have arrived (expect_tx); the loads' share of the SM's load path is A's
//                   third of the bytes only (cp.async alone for both fed wgmma at ~56% of cuBLAS);
//   warpgroups 1-2  wait for a stage, run 4 wgmma k-steps on it (64 x 256 each), release the stage
//                   once the next stage's wgmmas are issued (one batch in flight), then store the tile.
// The barriers are CUTLASS's mbarrier wrappers, the layouts and wgmma descriptors CuTe's, the TMA
// descriptor is made by cuTensorMapEncodeTiled through CUTLASS's driver-entry-point adapter. The loaders run ahead by up to four stages, also across tiles, so the next tile's loads
// overlap this tile's epilogue.
#include "flexep/cuda/gather_gemm.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cuda_host_adapter.hpp>

#include "flexep/core/checks.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::cuda {
namespace {

using namespace cute;
using Element = cutlass::bfloat16_t;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kLoadThreads = 128, kMmaThreads = 256, kThreads = kLoadThreads + kMmaThreads;
constexpr int kChunk = 8;  // bf16 per 16-byte copy

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                           make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
// B is stored [K, M] with M contiguous: "MN-major" for wgmma; atoms along K first, as CUTLASS lays it.
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                           make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}), Step<_2, _1, _3>{}));
using TiledMma = decltype(make_tiled_mma(
    SM90::GMMA::MMA_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}, Layout<cute::Shape<_2, _1, _1>>{}));
using FullBarrier = cutlass::arch::ClusterTransactionBarrier;
using EmptyBarrier = cutlass::arch::ClusterBarrier;
constexpr int kBoxN = 64;                                  // one 128-byte swizzle span of B's rows
constexpr std::uint32_t kStageBBytes = kBN * kBK * sizeof(Element);
constexpr std::uint32_t kStageABytes = kBM * kBK * sizeof(Element);

// A stage index and the parity of its barriers' current phase.
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

struct SharedStorage {
  alignas(1024) Element a[cosize_v<SmemLayoutA>];
  alignas(1024) Element b[cosize_v<SmemLayoutB>];
  std::uint64_t full[kStages];   // loads landed: 128 cp.async arrivals + 1 expect_tx arrival and B's bytes
  std::uint64_t empty[kStages];  // the 256 wgmma threads are done reading the stage
  int tile_start[kGatherGemmMaxGroups + 1];  // the first tile of each group; [G] = all tiles
  int row_begin[kGatherGemmMaxGroups + 1];   // the groups' rows, clamped to [0, N]
};

struct Params {
  CUtensorMap b_map;  // B as [G][K][M], boxes of 64 (M) x 64 (K)
  CUtensorMap a_map;  // GatherLoad::tma_rows: A as [R][K], boxes of 64 (K) x 1 row
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

// Group starts and tile counts, by warp 0 (one warp scan per 32 groups). Offsets are clamped so a bad
// table can only mean fewer rows, never an address outside c.
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
      tiles = (e - b + kBM - 1) / kBM * n_tiles;
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

// Tile t -> (group, m tile, n tile): the group is the last one starting at or before t (empty groups
// start where the next one does); inside a group the M tiles of one N column are consecutive.
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
  const int m_tiles = (tile.rows + kBM - 1) / kBM;
  const int local = t - s.tile_start[lo];
  tile.n_tile = local / m_tiles;
  tile.m_tile = local % m_tiles;
  return tile;
}

__device__ __forceinline__ void copy16(const Element* src, Element* dst, bool valid) {
  SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<uint128_t>::copy(*reinterpret_cast<const uint128_t*>(src),
                                                   *reinterpret_cast<uint128_t*>(dst), valid);
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

// Thread 0 of the loaders: B's 64 x 256 block of the stage by four TMA boxes, after announcing the
// stage's bytes (B's, plus A's when A comes by TMA too).
__device__ __forceinline__ void load_b(const Params& p, SharedStorage& s, const Tile& tile, int stage, int k0,
                                       std::uint32_t stage_bytes) {
  FullBarrier::arrive_and_expect_tx(&s.full[stage], stage_bytes);
  Element* b_stage = s.b + stage * (kBN * kBK);
  const int n0 = tile.n_tile * kBN;
#pragma unroll
  for (int j = 0; j < kBN / kBoxN; ++j)
    SM90_TMA_LOAD_3D::copy(&p.b_map, &s.full[stage], 0, b_stage + j * (kBoxN * kBK), n0 + j * kBoxN, k0, tile.group);
}

// Warpgroup 0, GatherLoad::cp_async. Thread t copies 16-byte column chunk t % 8 of A's rows
// t / 8 + 16 i (i < 8): a warp reads four rows' 128 bytes. The stage completes when B's bytes have
// landed and every thread's copies have (cp.async.mbarrier.arrive.noinc: one arrival per thread).
__device__ void load_tiles_cp_async(const Params& p, SharedStorage& s, int total_tiles) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  const int t = threadIdx.x;
  const int a_col = (t % 8) * kChunk, a_row0 = t / 8;
  const int k_tiles = (p.k + kBK - 1) / kBK;
  StageState state;
  for (int tile_id = blockIdx.x; tile_id < total_tiles; tile_id += gridDim.x) {
    const Tile tile = tile_at(p, s, tile_id);
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
      if (t == 0) load_b(p, s, tile, stage, k0, kStageBBytes);
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

// Warpgroup 0, GatherLoad::tma_rows. Thread t brings tile row t: one TMA box of 64 columns x 1 row
// per stage, written at the row's place in the stage. The 128-byte swizzle is a function of the
// shared-memory address, so rows copied one by one land exactly where a 128-row box would put them.
// A zero row (id -1, or past the group's rows) is the box at row -1: outside A, zero-filled by the
// TMA unit (and K's tail past the last column likewise). Only thread 0 arrives on the full barrier,
// announcing all 48 KB; the other threads' boxes may land first (the transaction count goes negative
// until then, and the phase cannot complete before that arrival).
__device__ void load_tiles_tma_rows(const Params& p, SharedStorage& s, int total_tiles) {
  const int t = threadIdx.x;
  const int k_tiles = (p.k + kBK - 1) / kBK;
  StageState state;
  for (int tile_id = blockIdx.x; tile_id < total_tiles; tile_id += gridDim.x) {
    const Tile tile = tile_at(p, s, tile_id);
    const auto row = static_cast<std::int32_t>(source_row(p, tile, tile.m_tile * kBM + t));
    for (int kt = 0; kt < k_tiles; ++kt) {
      EmptyBarrier::wait(&s.empty[state.index], state.phase ^ 1);
      const int stage = state.index;
      const int k0 = kt * kBK;
      if (t == 0) load_b(p, s, tile, stage, k0, kStageBBytes + kStageABytes);
      SM90_TMA_LOAD_2D::copy(&p.a_map, &s.full[stage], 0, s.a + stage * (kBM * kBK) + t * kBK, k0, row);
      state.advance();
    }
  }
}

// Warpgroups 1 and 2: rows [64 w, 64 w + 64) of each tile.
__device__ void mma_tiles(const Params& p, SharedStorage& s, int total_tiles) {
  auto sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  auto sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
  const int mma_thread = threadIdx.x - kLoadThreads;
  TiledMma tiled_mma;
  // The descriptors are per warpgroup (sliced at its first thread); the accumulator layout per thread.
  auto wg_mma = tiled_mma.get_slice(mma_thread / cutlass::NumThreadsPerWarpGroup * cutlass::NumThreadsPerWarpGroup);
  auto tCrA = wg_mma.make_fragment_A(wg_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
  auto tCrB = wg_mma.make_fragment_B(wg_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)
  auto accum = partition_fragment_C(tiled_mma, make_shape(Int<kBM>{}, Int<kBN>{}));
  auto thr_mma = tiled_mma.get_slice(mma_thread);
  auto tCcC = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kBM>{}, Int<kBN>{})));
  const int k_tiles = (p.k + kBK - 1) / kBK;

  StageState read;
  for (int tile_id = blockIdx.x; tile_id < total_tiles; tile_id += gridDim.x) {
    const Tile tile = tile_at(p, s, tile_id);
    tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
    StageState release = read;
    for (int kt = 0; kt < k_tiles; ++kt) {
      FullBarrier::wait(&s.full[read.index], read.phase);
      // A's rows were written by cp.async (the generic proxy); wgmma reads them through the async proxy.
      cutlass::arch::fence_view_async_shared();
      const int stage = read.index;
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
#pragma unroll
      for (int kb = 0; kb < size<2>(tCrA); ++kb) {
        cute::gemm(tiled_mma, tCrA(_, _, kb, stage), tCrB(_, _, kb, stage), accum);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // Keep this stage's wgmmas in flight; the previous stage's have finished reading.
      warpgroup_wait<1>();
      warpgroup_fence_operand(accum);
      if (kt > 0) {
        EmptyBarrier::arrive(&s.empty[release.index]);
        release.advance();
      }
      read.advance();
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    EmptyBarrier::arrive(&s.empty[release.index]);

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

template <GatherLoad kLoad>
__global__ void __launch_bounds__(kThreads, 1) gather_grouped_gemm_kernel(const __grid_constant__ Params p) {
  extern __shared__ char smem_raw[];
  auto& s = *reinterpret_cast<SharedStorage*>(
      (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) / 1024 * 1024);
  if (threadIdx.x == 0) {
    for (int i = 0; i < kStages; ++i) {
      FullBarrier::init(&s.full[i], kLoad == GatherLoad::cp_async ? kLoadThreads + 1 : 1);
      EmptyBarrier::init(&s.empty[i], kMmaThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  if (threadIdx.x == 32) cute::prefetch_tma_descriptor(&p.b_map);
  if (kLoad == GatherLoad::tma_rows && threadIdx.x == 64) cute::prefetch_tma_descriptor(&p.a_map);
  plan_tiles(p, s);
  __syncthreads();
  const int total_tiles = s.tile_start[p.groups];
  if (threadIdx.x < kLoadThreads) {
    if constexpr (kLoad == GatherLoad::cp_async) load_tiles_cp_async(p, s, total_tiles);
    else load_tiles_tma_rows(p, s, total_tiles);
  } else {
    mma_tiles(p, s, total_tiles);
  }
}

constexpr std::size_t kSmemBytes = sizeof(SharedStorage) + 1024;  // + the 1024-byte alignment

void check_cuda_tensor(const TensorView& t, DType dtype, int rank, const char* arg, Device device) {
  check::rank(t, rank, arg);
  check::dtype(t, {dtype}, arg);
  FLEXEP_CHECK_ARG(t.device.is_cuda(), arg, "must be on a CUDA device, got ", t.device.str());
  FLEXEP_CHECK_ARG(t.device == device, arg, "is on ", t.device.str(), " but 'a' is on ", device.str());
}

// A row-major bf16 tensor of rank 2 or 3 (dims innermost first, packed) as a TMA map with the 128-byte
// swizzle; reads outside it are zero-filled.
void encode_bf16_map(CUtensorMap& map, const TensorView& t, std::vector<cuuint64_t> dims, std::vector<cuuint32_t> box,
                     CUtensorMapL2promotion promotion, const char* arg) {
  const auto rank = static_cast<cuuint32_t>(dims.size());
  std::vector<cuuint64_t> strides(rank - 1);
  cuuint64_t stride = sizeof(Element);
  for (cuuint32_t i = 0; i + 1 < rank; ++i) strides[i] = stride *= dims[i];
  const std::vector<cuuint32_t> unit(rank, 1);
  const CUresult made = cutlass::call_cuTensorMapEncodeTiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(t.data), dims.data(), strides.data(), box.data(),
      unit.data(), CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, promotion,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  FLEXEP_CHECK(made == CUDA_SUCCESS, "gather_grouped_gemm: cuTensorMapEncodeTiled failed (", static_cast<int>(made),
               ") for ", arg, " ", t.shape.str());
}

std::atomic<GatherLoad> g_a_load{GatherLoad::cp_async};

}  // namespace

void set_gather_gemm_a_load(GatherLoad load) { g_a_load.store(load, std::memory_order_relaxed); }
GatherLoad gather_gemm_a_load() { return g_a_load.load(std::memory_order_relaxed); }

void gather_grouped_gemm(const TensorView& a, const TensorView& row_ids, const TensorView& offsets,
                         const TensorView& b, const TensorView& c, cudaStream_t stream, DeviceErrorRecord* errors) {
  check_cuda_tensor(a, DType::bf16, 2, "a", a.device);
  const Device dev = a.device;
  check_cuda_tensor(b, DType::bf16, 3, "b", dev);
  check_cuda_tensor(c, DType::bf16, 2, "c", dev);
  check_cuda_tensor(offsets, DType::i64, 1, "offsets", dev);
  const std::int64_t K = a.shape[1], G = b.shape[0], M = b.shape[2], N = c.shape[0];
  check::shape(b, {G, K, M}, "b");
  check::shape(c, {N, M}, "c");
  check::shape(offsets, {G + 1}, "offsets");
  if (row_ids.shape.defined()) {
    check_cuda_tensor(row_ids, DType::i32, 1, "row_ids", dev);
    check::shape(row_ids, {N}, "row_ids");
  } else {
    FLEXEP_CHECK_ARG(a.shape[0] >= N, "a", "has ", a.shape[0], " rows; without row_ids it needs one per row of c (", N,
                     ")");
  }
  FLEXEP_CHECK_ARG(G >= 1 && G <= kGatherGemmMaxGroups, "b", "must hold 1 to ", kGatherGemmMaxGroups,
                   " groups, got ", G);
  FLEXEP_CHECK_ARG(K >= 8 && K % 8 == 0, "a", "needs K (its columns) a positive multiple of 8, got ", K);
  FLEXEP_CHECK_ARG(M >= 8 && M % 8 == 0, "b", "needs M (its last dimension) a positive multiple of 8, got ", M);
  FLEXEP_CHECK_ARG(K <= INT32_MAX && M <= INT32_MAX, "b", "K and M must be < 2^31, got ", K, " and ", M);
  // Tile ids are int: at most N / 128 + G row blocks per column of 256.
  FLEXEP_CHECK_ARG((N / kBM + G) * ((M + kBN - 1) / kBN) < (std::int64_t{1} << 31), "c", "has too many rows (", N,
                   ") for M = ", M, ": the tile count must stay below 2^31");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(a.data) % 16 == 0, "a", "must be 16-byte aligned");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(b.data) % 16 == 0, "b", "must be 16-byte aligned (TMA)");
  if (N == 0) return;

  DeviceGuard guard(dev.index);
  // Row coordinates of A's TMA boxes are int32.
  const GatherLoad load = a.shape[0] <= INT32_MAX ? g_a_load.load(std::memory_order_relaxed) : GatherLoad::cp_async;
  const auto kernel = load == GatherLoad::tma_rows ? gather_grouped_gemm_kernel<GatherLoad::tma_rows>
                                                   : gather_grouped_gemm_kernel<GatherLoad::cp_async>;
  FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(kSmemBytes)));
  int sms = 0;
  FLEXEP_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev.index));
  Params p{};
  // B as a 3-D tensor [G][K][M] (M innermost): reads past K or M are zero-filled by the TMA unit.
  encode_bf16_map(p.b_map, b, {static_cast<cuuint64_t>(M), static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(G)},
                  {kBoxN, kBK, 1}, CU_TENSOR_MAP_L2_PROMOTION_L2_256B, "b");
  // A as [R][K] in boxes of one row's 64 columns (128 bytes).
  if (load == GatherLoad::tma_rows)
    encode_bf16_map(p.a_map, a, {static_cast<cuuint64_t>(K), static_cast<cuuint64_t>(a.shape[0])}, {kBK, 1},
                    CU_TENSOR_MAP_L2_PROMOTION_L2_128B, "a");
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
  kernel<<<sms, kThreads, kSmemBytes, stream>>>(p);
  FLEXEP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flexep::cuda
