#include "flexep/core/synthetic_routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "flexep/core/random.h"

namespace flexep {

RoutingKind parse_routing(std::string_view s, const std::string& arg) {
  if (s == "uniform") return RoutingKind::uniform;
  if (s == "zipf") return RoutingKind::zipf;
  if (s == "hot") return RoutingKind::hot;
  throw_argument_error(arg, "'", s, "' is not a routing; allowed: uniform, zipf, hot");
}

std::string_view to_string(RoutingKind k) {
  switch (k) {
    case RoutingKind::uniform: return "uniform";
    case RoutingKind::zipf: return "zipf";
    case RoutingKind::hot: return "hot";
  }
  return "?";
}

TopK synthetic_topk(std::int64_t tokens, int topk, int experts, const RoutingSpec& spec, std::uint64_t seed,
                    int rank, std::int64_t first_token) {
  FLEXEP_CHECK_ARG(tokens >= 0, "tokens", "must be >= 0, got ", tokens);
  FLEXEP_CHECK_ARG(first_token >= 0, "first_token", "must be >= 0, got ", first_token);
  FLEXEP_CHECK_ARG(experts >= 1, "experts", "must be >= 1, got ", experts);
  FLEXEP_CHECK_ARG(topk >= 1 && topk <= experts, "topk", topk, " is out of range; allowed: 1 <= topk <= ", experts);
  FLEXEP_CHECK_ARG(spec.kind != RoutingKind::zipf || (spec.zipf_s >= 0 && std::isfinite(spec.zipf_s)), "zipf_s",
                   "must be finite and >= 0, got ", spec.zipf_s);
  FLEXEP_CHECK_ARG(spec.kind != RoutingKind::hot || (spec.hot_expert >= 0 && spec.hot_expert < experts),
                   "hot_expert", spec.hot_expert, " is out of range [0, ", experts, ")");
  TopK out{Tensor::empty({tokens, topk}, DType::i64), Tensor::empty({tokens, topk}, DType::f32)};
  const std::uint64_t stream = splitmix64(stream_id("synthetic_routing") + static_cast<std::uint64_t>(rank));
  std::vector<double> log_pop(static_cast<std::size_t>(experts), 0.0);
  if (spec.kind == RoutingKind::zipf)
    for (int e = 0; e < experts; ++e) log_pop[static_cast<std::size_t>(e)] = -spec.zipf_s * std::log(e + 1.0);
  std::vector<std::pair<double, int>> keys(static_cast<std::size_t>(experts));
  // Gumbel top-k: k distinct experts sampled proportionally to their popularity. With equal
  // popularities (uniform, hot) the key -log(-log(u)) is strictly increasing in u, so u itself
  // orders the experts the same way, without the two logarithms per expert; and u is increasing
  // in its 53 random bits, so those order them too: for k up to kFastTopk the experts are kept in
  // a small sorted array as they are drawn (larger bits first, the lower id on a tie, as the pairs'
  // sort does), with no key array and no sort: `flexep plan` at EP1024 spends most of its time here.
  constexpr int kFastTopk = 32;
  const bool equal_popularity = spec.kind != RoutingKind::zipf;
  const bool fast = equal_popularity && topk <= kFastTopk;
  const std::uint64_t key0 = uniform01_key(seed, stream);
  std::uint64_t best_bits[kFastTopk];
  int best_e[kFastTopk];
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::uint64_t base = static_cast<std::uint64_t>(first_token + t) * static_cast<std::uint64_t>(experts + topk);
    if (fast) {
      int n = 0;
      for (int e = 0; e < experts; ++e) {
        const std::uint64_t bits = spec.kind == RoutingKind::hot && e == spec.hot_expert
                                       ? ~std::uint64_t{0}  // above every draw (53 bits)
                                       : uniform01_bits(key0, base + static_cast<std::uint64_t>(e));
        if (n == topk && bits <= best_bits[topk - 1]) continue;  // ties keep the lower id, drawn first
        int i = n < topk ? n++ : topk - 1;
        for (; i > 0 && best_bits[i - 1] < bits; --i) best_bits[i] = best_bits[i - 1], best_e[i] = best_e[i - 1];
        best_bits[i] = bits;
        best_e[i] = e;
      }
      for (int j = 0; j < topk; ++j) keys[static_cast<std::size_t>(j)].second = best_e[j];
    } else {
      for (int e = 0; e < experts; ++e) {
        const double u = uniform01(seed, stream, base + static_cast<std::uint64_t>(e)) + 1e-300;
        double key = equal_popularity ? u : log_pop[static_cast<std::size_t>(e)] - std::log(-std::log(u));
        if (spec.kind == RoutingKind::hot && e == spec.hot_expert) key = HUGE_VAL;
        keys[static_cast<std::size_t>(e)] = {-key, e};
      }
      std::partial_sort(keys.begin(), keys.begin() + topk, keys.end());
    }
    double sum = 0;
    std::vector<double> w(static_cast<std::size_t>(topk));
    for (int j = 0; j < topk; ++j) {
      w[static_cast<std::size_t>(j)] =
          0.5 + uniform01(seed, stream, base + static_cast<std::uint64_t>(experts + j));
      sum += w[static_cast<std::size_t>(j)];
    }
    for (int j = 0; j < topk; ++j) {
      out.indices.data<std::int64_t>()[t * topk + j] = keys[static_cast<std::size_t>(j)].second;
      out.weights.data<float>()[t * topk + j] = static_cast<float>(w[static_cast<std::size_t>(j)] / sum);
    }
  }
  return out;
}

}  // namespace flexep
