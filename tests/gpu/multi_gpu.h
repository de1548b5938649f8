// Multi-GPU test helper: R ranks as one thread per GPU in this process, each with its own NCCL
// communicator (one unique id made on the calling thread) and its own stream as the thread's
// current stream. What each rank threw is collected; assertions run afterwards on the main thread
// (see cpu/host_ranks.h for all_ok / all_threw / what_of).
//
// With simulated ranks (simulated_ranks() below) the same tests run R ranks on GPU 0 instead: one
// thread each, communicators from Communicator::simulate over one HostWorld. The hybridep kernels
// then run their multi-rank paths (peer windows and flags, the combine's second level) on one GPU;
// NCCL-based backends refuse such communicators.
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include "cpu/host_ranks.h"
#include "flexep/comm/communicator.h"
#include "flexep/comm/host_world.h"
#include "flexep/cuda/runtime.h"

namespace flexep::testing {

// Simulated ranks of the running test: 0 = one rank per GPU, n = n ranks sharing GPU 0. A test
// fixture sets it in SetUp; every helper below reads it.
inline int& simulated_ranks() {
  static int n = 0;
  return n;
}

// Sets simulated_ranks() for a scope (a test body outside the RankVariantTest fixtures), then puts
// the previous value back.
struct Simulate {
  explicit Simulate(int n) : previous(simulated_ranks()) { simulated_ranks() = n; }
  ~Simulate() { simulated_ranks() = previous; }
  Simulate(const Simulate&) = delete;
  Simulate& operator=(const Simulate&) = delete;
  int previous;
};

// Ranks of a multi-GPU test: every visible GPU, at most 4 (or the simulated ranks).
inline int gpu_ranks() { return simulated_ranks() > 0 ? simulated_ranks() : std::min(cuda::device_count(), 4); }

// GPUs a test that runs `ranks` ranks needs: one per rank, or GPU 0 alone for simulated ranks.
inline int gpus_for_ranks(int ranks) { return simulated_ranks() > 0 ? 1 : ranks; }

struct GpuRank {
  int rank = 0;
  int size = 1;
  int device = 0;  // this rank's GPU (0 for every simulated rank)
  std::shared_ptr<Communicator> comm;
  cudaStream_t stream = nullptr;
};

inline std::vector<std::exception_ptr> run_gpu_ranks(int R, const std::function<void(GpuRank&)>& fn,
                                                     const CommunicatorOptions& options = {}) {
  cuda::init();
  const bool simulated = simulated_ranks() > 0;
  const ncclUniqueId id = simulated ? ncclUniqueId{} : Communicator::new_unique_id();
  const auto world = simulated ? std::make_shared<HostWorld>(R, options.timeout_seconds) : nullptr;
  return run_ranks(R, [&](int r) {
    const int device = simulated ? 0 : r;
    FLEXEP_CUDA_CHECK(cudaSetDevice(device));
    GpuRank g;
    g.rank = r;
    g.size = R;
    g.device = device;
    const cuda::OwnedStream owner(cudaStreamNonBlocking);
    g.stream = owner;
    cuda::StreamGuard current(g.stream);  // device tensors of fn are allocated and freed on it
    g.comm = simulated ? Communicator::simulate(world, r, device, options)
                       : Communicator::create(id, r, R, device, options);
    fn(g);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(g.stream));
  });
}

}  // namespace flexep::testing
