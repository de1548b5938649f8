// The end of every deepep sender kernel: each thread orders its own stores (system scope) before
// the flags, the grid's last CTA releases the operation's epoch into one flag per peer
// (flags[kind * R + this rank] of every rank) and closes the operation.
#pragma once

#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "flexep/comm/symmetric_buffer.h"

namespace flexep::deepep {

__device__ inline void publish_to_peers(const hybridep::OpSession& session, const SymmetricPeerTable& peers, int kind,
                                        int ranks, int rank) {
  hybridep::fence_sys(::cuda::memory_order_seq_cst);
  if (!session.last_cta_to_finish()) return;
  for (int d = static_cast<int>(threadIdx.x); d < ranks; d += blockDim.x)
    hybridep::st_sys(reinterpret_cast<unsigned*>(peers.flags[d]) + kind * ranks + rank, session.epoch(),
                     ::cuda::memory_order_release);
  if (threadIdx.x == 0) session.finish();
}

}  // namespace flexep::deepep
