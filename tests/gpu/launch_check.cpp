// flexep_launch_check: one process of a process-per-GPU job. The communicator comes from the
// environment (mpirun's OMPI_* variables, or FLEXEP_RANK/FLEXEP_WORLD_SIZE/FLEXEP_LOCAL_RANK with the
// unique id shared through FLEXEP_NCCL_ID_FILE); the check is an all-reduce of rank + 1 and the
// topology. Exit status 0 on success; tests/gpu/run_launch_check.sh starts the processes.
#include <cstdio>

#include "flexep/comm/communicator.h"
#include "flexep/cuda/runtime.h"

int main() {
  using namespace flexep;
  try {
    CommunicatorOptions o;
    o.timeout_seconds = 60;
    auto comm = Communicator::from_environment(o);
    const int R = comm->size(), r = comm->rank();
    cuda::DeviceGuard guard(comm->device());
    Tensor t = cuda::to_device(Tensor::from_vector<double>({double(r + 1)}, {1}), comm->device(), nullptr);
    comm->all_reduce_sum(t, "launch check");
    const double got = cuda::to_host(t, nullptr).data<double>()[0], want = R * (R + 1) / 2.0;
    if (got != want) {
      std::fprintf(stderr, "rank %d: all-reduce gave %g, expected %g\n", r, got, want);
      return 1;
    }
    std::printf("rank %d of %d on GPU %d (local rank %d): ok\n", r, R, comm->device(), comm->local_rank());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "launch check failed: %s\n", e.what());
    return 1;
  }
}
