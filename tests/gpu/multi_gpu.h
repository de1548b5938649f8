// Multi-GPU test helper: R ranks as one thread per GPU in this process, each with its own NCCL
// communicator (one unique id made on the calling thread) and its own stream as the thread's
// current stream. What each rank threw is collected; assertions run afterwards on the main thread
// (see cpu/host_ranks.h for all_ok / all_threw / what_of).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/comm/communicator.h"
#include "flexep/cuda/runtime.h"

namespace flexep::testing {

// Ranks of a multi-GPU test: every visible GPU, at most 4.
inline int gpu_ranks() { return std::min(cuda::device_count(), 4); }

struct GpuRank {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Communicator> comm;
  cudaStream_t stream = nullptr;
};

inline std::vector<std::exception_ptr> run_gpu_ranks(int R, const std::function<void(GpuRank&)>& fn,
                                                     const CommunicatorOptions& options = {}) {
  cuda::init();
  const ncclUniqueId id = Communicator::new_unique_id();
  return run_ranks(R, [&](int r) {
    FLEXEP_CUDA_CHECK(cudaSetDevice(r));
    GpuRank g;
    g.rank = r;
    g.size = R;
    const cuda::OwnedStream owner(cudaStreamNonBlocking);
    g.stream = owner;
    cuda::StreamGuard current(g.stream);  // device tensors of fn are allocated and freed on it
    g.comm = Communicator::create(id, r, R, r, options);
    fn(g);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  });
}

}  // namespace flexep::testing
