// Private to the router files: the kernel launchers of src/cuda/router_*.cu, callable from host code
// built with g++ (router_cuda.cpp). Every launcher enqueues on `stream` and checks the launch; none
// validates its arguments (router_cuda.cpp does that before calling). A launcher with nothing to do
// (zero rows) launches nothing.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/core/dtype.h"

namespace flexep::cuda::router {

// ---- routing (router_route.cu): one warp per token -------------------------------------------------
enum ScoreKind : int { kSoftmax = 0, kSigmoid = 1, kSqrtSoftplus = 2 };  // gate_rules::ScoreKind

struct RouteParams {
  int experts = 0, topk = 0;
  int groups = 1, limited_groups = 1;  // groups > 1: group-limited selection
  bool top2_group_score = false;       // group score = sum of its top-2 (else its max)
  bool neg_inf_mask = false;           // dropped groups -inf (else multiplied by 0)
  int score = kSoftmax;
  bool topk_then_softmax = false;      // plain softmax: top-k of the logits, softmax over the k
  bool weights_from_biased = false;    // weights (and original scores) = scores + correction bias
  bool normalized = false;             // norm_topk_prob with k > 1
  bool round_logits_bf16 = false;      // logits = bf16(x W^T + bf16(b)): Automodel's bf16 F.linear
  bool round_weights_bf16 = false;     // weights rounded to bf16 (stored in f32)
  double route_scale = 1.0;
};

template <class S>
struct RouteArgs {
  std::int64_t tokens = 0;
  S* logits = nullptr;                   // [T, E] in; the bias (and rounding) applied in place
  const void* bias = nullptr;            // [E] or null
  bool bias_is_bf16 = false;             // else f32
  const float* correction_bias = nullptr;  // [E] or null (selection only)
  const bool* mask = nullptr;            // [T] or null (every token valid)
  const std::int64_t* replay = nullptr;  // [T, k] or null: the selection to use instead of the top-k
  S* scores = nullptr;                   // [T, E] out
  S* topk_scores = nullptr;              // [T, k] out
  float* weights = nullptr;              // [T, k] out
  std::int64_t* indices = nullptr;       // [T, k] out
  std::int64_t* load = nullptr;          // [E], incremented (zero it first)
  S* score_denominator = nullptr;        // [T] out or null: sum_e original scores + 1e-20 (aux normalisation)
};

template <class S>
void launch_route(const RouteParams& p, const RouteArgs<S>& a, cudaStream_t stream);

// ---- fixed-order column sums (router_reduce.cu) ----------------------------------------------------
// Rows are cut into chunks of a size that depends on `rows` only, so results never depend on the
// device or on timing.
struct ColumnChunks {
  int chunks = 0;           // ceil(rows / rows_per_chunk)
  int rows_per_chunk = 0;
};
ColumnChunks column_chunks(std::int64_t rows);

// partial[c, col] = sum over the rows r of chunk c (ascending, fixed tree) of
// (m[r, col] + col_offset[col]) / row_div[r] for the rows with mask[r] (mask, row_div, col_offset:
// null = all rows, no division, no offset), the offset added in S, the rest in double.
// valid_partial[c] (may be null) = number of rows of chunk c with mask[r].
template <class S>
void launch_column_partial_sums(const S* m, const bool* mask, const S* row_div, const float* col_offset,
                                std::int64_t rows, int cols, double* partial, int* valid_partial, cudaStream_t stream);

// Aux loss from the partial column sums of the scores: L = sum_e f_e P_e, f_e = load_e E / (k Lctx),
// P_e = sum_c partial[c, e] / Lctx, Lctx = max(sum_c valid_partial[c], 1). Writes f_over_ctx[e] and
// *loss (double or float). One block; the sums run in a fixed order.
void launch_aux_finish(const double* partial, const int* valid_partial, int chunks, const std::int64_t* load,
                       int experts, int topk, double* f_over_ctx, void* loss, bool loss_is_double,
                       cudaStream_t stream);

// out[col] += sum_c partial[c, col] (ascending c), rounded once to float.
void launch_add_column_sums(const double* partial, int chunks, int cols, float* out, cudaStream_t stream);

// ---- backward (router_backward.cu): one warp per token, fp64 arithmetic ----------------------------
struct BackwardParams {
  int experts = 0, topk = 0;
  int score = kSoftmax;
  bool topk_then_softmax = false, normalized = false;
  double route_scale = 1.0;
  bool aux = false;        // add the aux-loss gradient
  double aux_scale = 0.0;  // aux_loss_coeff * aux_loss_scale
};

template <class S>
struct BackwardArgs {
  std::int64_t tokens = 0;
  const float* grad_weights = nullptr;       // [T, k]
  const std::int64_t* indices = nullptr;     // [T, k] (compared, never used as an address)
  const S* topk_scores = nullptr;            // [T, k]
  const S* scores = nullptr;                 // [T, E]
  const S* logits = nullptr;                 // [T, E], read for sqrtsoftplus
  const float* score_offset = nullptr;       // [E] or null: original scores = scores + offset (aux)
  const bool* mask = nullptr;                // [T] or null
  const double* f_over_ctx = nullptr;        // [E], needed when aux
  S* grad_logits = nullptr;                  // [T, E] out
};

template <class S>
void launch_router_backward(const BackwardParams& p, const BackwardArgs<S>& a, cudaStream_t stream);

// ---- element-wise conversions (router_cast.cu) -----------------------------------------------------
void launch_cast(const bf16* src, float* dst, std::int64_t n, cudaStream_t stream);
void launch_cast(const bf16* src, double* dst, std::int64_t n, cudaStream_t stream);
void launch_cast(const float* src, bf16* dst, std::int64_t n, cudaStream_t stream);
void launch_cast(const double* src, bf16* dst, std::int64_t n, cudaStream_t stream);
void launch_cast(const float* src, double* dst, std::int64_t n, cudaStream_t stream);
void launch_cast(const double* src, float* dst, std::int64_t n, cudaStream_t stream);
// hl [rows, 2 cols] = [hi | lo] with hi = bf16(g), lo = bf16(g - hi): g = hi + lo to ~2^-17 relative.
void launch_split_bf16(const float* g, bf16* hl, std::int64_t rows, int cols, cudaStream_t stream);
// dst[i] = float(dst[i] + src[i]).
void launch_accumulate(const double* src, float* dst, std::int64_t n, cudaStream_t stream);
// dst[i] += src[i] + src[n + i] for i < n: the hi and lo halves of the split's weight gradient.
void launch_accumulate_halves(const float* src, float* dst, std::int64_t n, cudaStream_t stream);

}  // namespace flexep::cuda::router
