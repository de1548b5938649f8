#include "dispatch/common/call_signature.h"


namespace flexep::call_signature {

namespace {
std::string mode_name(DispatchMode m) { return m == DispatchMode::budget ? "budget" : "blocking"; }
std::string overflow_name(OverflowPolicy p) { return p == OverflowPolicy::drop ? "drop" : "error"; }
std::string form_name(bool multihot) {
  return multihot ? "the multihot form (routing_map, probs)" : "the top-k form (indices, weights)";
}
std::string num(const char* name, std::int64_t v) { return std::string(name) + "=" + std::to_string(v); }

// First rank whose `key` differs from rank 0's, or -1.
template <class Key>
int first_different(const std::vector<CallSignature>& h, Key key) {
  for (std::size_t r = 1; r < h.size(); ++r)
    if (key(h[r]) != key(h[0])) return static_cast<int>(r);
  return -1;
}
}  // namespace

void set_call(CallSignature& s, int experts, bool multihot, std::int64_t hidden, std::int64_t topk,
              const DispatchOptions& options, std::int64_t tokens) {
  s.experts = experts;
  s.multihot = multihot;
  s.hidden = hidden;
  s.topk = topk;
  s.mode = options.mode;
  s.pad_multiple = options.pad_multiple;
  s.budget_rows = options.budget_rows;
  s.overflow = options.overflow;
  s.layout = options.layout;
  s.tokens = tokens;
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

std::exception_ptr compare_headers(const std::vector<CallSignature>& h) {
  const CallSignature& h0 = h[0];
  int r = -1;
  auto fail = [&](const std::string& arg, const std::string& what_r, const std::string& what_0,
                  const std::string& rule) {
    return std::make_exception_ptr(
        ArgumentError(arg, detail::concat("rank ", r, " has ", what_r, " but rank 0 has ", what_0, "; all ranks must ", rule)));
  };
  if ((r = first_different(h, [](const auto& x) { return x.experts; })) >= 0)
    return fail("num_experts", num("E", h[r].experts), num("E", h0.experts),
                "create their dispatcher with the same num_experts");
  if ((r = first_different(h, [](const auto& x) { return x.multihot; })) >= 0)
    return fail("routing_map", form_name(h[r].multihot), form_name(h0.multihot), "use the same routing form");
  if ((r = first_different(h, [](const auto& x) { return x.hidden; })) >= 0)
    return fail("hidden", num("H", h[r].hidden), num("H", h0.hidden), "pass the same hidden size");
  if ((r = first_different(h, [](const auto& x) { return x.hidden_dtype; })) >= 0)
    return fail("hidden", "dtype " + std::string(dtype_name(h[r].hidden_dtype)),
                "dtype " + std::string(dtype_name(h0.hidden_dtype)), "pass hidden states of the same dtype");
  if ((r = first_different(h, [](const auto& x) { return x.fp8; })) >= 0) {  // never in the alltoall backend
    auto fmt = [](bool fp8) { return std::string(fp8 ? "FP8 (dispatch_fp8)" : "bf16 (dispatch)"); };
    return fail("hidden", fmt(h[r].fp8) + " rows", fmt(h0.fp8) + " rows", "dispatch rows of the same format");
  }
  if (!h0.multihot && (r = first_different(h, [](const auto& x) { return x.topk; })) >= 0)
    return fail("indices", num("k", h[r].topk), num("k", h0.topk), "route every token to the same top-k");
  if ((r = first_different(h, [](const auto& x) { return x.weight_dtype; })) >= 0)
    return fail(h0.multihot ? "probs" : "weights", "dtype " + std::string(dtype_name(h[r].weight_dtype)),
                "dtype " + std::string(dtype_name(h0.weight_dtype)), "pass routing weights of the same dtype");
  if ((r = first_different(h, [](const auto& x) { return x.layout; })) >= 0) {
    auto name = [](DispatchLayout l) { return std::string(l == DispatchLayout::rank_major ? "rank_major" : "expert_major"); };
    return fail("options.layout", "layout " + name(h[r].layout), "layout " + name(h0.layout),
                "dispatch into the same layout");
  }
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

std::string index_violation(const CallSignature& h) {
  if (h.device_value >= -1 && h.device_value < h.device_limit)
    return detail::concat("token ", h.device_row, " lists expert ", h.device_value,
                          " twice; each expert may appear once per token");
  return detail::concat("value ", h.device_value, " at [", h.device_row, ", ", h.device_column,
                        "] is out of range; allowed: -1 (no expert) <= id < ", h.device_limit);
}

std::exception_ptr peer_failure(const std::vector<CallSignature>& headers, int me, DescribeViolation describe) {
  for (std::size_t r = 0; r < headers.size(); ++r) {
    const CallSignature& h = headers[r];
    if (static_cast<int>(r) == me || (!h.failed && h.device_arg == 0)) continue;
    const std::string who =
        "rank " + std::to_string(r) + " failed its checks, so this collective call stops on every rank: ";
    if (h.failed) {
      if (h.argument.empty())
        return std::make_exception_ptr(Error("flexep: " + who + "see the error raised on rank " + std::to_string(r)));
      return std::make_exception_ptr(
          ArgumentError(h.argument, who + "see the error raised on rank " + std::to_string(r)));
    }
    const DeviceViolation v = describe(h);
    return std::make_exception_ptr(ArgumentError(v.argument, who + "dispatch: " + v.message));
  }
  return nullptr;
}

}  // namespace flexep::call_signature
