#include "dispatch/alltoall/layout.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <sstream>

#include "flexep/core/error.h"

namespace flexep::alltoall {

namespace {
std::string mode_name(DispatchMode m) { return m == DispatchMode::budget ? "budget" : "blocking"; }
std::string overflow_name(OverflowPolicy p) { return p == OverflowPolicy::drop ? "drop" : "error"; }
std::string form_name(bool multihot) {
  return multihot ? "the multihot form (routing_map, probs)" : "the top-k form (indices, weights)";
}
std::string num(const char* name, std::int64_t v) { return std::string(name) + "=" + std::to_string(v); }

// Names of the DeviceArg codes the kernels may report (flexep/cuda/device_errors.h).
std::string device_arg_name(int arg) {
  switch (arg) {
    case 2: return "routing_map";
    case 3: return "tokens_per_expert";
    case 4: return "budget_rows";
    default: return "indices";
  }
}

template <class Key>
int first_different(const std::vector<RankHeader>& h, Key key) {
  for (std::size_t r = 1; r < h.size(); ++r)
    if (key(h[r]) != key(h[0])) return static_cast<int>(r);
  return -1;
}
}  // namespace

std::vector<std::int64_t> encode(const RankHeader& h) {
  std::vector<std::int64_t> w(word::count, 0);
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
  return w;
}

RankHeader decode(const std::int64_t* w) {
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
  return h;
}

Exchange parse_exchange(const std::vector<std::int64_t>& gathered, int ranks, int experts) {
  const std::int64_t P = payload_words(experts, ranks);
  FLEXEP_CHECK(static_cast<std::int64_t>(gathered.size()) == P * ranks, "alltoall count exchange: got ",
               gathered.size(), " words, expected ", P * ranks);
  Exchange ex;
  for (int s = 0; s < ranks; ++s) {
    const std::int64_t* p = gathered.data() + s * P;
    ex.headers.push_back(decode(p));
    ex.counts.insert(ex.counts.end(), p + word::count, p + word::count + experts);
    ex.dest.insert(ex.dest.end(), p + word::count + experts, p + P);
  }
  return ex;
}

std::exception_ptr peer_failure(const Exchange& ex, int me) {
  for (std::size_t r = 0; r < ex.headers.size(); ++r) {
    const RankHeader& h = ex.headers[r];
    if (static_cast<int>(r) == me || (!h.failed && h.device_arg == 0)) continue;
    const std::string who =
        "rank " + std::to_string(r) + " failed its checks, so this collective call stops on every rank: ";
    if (h.failed) {
      if (h.argument.empty())
        return std::make_exception_ptr(Error("flexep: " + who + "see the error raised on rank " + std::to_string(r)));
      return std::make_exception_ptr(
          ArgumentError(h.argument, who + "see the error raised on rank " + std::to_string(r)));
    }
    std::ostringstream os;
    os << who << "dispatch: ";
    if (h.device_value >= -1 && h.device_value < h.device_limit)
      os << "token " << h.device_row << " lists expert " << h.device_value
         << " twice; each expert may appear once per token";
    else
      os << "value " << h.device_value << " at [" << h.device_row << ", " << h.device_column
         << "] is out of range; allowed: -1 (no expert) <= id < " << h.device_limit;
    return std::make_exception_ptr(ArgumentError(device_arg_name(h.device_arg), os.str()));
  }
  return nullptr;
}

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

PlanParams plan_params(const DispatchOptions& o, int ranks, int experts) {
  PlanParams p;
  p.ranks = ranks;
  p.experts = experts;
  p.pad_multiple = o.pad_multiple;
  if (o.mode == DispatchMode::budget) p.budget_rows = o.budget_rows;
  p.overflow = o.overflow;
  return p;
}

RankPlan rank_plan(const DispatchPlan& plan, const Exchange& ex, int me) {
  const int R = plan.params.ranks, E = plan.params.experts, L = plan.params.local_experts();
  const RankLayout& lay = plan.ranks.at(static_cast<std::size_t>(me));
  RankPlan rp;
  rp.out_rows = lay.out_rows;
  rp.dropped = lay.dropped;
  rp.tokens_per_expert = lay.tokens_per_expert;
  rp.expert_begin = lay.expert_begin;
  rp.kept_rows = lay.kept_rows;
  rp.pairs_before.assign(static_cast<std::size_t>(L), 0);
  std::int64_t before = 0;
  for (int e = 0; e < L; ++e) {
    rp.pairs_before[static_cast<std::size_t>(e)] = before;
    for (int s = 0; s < R; ++s) before += ex.counts[static_cast<std::size_t>(s) * E + me * L + e];
  }
  rp.send_count.assign(static_cast<std::size_t>(R), 0);
  rp.send_offset.assign(static_cast<std::size_t>(R), 0);
  rp.recv_count.assign(static_cast<std::size_t>(R), 0);
  rp.recv_offset.assign(static_cast<std::size_t>(R), 0);
  for (int p = 0; p < R; ++p) {
    const auto i = static_cast<std::size_t>(p);
    rp.send_count[i] = ex.dest[static_cast<std::size_t>(me) * R + i];
    rp.recv_count[i] = ex.dest[i * R + static_cast<std::size_t>(me)];
    rp.send_offset[i] = rp.total_send;
    rp.recv_offset[i] = rp.total_recv;
    rp.total_send += rp.send_count[i];
    rp.total_recv += rp.recv_count[i];
  }
  return rp;
}

void check_index_range(const DispatchPlan& plan, const Exchange& ex, int meta_width) {
  const int R = plan.params.ranks, L = plan.params.local_experts();
  for (int r = 0; r < R; ++r) {
    std::int64_t sent = 0, received = 0;
    for (int p = 0; p < R; ++p) {
      sent += ex.dest[static_cast<std::size_t>(r) * R + p];
      received += ex.dest[static_cast<std::size_t>(p) * R + r];
    }
    const std::int64_t rows = plan.ranks[static_cast<std::size_t>(r)].out_rows;
    const std::int64_t most = std::max({sent * meta_width, received * meta_width, received * L, rows});
    FLEXEP_CHECK(most <= INT_MAX, "alltoall dispatch: rank ", r, " would send ", sent, " and receive ", received,
                 " token rows (", meta_width, " metadata entries each, ", L, " local experts, ", rows,
                 " output rows); this backend indexes them with 32-bit integers (at most ", INT_MAX,
                 "): dispatch fewer tokens per call");
  }
}

}  // namespace flexep::alltoall
