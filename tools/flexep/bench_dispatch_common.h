// What the per-backend parts of the `dsv3-ep2` and `decode` cases share (bench_dispatch_cuda.cpp runs
// them, one thread per rank): the timing of a collective call, from an idle stream or from an aligned
// start, and the context a backend's part records into.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench_cases.h"
#include "bench_record.h"
#include "flexep/comm/communicator.h"
#include "flexep/core/tensor.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::tools {

// fn() timed with CUDA events on `stream`, each repetition started together on all ranks by a host
// barrier, after `warmup` untimed calls.
TimeStats timed_collective(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                           cudaStream_t stream);

// The same call started as a training step starts it: on a busy stream, with the ranks together on
// the GPU. A spin kernel keeps the stream busy while the host enqueues the call (its launch work is
// not idle GPU time), and a one-element all-reduce right before the start event lines the ranks up
// (the host barrier lets them go up to its 50 us polling interval apart, which the call's first
// exchange would otherwise absorb and charge to the call).
inline constexpr const char* kAlignedNote = " (aligned start: busy stream, ranks lined up on the GPU)";

class AlignedStart {
 public:
  AlignedStart(Communicator& comm, cudaStream_t stream);
  // Enqueues the spin and the all-reduce: what the stream runs next starts with the ranks together.
  void line_up();

 private:
  Communicator& comm_;
  cudaStream_t stream_;
  Tensor flag_;
};

TimeStats timed_collective_aligned(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                                   cudaStream_t stream);

// One rank's share of a dispatch case: its inputs, and where its records go (rank 0's are reported).
struct DispatchBench {
  using Recorder = std::function<void(const std::string& backend, const std::string& phase, const TimeStats& t,
                                      const std::string& note, const std::string& timing, const std::string& start)>;
  const BenchArgs& args;
  std::shared_ptr<Communicator> comm;
  DispatchInput in;                 // [T, H] bf16 rows, top-k ids and weights, on this rank's GPU
  std::int64_t tokens = 0;          // T
  int hidden = 0, topk = 0, experts = 0;
  std::int64_t exact_rows = 0;      // the largest rank's expert-major rows (hybridep's budget)
  cudaStream_t stream = nullptr;
  std::vector<BenchRecord>& mine;   // this rank's records; `recorder` appends to it
  Recorder recorder;

  void record(const std::string& backend, const std::string& phase, const TimeStats& t, const std::string& note,
              const std::string& timing = "call", const std::string& start = "") const {
    recorder(backend, phase, t, note, timing, start);
  }
  // The SM counts to sweep: --sms, or the backend's default when it is not given.
  std::vector<int> sm_sweep(int default_sms) const {
    return args.sms.empty() ? std::vector<int>{default_sms} : args.sms;
  }
};

void bench_hybridep(const DispatchBench& b);
void bench_deepep(const DispatchBench& b);

}  // namespace flexep::tools
