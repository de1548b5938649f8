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

namespace flexep {

struct GateSaved {
  std::int64_t tokens = 0;
  int dim = 0, experts = 0, topk = 0;
  DType x_dtype = DType::f32;
  ScoreFunc score_func = ScoreFunc::softmax;
  bool softmax_before_topk = false;
  bool normalized = false;  // norm_topk_prob with k > 1: weights and original_scores divided by their sums
  double route_scale = 1.0;

  std::vector<double> x;                // [T, dim] as used for the logits (rounded to the gate precision)
  std::vector<double> weight;           // [E, dim] snapshot used for the logits
  std::vector<std::int64_t> indices;    // [T, k]
  std::vector<double> topk_scores;      // [T, k] weights before normalisation and route_scale
  std::vector<double> scores;           // [T, E] full softmax or sigmoid (original_scores before normalisation)
  std::vector<unsigned char> mask;      // [T] 1 = valid token

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
