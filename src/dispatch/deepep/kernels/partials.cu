// The way back (combine, dispatch_backward): each received row to its source's window, one row per
// (token, rank), and the source's fixed-order fp32 sum over the ranks.
#include <cuda_bf16.h>

#include "dispatch/deepep/device/copy_row.cuh"
#include "dispatch/deepep/device/publish.cuh"
#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::deepep {

using hybridep::ld_volatile;
using hybridep::OpSession;
using hybridep::wait_flag_at_least;
using hybridep::WaitContext;

namespace {

constexpr int kThreads = 1024;       // 32 warps per SM, each with kRowUnroll loads in flight
constexpr int kReduceThreads = 512;  // 16 warps; kReduceUnroll x 8 fp32 sums need more than 64 registers
constexpr int kReduceUnroll = 8;     // 64 KB of loads in flight per SM

// One warp per received row from another rank.
__global__ void __launch_bounds__(kThreads) send_partials_kernel(SendPartialsCall c) {
  const OpSession session(c.op);
  const int lane = static_cast<int>(threadIdx.x % 32);
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kThreads / 32);
  const std::int64_t vectors = c.hidden / 8;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * (kThreads / 32) + threadIdx.x / 32; i < c.rows;
       i += warps) {
    const int src = __ldcg(c.src + i);
    if (src < 0) continue;  // a budget's tail
    const long long* source_begin = c.layout + layout_word::source_begin(c.ranks);
    int s = 0;
    while (s + 1 < c.ranks && source_begin[s + 1] <= i) ++s;
    if (s == c.rank) continue;  // this rank's own tokens: the reduce reads them where they are
    const std::int64_t t = src;
    const std::int64_t at = static_cast<std::int64_t>(c.rank) * c.max_tokens + t;
    char* win = c.peers.window[s];
    const uint4* from = static_cast<const uint4*>(c.y) + i * vectors;
    uint4* to = reinterpret_cast<uint4*>(win + c.win.part) + at * vectors;
    copy_row<RowSource::l2>(from, to, vectors, lane);  // the rows may be this rank's window (recv_x)
    if (c.grad_w != nullptr)
      for (int j = lane; j < c.k; j += 32)
        reinterpret_cast<float*>(win + c.win.part_w)[at * c.k + j] = c.grad_w[i * c.k + j];
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
    const int r = c.dest_row[static_cast<std::int64_t>(d) * c.tokens + t];  // the same in the whole warp
    if (r < 0) continue;
    const uint4* row = d == c.rank ? static_cast<const uint4*>(c.own_rows) + static_cast<std::int64_t>(r) * vectors
                                   : part + (static_cast<std::int64_t>(d) * c.max_tokens + t) * vectors;
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
      const int r = c.dest_row[static_cast<std::int64_t>(d) * c.tokens + t];
      if (r >= 0)
        g = d == c.rank ? __ldcg(c.own_grad_w + static_cast<std::int64_t>(r) * c.k + j)
                        : __ldcg(part_w + (static_cast<std::int64_t>(d) * c.max_tokens + t) * c.k + j);
    }
    c.grad_w[q] = g;
  }
}

}  // namespace

void launch_send_partials(const SendPartialsCall& c, int ctas, cudaStream_t stream) {
  send_partials_kernel<<<ctas < 1 ? 1 : ctas, kThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep send_partials_kernel");
}

void launch_reduce(const ReduceCall& c, int ctas, cudaStream_t stream) {
  reduce_kernel<<<ctas < 1 ? 1 : ctas, kReduceThreads, 0, stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("deepep reduce_kernel");
}

}  // namespace flexep::deepep
