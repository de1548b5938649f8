// The timing of the dispatch cases' collective calls (bench_dispatch_common.h).
#include "bench_dispatch_common.h"
#include "bench_spin.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {

TimeStats timed_collective(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                           cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  EventTimer timer;
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    comm.barrier("bench barrier");
    us.push_back(timer.time_us(fn, stream));
  }
  return stats_of(us);
}

constexpr double kSpinUs = 300;  // longer than the host's enqueue work of any timed call

AlignedStart::AlignedStart(Communicator& comm, cudaStream_t stream)
    : comm_(comm), stream_(stream), flag_(Tensor::empty({1}, DType::i32, Device::cuda(comm.device()))) {
  FLEXEP_CUDA_CHECK(cudaMemsetAsync(flag_.raw(), 0, sizeof(std::int32_t), stream));
}

void AlignedStart::line_up() {
  comm_.barrier("bench barrier");
  launch_spin(kSpinUs, stream_);
  FLEXEP_NCCL_CHECK(ncclAllReduce(flag_.raw(), flag_.raw(), 1, ncclInt32, ncclSum, comm_.get(), stream_));
  comm_.wait_enqueued("bench:aligned start");  // a non-blocking communicator takes no call before that
}

TimeStats timed_collective_aligned(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                                   cudaStream_t stream) {
  AlignedStart start(comm, stream);
  EventTimer timer;
  std::vector<double> us;
  for (int i = 0; i < warmup + reps; ++i) {
    start.line_up();
    const double t = timer.time_us(fn, stream);
    if (i >= warmup) us.push_back(t);
  }
  return stats_of(us);
}

}  // namespace flexep::tools
