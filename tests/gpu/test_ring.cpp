// The hybridep stage ring (src/dispatch/hybridep/device/ring.cuh) on its own: a producer warp posts
// descriptor-only and bulk-loaded jobs, a consumer warp (every lane, or lane 0 alone) checks every
// descriptor and row in order and frees the stages, through many wrap-arounds of rings of 3 and 8
// stages. Also the quickest way to
// see what compute-sanitizer racecheck makes of the mbarrier handoff:
//   compute-sanitizer --tool racecheck flexep_gpu_tests --gtest_filter='HybridEpRing.*'
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "flexep/cuda/runtime.h"
#include "gpu/gpu_test_util.h"
#include "gpu/ring_kernels.h"

namespace flexep::testing {
namespace {

TEST(HybridEpRing, JobsArriveInOrderWithTheirRows) {
  if (!require_gpus(1)) return;
  const cuda::OwnedStream stream;
  for (const RingConsumer consumer : {RingConsumer::all_lanes, RingConsumer::lane0}) {
    for (int stages : {3, 8}) {
      for (int row_bytes : {16, 14336}) {
        SCOPED_TRACE(std::string(consumer == RingConsumer::lane0 ? "lane-0 consumer" : "all-lanes consumer") +
                     ", stages " + std::to_string(stages) + ", row " + std::to_string(row_bytes) + " B");
        const int jobs = 1000;
        std::vector<unsigned char> host(static_cast<std::size_t>(jobs) * row_bytes);
        for (std::size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>((i * 2654435761u) >> 13);
        unsigned char* rows = nullptr;
        RingTestResult* result = nullptr;
        FLEXEP_CUDA_CHECK(cudaMalloc(&rows, host.size()));
        FLEXEP_CUDA_CHECK(cudaMalloc(&result, sizeof(RingTestResult)));
        FLEXEP_CUDA_CHECK(cudaMemcpyAsync(rows, host.data(), host.size(), cudaMemcpyHostToDevice, stream));
        FLEXEP_CUDA_CHECK(cudaMemsetAsync(result, 0xff, sizeof(RingTestResult), stream));
        launch_ring_test(rows, row_bytes, jobs, stages, consumer, result, stream);
        RingTestResult got{};
        FLEXEP_CUDA_CHECK(cudaMemcpyAsync(&got, result, sizeof(got), cudaMemcpyDeviceToHost, stream));
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
        cudaFree(rows);
        cudaFree(result);
        EXPECT_EQ(got.jobs_seen, jobs);
        EXPECT_EQ(got.bad_jobs, 0);
        EXPECT_EQ(got.bad_words, 0);
      }
    }
  }
}

}  // namespace
}  // namespace flexep::testing
