// What a host dispatch leaves for its combine and backwards: the sender-side view of the layout.
// Receivers never store their layout; every later collective re-derives it from the senders'
// handles, which is exactly what the dispatch did, so the backward cannot drift from the forward.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/dispatch/dispatcher.h"

namespace flexep::host {

struct HostHandle : HandleState {
  std::uint64_t sequence = 0;           // dispatch call number; equal on all ranks for one collective call
  std::int64_t slots = 0;               // k of the internal top-k form (multihot: max experts per token)
  std::vector<std::int64_t> indices;    // [tokens * slots] global expert ids, -1 = none
  std::vector<std::int64_t> slot_rows;  // [tokens * slots] row on the owner rank, -1 = none or dropped
                                        // (expert_major)
  std::vector<std::int64_t> dest_rows;  // [tokens * R] row on rank d, -1 = none or dropped (rank_major)
};

}  // namespace flexep::host
