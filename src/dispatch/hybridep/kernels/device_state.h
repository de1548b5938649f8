// Plain structs that live in device memory and are read by both the kernels and the host glue
// (no CUDA headers, so the CPU tests can size and decode them).
#pragma once

#include "dispatch/hybridep/kernels/layout_math.h"

namespace flexep::hybridep {

// Per-buffer operation state, zeroed at allocation. `epoch` is the number of completed operations
// on the buffer; operation n uses epoch n in every flag it sets and waits for, so flags are never
// reset (they only grow) and a captured CUDA graph replays correctly: the epoch lives on the
// device, not in the kernel arguments. `done_ctas` counts finished CTAs of the running kernel; the
// last one resets it and publishes the new epoch (device/op_session.cuh, OpSession::last_cta_to_finish).
struct OpControl {
  unsigned epoch;
  unsigned done_ctas;
};

// Dispatch buffer: the operation state plus what the preprocess kernel decided for this call,
// read by the dispatch kernel and, through the handle, by the combine and backward kernels.
// tokens_per_expert [L] (int64) follows the struct directly, so blocking mode reads everything it
// needs with one copy.
struct DispatchControl {
  OpControl op;
  int abort;  // 1: every rank skips the data movement of this call (all ranks decide alike)
  int reserved;
  long long out_rows;           // rows of this rank's output
  long long used_rows;          // rows covered by its expert groups
  long long required_rows;      // rows the blocking layout needs
  long long dropped;            // pairs dropped on this rank by the budget
  long long tokens[kMaxRanks];  // T of every rank in this call (0 for a rank that failed its checks)
};
static_assert(sizeof(DispatchControl) % 16 == 0, "tokens_per_expert follows, 16-byte aligned");

enum class StatusCode : int {
  ok = 0,
  abort = 1,    // a rank failed its checks, configurations differ, or a budget/capacity overflow:
                // the snapshot of the count exchange says which (decoded on the host)
  timeout = 2,  // a wait passed its deadline: phase and peer
  corrupt = 3,  // a record or row index from `peer` failed validation (value, limit)
};

// Protocol phases, for error messages (phase_name() in layout.h).
enum class Phase : int {
  none = 0,
  dispatch_counts = 1,
  dispatch_tokens = 2,
  combine_partials = 3,
  combine_reuse = 4,
  dispatch_backward_partials = 5,
  dispatch_backward_reuse = 6,
  combine_backward_rows = 7,
  combine_backward_reuse = 8,
  low_latency_dispatch = 9,  // deepep's low-latency mode
  low_latency_combine = 10,
};

// One per dispatcher, shared by all its kernels; the first error wins (code is claimed with an
// atomic compare-and-swap, the fields are written, then code is published).
struct Status {
  int code;   // StatusCode; -1 while the first reporter fills the fields in
  int phase;  // Phase
  int peer;   // the rank waited for, or whose data was bad
  int reserved;
  long long value;
  long long limit;
};

}  // namespace flexep::hybridep
