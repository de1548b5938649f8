// Preprocessing of a hybridep dispatch, on the GPU with no host synchronisation:
//
//   multihot_slots_kernel  (multihot form only) [T, E] map -> `slots` ascending expert ids per token.
//   (the single-GPU plan, chunk_plan.cu: per-expert counts and each slot's rank among its chunk's
//   pairs of its expert; a call whose tokens fit one chunk skips it and plans inline, step 0)
//   preprocess_kernel      one grid of `preprocess_sms` CTAs; every CTA does steps 1-4 redundantly
//                          (tiny, and it means no CTA ever waits for another CTA of this grid):
//     0. (one chunk of tokens only) the plan of that chunk, in shared memory;
//     1. write [header | E pair counts] into slot `me` of every rank's count region, then release
//        this rank's count flag on every rank (epoch of the call);
//     2. acquire every rank's count flag (deadline: phase dispatch:count-exchange);
//     3. decide, from the R headers and counts that every rank now holds identically, whether the
//        call is aborted (a rank failed its checks, configurations differ, a budget overflow
//        under the error policy, a receive-capacity overflow) - so all ranks decide alike;
//     4. compute the layout of every receiver (layout_math.h: core/plan.cpp's arithmetic) and
//        this rank's first row for each of its experts on their owners;
//   then CTA 0 publishes this rank's receiver layout and the decision (DispatchControl), and every
//   CTA stages, for its share of tokens, one record per (token, destination rank): the (row, prob)
//   pairs of the token's kept slots on that rank, sorted by row; plus each slot's entry index (for
//   the gradient of its prob in dispatch_backward).
#include <cuda_runtime.h>

#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/kernels/launch.h"
#include "dispatch/hybridep/kernels/kernels.h"
#include "dispatch/hybridep/kernels/preprocess_steps.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

namespace {

using namespace preprocess_steps;

__global__ void __launch_bounds__(kThreads)
    multihot_slots_kernel(const unsigned char* __restrict__ map, const float* __restrict__ probs, long long tokens,
                          int experts, int slots, int* __restrict__ slot_expert, float* __restrict__ slot_weight,
                          cuda::DeviceErrorRecord* errors) {
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long t = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; t < tokens; t += stride) {
    const long long in = t * experts, out = t * slots;
    int j = 0;
    for (int e = 0; e < experts; ++e) {
      if (map[in + e] == 0) continue;
      if (j < slots) {
        slot_expert[out + j] = e;
        slot_weight[out + j] = probs[in + e];
      }
      ++j;
    }
    if (j > slots) cuda::report_device_error(errors, cuda::DeviceArg::routing_map, t, -1, j, slots);
    for (int q = j; q < slots; ++q) {
      slot_expert[out + q] = -1;
      slot_weight[out + q] = 0.0f;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    preprocess_kernel(const __grid_constant__ DispatchView v, const __grid_constant__ DispatchCall c) {
  extern __shared__ long long smem[];
  // The dispatch kernel that follows may be scheduled from now on (programmatic dependent launch):
  // its CTAs get resident while this grid exchanges counts, and wait for this grid's completion
  // before reading anything. All of this grid's CTAs are resident once every CTA has executed this,
  // so the early dispatch CTAs cannot keep a preprocess CTA from running.
  tma::allow_dependent_launch();
  // Launched as a dependent of the plan kernel: nothing of the plan may be read before it completed.
  tma::grid_dependency_wait();
  const CtaLayout l = lay_out_call(v, c, OpSession(&v.control->op).epoch(), smem, nullptr);
  if (!l.ok) return;  // timed out: the dispatch kernel sees the status and neither moves nor waits

  // 5. Staging records and slot entries, one thread per token of this rank.
  const TokenRows rows{c, l.src, l.begin, l.kept, v.experts, v.owner, l.abort};
  const StagingShare share = staging_share(c.inline_plan != 0);
  for (long long t = share.token(threadIdx.x); t < c.tokens; t += share.stride) {
    if (c.slots <= kRegisterSlots)
      stage_token_in_registers(v, rows, t, load_token_slots(c, v.experts, t),
                               t == share.token(0) && c.trace != nullptr);
    else
      stage_token_in_memory(v, rows, t);
  }
  if (c.trace) {
    __syncthreads();
    if (threadIdx.x == 0) trace_stamp(c.trace, kTraceStaged);
  }
}

}  // namespace

void prepare_preprocess(int experts) {
  const std::size_t bytes = preprocess_smem_bytes(experts);
  if (bytes > 48 * 1024)
    FLEXEP_CUDA_CHECK(
        cudaFuncSetAttribute(preprocess_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

void launch_multihot_slots(const unsigned char* routing_map, const float* probs, long long tokens, int experts,
                           int slots, int* slot_expert, float* slot_weight, cuda::DeviceErrorRecord* errors,
                           cudaStream_t stream) {
  if (tokens == 0) return;
  const long long blocks = (tokens + kThreads - 1) / kThreads;
  multihot_slots_kernel<<<static_cast<unsigned>(blocks < 4096 ? blocks : 4096), kThreads, 0, stream>>>(
      routing_map, probs, tokens, experts, slots, slot_expert, slot_weight, errors);
  FLEXEP_CUDA_CHECK_LAUNCH("multihot_slots_kernel");
}

void launch_preprocess(const DispatchView& v, const DispatchCall& c, int grid, cudaStream_t stream,
                       bool after_plan) {
  launch_kernel(preprocess_kernel, grid, kThreads, preprocess_smem_bytes(v.experts), stream, after_plan, v, c);
}

}  // namespace flexep::hybridep
