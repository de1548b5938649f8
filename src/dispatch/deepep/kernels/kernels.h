// Launchers of the deepep kernels (rows.cu, receive.cu, partials.cu, expert_major.cu) and the views they take by
// value. Every sender kernel is one OpSession on its kind's OpControl: it releases the epoch into
// one flag per peer when its last CTA is done; the matching receiver kernel acquires them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dispatch/common/failed_arg.h"
#include "dispatch/common/signature_words.h"
#include "dispatch/hybridep/kernels/device_state.h"
#include "flexep/comm/symmetric_buffer.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::deepep {

using hybridep::OpControl;
using hybridep::Phase;
using hybridep::Status;

// The kinds of operation, each with its own epoch and one flag per source rank: the four calls,
// and the budget-mode dispatch's count exchange.
enum Kind : int {
  kDispatch = 0,
  kCombine = 1,
  kDispatchBackward = 2,
  kCombineBackward = 3,
  kCounts = 4,
  kLowLatencyDispatch = 5,
  kLowLatencyCombine = 6,
  kKinds = 7
};

// The flag buffer of every rank: flags [kKinds * R], then the abort words [kKinds * R] (the epoch of
// a call that failed its checks on that source) and their arguments [kKinds * R] (FailedArg).
inline constexpr int flag_words(int ranks) { return 3 * kKinds * ranks; }
__host__ __device__ inline constexpr int abort_word(int kind, int ranks, int source) {
  return kKinds * ranks + kind * ranks + source;
}
__host__ __device__ inline constexpr int abort_arg_word(int kind, int ranks, int source) {
  return 2 * kKinds * ranks + kind * ranks + source;
}


// A call's layout on the device, int64 words (a tensor of the handle): written by the host in
// blocking mode, by the count-exchange kernel in budget mode; the kernels read it from there.
namespace layout_word {
constexpr int abort = 0;     // 1: the call failed on some rank; every rank moves nothing (all decide alike)
constexpr int received = 1;  // rows this rank receives (source_begin[R])
constexpr int row_begin = 2;  // [R]: this rank's first row on rank d
inline constexpr int source_begin(int ranks) { return row_begin + ranks; }  // [R + 1]: rows from source s
inline constexpr int list_begin(int ranks) { return source_begin(ranks) + ranks + 1; }  // [L] (blocking)
inline constexpr int list_len(int ranks, int local) { return list_begin(ranks) + local; }  // [L] (blocking)
inline constexpr int words(int ranks, int local) { return list_len(ranks, local) + local; }
}  // namespace layout_word

#if defined(__CUDACC__)
// The rows a budget call received on this rank: none when it aborted.
__device__ inline long long received_rows(const long long* layout) {
  return layout[layout_word::abort] ? 0 : layout[layout_word::received];
}
#endif

// The count exchange's words of one rank: [call signature (kWords) | fp8 | layout | pairs per expert
// [E] | rows per destination rank [R]].
namespace exchange_word {
constexpr int fp8 = call_signature::kWords;  // 1: the rows travel as e4m3 with their scales (dispatch_fp8)
constexpr int layout = fp8 + 1;              // 1: the expert-major layout (DispatchOptions::layout)
constexpr int header = layout + 1;           // the words before the counts
inline constexpr int words(int experts, int ranks) { return header + experts + ranks; }
}  // namespace exchange_word

// The count kernel's destination masks: one word per (destination, chunk of 32 tokens).
inline constexpr std::int64_t mask_chunks(std::int64_t tokens) { return (tokens + 31) / 32; }

// FP8 rows carry one fp32 scale per this many elements (DeepEP's and hybridep's).
constexpr int kFp8ScaleBlock = 128;

// Byte offsets into every rank's window (the same on all ranks).
struct WindowLayout {
  unsigned long long x = 0;       // [cap, H] bf16 (or e4m3, dispatch_fp8): recv_x
  unsigned long long scales = 0;  // [cap, H / 128] f32: recv_x's scales (dispatch_fp8)
  unsigned long long idx = 0;     // [cap, k] int32: recv_topk_idx
  unsigned long long w = 0;       // [cap, k] f32: recv_topk_weights
  unsigned long long src = 0;     // [cap] int32: the source token of each received row
  unsigned long long grad = 0;    // [cap, H] bf16: combine_backward's rows
  unsigned long long part = 0;    // [R, T_max, H] bf16: the rows coming back (combine, dispatch_backward)
  unsigned long long part_w = 0;  // [R, T_max, K] f32: their weight gradients (dispatch_backward)
  unsigned long long counts = 0;  // [R, P] int64: the budget-mode count exchange, row s from source s
  // Low-latency mode (DeepEpOptions::low_latency_max_tokens = T_ll > 0; else empty):
  unsigned long long ll_x = 0;       // [L, R, T_ll, 2H] bytes: the pairs' rows as they arrive, per (expert, source)
  unsigned long long ll_scales = 0;  // [L, R, T_ll, H / 128] f32: their FP8 scales
  unsigned long long ll_info = 0;    // [L, R, T_ll] int32: t * K + j of each arrived row (K = max_topk)
  unsigned long long ll_counts = 0;  // [L, R] int32: rows from each source per local expert
  unsigned long long ll_back = 0;    // [T_ll, K, H] bf16: the expert outputs coming back, per (token, slot)
  unsigned long long bytes = 0;
};

// Budget mode's count exchange, one CTA: this rank's words [signature | pairs per expert | rows per
// destination] (the device_* words from `errors`) into row `rank` of every peer's count area, one
// flag per peer, then every source's words awaited (deadline) and the call's layout derived, as the
// host does in blocking mode: row_begin, source_begin, received. A rank that failed its checks,
// configurations that differ, or a receiver over the budget set layout[abort] on every rank; the
// words are then kept in `snapshot` and the status says abort, so that the host decodes the exact
// error at its next check.
// The expert-major layout: `budget` is the window (every rank-major row is received; more is an
// error whatever the policy) and `entries_budget` bounds the expert-major entries, padded lists end
// to end (docs/semantics.md, "Dispatch"): over it, an error on every rank, or with the drop policy a
// prefix of each receiver's entries kept. This rank's list lengths go to tokens_per_expert and its
// dropped pairs to *dropped.
struct NotifyCall {
  SymmetricPeerTable peers{};
  int rank = 0, ranks = 0, experts = 0;
  long long header[exchange_word::header] = {};
  const cuda::DeviceErrorRecord* errors = nullptr;
  // [E + R], or null (this rank's checks failed: zeros travel). Budget mode's counts buffer, which
  // the count kernel adds into: the notify kernel zeroes it once sent, for the next call (zero at
  // creation), so no call clears it first.
  long long* counts = nullptr;
  int words = 0;                      // P = exchange_word::words(E, R)
  WindowLayout win{};
  OpControl* op = nullptr;
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  long long budget = 0, capacity = 0;  // the budget; the window's rows
  bool drop = false;                   // overflow policy drop: receivers keep their first `budget` rows
  bool expert_major = false;
  long long entries_budget = 0, pad = 1;  // expert-major: the budget of entries, DispatchOptions::pad_multiple
  int local_experts = 0;
  long long* tokens_per_expert = nullptr;  // [L]: the expert-major layout's, or the rank-major one's
                                           // without the drop policy (the lists' padded lengths)
  bool rank_major_lengths = false;         // rank-major, no drop: tokens_per_expert from the counts
  long long* layout = nullptr;         // layout_word
  long long* snapshot = nullptr;       // [R * P]
  long long* dropped = nullptr;        // zeroed here; the receive kernels add this rank's dropped pairs
  // This rank's rows on every destination (device/chunk_rows.cuh), from the count kernel's masks.
  const unsigned* dest_mask = nullptr;  // [R, chunks]
  int* chunk_base = nullptr;            // [R, chunks]
  std::int64_t chunks = 0;
};
void launch_notify(const NotifyCall& c, cudaStream_t stream);

// Blocking mode's chunk bases (device/chunk_rows.cuh) from the host's layout words: one CTA per
// destination, a block scan. (Budget mode's notify kernel computes them itself.)
struct ChunkBasesCall {
  const unsigned* dest_mask = nullptr;  // [R, chunks]
  const long long* layout = nullptr;    // layout_word: row_begin
  std::int64_t chunks = 0;
  int ranks = 0;
  int* chunk_base = nullptr;            // [R, chunks]
};
void launch_chunk_bases(const ChunkBasesCall& c, cudaStream_t stream);

// Budget mode's tail of a window region on this rank: rows [layout[received], rows) zero (unless
// !zero_rows: the expert-major layout reads no row past the received ones), and with slots their
// ids -1, weights 0 and source tokens -1 (and with scale_cols their scales 0). Peers write only
// rows below `received`, so the sender kernel clears it while the rows travel.
struct TailCall {
  char* window = nullptr;
  unsigned long long rows_at = 0;  // WindowLayout::x or ::grad
  WindowLayout win{};
  bool slots = false;
  bool zero_rows = true;
  const long long* layout = nullptr;
  std::int64_t rows = 0;           // 0: no tail
  long long row_bytes = 0;
  int k = 0, scale_cols = 0;
};

// Sender: row t goes to its row on rank d's window at `rows_at` (and, with slots, its k slots as d's
// local ids, their weights, and t; with scales, its scales). Then one flag per destination:
// flags[kind * R + me]. The rows come from dest_row (combine_backward: the handle's), or for a
// dispatch from the masks and chunk bases (device/chunk_rows.cuh), the kernel writing dest_row
// [R * T] for the way back (-1: not sent; everywhere -1 when the call aborted; with `budget`, the
// drop policy's rows at or past it). With a tail, it also clears this rank's tail (TailCall).
struct SendRowsCall {
  SymmetricPeerTable peers{};
  int rank = 0, ranks = 0, local_experts = 0, k = 0;
  std::int64_t tokens = 0;
  long long row_bytes = 0;             // 2H (bf16) or H (e4m3): a multiple of 16
  const void* x = nullptr;             // [T, row_bytes]
  const float* scales = nullptr;       // [T, scale_cols] (dispatch_fp8) or null
  int scale_cols = 0;                  // H / 128
  const int* slot_expert = nullptr;    // [T * k] (null: no slots travel)
  const float* weights = nullptr;      // [T * k]
  const int* dest_row = nullptr;       // [R * T], or null: from the masks
  const unsigned* dest_mask = nullptr; // [R, chunks]
  const int* chunk_base = nullptr;     // [R, chunks]
  std::int64_t chunks = 0;
  const long long* layout = nullptr;   // layout_word: abort
  long long budget = -1;               // the drop policy's budget (-1: none)
  int* dest_row_out = nullptr;         // [R * T]
  int* minus_one[2] = {};              // filled with -1 (minus_one_count each): the expert-major maps
  std::int64_t minus_one_count = 0;
  TailCall tail{};
  unsigned long long rows_at = 0;      // WindowLayout::x or ::grad
  WindowLayout win{};
  OpControl* op = nullptr;
  int kind = kDispatch;
  int failed_arg = 0;  // FailedArg: this rank's checks failed, nothing is sent, the peers learn why
};
void launch_send_rows(const SendRowsCall& c, int ctas, cudaStream_t stream);

// Receiver: waits (deadline) for the flags of every source of `kind` at the epoch its sender
// kernel closed (every CTA of the listing kernels waits itself: no kernel only to wait); then,
// with expert_rows, CTA e lists local expert e's rows (any slot == e) in
// ascending order at list_begin[e], padded with -1 to list_len[e]. For the expert-major layout it
// also writes, for entry p of those lists (row r, slot j): probs[p] = recv_topk_weights[r][j] (0 for
// padding), slot_pos[r * k + j] = p, and row_order[r * k + n] = p for the row's n-th expert in
// ascending local id (so row_order lists a row's entries in expert-major order). slot_pos and
// row_order are -1 on entry. Budget mode (tokens_per_expert set): the rows are the `received` of
// the layout, each list's length is counted here first (padded, into tokens_per_expert) unless
// `lengths_known` (the notify kernel wrote them: the expert-major layout), the lists lie end to end
// from 0, and the entries past them up to `capacity` are -1 (probs 0). A list keeps its first
// `length` rows: the rest are the drop policy's dropped pairs (their slot_pos stays -1).
struct ReceiveCall {
  const unsigned* flags = nullptr;  // this rank's flag buffer
  int rank = 0, ranks = 0, kind = kDispatch;
  const OpControl* op = nullptr;
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  Phase phase = Phase::dispatch_tokens;
  const int* idx = nullptr;  // this rank's recv_topk_idx (window)
  int k = 0, local_experts = 0;
  std::int64_t rows = 0;
  const long long* list_begin = nullptr;  // [L] (blocking)
  const long long* list_len = nullptr;    // [L] (blocking)
  long long* tokens_per_expert = nullptr; // [L] (budget)
  bool lengths_known = false;             // budget, expert-major
  const long long* layout = nullptr;      // layout_word (budget: received, abort)
  long long pad = 1;                      // budget
  long long capacity = 0;                 // expert_rows' entries (budget: its capacity)
  // Budget mode with the drop policy: the pairs sent here (the count exchange's words in this rank's
  // window, P per source) less those kept are added to *dropped.
  const long long* exchanged = nullptr;
  int words = 0;
  unsigned long long* dropped = nullptr;
  int* expert_rows = nullptr;             // null: only wait
  const float* weights = nullptr;         // this rank's recv_topk_weights (window); with probs
  float* probs = nullptr;                 // [sum list_len] or null
  int* slot_pos = nullptr;                // [rows * k] or null
  int* row_order = nullptr;               // [rows * k] or null
  // The received rows' source tokens copied out of the window (the handle keeps them: a later
  // dispatch rewrites the window): src_out[i] = src[i] for i < src_rows.
  const int* src = nullptr;
  int* src_out = nullptr;
  std::int64_t src_rows = 0;
};
void launch_receive(const ReceiveCall& c, cudaStream_t stream);

// Sender of the way back: received row i (from source s, token src[i]) goes to rank s's window at
// part[me][t] (and its k weight gradients to part_w[me][t]); then one flag per source. Rows from
// this rank itself stay where they are: the reduce reads them there (one copy less per local row).
struct SendPartialsCall {
  SymmetricPeerTable peers{};
  int rank = 0, ranks = 0, k = 0;
  std::int64_t rows = 0, hidden = 0, max_tokens = 0;  // rows: recv_x's (a budget's tail has src -1)
  const long long* layout = nullptr;                  // layout_word: source_begin
  const void* y = nullptr;        // [rows, H] bf16
  const float* grad_w = nullptr;  // [rows, k] or null
  const int* src = nullptr;       // this rank's window: the source token of each row
  WindowLayout win{};
  OpControl* op = nullptr;
  int kind = kCombine;
  int failed_arg = 0;  // FailedArg: this rank's checks failed, nothing is sent, the peers learn why
};
void launch_send_partials(const SendPartialsCall& c, int ctas, cudaStream_t stream);

// The source: waits for every rank's flag of `kind`, then out[t] = the sum over ranks d, ascending,
// of part[d][t] where dest_row[d * T + t] >= 0, in fp32, rounded to bf16 once; with grad_w,
// grad_w[t * k + j] = part_w[owner][t][j] for the slots whose owner kept the token, else 0. For d =
// this rank the row is own_rows[dest_row[d * T + t]] (and own_grad_w's), the sender's input.
// A source whose checks failed (abort words) makes the receiver report Status abort with the
// phase, that rank and its FailedArg (as `value`) and write nothing.
struct ReduceCall {
  const unsigned* flags = nullptr;
  int rank = 0, ranks = 0, kind = kCombine, k = 0, local_experts = 0;
  const OpControl* op = nullptr;
  Status* status = nullptr;
  unsigned long long timeout_ns = 0;
  Phase phase = Phase::combine_partials;
  const char* window = nullptr;  // this rank's window
  WindowLayout win{};
  std::int64_t tokens = 0, hidden = 0, max_tokens = 0;
  const int* dest_row = nullptr;     // [R * T]
  const int* slot_expert = nullptr;  // [T * k]
  void* out = nullptr;               // [T, H] bf16
  float* grad_w = nullptr;           // [T, k] or null
  const void* own_rows = nullptr;     // [N, H] bf16: the rows this rank sent back (SendPartialsCall::y)
  const float* own_grad_w = nullptr;  // [N, k]: their weight gradients (with grad_w)
};
void launch_reduce(const ReduceCall& c, int ctas, cudaStream_t stream);

// The expert-major layout on this rank, from the rank-major rows (no communication):
// out[p] = rows[index[p]] for every entry p, a zero row where index[p] = -1. One warp per entry.
// Rows of row_bytes (a multiple of 16: bf16 or e4m3 rows), and FP8 scales of scale_cols floats.
void launch_gather_rows(const void* rows, const int* index, std::int64_t entries, long long row_bytes, void* out,
                        cudaStream_t stream);
void launch_gather_scales(const float* scales, const int* index, std::int64_t entries, int scale_cols, float* out,
                          cudaStream_t stream);

// Level 1 of the combine (docs/semantics.md, "Combine"): out[r] = the sum of entries[row_order[r *
// k + n]] over n in order (ascending local expert) until -1, in fp32, rounded to bf16 once. With
// grad_w, also grad_w[r * k + j] = grad_probs[slot_pos[r * k + j]] (0 where -1; grad_probs may be
// null when there are no entries). One warp per row.
// With a budget call's layout, rows at or past layout[received] are left alone (never read).
struct SumRowsCall {
  const void* entries = nullptr;  // [M, H] bf16
  const int* row_order = nullptr;  // [rows * k]
  const long long* layout = nullptr;  // budget: layout_word
  std::int64_t rows = 0, hidden = 0;
  int k = 0;
  void* out = nullptr;               // [rows, H] bf16
  const float* grad_probs = nullptr;  // [M] (null when M = 0)
  const int* slot_pos = nullptr;      // [rows * k]
  float* grad_w = nullptr;            // [rows * k], or null: no weight gradients
};
void launch_sum_rows(const SumRowsCall& c, cudaStream_t stream);

}  // namespace flexep::deepep
