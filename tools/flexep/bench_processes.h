// One rank per process for the multi-GPU benchmark cases: when the environment names a rank
// (mpirun's OMPI_COMM_WORLD_RANK / _SIZE, or FLEXEP_RANK / FLEXEP_WORLD_SIZE with the unique id in
// FLEXEP_NCCL_ID or FLEXEP_NCCL_ID_FILE, as Communicator::from_environment reads them), a case
// runs only that rank here, and only rank 0 prints and writes the results. This is what a profiler
// needs that serialises one process's kernels (ncu): the peer runs on in its own process instead
// of waiting behind the profiled rank's kernels in the same one.
#pragma once

#include <cstdlib>

namespace flexep::tools {

struct ProcessRank {
  bool active = false;  // launched one rank per process
  int rank = 0, size = 1;
};

inline ProcessRank process_rank() {
  auto get = [](const char* a, const char* b) {
    const char* v = std::getenv(a);
    return v ? v : std::getenv(b);
  };
  const char* r = get("OMPI_COMM_WORLD_RANK", "FLEXEP_RANK");
  const char* n = get("OMPI_COMM_WORLD_SIZE", "FLEXEP_WORLD_SIZE");
  if (!r || !n) return {};
  return {true, std::atoi(r), std::atoi(n)};
}

}  // namespace flexep::tools
