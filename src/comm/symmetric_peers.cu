// The one device-side step of SymmetricBuffer's set-up: NCCL 2.28 has no host call that returns a
// peer's address in a window, so a one-block kernel asks ncclGetLsaPointer (and
// ncclGetResourceBufferLsaPointer for the flag buffer) for every LSA peer and the host copies the
// table back once. Kernels then take the table by value instead of the 200-byte devComm.
#include <nccl_device.h>

#include "flexep/comm/symmetric_buffer.h"
#include "flexep/cuda/runtime.h"

namespace flexep::detail {

namespace {
__global__ void resolve_peers_kernel(ncclWindow_t window, ncclDevComm dev_comm, ncclDevResourceHandle_t flags,
                                     bool has_flags, int ranks, SymmetricPeers* out) {
  const int p = threadIdx.x;
  if (p >= kMaxSymmetricPeers) return;
  // LSA peer index p is world rank p: the buffer refuses communicators whose LSA team is not the
  // whole, consecutively numbered group.
  out->window[p] = p < ranks ? static_cast<char*>(ncclGetLsaPointer(window, 0, p)) : nullptr;
  out->flags[p] =
      p < ranks && has_flags ? static_cast<char*>(ncclGetResourceBufferLsaPointer(dev_comm, flags, p)) : nullptr;
}
}  // namespace

void resolve_symmetric_peers(ncclWindow_t window, const ncclDevComm& dev_comm, ncclDevResourceHandle_t flags,
                             bool has_flags, int ranks, SymmetricPeers* out) {
  SymmetricPeers* dev = nullptr;
  FLEXEP_CUDA_CHECK(cudaMalloc(&dev, sizeof(SymmetricPeers)));
  resolve_peers_kernel<<<1, kMaxSymmetricPeers>>>(window, dev_comm, flags, has_flags, ranks, dev);
  const cudaError_t launch = cudaGetLastError();
  const cudaError_t copy =
      launch == cudaSuccess ? cudaMemcpy(out, dev, sizeof(SymmetricPeers), cudaMemcpyDeviceToHost) : launch;
  cudaFree(dev);
  FLEXEP_CUDA_CHECK(copy);
}

}  // namespace flexep::detail
