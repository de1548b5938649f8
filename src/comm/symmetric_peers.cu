// The one device-side step of SymmetricBuffer's set-up: NCCL 2.28 has no host call that returns a
// peer's address in a window, so a small kernel asks ncclGetLsaPointer (and
// ncclGetResourceBufferLsaPointer for the flag buffer) for every LSA peer and the host copies the
// addresses back once. Kernels then take a table of them instead of the 200-byte devComm.
#include <nccl_device.h>

#include "flexep/comm/symmetric_buffer.h"
#include "flexep/cuda/runtime.h"

namespace flexep::detail {

namespace {
__global__ void resolve_peers_kernel(ncclWindow_t window, ncclDevComm dev_comm, ncclDevResourceHandle_t flags,
                                     bool has_flags, int ranks, char** windows, char** flag_buffers) {
  // LSA peer index p is world rank p: the buffer refuses communicators whose LSA team is not the
  // whole, consecutively numbered group.
  for (int p = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x); p < ranks;
       p += static_cast<int>(gridDim.x * blockDim.x)) {
    windows[p] = static_cast<char*>(ncclGetLsaPointer(window, 0, p));
    flag_buffers[p] = has_flags ? static_cast<char*>(ncclGetResourceBufferLsaPointer(dev_comm, flags, p)) : nullptr;
  }
}
}  // namespace

void resolve_symmetric_peers(ncclWindow_t window, const ncclDevComm& dev_comm, ncclDevResourceHandle_t flags,
                             bool has_flags, int ranks, char** windows, char** flag_buffers) {
  char** dev = nullptr;
  const std::size_t bytes = 2 * static_cast<std::size_t>(ranks) * sizeof(char*);
  FLEXEP_CUDA_CHECK(cudaMalloc(&dev, bytes));
  resolve_peers_kernel<<<1, 128>>>(window, dev_comm, flags, has_flags, ranks, dev, dev + ranks);
  const cudaError_t launch = cudaGetLastError();
  const std::size_t half = bytes / 2;
  cudaError_t copy = launch == cudaSuccess ? cudaMemcpy(windows, dev, half, cudaMemcpyDeviceToHost) : launch;
  if (copy == cudaSuccess) copy = cudaMemcpy(flag_buffers, dev + ranks, half, cudaMemcpyDeviceToHost);
  cudaFree(dev);
  FLEXEP_CUDA_CHECK(copy);
}

}  // namespace flexep::detail
