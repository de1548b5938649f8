// A test kernel for SymmetricBuffer's device peer table (include/flexep/comm/symmetric_buffer.h).
#pragma once

#include <cuda_runtime.h>

#include "flexep/comm/symmetric_buffer.h"

namespace flexep::testing {

// One thread per peer p < ranks: stores `rank` into word `rank` of table.window[p] and of
// table.flags[p], the way deepep's kernels reach a peer.
void launch_write_through_peer_table(SymmetricPeerTable table, int ranks, int rank, cudaStream_t stream);

}  // namespace flexep::testing
