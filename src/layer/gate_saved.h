// Private to the gate files: what Gate::backward needs from its forward, and the token-mask and
// expert-load helpers that Gate and FakeBalancedGate share.
//
// Saved values are fp64: they were computed in the gate precision (f32 or f64) and widen exactly,
// so backward is one fp64 code path whatever the forward precision, and never reads views that the
// caller may have freed since.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "flexep/core/checks.h"
#include "flexep/core/config.h"
#include "flexep/core/dtype.h"
#include "flexep/core/tensor.h"
#include "core/gate_rules.h"

namespace flexep {

// Roundings (of the logits, of the output weights) are not differentiated: backward is the exact
// derivative of the unrounded formulas at the rounded forward values.
struct GateSaved {
  std::int64_t tokens = 0;
  int dim = 0, experts = 0, topk = 0;
  DType x_dtype = DType::f32;
  gate_rules::ScoreKind kind = gate_rules::ScoreKind::softmax;
  bool topk_then_softmax = false;  // plain softmax: the weights are a softmax over the k selected logits
  bool normalized = false;  // norm_topk_prob with k > 1: weights and original_scores divided by their sums
  double route_scale = 1.0;
  bool in_double = false;  // routed in f64 (x f64 or gate precision f64); else in f32

  std::vector<double> x;                // [T, dim] as used for the logits (cast to the linear's dtype)
  std::vector<std::int64_t> indices;    // [T, k]
  std::vector<double> topk_scores;      // [T, k] weights before normalisation and route_scale
  std::vector<double> scores;           // [T, E] softmax, sigmoid or sqrtsoftplus of the logits
  std::vector<double> original;         // [T, E] original_scores when they are not `scores` (biased
                                        // sigmoid weights), else empty
  std::vector<double> logits;           // [T, E] for sqrtsoftplus (its derivative), else empty
  std::vector<unsigned char> mask;      // [T] 1 = valid token

  // Automodel's original_scores (before their normalisation): what the weights, the aux loss and
  // the normalisation read.
  double original_score(std::size_t i) const { return original.empty() ? scores[i] : original[i]; }

  // Aux loss (set when the forward produced one): dL/d original_scores[t, e] = aux_f_over_ctx[e] * mask_t,
  // with aux_f_over_ctx[e] = f_e / Lctx; the load is a count, so it carries no gradient.
  bool has_aux = false;
  std::vector<double> aux_f_over_ctx;   // [E]
};

// Greedy top-k in torch.topk's order: descending value, and among equal values the lower index first
// (torch leaves that unspecified; we fix it so that every backend routes identically). NaN ranks
// below every number, so a NaN never displaces a real score. `taken` is scratch of any size.
template <class S>
void select_top_k(const S* values, int n, int k, std::int64_t* out, std::vector<unsigned char>& taken) {
  taken.assign(static_cast<std::size_t>(n), 0);
  for (int j = 0; j < k; ++j) {
    int best = -1;
    for (int e = 0; e < n; ++e) {
      if (taken[static_cast<std::size_t>(e)]) continue;
      if (best < 0 || (!std::isnan(values[e]) && (std::isnan(values[best]) || values[e] > values[best]))) best = e;
    }
    taken[static_cast<std::size_t>(best)] = 1;
    out[j] = best;
  }
}

// token_mask [T] bool, or undefined for "every token is valid". Returns 1 for valid tokens.
inline std::vector<unsigned char> read_token_mask(const TensorView& token_mask, std::int64_t tokens) {
  std::vector<unsigned char> valid(static_cast<std::size_t>(tokens), 1);
  if (!token_mask.defined()) return valid;
  check::shape(token_mask, {tokens}, "token_mask");
  check::dtype(token_mask, {DType::b8}, "token_mask");
  check::device(token_mask, Device::cpu(), "token_mask");
  const bool* m = token_mask.ptr<bool>();
  for (std::int64_t t = 0; t < tokens; ++t) valid[static_cast<std::size_t>(t)] = m[t] ? 1 : 0;
  return valid;
}

// load[e] = number of (valid token, slot) pairs routed to e; padding tokens do not count (Automodel).
inline std::vector<std::int64_t> count_expert_load(const std::vector<std::int64_t>& indices,
                                                   const std::vector<unsigned char>& valid, int topk, int experts) {
  std::vector<std::int64_t> load(static_cast<std::size_t>(experts), 0);
  for (std::size_t t = 0; t < valid.size(); ++t) {
    if (!valid[t]) continue;
    for (int j = 0; j < topk; ++j) ++load[static_cast<std::size_t>(indices[t * static_cast<std::size_t>(topk) + j])];
  }
  return load;
}

}  // namespace flexep
