#include "dispatch/hybridep/layout.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>

#include "flexep/core/error.h"

namespace flexep::hybridep {

namespace {
std::string mode_name(DispatchMode m) { return m == DispatchMode::budget ? "budget" : "blocking"; }
std::string overflow_name(OverflowPolicy p) { return p == OverflowPolicy::drop ? "drop" : "error"; }
std::string form_name(bool multihot) {
  return multihot ? "the multihot form (routing_map, probs)" : "the top-k form (indices, weights)";
}
std::string num(const char* name, std::int64_t v) { return std::string(name) + "=" + std::to_string(v); }

template <class Key>
int first_different(const std::vector<RankHeader>& h, Key key) {
  for (std::size_t r = 1; r < h.size(); ++r)
    if (key(h[r]) != key(h[0])) return static_cast<int>(r);
  return -1;
}

// The message of a device-side argument violation (cuda::DeviceArg 1 = indices, 2 = routing_map),
// the same words as cuda::DeviceErrors::check.
std::string device_violation(const RankHeader& h) {
  std::ostringstream os;
  if (h.device_arg == 2) {
    os << "token " << h.device_row << " routes to " << h.device_value << " experts, more than the " << h.device_limit
       << " slots per token the hybridep buffers hold (HybridEpOptions::max_topk)";
  } else if (h.device_value >= -1 && h.device_value < h.device_limit) {
    os << "token " << h.device_row << " lists expert " << h.device_value
       << " twice; each expert may appear once per token";
  } else {
    os << "value " << h.device_value << " at [" << h.device_row << ", " << h.device_column
       << "] is out of range; allowed: -1 (no expert) <= id < " << h.device_limit;
  }
  return os.str();
}
std::string device_arg_name(int arg) { return arg == 2 ? "routing_map" : "indices"; }

std::exception_ptr compare_headers(const std::vector<RankHeader>& h) {
  const RankHeader& h0 = h[0];
  int r = -1;
  auto fail = [&](const std::string& arg, const std::string& what_r, const std::string& what_0,
                  const std::string& rule) {
    std::ostringstream os;
    os << "rank " << r << " has " << what_r << " but rank 0 has " << what_0 << "; all ranks must " << rule;
    return std::make_exception_ptr(ArgumentError(arg, os.str()));
  };
  if ((r = first_different(h, [](const auto& x) { return x.experts; })) >= 0)
    return fail("num_experts", num("E", h[r].experts), num("E", h0.experts),
                "create their dispatcher with the same num_experts");
  if ((r = first_different(h, [](const auto& x) { return x.multihot; })) >= 0)
    return fail("routing_map", form_name(h[r].multihot), form_name(h0.multihot), "use the same routing form");
  if ((r = first_different(h, [](const auto& x) { return x.hidden; })) >= 0)
    return fail("hidden", num("H", h[r].hidden), num("H", h0.hidden), "pass the same hidden size");
  if ((r = first_different(h, [](const auto& x) { return x.fp8; })) >= 0) {
    auto fmt = [](bool fp8) { return std::string(fp8 ? "FP8 (dispatch_fp8)" : "bf16 (dispatch)"); };
    return fail("hidden", fmt(h[r].fp8) + " rows", fmt(h0.fp8) + " rows", "dispatch rows of the same format");
  }
  if (!h0.multihot && (r = first_different(h, [](const auto& x) { return x.topk; })) >= 0)
    return fail("indices", num("k", h[r].topk), num("k", h0.topk), "route every token to the same top-k");
  if ((r = first_different(h, [](const auto& x) { return x.mode; })) >= 0)
    return fail("options.mode", mode_name(h[r].mode), mode_name(h0.mode), "dispatch in the same mode");
  if ((r = first_different(h, [](const auto& x) { return x.pad_multiple; })) >= 0)
    return fail("options.pad_multiple", num("pad_multiple", h[r].pad_multiple), num("pad_multiple", h0.pad_multiple),
                "pad expert groups to the same multiple");
  if (h0.mode == DispatchMode::budget) {
    if ((r = first_different(h, [](const auto& x) { return x.budget_rows; })) >= 0)
      return fail("options.budget_rows", num("budget_rows", h[r].budget_rows), num("budget_rows", h0.budget_rows),
                  "use the same budget");
    if ((r = first_different(h, [](const auto& x) { return x.overflow; })) >= 0)
      return fail("options.overflow", overflow_name(h[r].overflow), overflow_name(h0.overflow),
                  "use the same overflow policy");
  }
  return nullptr;
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
  FLEXEP_CHECK_ARG(max_tokens >= 1 && max_tokens <= INT_MAX, "max_tokens_per_rank", "must be in [1, 2^31), got ",
                   max_tokens);
  FLEXEP_CHECK_ARG(hidden >= 8 && hidden % 8 == 0, "hidden",
                   "must be a positive multiple of 8 (rows move as 16-byte vectors), got ", hidden);
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

DispatchGeometry dispatch_geometry(const BufferConfig& c, std::size_t sort_temp_bytes) {
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

  g.slot_words = static_cast<std::size_t>(word::count) + E;
  g.slot_bytes = align_up(g.slot_words * 8, 128);
  g.off_counts = 0;
  g.off_records = align_up(g.off_counts + R * g.slot_bytes);
  g.off_probs = align_up(g.off_records + R * T * rec);
  g.off_tokens = align_up(g.off_probs + cap * 4);
  g.off_scales = align_up(g.off_tokens + cap * static_cast<std::size_t>(c.hidden) * 2);
  const std::size_t scale_bytes = c.fp8 ? cap * static_cast<std::size_t>(c.hidden / kFp8ScaleBlock) * 4 : 0;
  g.window_bytes = align_up(g.off_scales + scale_bytes, 4096);

  g.flag_counts = 0;
  g.flag_chunks = R;
  g.flag_bytes = align_up((R + R * static_cast<std::size_t>(g.max_chunks)) * 4, 128);

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
  g.off_plan_tpe = take(E * 8);
  g.off_plan_used = take(8);
  g.off_plan_dropped = take(8);
  g.off_plan_begin = take(E * 8);
  g.off_plan_kept = take(E * 8);
  g.off_plan_slot_rows = take(pairs * 4);
  g.off_keys_in = take(pairs * 4);
  g.off_keys_out = take(pairs * 4);
  g.off_pairs_in = take(pairs * 4);
  g.off_pairs_out = take(pairs * 4);
  g.off_sorted_begin = take(E * 8);
  g.sort_temp_bytes = sort_temp_bytes;
  g.off_sort_temp = take(sort_temp_bytes);
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
  g.flag_bytes = align_up((g.flag_consumed + R) * 4, 128);
  g.off_control = 0;
  g.local_bytes = align_up(sizeof(OpControl));
  return g;
}

std::vector<long long> encode(const RankHeader& h) {
  std::vector<long long> w(word::count, 0);
  w[word::status] = h.failed ? 1 : 0;
  char name[8 * word::argument_words] = {};
  std::memcpy(name, h.argument.data(), std::min(h.argument.size(), sizeof name));
  std::memcpy(&w[word::argument], name, sizeof name);
  w[word::device_arg] = h.device_arg;
  w[word::device_row] = h.device_row;
  w[word::device_column] = h.device_column;
  w[word::device_value] = h.device_value;
  w[word::device_limit] = h.device_limit;
  w[word::experts] = h.experts;
  w[word::multihot] = h.multihot ? 1 : 0;
  w[word::hidden] = h.hidden;
  w[word::topk] = h.topk;
  w[word::mode] = h.mode == DispatchMode::budget ? 1 : 0;
  w[word::pad_multiple] = h.pad_multiple;
  w[word::budget_rows] = h.budget_rows;
  w[word::overflow] = h.overflow == OverflowPolicy::drop ? 1 : 0;
  w[word::tokens] = h.tokens;
  w[word::fp8] = h.fp8 ? 1 : 0;
  return w;
}

RankHeader decode(const long long* w) {
  RankHeader h;
  h.failed = w[word::status] != 0;
  char name[8 * word::argument_words + 1] = {};
  std::memcpy(name, &w[word::argument], 8 * word::argument_words);
  h.argument = name;  // stops at the first NUL
  h.device_arg = static_cast<int>(w[word::device_arg]);
  h.device_row = w[word::device_row];
  h.device_column = w[word::device_column];
  h.device_value = w[word::device_value];
  h.device_limit = w[word::device_limit];
  h.experts = static_cast<int>(w[word::experts]);
  h.multihot = w[word::multihot] != 0;
  h.hidden = w[word::hidden];
  h.topk = w[word::topk];
  h.mode = w[word::mode] ? DispatchMode::budget : DispatchMode::blocking;
  h.pad_multiple = w[word::pad_multiple];
  h.budget_rows = w[word::budget_rows];
  h.overflow = w[word::overflow] ? OverflowPolicy::drop : OverflowPolicy::error;
  h.tokens = w[word::tokens];
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
  for (int r = 0; r < R; ++r) {
    const RankHeader& h = snap.headers[static_cast<std::size_t>(r)];
    if (r == me || (!h.failed && h.device_arg == 0)) continue;
    const std::string who =
        "rank " + std::to_string(r) + " failed its checks, so this collective call stops on every rank: ";
    if (h.failed) {
      if (h.argument.empty())
        return std::make_exception_ptr(Error("flexep: " + who + "see the error raised on rank " + std::to_string(r)));
      return std::make_exception_ptr(
          ArgumentError(h.argument, who + "see the error raised on rank " + std::to_string(r)));
    }
    return std::make_exception_ptr(
        ArgumentError(device_arg_name(h.device_arg), who + "dispatch: " + device_violation(h)));
  }
  if (auto err = compare_headers(snap.headers)) return err;
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
    case Phase::none: break;
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
                         " (it stopped participating, called a different operation, or its GPU stalled); the "
                         "dispatcher cannot be used any more: create a new one")));
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
