// A test kernel for the hybridep stage ring (src/dispatch/hybridep/device/ring.cuh) in isolation.
#pragma once

#include <cuda_runtime.h>

namespace flexep::testing {

struct RingTestResult {
  int jobs_seen;  // jobs the consumer received before "exit"
  int bad_jobs;   // descriptors out of order or with wrong fields
  int bad_words;  // stage words that differ from the source row (bulk-loaded jobs)
};

// How the consumer warp takes its jobs: every lane waits, reads and frees (the combine's compute
// warps), or lane 0 alone with the descriptor shuffled to the others (the dispatch's store warp).
enum class RingConsumer { all_lanes, lane0 };

// One CTA: a producer warp posts `jobs` jobs through a ring of `stages` stages of `row_bytes`
// (every other job bulk-loads row j of `rows` into its stage, the others carry only a descriptor),
// then "exit"; a consumer warp checks each descriptor and stage and frees it. `result` is device
// memory, written by the consumer.
void launch_ring_test(const unsigned char* rows, int row_bytes, int jobs, int stages, RingConsumer consumer,
                      RingTestResult* result, cudaStream_t stream);

}  // namespace flexep::testing
