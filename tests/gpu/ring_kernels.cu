// The ring test kernel (ring_kernels.h): the producer/consumer handshake of the hybridep kernels, with the
// same calls (acquire, post / post_expecting + bulk load, wait, release), checked job by job.
#include "dispatch/hybridep/device/ring.cuh"
#include "dispatch/hybridep/device/tma.cuh"
#include "flexep/cuda/runtime.h"
#include "gpu/ring_kernels.h"

namespace flexep::testing {

namespace {

using hybridep::Job;
using hybridep::Ring;
using hybridep::RingLayout;
namespace tma = hybridep::tma;

constexpr int kExit = 1;

__device__ Job job_of(int j) { return Job{0, j, 7 * j + 1, j % 2, -j, 0, 0, 0}; }

__global__ void ring_test_kernel(const unsigned char* rows, int row_bytes, int jobs, RingLayout layout,
                                 RingConsumer consumer, RingTestResult* result) {
  extern __shared__ __align__(128) unsigned char smem[];
  const bool all_lanes = consumer == RingConsumer::all_lanes;
  if (threadIdx.x == 0) {
    Ring::make(smem, layout, 0).init(all_lanes ? 32 : 1);  // one arrival per thread that reads a stage
    tma::fence_mbar_init();
  }
  __syncthreads();
  const Ring ring = Ring::make(smem, layout, 0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {  // producer
    for (int j = 0; j < jobs; ++j) {
      ring.acquire(static_cast<unsigned>(j), lane);
      if (lane == 0) {
        if (j % 2 == 1) {
          ring.post_expecting(static_cast<unsigned>(j), job_of(j), static_cast<std::uint32_t>(row_bytes));
          tma::load_async(ring.stage(static_cast<unsigned>(j)), rows + static_cast<long long>(j) * row_bytes,
                          static_cast<std::uint32_t>(row_bytes), ring.full_bar(static_cast<unsigned>(j)));
        } else {
          ring.post(static_cast<unsigned>(j), job_of(j));
        }
      }
    }
    ring.acquire(static_cast<unsigned>(jobs), lane);
    if (lane == 0) ring.post(static_cast<unsigned>(jobs), Job{kExit, 0, 0, 0, 0, 0, 0, 0});
  } else if (warp == 1) {  // consumer
    int seen = 0, bad_jobs = 0, bad_words = 0;
    const int readers = all_lanes ? 32 : 1;
    for (unsigned j = 0;; ++j) {
      const Job job = all_lanes ? ring.wait(j) : ring.wait_lane0(j, lane);
      if (job.kind == kExit) break;
      const Job want = job_of(static_cast<int>(j));
      if (lane == 0 &&
          (job.kind != want.kind || job.a != want.a || job.b != want.b || job.c != want.c || job.d != want.d))
        ++bad_jobs;
      if (job.c == 1) {  // a bulk-loaded row: every word as in the source
        const uint4* stage = reinterpret_cast<const uint4*>(ring.stage(j));
        const uint4* src = reinterpret_cast<const uint4*>(rows + static_cast<long long>(j) * row_bytes);
        for (int w = lane; lane < readers && w < row_bytes / 16; w += readers) {
          const uint4 x = stage[w], y = src[w];
          bad_words += x.x != y.x || x.y != y.y || x.z != y.z || x.w != y.w;
        }
      }
      ++seen;
      if (lane < readers) ring.release(j);  // this lane has read the stage and the descriptor
    }
    for (int o = 16; o > 0; o /= 2) bad_words += __shfl_xor_sync(0xffffffffu, bad_words, o);
    if (lane == 0) *result = RingTestResult{seen, bad_jobs, bad_words};
  }
}

}  // namespace

void launch_ring_test(const unsigned char* rows, int row_bytes, int jobs, int stages, RingConsumer consumer,
                      RingTestResult* result, cudaStream_t stream) {
  RingLayout layout;
  layout.rings = 1;
  layout.stages = stages;
  layout.stage_bytes = (row_bytes + 127) / 128 * 128;
  const std::size_t smem = layout.total_bytes();
  FLEXEP_CUDA_CHECK(
      cudaFuncSetAttribute(ring_test_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  ring_test_kernel<<<1, 64, smem, stream>>>(rows, row_bytes, jobs, layout, consumer, result);
  FLEXEP_CUDA_CHECK_LAUNCH("ring_test_kernel");
}

}  // namespace flexep::testing
