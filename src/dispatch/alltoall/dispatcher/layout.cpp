#include "dispatch/alltoall/dispatcher/layout.h"

#include <algorithm>
#include <climits>

#include "flexep/core/error.h"

namespace flexep::alltoall {

namespace {
// Names of the DeviceArg codes the kernels may report (flexep/cuda/device_errors.h).
std::string device_arg_name(int arg) {
  switch (arg) {
    case 2: return "routing_map";
    case 3: return "tokens_per_expert";
    case 4: return "budget_rows";
    default: return "indices";
  }
}

call_signature::DeviceViolation describe_violation(const RankHeader& h) {
  return {device_arg_name(h.device_arg), call_signature::index_violation(h)};
}
}  // namespace

std::vector<std::int64_t> encode(const RankHeader& h) {
  std::vector<std::int64_t> w(word::count, 0);
  call_signature::encode_words(h, w.data());
  return w;
}

RankHeader decode(const std::int64_t* w) { return call_signature::decode_words(w); }

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
  return call_signature::peer_failure(ex.headers, me, describe_violation);
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
