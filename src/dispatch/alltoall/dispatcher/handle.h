// What an alltoall dispatch leaves for its combine and the two backwards. The sender side says
// where each token went (send positions, and each slot's metadata entry); the receiver side says
// where each received entry landed. combine and the backwards reuse both without any metadata
// exchange, so they cannot drift from the forward.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/tensor.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::alltoall {

struct AlltoallHandle : HandleState {
  int slots = 0;       // k of the internal top-k form (multihot: E)
  int meta_width = 1;  // metadata entries per sent row: min(slots, E_local), at least 1
  // Sender (this rank as source), device int32:
  Tensor slot_expert;  // [T * slots] global expert id, -1 for none (after validation)
  Tensor slot_entry;   // [T * slots] send row * meta_width + entry, -1 for none
  Tensor send_pos;     // [R * T] row of token t in the send buffer for rank d at [d * T + t], -1 for none
  // Receiver, device int32:
  Tensor out_row;  // [total_recv * meta_width] expert-major row of each received entry, -1 for none/dropped
  // Message sizes in rows, per peer (host), from the dispatch's count exchange.
  std::vector<std::int64_t> send_count, send_offset, recv_count, recv_offset;
  std::int64_t total_send = 0, total_recv = 0;
};

}  // namespace flexep::alltoall
