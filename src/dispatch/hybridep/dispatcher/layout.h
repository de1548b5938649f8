// Host-side logic of the hybridep backend that needs no GPU (tested on the CPU):
//   - the buffer configuration and the geometry of both buffers (window regions, flag words, the
//     plain device memory next to them), from which the sizes are reported;
//   - the header of the count exchange (encode/decode);
//   - why a call was aborted, decoded from the snapshot of the count exchange the preprocess kernel
//     keeps (a rank failed its checks, configurations differ, a budget or capacity overflow), with
//     the same messages on every rank;
//   - phase names and the errors of the device status record.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <string>
#include <vector>

#include "dispatch/common/call_signature.h"
#include "dispatch/hybridep/kernels/device_state.h"
#include "flexep/core/plan.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep::hybridep {

// What the buffers are sized for; equal on every rank (checked at init).
struct BufferConfig {
  int ranks = 1;
  int experts = 1;
  std::int64_t max_tokens = 0;     // T on any rank in one call
  std::int64_t hidden = 0;         // H (bf16 rows)
  int slots = 1;                   // slots per token: the largest top-k (multihot rows are limited to it)
  std::int64_t capacity_rows = 0;  // expert-major rows the receive window holds
  std::int64_t max_pad_multiple = 1;
  bool fp8 = false;  // also holds e4m3 rows' scales (dispatch_fp8)

  int local_experts() const { return experts / ranks; }
  // Entries of one record: a token has at most min(slots, L) kept pairs on one rank.
  int width() const { return slots < local_experts() ? slots : local_experts(); }
  int max_chunks() const { return num_chunks(max_tokens); }
  friend bool operator==(const BufferConfig&, const BufferConfig&) = default;
};

// The largest H the kernels hold: a bf16 row of the combine kernel's narrow shape fills one ring
// stage (combine.cu; dispatcher_cuda.cpp checks the kernels agree).
constexpr std::int64_t kMaxHidden = 8192;

// Validates and completes a configuration (ArgumentErrors name the HybridEpOptions field).
// max_topk 0 means E; max_recv_rows 0 means the worst case R * T * width + L * (max_pad - 1).
BufferConfig make_buffer_config(int ranks, int experts, std::int64_t max_tokens, std::int64_t hidden, int max_topk,
                                std::int64_t max_recv_rows, std::int64_t max_pad_multiple, bool fp8 = false);
// Words exchanged at init so that every rank can verify the others use the same configuration.
std::vector<long long> config_words(const BufferConfig& c);

constexpr std::size_t kRegionAlign = 256;
inline std::size_t align_up(std::size_t x, std::size_t a = kRegionAlign) { return (x + a - 1) / a * a; }

// Dispatch buffer.
//   window (symmetric, written by peers):
//     counts  [R] slots of (word::count + E) int64: rank s writes slot s (header + pair counts)
//     records [R][T] records of record_bytes(width): source s's token t at (s * T + t)
//     probs   [capacity] f32   the output token_probs (a view of the window)
//     tokens  [capacity][H] bf16  the output tokens (a view of the window; dispatch_fp8 packs
//             [capacity][H] e4m3 rows at the same offset)
//     scales  [capacity][H/128] f32  (fp8 buffers only) the output scales of dispatch_fp8
//   flags (NCCL resource buffer, uint32): chunk flags [R][max_chunks] (the counts carry their own
//     epochs: count_words.cuh)
//   local (plain device memory): the DispatchControl + tokens_per_expert [L], begin [L], kept [L],
//     the abort snapshot (a copy of the count slots), the sender's staging records [R][T], the
//     slot entries [T * slots], the multihot slots [T * slots] (expert, prob), the kernels' work
//     counters [2 + max_chunks] uint32 (work_items.cuh), and the chunk plan's counts, slot ranks,
//     chunk bases [plan_chunks(T)][E] int32 and CTA counter.
struct DispatchGeometry {
  BufferConfig cfg;
  int width = 1, record_bytes = 16, max_chunks = 1;
  std::int64_t max_pairs = 0;  // max_tokens * slots
  std::size_t slot_words = 0, slot_bytes = 0;
  std::size_t off_counts = 0, off_records = 0, off_probs = 0, off_tokens = 0, off_scales = 0, window_bytes = 0;
  std::size_t flag_bytes = 0;
  std::size_t off_control = 0, off_tpe = 0, off_begin = 0, off_kept = 0, off_snapshot = 0, off_staging = 0,
              off_slot_entry = 0, off_slot_expert = 0, off_slot_weight = 0, off_work = 0;
  // The chunk plan (chunk_plan.cu): counts [E] int64, slot ranks [T * slots] int32, chunk bases
  // [plan_chunks(T)][E] int32, its CTA counter.
  std::size_t off_plan_counts = 0, off_plan_slot_rows = 0, off_plan_chunk_base = 0, off_plan_done = 0;
  std::size_t local_bytes = 0;
};
DispatchGeometry dispatch_geometry(const BufferConfig& c);

// Combine buffer (combine, dispatch_backward and combine_backward).
//   window: partials [R][T][H] bf16 (owner rank's level-1 sums, row (s, t) for source s's token
//           t; combine_backward stages grad_out [T][H] at the same offset), then prob grads
//           [R][T][width] f32 (dispatch_backward)
//   flags:  ready [R][max_chunks], then consumed [R], then abort [R] and abort_arg [R] (the
//           epoch of a call that producer rank failed its checks in, and its FailedArg)
//   local:  the OpControl, then the kernels' work counters [2 + R * max_chunks] uint32
struct CombineGeometry {
  BufferConfig cfg;
  int width = 1, max_chunks = 1;
  std::size_t off_partials = 0, off_grads = 0, window_bytes = 0;
  std::size_t flag_ready = 0, flag_consumed = 0, flag_abort = 0, flag_abort_arg = 0, flag_bytes = 0;
  std::size_t off_control = 0, off_work = 0, local_bytes = 0;
};
CombineGeometry combine_geometry(const BufferConfig& c);

// ---- the count exchange header ----------------------------------------------------------------------

// The header of the count exchange: the call signature, and fp8 in its own word.
using RankHeader = call_signature::CallSignature;

std::vector<long long> encode(const RankHeader& h);  // word::count words
RankHeader decode(const long long* words);

// A copy of the count region: R slots of `slot_words` words (slot_bytes / 8), each header + E counts.
struct Snapshot {
  std::vector<RankHeader> headers;   // [R]
  std::vector<std::int64_t> counts;  // [R * E]
};
Snapshot parse_snapshot(const std::vector<long long>& words, int ranks, int experts, std::size_t slot_words);

// The error every rank raises for an aborted call, as rank `me` sees it; null when the abort came
// from `me`'s own host-side failure (already raised where it happened). Order: this rank's device
// error, another rank's failure, a configuration mismatch, a budget overflow (DispatchPlan::build's
// error), a receive-capacity overflow.
std::exception_ptr abort_reason(const Snapshot& snap, int me, std::int64_t capacity_rows);

// ---- status -----------------------------------------------------------------------------------------

std::string phase_name(Phase p);
// The exception of a timeout or corrupt-data status (StatusCode::timeout / corrupt).
std::exception_ptr status_error(const Status& s, int me, double timeout_seconds);

}  // namespace flexep::hybridep
