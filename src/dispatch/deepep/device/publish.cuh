// The end of every deepep sender kernel: each thread orders its own stores (system scope) before
// the flags, the grid's last CTA releases the operation's epoch into one flag per peer
// (flags[kind * R + this rank] of every rank) and closes the operation.
//
// A rank whose own checks failed (combine, the backwards) still runs its part with nothing to send
// and passes `failed_arg` (FailedArg, not none): the last CTA then writes the argument and the
// epoch into every peer's abort words before the flag, so each receiver, having acquired the flag,
// sees that this call stopped here (failed_peer).
#pragma once

#include "dispatch/deepep/kernels/kernels.h"
#include "dispatch/hybridep/device/flag.cuh"
#include "dispatch/hybridep/device/op_session.cuh"
#include "dispatch/hybridep/device/status.cuh"
#include "flexep/comm/symmetric_buffer.h"

namespace flexep::deepep {

__device__ inline void publish_to_peers(const hybridep::OpSession& session, const SymmetricPeerTable& peers, int kind,
                                        int ranks, int rank, int failed_arg = 0) {
  hybridep::fence_sys(::cuda::memory_order_seq_cst);
  if (!session.last_cta_to_finish()) return;
  for (int d = static_cast<int>(threadIdx.x); d < ranks; d += blockDim.x) {
    auto* flags = reinterpret_cast<unsigned*>(peers.flags[d]);
    if (failed_arg != 0) {
      flags[abort_arg_word(kind, ranks, rank)] = static_cast<unsigned>(failed_arg);
      flags[abort_word(kind, ranks, rank)] = session.epoch();
    }
    hybridep::st_sys(flags + kind * ranks + rank, session.epoch(), ::cuda::memory_order_release);
  }
  if (threadIdx.x == 0) session.finish();
}

// After every source's flag of `kind` was acquired at `epoch`, by every thread of the CTA: whether a
// source other than `self` failed its own checks in this call (its abort word holds the epoch). Each
// thread looks at its share of the sources and reports Status abort with the phase, the rank and its
// FailedArg (as the value; the first report wins); the caller then writes nothing.
__device__ inline bool stopped_by_peer(const unsigned* flags, int kind, int self, int ranks, unsigned epoch,
                                       hybridep::Status* status, hybridep::Phase phase) {
  bool stopped = false;
  for (int s = static_cast<int>(threadIdx.x); s < ranks; s += blockDim.x) {
    if (s == self || __ldcg(flags + abort_word(kind, ranks, s)) != epoch) continue;
    hybridep::report_status(status, hybridep::StatusCode::abort, phase, s, __ldcg(flags + abort_arg_word(kind, ranks, s)),
                            0);
    stopped = true;
  }
  return __syncthreads_or(stopped) != 0;
}

}  // namespace flexep::deepep
