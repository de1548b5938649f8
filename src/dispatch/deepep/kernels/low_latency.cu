// deepep's low-latency (decode) mode: one kernel per direction, as DeepEP's. Each kernel sends
// first, then releases one flag per peer when its last CTA is done (publish.cuh), then waits for
// every peer's flag and finishes on the receiving side. A CTA therefore waits for the other CTAs of
// its own grid (through the peers' flags): every CTA of the grid must be resident at once, which
// the launch guarantees by taking at most one CTA per SM of this rank's share (the dispatcher
// checks it).
#include <cuda_bf16.h>

#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/low_latency.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::OpSession;
using hybridep::wait_flag_at_least;
using hybridep::WaitContext;

namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kPieceVectors = 4;  // combine: 16-byte vectors per lane of one work item
constexpr int kBatch = 8;         // combine: a token's rows loaded together

template <class Call>
__device__ __forceinline__ long long id_at(const Call& c, std::int64_t p) {
  return c.indices_i64 ? __ldg(static_cast<const long long*>(c.indices) + p) : __ldg(static_cast<const int*>(c.indices) + p);
}

// Whether slot j of token t sends: its id lies in [0, E) and no earlier slot of t has it
// (core/low_latency.h).
template <class Call>
__device__ __forceinline__ bool slot_sends(const Call& c, std::int64_t t, int j) {
  const long long e = id_at(c, t * c.k + j);
  if (e < 0 || e >= c.experts) return false;
  for (int i = 0; i < j; ++i)
    if (id_at(c, t * c.k + i) == e) return false;
  return true;
}

// Every thread s < ranks of the CTA acquires source s's flag of `kind` at `epoch`; false in every
// thread when a wait timed out (the status then names the phase and the rank).
__device__ __forceinline__ bool wait_all_sources(const SymmetricPeerTable& peers, int rank, int ranks, int kind, unsigned epoch,
                                        const WaitContext& w) {
  const unsigned* flags = reinterpret_cast<const unsigned*>(peers.flags[rank]) + kind * ranks;
  bool ok = true;
  for (int s = static_cast<int>(threadIdx.x); s < ranks; s += blockDim.x) ok = ok && wait_flag_at_least(flags + s, epoch, w, s);
  return __syncthreads_and(ok) != 0;
}

// The first slot of token t (t may be past the tokens: -1) whose id is e.
__device__ __forceinline__ int slot_of(const LowLatencyDispatchCall& c, std::int64_t t, int e) {
  if (t >= c.tokens) return -1;
  for (int s = 0; s < c.k; ++s)
    if (id_at(c, t * c.k + s) == e) return s;
  return -1;
}

// The last s < n with offsets[s] <= i (offsets ascending, [n + 1]): the source of packed row i, or
// the local expert of received row i.
__device__ __forceinline__ int source_of(const long long* offsets, int ranks, long long i) {
  int lo = 0, hi = ranks - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (offsets[mid] <= i)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(LowLatencyDispatchCall c) {
  extern __shared__ long long offsets[];  // [R + 1]
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int R = c.ranks, L = c.local_experts;
  const std::int64_t vectors = c.row_bytes / 16;

  // 0. Ids outside [-1, E) or repeated in a token send nothing; the first such is reported.
  for (std::int64_t p = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < c.tokens * c.k;
       p += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const long long e = id_at(c, p);
    const std::int64_t t = p / c.k;
    const int j = static_cast<int>(p - t * c.k);
    if (e != -1 && (e < -1 || e >= c.experts || !slot_sends(c, t, j)))
      cuda::report_device_error(c.errors, cuda::DeviceArg::indices, t, j, e, c.experts);
  }

  // 1. A warp per (expert, 32 tokens): its place among this rank's rows of the expert counted over
  //    the tokens before, then each of its rows into the expert's rank; the last chunk's warp
  //    writes the (expert, this rank) count.
  const int chunks = c.tokens > 0 ? static_cast<int>((c.tokens + 31) / 32) : 1;
  for (int item = static_cast<int>(blockIdx.x) * kWarps + static_cast<int>(threadIdx.x / 32);
       item < c.experts * chunks; item += warps) {
    const int e = item / chunks, chunk = item - e * chunks;
    const int d = e / L, le = e - d * L;
    char* win = c.peers.window[d];
    const std::int64_t first_row = (static_cast<std::int64_t>(le) * R + c.rank) * c.max_tokens;
    int n = 0;
    for (int before = 0; before < chunk; ++before) n += __popc(__ballot_sync(~0u, slot_of(c, before * 32 + lane, e) >= 0));
    const std::int64_t base = static_cast<std::int64_t>(chunk) * 32;
    const int j = slot_of(c, base + lane, e);
    for (unsigned mask = __ballot_sync(~0u, j >= 0); mask != 0; mask &= mask - 1) {
      const int from_lane = __ffs(mask) - 1;
      const int slot = __shfl_sync(~0u, j, from_lane);
      const std::int64_t tt = base + from_lane, row = first_row + n++;
      copy_row<RowSource::nc>(static_cast<const uint4*>(c.x) + tt * vectors,
                              reinterpret_cast<uint4*>(win + c.win.ll_x) + row * vectors, vectors, lane);
      if (c.scales != nullptr)
        copy_row<RowSource::nc>(c.scales + tt * c.scale_cols,
                                reinterpret_cast<float*>(win + c.win.ll_scales) + row * c.scale_cols, c.scale_cols,
                                lane);
      if (lane == 0) reinterpret_cast<int*>(win + c.win.ll_info)[row] = static_cast<int>(tt) * c.slots + slot;
    }
    if (lane == 0 && chunk == chunks - 1) reinterpret_cast<int*>(win + c.win.ll_counts)[le * R + c.rank] = n;
  }
  publish_to_peers(session, c.peers, kLowLatencyDispatch, R, c.rank);

  // 2. Every source's rows here: each local expert's rows packed in (source, token) order.
  const WaitContext wait{c.status, c.timeout_ns, Phase::low_latency_dispatch};
  if (!wait_all_sources(c.peers, c.rank, R, kLowLatencyDispatch, session.epoch(), wait)) return;
  const char* own = c.peers.window[c.rank];
  const std::int64_t region = static_cast<std::int64_t>(R) * c.max_tokens;
  for (int le = static_cast<int>(blockIdx.x); le < L; le += static_cast<int>(gridDim.x)) {
    if (threadIdx.x == 0) {
      long long at = 0;
      for (int s = 0; s < R; ++s) {
        const int n = __ldcg(reinterpret_cast<const int*>(own + c.win.ll_counts) + le * R + s);
        offsets[s] = at;
        c.layout_range[static_cast<std::int64_t>(le) * R + s] = (at << 32) | n;
        at += n;
      }
      offsets[R] = at;
      c.recv_count[le] = static_cast<int>(at);
    }
    __syncthreads();
    const long long total = offsets[R];
    for (long long i = threadIdx.x / 32; i < total; i += kWarps) {
      const int s = source_of(offsets, R, i);
      const std::int64_t from = (static_cast<std::int64_t>(le) * R + s) * c.max_tokens + (i - offsets[s]);
      const std::int64_t to = le * region + i;
      copy_row<RowSource::l2>(reinterpret_cast<const uint4*>(own + c.win.ll_x) + from * vectors,
                              static_cast<uint4*>(c.recv_x) + to * vectors, vectors, lane);
      if (c.recv_scales != nullptr)
        copy_row<RowSource::l2>(reinterpret_cast<const float*>(own + c.win.ll_scales) + from * c.scale_cols,
                                c.recv_scales + to * c.scale_cols, c.scale_cols, lane);
      if (lane == 0) {
        const int info = __ldcg(reinterpret_cast<const int*>(own + c.win.ll_info) + from);
        c.recv_src_info[to] = info / c.slots;
        c.route[to] = static_cast<int>(s * c.max_tokens * c.slots) + info;
      }
    }
    __syncthreads();  // offsets are rewritten for the next expert
  }
}

__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(LowLatencyCombineCall c) {
  extern __shared__ long long prefix[];  // [L + 1]: the received rows before each local expert
  __shared__ float weight[kWarps][32];
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32), w = static_cast<int>(threadIdx.x / 32);
  const int warps = static_cast<int>(gridDim.x) * kWarps;
  const int warp = static_cast<int>(blockIdx.x) * kWarps + w;
  const std::int64_t vectors = c.hidden / 8;
  const std::int64_t region = static_cast<std::int64_t>(c.ranks) * c.max_tokens;
  const std::int64_t per_source = c.max_tokens * c.slots;

  // 1. Every received row's output back to its source, at (token, slot): the received rows counted
  //    end to end over the local experts (prefix in shared memory), a warp per row, so the work
  //    spreads over every warp whatever the counts.
  if (threadIdx.x == 0) {
    long long at = 0;
    for (int le = 0; le < c.local_experts; ++le) {
      prefix[le] = at;
      at += __ldg(c.recv_count + le);
    }
    prefix[c.local_experts] = at;
  }
  __syncthreads();
  for (long long g = warp; g < prefix[c.local_experts]; g += warps) {
    const int le = source_of(prefix, c.local_experts, g);  // the last expert whose rows start at or before g
    const std::int64_t row = le * region + (g - prefix[le]);
    const int r = __ldg(c.route + row);
    const int s = static_cast<int>(r / per_source);
    const std::int64_t tj = r - s * per_source;
    copy_row<RowSource::nc>(static_cast<const uint4*>(c.expert_out) + row * vectors,
                            reinterpret_cast<uint4*>(c.peers.window[s] + c.win.ll_back) + tj * vectors, vectors, lane);
  }
  publish_to_peers(session, c.peers, kLowLatencyCombine, c.ranks, c.rank);

  // 2. Every rank's rows here: each token's weighted sum in slot order.
  const WaitContext wait{c.status, c.timeout_ns, Phase::low_latency_combine};
  if (!wait_all_sources(c.peers, c.rank, c.ranks, kLowLatencyCombine, session.epoch(), wait)) return;
  const auto* back = reinterpret_cast<const uint4*>(c.peers.window[c.rank] + c.win.ll_back);
  // A warp per (token, piece of kPieceVectors vectors per lane): the token's k rows read together
  // (kBatch loads in flight per lane), summed in slot order.
  const std::int64_t pieces = (vectors + 32 * kPieceVectors - 1) / (32 * kPieceVectors);
  for (std::int64_t item = warp; item < c.tokens * pieces; item += warps) {
    const std::int64_t t = item / pieces, piece = item - t * pieces;
    const bool sends = lane < c.k && slot_sends(c, t, lane);
    weight[w][lane] = sends ? __ldg(c.weights + t * c.k + lane) : 0.0f;
    const unsigned slots = __ballot_sync(~0u, sends);
    __syncwarp();
#pragma unroll 1
    for (int u = 0; u < kPieceVectors; ++u) {
      const std::int64_t v = (piece * kPieceVectors + u) * 32 + lane;
      if (v >= vectors) break;
      float acc[8] = {};
      for (unsigned m = slots; m != 0;) {
        uint4 raw[kBatch];
        int js[kBatch];
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          js[q] = m != 0 ? __ffs(m) - 1 : -1;
          if (m != 0) {
            raw[q] = __ldcg(back + (t * c.slots + js[q]) * vectors + v);
            m &= m - 1;
          }
        }
#pragma unroll
        for (int q = 0; q < kBatch; ++q) {
          if (js[q] < 0) continue;
          const float wj = weight[w][js[q]];
          const auto* y = reinterpret_cast<const __nv_bfloat16*>(&raw[q]);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[i] = __fadd_rn(acc[i], __fmul_rn(wj, __bfloat162float(y[i])));
        }
      }
      uint4 packed;
      auto* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[i]);
      static_cast<uint4*>(c.out)[t * vectors + v] = packed;
    }
    __syncwarp();  // weight[w] is rewritten for the warp's next item
  }
}

}  // namespace

void launch_low_latency_dispatch(const LowLatencyDispatchCall& c, int ctas, cudaStream_t stream) {
  const std::size_t shared = static_cast<std::size_t>(c.ranks + 1) * sizeof(long long);
  ll_dispatch_kernel<<<ctas < 1 ? 1 : ctas, kThreads, shared, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep ll_dispatch_kernel");
}

void launch_low_latency_combine(const LowLatencyCombineCall& c, int ctas, cudaStream_t stream) {
  const std::size_t shared = static_cast<std::size_t>(c.local_experts + 1) * sizeof(long long);
  ll_combine_kernel<<<ctas < 1 ? 1 : ctas, kThreads, shared, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep ll_combine_kernel");
}

}  // namespace flexep::deepep
