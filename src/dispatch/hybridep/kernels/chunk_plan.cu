// The single-GPU plan of a hybridep dispatch in ONE kernel on the preprocess SMs
// (chunk_plan_math.h says what it computes and why that is enough):
//
//   per chunk of kPlanChunkTokens tokens (CTA b takes chunks b, b + grid, ...; a token per thread):
//     1. check the token's ids in slot order (out of range, or a repeat of an earlier slot's expert:
//        reported as the general plan reports them) and set bit (e, token) in shared memory;
//     2. the chunk's count of every expert (popcounts) into chunk_base[g][e];
//     3. every slot's rank among the chunk's pairs of its expert;
//   then the last CTA to finish turns chunk_base into its exclusive scan over the chunks, and writes
//   count(e). A repeated expert gets the same rank twice (the general plan gives it two): the call is
//   aborted anyway, since the reported error fails it on every rank.
#include "dispatch/hybridep/kernels/chunk_plan.cuh"
#include "dispatch/hybridep/kernels/chunk_plan_math.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/device/tma.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

static_assert(kThreads == kPlanChunkTokens, "a token of the chunk per thread");
static_assert(static_cast<std::size_t>(kMaxExperts) * kPlanChunkWords * sizeof(std::uint32_t) <= kChunkPlanMaxSmem,
              "the chunk plan takes every expert count a hybridep buffer allows (layout.cpp): the dispatch has no "
              "other plan");

namespace {

// The last CTA: chunk counts -> their exclusive scan over chunks, and the totals. The chunk counts
// were written by other CTAs (ordered by their fence before the `done` increment): read via L2,
// kScanBatch at a time, all in flight before the batch's stores (a store between two loads would
// make each load wait for the one before: a chain of L2 round trips, one per chunk).
constexpr int kScanBatch = 8;

__device__ void scan_chunks(const ChunkPlanCall& c, long long chunks) {
  for (int e = threadIdx.x; e < c.experts; e += blockDim.x) {
    long long running = 0;
    for (long long g0 = 0; g0 < chunks; g0 += kScanBatch) {
      int n[kScanBatch];
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) n[i] = g0 + i < chunks ? __ldcg(c.chunk_base + (g0 + i) * c.experts + e) : 0;
#pragma unroll
      for (int i = 0; i < kScanBatch; ++i) {
        if (g0 + i < chunks) c.chunk_base[(g0 + i) * c.experts + e] = static_cast<int>(running);
        running += n[i];
      }
    }
    c.counts[e] = running;
  }
}

__global__ void __launch_bounds__(kThreads) chunk_plan_kernel(const __grid_constant__ ChunkPlanCall c) {
  extern __shared__ std::uint32_t bits[];  // [experts][kPlanChunkWords]
  __shared__ bool s_last;
  // The preprocess kernel may be scheduled now: it waits for this grid's completion (and its
  // memory) before it reads anything, but its launch latency hides behind this kernel.
  tma::allow_dependent_launch();
  const int tid = threadIdx.x, words = c.experts * kPlanChunkWords;
  const long long chunks = plan_chunks(c.tokens);
  const PlanIds ids{c.indices, c.indices_i64, c.slots, c.experts};
  // Reported as the general plan (src/cuda/local_plan*) reports them.
  const auto report = [&](long long t, int j, long long id) {
    cuda::report_device_error(c.errors, cuda::DeviceArg::indices, t, j, id, c.experts);
  };
  for (long long g = blockIdx.x; g < chunks; g += gridDim.x) {
    for (int w = tid; w < words; w += blockDim.x) bits[w] = 0;
    __syncthreads();
    const long long t = g * kPlanChunkTokens + tid;
    if (t < c.tokens) set_token_bits(bits, ids, t, tid, report);
    __syncthreads();
    for (int e = tid; e < c.experts; e += blockDim.x)
      c.chunk_base[g * c.experts + e] = plan_word_prefix(bits, e, kPlanChunkWords);
    if (t < c.tokens) write_slot_ranks(bits, ids, t, tid, c.slot_rank);
    __syncthreads();  // the bits are cleared for the next chunk
  }
  __threadfence();  // this CTA's chunk counts before its arrival
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(c.done, 1u) == gridDim.x - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  scan_chunks(c, chunks);
  if (tid == 0) *c.done = 0;  // every CTA has arrived: zero again for the next call
}

std::size_t chunk_plan_smem_bytes(int experts) {
  return static_cast<std::size_t>(experts) * kPlanChunkWords * sizeof(std::uint32_t);
}

}  // namespace

bool chunk_plan_fits(int experts) { return chunk_plan_smem_bytes(experts) <= kChunkPlanMaxSmem; }

void prepare_chunk_plan(int experts) {
  if (!chunk_plan_fits(experts)) return;
  FLEXEP_CUDA_CHECK(cudaFuncSetAttribute(chunk_plan_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(chunk_plan_smem_bytes(experts))));
}

void launch_chunk_plan(const ChunkPlanCall& c, int grid, cudaStream_t stream) {
  chunk_plan_kernel<<<grid, kThreads, chunk_plan_smem_bytes(c.experts), stream>>>(c);
  FLEXEP_CUDA_CHECK_LAUNCH("hybridep chunk_plan_kernel");
}

}  // namespace flexep::hybridep
