#include "dispatch/host/dispatcher/signature.h"

#include <sstream>
#include <string>

namespace flexep::host {

namespace {
std::string mode_name(DispatchMode m) { return m == DispatchMode::budget ? "budget" : "blocking"; }
std::string overflow_name(OverflowPolicy p) { return p == OverflowPolicy::drop ? "drop" : "error"; }
std::string form_name(bool multihot) {
  return multihot ? "the multihot form (routing_map, probs)" : "the top-k form (indices, weights)";
}

// First rank whose `key` differs from rank 0's, or -1.
template <class Key>
int first_different(const std::vector<const DispatchSignature*>& sigs, Key key) {
  for (std::size_t r = 1; r < sigs.size(); ++r)
    if (key(*sigs[r]) != key(*sigs[0])) return static_cast<int>(r);
  return -1;
}
}  // namespace

std::exception_ptr compare_signatures(const std::vector<const DispatchSignature*>& sigs) {
  const DispatchSignature& s0 = *sigs[0];
  int r = -1;
  // One check per field, in the order a user would fix them; `fail` formats "<name>=<value>".
  auto fail = [&](const std::string& arg, const std::string& what_r, const std::string& what_0,
                  const std::string& rule) {
    std::ostringstream os;
    os << "rank " << r << " has " << what_r << " but rank 0 has " << what_0 << "; all ranks must " << rule;
    return std::make_exception_ptr(ArgumentError(arg, os.str()));
  };
  auto num = [](const char* name, std::int64_t v) { return std::string(name) + "=" + std::to_string(v); };
  if ((r = first_different(sigs, [](const auto& s) { return s.experts; })) >= 0)
    return fail("num_experts", num("E", sigs[r]->experts), num("E", s0.experts),
                "create their dispatcher with the same num_experts");
  if ((r = first_different(sigs, [](const auto& s) { return s.multihot; })) >= 0)
    return fail("routing_map", form_name(sigs[r]->multihot), form_name(s0.multihot), "use the same routing form");
  if ((r = first_different(sigs, [](const auto& s) { return s.hidden; })) >= 0)
    return fail("hidden", num("H", sigs[r]->hidden), num("H", s0.hidden), "pass the same hidden size");
  if ((r = first_different(sigs, [](const auto& s) { return s.hidden_dtype; })) >= 0)
    return fail("hidden", "dtype " + std::string(dtype_name(sigs[r]->hidden_dtype)),
                "dtype " + std::string(dtype_name(s0.hidden_dtype)), "pass hidden states of the same dtype");
  if (!s0.multihot && (r = first_different(sigs, [](const auto& s) { return s.topk; })) >= 0)
    return fail("indices", num("k", sigs[r]->topk), num("k", s0.topk), "route every token to the same top-k");
  const std::string warg = s0.multihot ? "probs" : "weights";
  if ((r = first_different(sigs, [](const auto& s) { return s.weight_dtype; })) >= 0)
    return fail(warg, "dtype " + std::string(dtype_name(sigs[r]->weight_dtype)),
                "dtype " + std::string(dtype_name(s0.weight_dtype)), "pass routing weights of the same dtype");
  if ((r = first_different(sigs, [](const auto& s) { return s.mode; })) >= 0)
    return fail("options.mode", mode_name(sigs[r]->mode), mode_name(s0.mode), "dispatch in the same mode");
  if ((r = first_different(sigs, [](const auto& s) { return s.pad_multiple; })) >= 0)
    return fail("options.pad_multiple", num("pad_multiple", sigs[r]->pad_multiple),
                num("pad_multiple", s0.pad_multiple), "pad expert groups to the same multiple");
  if (s0.mode == DispatchMode::budget) {
    if ((r = first_different(sigs, [](const auto& s) { return s.budget_rows; })) >= 0)
      return fail("options.budget_rows", num("budget_rows", sigs[r]->budget_rows), num("budget_rows", s0.budget_rows),
                  "use the same budget");
    if ((r = first_different(sigs, [](const auto& s) { return s.overflow; })) >= 0)
      return fail("options.overflow", overflow_name(sigs[r]->overflow), overflow_name(s0.overflow),
                  "use the same overflow policy");
  }
  return nullptr;
}

}  // namespace flexep::host
