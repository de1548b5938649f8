// The way back (combine, dispatch_backward): each received row to its source's window, one row per
// (token, rank), and the source's fixed-order fp32 sum over the ranks.
#include <cuda_bf16.h>

#include "dispatch/deepep/device/bulk_copy.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/kernels/launch.h"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::ld_volatile;
using hybridep::OpSession;
using hybridep::SmemBudget;
using hybridep::wait_flag_at_least;
using hybridep::WaitContext;

namespace {

constexpr int kReduceThreads = 512;  // 16 warps; kReduceUnroll x 8 fp32 sums need more than 64 registers
constexpr int kReduceUnroll = 8;     // 64 KB of loads in flight per SM

// Row i's source rank (the rows lie in source order), and where the row goes there: this rank's
// part, at the row's source token.
__device__ __forceinline__ int source_of(const SendPartialsCall& c, std::int64_t i) {
  const long long* source_begin = c.layout + layout_word::source_begin(c.ranks);
  int s = 0;
  while (s + 1 < c.ranks && source_begin[s + 1] <= i) ++s;
  return s;
}
__device__ __forceinline__ std::int64_t part_slot(const SendPartialsCall& c, int t) {
  return static_cast<std::int64_t>(c.rank) * c.max_tokens + t;
}

// The first l.warps warps copy the received rows back through their rings (device/bulk_copy.cuh);
// the kFieldWarps warps after them store, a lane per row, the weight gradients. (The lambda takes
// only the call: a captured local would be copied into the cursors and live on the stack.)
__global__ void __launch_bounds__((kMaxCopyWarps + kFieldWarps) * 32)
    send_partials_kernel(const __grid_constant__ SendPartialsCall c, const CopyRingLayout l) {
  extern __shared__ __align__(128) unsigned char smem[];
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32), warp = static_cast<int>(threadIdx.x / 32);
  if (warp < l.warps) {
    const auto where = [&c](std::int64_t i) -> RowRoute {
      const int t = __ldcg(c.src + i);
      if (t < 0) return {nullptr, nullptr};  // a budget's tail
      const long long row_bytes = c.hidden * 2;
      return {static_cast<const char*>(c.y) + i * row_bytes,
              c.peers.window[source_of(c, i)] + c.win.part + part_slot(c, t) * row_bytes};
    };
    WarpCopyRing(smem, l, warp, lane)
        .copy(RowPieces<decltype(where)>(where, static_cast<std::int64_t>(blockIdx.x) * l.warps + warp,
                                         static_cast<std::int64_t>(gridDim.x) * l.warps, c.rows, c.hidden * 2,
                                         l.piece_bytes));
  } else if (c.grad_w != nullptr) {
    const int field_threads = kFieldWarps * 32;
    for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * field_threads + threadIdx.x - l.warps * 32;
         i < c.rows; i += static_cast<std::int64_t>(gridDim.x) * field_threads) {
      const int t = __ldcg(c.src + i);
      if (t < 0) continue;
      float* to = reinterpret_cast<float*>(c.peers.window[source_of(c, i)] + c.win.part_w) + part_slot(c, t) * c.k;
      for (int j = 0; j < c.k; ++j) to[j] = c.grad_w[i * c.k + j];
    }
  }
  publish_to_peers(session, c.peers, c.kind, c.ranks, c.rank, c.failed_arg);
}

// out[v0 + 32 u] (u < kReduceUnroll) of one token: the sum of its ranks' rows in ascending rank
// order (the host backend's order of additions), in fp32, rounded once. kFull: all kReduceUnroll
// vectors exist, so that the loads carry no branch and issue together.
template <bool kFull>
__device__ __forceinline__ void reduce_vectors(const ReduceCall& c, const uint4* part, std::int64_t t,
                                               std::int64_t vectors, std::int64_t v0, uint4* out) {
  float acc[kReduceUnroll][8] = {};
  for (int d = 0; d < c.ranks; ++d) {
    if (c.dest_row[static_cast<std::int64_t>(d) * c.tokens + t] < 0) continue;  // the same in the whole warp
    const uint4* row = part + (static_cast<std::int64_t>(d) * c.max_tokens + t) * vectors;
    uint4 raw[kReduceUnroll];
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u)
      if (kFull || v0 + 32 * u < vectors) raw[u] = __ldcg(row + v0 + 32 * u);
#pragma unroll
    for (int u = 0; u < kReduceUnroll; ++u) {
      if (!kFull && v0 + 32 * u >= vectors) continue;
      const auto* h = reinterpret_cast<const __nv_bfloat16*>(&raw[u]);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[u][i] += __bfloat162float(h[i]);
    }
  }
#pragma unroll
  for (int u = 0; u < kReduceUnroll; ++u) {
    if (!kFull && v0 + 32 * u >= vectors) break;
    uint4 packed;
    auto* o = reinterpret_cast<__nv_bfloat16*>(&packed);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16_rn(acc[u][i]);
    out[v0 + 32 * u] = packed;
  }
}

// Every CTA acquires all flags, then a warp per token, its lanes over the row's 16-byte vectors
// (no division per vector), kReduceUnroll loads in flight per lane.
__global__ void __launch_bounds__(kReduceThreads) reduce_kernel(const __grid_constant__ ReduceCall c) {
  const unsigned epoch = ld_volatile(&c.op->epoch);
  const WaitContext w{c.status, c.timeout_ns, c.phase};
  bool ok = true;
  for (int s = static_cast<int>(threadIdx.x); s < c.ranks; s += blockDim.x)
    ok = ok && wait_flag_at_least(c.flags + c.kind * c.ranks + s, epoch, w, s);
  if (!__syncthreads_and(ok)) return;
  if (stopped_by_peer(c.flags, c.kind, c.rank, c.ranks, epoch, c.status, c.phase)) return;
  const std::int64_t vectors = c.hidden / 8;
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (blockDim.x / 32);
  const auto* part = reinterpret_cast<const uint4*>(c.window + c.win.part);
  for (std::int64_t t = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; t < c.tokens;
       t += warps) {
    uint4* out = static_cast<uint4*>(c.out) + t * vectors;
    for (std::int64_t v0 = lane; v0 < vectors; v0 += 32 * kReduceUnroll) {
      if (v0 + 32 * (kReduceUnroll - 1) < vectors)
        reduce_vectors<true>(c, part, t, vectors, v0, out);
      else
        reduce_vectors<false>(c, part, t, vectors, v0, out);
    }
  }
  if (c.grad_w == nullptr) return;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const auto* part_w = reinterpret_cast<const float*>(c.window + c.win.part_w);
  for (std::int64_t q = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < c.tokens * c.k;
       q += stride) {
    const std::int64_t t = q / c.k, j = q - t * c.k;
    const int e = c.slot_expert[q];
    float g = 0.0f;
    if (e >= 0) {
      const int d = e / c.local_experts;
      if (c.dest_row[static_cast<std::int64_t>(d) * c.tokens + t] >= 0)
        g = __ldcg(part_w + (static_cast<std::int64_t>(d) * c.max_tokens + t) * c.k + j);
    }
    c.grad_w[q] = g;
  }
}

SmemBudget send_partials_smem;

}  // namespace

void prepare_send_partials() { hybridep::raise_smem_limit(send_partials_kernel); }

void launch_send_partials(const SendPartialsCall& c, int ctas, cudaStream_t stream) {
  const CopyRingLayout l = copy_ring_for(c.hidden * 2, send_partials_smem.get(send_partials_kernel));
  send_partials_kernel<<<ctas < 1 ? 1 : ctas, (l.warps + kFieldWarps) * 32, l.bytes(), stream>>>(c, l);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep send_partials_kernel");
}

void launch_reduce(const ReduceCall& c, int ctas, cudaStream_t stream) {
  reduce_kernel<<<ctas < 1 ? 1 : ctas, kReduceThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep reduce_kernel");
}

}  // namespace flexep::deepep
