#include "dispatch/hybridep/dispatcher/layout.h"

#include <algorithm>
#include <climits>

#include "dispatch/hybridep/kernels/chunk_plan_math.h"
#include "flexep/core/error.h"

namespace flexep::hybridep {

namespace {
// The message of a device-side argument violation (cuda::DeviceArg 1 = indices, 2 = routing_map),
// the same words as cuda::DeviceErrors::check.
std::string device_violation(const RankHeader& h) {
  if (h.device_arg != 2) return call_signature::index_violation(h);
  return detail::concat("token ", h.device_row, " routes to ", h.device_value, " experts, more than the ",
                        h.device_limit, " slots per token the hybridep buffers hold (HybridEpOptions::max_topk)");
}
std::string device_arg_name(int arg) { return arg == 2 ? "routing_map" : "indices"; }

call_signature::DeviceViolation describe_violation(const RankHeader& h) {
  return {device_arg_name(h.device_arg), device_violation(h)};
}
}  // namespace

BufferConfig make_buffer_config(int ranks, int experts, std::int64_t max_tokens, std::int64_t hidden, int max_topk,
                                std::int64_t max_recv_rows, std::int64_t max_pad_multiple, bool fp8) {
  FLEXEP_CHECK_ARG(ranks >= 1 && ranks <= kMaxRanks, "comm", "hybridep handles 1 to ", kMaxRanks,
                   " ranks in one NVLink domain, got ", ranks);
  FLEXEP_CHECK_ARG(experts >= 1 && experts % ranks == 0, "num_experts", experts, " must be >= 1 and divisible by the ",
                   ranks, " ranks");
  FLEXEP_CHECK_ARG(experts / ranks <= 1024, "num_experts", "hybridep handles at most 1024 experts per rank, got ",
                   experts / ranks);
  FLEXEP_CHECK_ARG(experts <= kMaxExperts, "num_experts", "hybridep handles at most ", kMaxExperts,
                   " experts in all (its preprocess kernel keeps 40 bytes per expert in shared memory), got ", experts);
  FLEXEP_CHECK_ARG(max_tokens >= 1 && max_tokens <= INT_MAX, "max_tokens_per_rank", "must be in [1, 2^31), got ",
                   max_tokens);
  FLEXEP_CHECK_ARG(hidden >= 8 && hidden % 8 == 0 && hidden <= kMaxHidden, "hidden",
                   "must be a multiple of 8 (rows move as 16-byte vectors) in [8, ", kMaxHidden,
                   "] (the combine kernel holds a row in one ring stage), got ", hidden);
  // FP8 rows: H e4m3 bytes and H / 128 fp32 scales, both moved as 16-byte words.
  FLEXEP_CHECK_ARG(!fp8 || hidden % (4 * kFp8ScaleBlock) == 0, "hidden",
                   "must be a multiple of 512 for FP8 dispatch (e4m3 rows and one fp32 scale per 128 elements move "
                   "as 16-byte vectors), got ",
                   hidden);
  FLEXEP_CHECK_ARG(max_topk >= 0 && max_topk <= 1024, "max_topk", "must be in [0, 1024] (0 = num_experts), got ",
                   max_topk);
  FLEXEP_CHECK_ARG(max_recv_rows >= 0, "max_recv_rows", "must be >= 0 (0 = the worst case), got ", max_recv_rows);
  FLEXEP_CHECK_ARG(max_pad_multiple >= 1 && max_pad_multiple <= (1 << 20), "max_pad_multiple",
                   "must be in [1, 2^20], got ", max_pad_multiple);
  BufferConfig c;
  c.ranks = ranks;
  c.experts = experts;
  c.max_tokens = max_tokens;
  c.hidden = hidden;
  c.slots = max_topk > 0 ? max_topk : std::min(experts, 1024);
  c.max_pad_multiple = max_pad_multiple;
  c.fp8 = fp8;
  FLEXEP_CHECK_ARG(max_tokens * c.slots <= INT_MAX, "max_tokens_per_rank", max_tokens, " tokens * ", c.slots,
                   " slots exceed the 2^31 - 1 pairs the single-GPU plan indexes; lower max_tokens_per_rank or set "
                   "max_topk");
  const std::int64_t worst = static_cast<std::int64_t>(ranks) * max_tokens * c.width() +
                             static_cast<std::int64_t>(c.local_experts()) * (max_pad_multiple - 1);
  c.capacity_rows = max_recv_rows > 0 ? max_recv_rows : worst;
  FLEXEP_CHECK_ARG(c.capacity_rows <= INT_MAX, "max_recv_rows", c.capacity_rows,
                   " rows exceed the 2^31 - 1 rows the kernels index; set max_recv_rows (or max_topk) lower");
  return c;
}

std::vector<long long> config_words(const BufferConfig& c) {
  return {c.ranks, c.experts, c.max_tokens, c.hidden, c.slots, c.capacity_rows, c.max_pad_multiple, c.fp8 ? 1 : 0};
}

DispatchGeometry dispatch_geometry(const BufferConfig& c) {
  DispatchGeometry g;
  g.cfg = c;
  const auto R = static_cast<std::size_t>(c.ranks), E = static_cast<std::size_t>(c.experts);
  const auto L = static_cast<std::size_t>(c.local_experts()), T = static_cast<std::size_t>(c.max_tokens);
  g.width = c.width();
  g.record_bytes = record_bytes(g.width);
  g.max_chunks = c.max_chunks();
  g.max_pairs = c.max_tokens * c.slots;
  const auto pairs = static_cast<std::size_t>(g.max_pairs);
  const auto rec = static_cast<std::size_t>(g.record_bytes);
  const auto cap = static_cast<std::size_t>(c.capacity_rows);

  g.slot_words = static_cast<std::size_t>(word::count) + E;  // the values (the abort snapshot's stride: slot_bytes)
  g.slot_bytes = align_up(static_cast<std::size_t>(ll_slot_words(static_cast<int>(E))) * 8, 128);  // as written
  g.off_counts = 0;
  g.off_records = align_up(g.off_counts + R * g.slot_bytes);
  g.off_probs = align_up(g.off_records + R * T * rec);
  g.off_tokens = align_up(g.off_probs + cap * 4);
  g.off_scales = align_up(g.off_tokens + cap * static_cast<std::size_t>(c.hidden) * 2);
  const std::size_t scale_bytes = c.fp8 ? cap * static_cast<std::size_t>(c.hidden / kFp8ScaleBlock) * 4 : 0;
  g.window_bytes = align_up(g.off_scales + scale_bytes, 4096);

  g.flag_bytes = align_up(R * static_cast<std::size_t>(g.max_chunks) * 4, 128);

  std::size_t at = 0;
  auto take = [&](std::size_t bytes) {
    const std::size_t off = at;
    at = align_up(at + bytes);
    return off;
  };
  g.off_control = take(sizeof(DispatchControl) + L * 8);
  g.off_tpe = g.off_control + sizeof(DispatchControl);
  g.off_begin = take(L * 8);
  g.off_kept = take(L * 8);
  g.off_snapshot = take(R * g.slot_bytes);  // a copy of the count region
  g.off_staging = take(R * T * rec);
  g.off_slot_entry = take(pairs * 4);
  g.off_slot_expert = take(pairs * 4);
  g.off_slot_weight = take(pairs * 4);
  g.off_work = take((2 + static_cast<std::size_t>(g.max_chunks)) * 4);
  g.off_plan_counts = take(E * 8);
  g.off_plan_slot_rows = take(pairs * 4);
  g.off_plan_chunk_base = take(static_cast<std::size_t>(plan_chunks(c.max_tokens)) * E * 4);
  g.off_plan_done = take(4);
  g.local_bytes = at;
  return g;
}

CombineGeometry combine_geometry(const BufferConfig& c) {
  CombineGeometry g;
  g.cfg = c;
  const auto R = static_cast<std::size_t>(c.ranks), T = static_cast<std::size_t>(c.max_tokens);
  g.width = c.width();
  g.max_chunks = c.max_chunks();
  g.off_partials = 0;
  g.off_grads = align_up(R * T * static_cast<std::size_t>(c.hidden) * 2);
  g.window_bytes = align_up(g.off_grads + R * T * static_cast<std::size_t>(g.width) * 4, 4096);
  g.flag_ready = 0;
  g.flag_consumed = R * static_cast<std::size_t>(g.max_chunks);
  g.flag_abort = g.flag_consumed + R;
  g.flag_abort_arg = g.flag_abort + R;
  g.flag_bytes = align_up((g.flag_abort_arg + R) * 4, 128);
  g.off_control = 0;
  g.off_work = align_up(sizeof(OpControl));
  g.local_bytes = align_up(g.off_work + (2 + R * static_cast<std::size_t>(g.max_chunks)) * 4);
  return g;
}

std::vector<long long> encode(const RankHeader& h) {
  std::vector<long long> w(word::count, 0);
  call_signature::encode_words(h, w.data());
  w[word::fp8] = h.fp8 ? 1 : 0;
  return w;
}

RankHeader decode(const long long* w) {
  RankHeader h = call_signature::decode_words(w);
  h.fp8 = w[word::fp8] != 0;
  return h;
}

Snapshot parse_snapshot(const std::vector<long long>& words, int ranks, int experts, std::size_t slot_words) {
  FLEXEP_CHECK(words.size() >= static_cast<std::size_t>(ranks) * slot_words, "hybridep: snapshot has ", words.size(),
               " words, expected ", static_cast<std::size_t>(ranks) * slot_words);
  FLEXEP_CHECK(slot_words >= static_cast<std::size_t>(word::count + experts), "hybridep: slot of ", slot_words,
               " words cannot hold ", experts, " counts");
  Snapshot s;
  for (int r = 0; r < ranks; ++r) {
    const long long* p = words.data() + static_cast<std::size_t>(r) * slot_words;
    s.headers.push_back(decode(p));
    s.counts.insert(s.counts.end(), p + word::count, p + word::count + experts);
  }
  return s;
}

std::exception_ptr abort_reason(const Snapshot& snap, int me, std::int64_t capacity_rows) {
  const int R = static_cast<int>(snap.headers.size());
  const RankHeader& mine = snap.headers.at(static_cast<std::size_t>(me));
  if (mine.failed) return nullptr;  // raised on this rank when its checks failed
  if (mine.device_arg != 0)
    return std::make_exception_ptr(
        ArgumentError(device_arg_name(mine.device_arg), "dispatch: " + device_violation(mine)));
  if (auto err = call_signature::peer_failure(snap.headers, me, describe_violation)) return err;
  if (auto err = call_signature::compare_headers(snap.headers)) return err;
  const RankHeader& h0 = snap.headers[0];
  PlanParams p;
  p.ranks = R;
  p.experts = h0.experts;
  p.pad_multiple = h0.pad_multiple;
  if (h0.mode == DispatchMode::budget) p.budget_rows = h0.budget_rows;
  p.overflow = h0.overflow;
  DispatchPlan plan;
  try {
    plan = DispatchPlan::build(snap.counts, p);  // throws the overflow error naming the rank
  } catch (...) {
    return std::current_exception();
  }
  for (int r = 0; r < R; ++r) {
    const RankLayout& lay = plan.ranks[static_cast<std::size_t>(r)];
    if (lay.out_rows > capacity_rows)
      return std::make_exception_ptr(Error(detail::concat(
          "flexep: hybridep dispatch: rank ", r, " needs ", lay.out_rows,
          " expert-major rows but the receive buffers hold ", capacity_rows,
          "; raise HybridEpOptions::max_recv_rows (or max_tokens_per_rank / max_topk / max_pad_multiple, which size "
          "the default) on every rank")));
  }
  return std::make_exception_ptr(
      Error("flexep: hybridep dispatch was aborted on the device without a reason in the count exchange (internal "
            "error)"));
}

std::string phase_name(Phase p) {
  switch (p) {
    case Phase::dispatch_counts: return "dispatch:count-exchange";
    case Phase::dispatch_tokens: return "dispatch:tokens";
    case Phase::combine_partials: return "combine:partials";
    case Phase::combine_reuse: return "combine:buffer-reuse";
    case Phase::dispatch_backward_partials: return "dispatch_backward:partials";
    case Phase::dispatch_backward_reuse: return "dispatch_backward:buffer-reuse";
    case Phase::combine_backward_rows: return "combine_backward:rows";
    case Phase::combine_backward_reuse: return "combine_backward:buffer-reuse";
    case Phase::none:
    case Phase::low_latency_dispatch:  // deepep's
    case Phase::low_latency_combine: break;
  }
  return "unknown";
}

std::exception_ptr status_error(const Status& s, int me, double timeout_seconds) {
  const std::string phase = phase_name(static_cast<Phase>(s.phase));
  switch (static_cast<StatusCode>(s.code)) {
    case StatusCode::timeout:
      return std::make_exception_ptr(TimeoutError(
          phase, s.peer,
          detail::concat("rank ", me, " waited ", timeout_seconds, " s on the device for rank ", s.peer,
                         " (it stopped participating, called a different operation, or its GPU stalled; epoch ",
                         s.value, " waited for, ", s.limit, " seen at the deadline); the dispatcher cannot be "
                         "used any more: create a new one")));
    case StatusCode::corrupt:
      return std::make_exception_ptr(
          Error(detail::concat("flexep: hybridep ", phase, ": rank ", me, " received an index ", s.value, " from rank ",
                               s.peer, " outside [0, ", s.limit,
                               "); the ranks disagree about the layout (internal error); the dispatcher cannot "
                               "be used any more")));
    default: return nullptr;
  }
}

}  // namespace flexep::hybridep
