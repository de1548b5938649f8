// The hybridep combine_backward kernel: grad_out staged into this rank's combine window, ready
// flags per chunk, a PULL by the expert ranks, "consumed" flags, epochs; the rows moved by bulk
// copies through shared-memory rings (a warp pulling one row at a time, 512 bytes in flight, took
// 4 ms of a dsv3-size layer backward; docs/hybridep-history.md).
//
// CTA = 5 warps:
//   per pipeline p (2 per CTA), one ring of row-sized stages:
//     loader warp   first the "consumed" flags of the previous operation on the combine buffer
//                   (deadline: combine_backward:buffer-reuse). STAGE: grabs parts of this rank's
//                   chunks (work_items.cuh), one job per token (a bulk load of its grad_out row),
//                   then "part end"; after its last part "flush" (a peer may be waiting for that
//                   part). PULL: grabs parts of every rank's chunks, acquires the chunk's ready flag
//                   (deadline: combine_backward:rows) and posts one job per token that has rows
//                   here (a bulk load of the source's staged row, over NVLink for a peer). "exit".
//     store warp    lane 0 issues the bulk stores: a staged job into this rank's window row; a
//                   pulled job into every row the token has here. One bulk group per job; a stage
//                   is freed once its stores have read it. A staged part is published once its
//                   stores are complete (a few jobs later, or at the next part end, flush or exit):
//                   async-proxy fence, system fence, count the part; the chunk's last part
//                   releases the chunk's ready flag on every rank.
//   one warp zeroes this CTA's share of the output rows no (token, expert) pair fills.
// The last CTA releases "consumed" on every rank and publishes the new epoch.
//
// Progress: as dispatch.cu. Staging waits only for the previous operation's "consumed"
// flags (released by every rank's last CTA whatever happened), stores wait only for their loader,
// and every staged part is published before its loader waits for a peer's ready flag.
#include <cuda_runtime.h>

#include "dispatch/hybridep/kernels/access.cuh"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/kernels/launch.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/store_lag.cuh"
#include "dispatch/hybridep/kernels/rows.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "dispatch/hybridep/kernels/work_items.cuh"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

constexpr int kPipes = 2;
constexpr int kZeroWarp = 2 * kPipes;
constexpr int kRingThreads = 32 * (2 * kPipes + 1);
constexpr int kMinStages = 3, kMaxStages = 8;
static_assert(kFreeLag < kMinStages, "the store warp must free a stage before the loader needs it");
constexpr long long kMaxRowBytes = 32768;

enum Kind : int { kStage = 0, kPull = 1, kPartEnd = 2, kFlush = 3, kExit = 4 };
// kStage: b = token.  kPull: a = source, b = token, c = rows here.  kPartEnd: a = chunk, b = parts per chunk.

struct Env {
  unsigned epoch, dispatch_epoch;
  int pipelines;
  std::uint32_t row_bytes;
  int failed_arg;  // FailedArg: this rank's checks failed; it stages and pulls nothing, its flags say why
};

// ---- loader -----------------------------------------------------------------------------------------------

__device__ void post_row(const Ring& ring, unsigned j, const Job& job, const void* src, std::uint32_t bytes) {
  ring.post_expecting(j, job, bytes);
  tma::load_async(ring.stage(j), src, bytes, ring.full_bar(j));
}

// The rows token t of source s has here (0: none, or a bad record, reported).
__device__ unsigned rows_here(const CombineView& v, const HandleView& h, int s, long long t, const Env& env) {
  const unsigned char* rec = record_at(h.records, s, t, h.max_tokens, h.record_bytes);
  const uint4 head = __ldcg(reinterpret_cast<const uint4*>(rec));
  if (head.x != env.dispatch_epoch) return 0;  // no row here (or an aborted dispatch)
  const unsigned n = head.y;
  const RecordEntry* e = record_entries(rec);
  bool bad = n == 0 || n > static_cast<unsigned>(v.width);
  long long bad_row = -1;
  for (unsigned q = 0; !bad && q < n; ++q) {
    const int row = __ldcg(&e[q].row);
    if (row < 0 || row >= h.rows) bad = true, bad_row = row;
  }
  if (bad) report_status(v.status, StatusCode::corrupt, Phase::combine_backward_rows, s, bad_row, h.rows);
  return bad ? 0 : n;
}

__device__ void load(const CombineView& v, const HandleView& h, const uint4* grad_out, const Ring& ring, const Env& env,
                     int pipe, int lane) {
  const int R = v.ranks, me = v.rank;
  const long long words = v.hidden / 8;
  unsigned j = 0;
  const WaitContext reuse{v.status, v.timeout_ns, Phase::combine_backward_reuse};
  if (warp_wait_ranks(consumed_flag(v, me, 0), 1, R, env.epoch - 1, reuse, lane)) {
    // Stage: this rank's grad_out rows into its window, where the expert ranks pull them. A rank
    // whose checks failed stages nothing but still ends every part, so that every chunk flag the
    // expert ranks wait for is released (its T is the dispatch's: the handle may be the bad argument).
    const bool failed = env.failed_arg != 0;
    const long long tokens_here = failed ? tokens_of(h.control, me, h.max_tokens) : h.tokens;
    const PartSplit split1 = part_split(num_chunks(tokens_here), env.pipelines, v.part_tokens);
    const long long parts1 = static_cast<long long>(num_chunks(tokens_here)) * split1.per_chunk;
    ItemQueue items1{&v.work[kWorkFirst], parts1, pipe, env.pipelines};
    for (long long i = items1.next(lane); i < parts1; i = items1.next(lane)) {
      const Part p = part_in_rank(i, split1, tokens_here, me);
      for (long long t = p.t0; t < (failed ? p.t0 : p.t1); ++t) {
        ring.acquire(j, lane);
        if (lane == 0)
          post_row(ring, j, Job{kStage, 0, static_cast<int>(t), 0, 0, 0, 0, 0}, grad_out + t * words, env.row_bytes);
        ++j;
      }
      ring.acquire(j, lane);
      if (lane == 0) ring.post(j, Job{kPartEnd, p.chunk, split1.per_chunk, 0, 0, 0, 0, 0});
      ++j;
    }
    ring.acquire(j, lane);
    if (lane == 0) ring.post(j, Job{kFlush, 0, 0, 0, 0, 0, 0, 0});
    ++j;

    // Pull: every source's tokens that have rows here, once the source has staged their chunk.
    auto none = [](int) { return false; };
    auto tokens = [&h](int s) { return tokens_of(h.control, s, h.max_tokens); };
    const PartSplit split2 = part_split(chunks_of_ranks(R, tokens, none), env.pipelines, v.part_tokens);
    const long long parts2 = failed ? 0 : parts_of_ranks(R, split2, tokens, none);
    const WaitContext wait{v.status, v.timeout_ns, Phase::combine_backward_rows};
    ItemQueue items2{&v.work[kWorkSecond], parts2, pipe, env.pipelines};
    for (long long i = items2.next(lane); i < parts2; i = items2.next(lane)) {
      Part p;
      parts_of_ranks(R, split2, tokens, none, i, &p);
      bool ok = true;
      if (lane == 0) {
        ok = wait_flag_at_least(ready_flag(v, me, p.source, p.chunk), env.epoch, wait, p.source);
        if (ok) tma::fence_proxy_global();  // the bulk loads below read what the flag published
      }
      __syncwarp();
      if (!__shfl_sync(kFullMask, ok, 0)) break;
      // A source that failed its checks staged nothing: its abort word (this epoch, written before
      // the flag) makes the call an argument error of that rank here, and its rows are not pulled.
      bool aborted = false;
      if (lane == 0 && ld_sys(abort_flag(v, me, p.source), ::cuda::memory_order_relaxed) == env.epoch) {
        aborted = true;
        report_status(v.status, StatusCode::abort, Phase::combine_backward_rows, p.source,
                      ld_sys(abort_arg_flag(v, me, p.source), ::cuda::memory_order_relaxed), 0);
      }
      if (__shfl_sync(kFullMask, aborted, 0)) continue;
      const long long t = p.t0 + lane;
      const unsigned n = t < p.t1 ? rows_here(v, h, p.source, t, env) : 0u;
      for (unsigned m = __ballot_sync(kFullMask, n > 0); m != 0; m &= m - 1) {
        const int l = __ffs(m) - 1;
        const unsigned nn = __shfl_sync(kFullMask, n, l);
        ring.acquire(j, lane);
        if (lane == 0)
          post_row(ring, j, Job{kPull, p.source, static_cast<int>(p.t0 + l), static_cast<int>(nn), 0, 0, 0, 0},
                   partial_row(v, p.source, 0, p.t0 + l), env.row_bytes);
        ++j;
      }
    }
  }
  ring.acquire(j, lane);
  if (lane == 0) ring.post(j, Job{kExit, 0, 0, 0, 0, 0, 0, 0});
}

// ---- store warp -------------------------------------------------------------------------------------------

// Lane 0 stores the stage into every row of token (s, t) here (rows fetched 32 at a time by the warp;
// the loader validated them).
__device__ void store_pulled(const CombineView& v, const HandleView& h, const unsigned char* stage, uint4* out,
                             const Job& job, const Env& env, int lane) {
  const RecordEntry* e = record_entries(record_at(h.records, job.a, job.b, h.max_tokens, h.record_bytes));
  const long long words = v.hidden / 8;
  const unsigned count = static_cast<unsigned>(job.c);
  for (unsigned base = 0; base < count; base += 32) {
    const int row = base + lane < count ? __ldcg(&e[base + lane].row) : -1;
    const unsigned batch = count - base < 32 ? count - base : 32;
    for (unsigned i = 0; i < batch; ++i) {
      const int r = __shfl_sync(kFullMask, row, static_cast<int>(i));
      if (lane == 0 && r >= 0 && r < h.rows) tma::store_async(out + r * words, stage, env.row_bytes);
    }
  }
}

// Lane 0: the stores of every job up to the part end `since` jobs ago are complete; count the part,
// and the chunk's last part releases the chunk's ready flag on every rank.
__device__ void publish_part(const CombineView& v, int chunk, int per_chunk, int since, const Env& env) {
  tma::wait_groups_dyn(since);
  tma::fence_proxy_global();  // the completed bulk writes before the generic fence and flags
  if (!count_part(&v.work[kWorkChunks + v.rank * v.max_chunks + chunk], per_chunk)) return;
  for (int d = 0; d < v.ranks; ++d) {
    if (env.failed_arg != 0) {  // before the flag's release: the puller reads them after its acquire
      st_sys(abort_arg_flag(v, d, v.rank), static_cast<unsigned>(env.failed_arg), ::cuda::memory_order_relaxed);
      st_sys(abort_flag(v, d, v.rank), env.epoch, ::cuda::memory_order_relaxed);
    }
    st_sys(ready_flag(v, d, v.rank, chunk), env.epoch, ::cuda::memory_order_release);
  }
}

__device__ void store(const CombineView& v, const HandleView& h, uint4* out, const Ring& ring, const Env& env,
                      int lane) {
  StoreLag lag;
  auto publish = [&](int chunk, int parts, int since) { publish_part(v, chunk, parts, since, env); };
  for (unsigned j = 0;; ++j) {
    const Job job = ring.wait_lane0(j, lane);
    if (job.kind == kExit) break;
    if (job.kind == kStage && lane == 0)
      tma::store_async(partial_row(v, v.rank, 0, job.b), ring.stage(j), env.row_bytes);
    if (job.kind == kPull) store_pulled(v, h, ring.stage(j), out, job, env, lane);
    if (lane == 0) lag.after_job(ring, j, job.kind == kPartEnd, job.kind == kFlush, job.a, job.b, publish);
    __syncwarp();
  }
  if (lane == 0) lag.finish(publish);
  __syncwarp();
}

__global__ void __launch_bounds__(kRingThreads, 1)
    combine_backward_kernel(const __grid_constant__ CombineView v, const __grid_constant__ HandleView h,
                               const uint4* __restrict__ grad_out, uint4* __restrict__ out, const RingLayout layout,
                               int failed_arg) {
  extern __shared__ __align__(128) unsigned char smem[];
  const OpSession op(v.control);
  const unsigned epoch = op.epoch();
  __shared__ int s_broken;
  __shared__ unsigned s_dispatch_epoch;
  if (threadIdx.x == 0) {
    s_broken = timed_out(v.status);
    s_dispatch_epoch = ld_volatile(&h.control->op.epoch);  // the handle's dispatch was the last one
    for (int p = 0; p < kPipes; ++p) Ring::make(smem, layout, p).init(1);
    tma::fence_mbar_init();
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (!s_broken) {
    const Env env{epoch, s_dispatch_epoch, static_cast<int>(gridDim.x) * kPipes,
                  static_cast<std::uint32_t>(v.hidden * 2), failed_arg};
    if (warp < 2 * kPipes) {
      const Ring ring = Ring::make(smem, layout, warp / 2);
      if (warp % 2 == 0)
        load(v, h, grad_out, ring, env, static_cast<int>(blockIdx.x) * kPipes + warp / 2, lane);
      else
        store(v, h, out, ring, env, lane);
    } else if (warp == kZeroWarp && failed_arg == 0) {
      const bool valid = h.control->abort == 0;  // an aborted dispatch placed no rows: all zero
      zero_unfilled_rows(out, nullptr, v.hidden / 8, h.begin, h.kept, h.tpe, h.local_experts,
                         valid ? h.control->used_rows : 0, h.rows, static_cast<int>(blockIdx.x),
                         static_cast<int>(gridDim.x), lane);
    }
  }
  finish_combine_side(v, op);
}

SmemBudget smem_budget;

RingLayout layout_for(long long hidden) {
  if (hidden * 2 > kMaxRowBytes) return RingLayout{1, 0, 128, 0};
  return fit_rings(kPipes, static_cast<std::size_t>(hidden * 2), 0, kMinStages, kMaxStages,
                   smem_budget.get(combine_backward_kernel));
}

}  // namespace

bool combine_backward_supported(long long hidden) { return layout_for(hidden).stages >= kMinStages; }

void prepare_combine_backward() { raise_smem_limit(combine_backward_kernel); }

void launch_combine_backward(const CombineView& v, const HandleView& h, const void* grad_out, void* out, int grid,
                             cudaStream_t stream, int failed_arg) {
  const RingLayout layout = layout_for(v.hidden);
  FLEXEP_CHECK(layout.stages >= kMinStages, "hybridep combine_backward: H = ", v.hidden,
               " does not fit its rings (internal error: combine_backward_supported decides)");
  launch_kernel(combine_backward_kernel, grid, kRingThreads, layout.total_bytes(), stream, false, v, h,
                static_cast<const uint4*>(grad_out), static_cast<uint4*>(out), layout, failed_arg);
}

}  // namespace flexep::hybridep
