// The token dispatcher: one interface, several communication backends (host, alltoall, deepep,
// hybridep). Every backend implements exactly the semantics of docs/semantics.md and core/plan.h; the
// host backend is the oracle the others are tested against.
//
// One TokenDispatcher object serves one rank. A call is collective: every rank of the group calls
// dispatch (and later combine, and the backwards) in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>
#include <string>
#include <string_view>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"

namespace flexep {

enum class DispatchMode { blocking, budget };

// Where a dispatch puts the rows (docs/semantics.md): expert_major, one row per (token, local
// expert) grouped by expert (every backend); rank_major, one row per (token, destination rank),
// DeepEP's layout (core/rank_major.h; the host backend, its oracle, and deepep). rank_major takes
// the top-k form.
enum class DispatchLayout { expert_major, rank_major };

struct DispatchOptions {
  DispatchMode mode = DispatchMode::blocking;
  std::int64_t budget_rows = 0;  // budget mode: output rows on every rank (multiple of pad_multiple)
  OverflowPolicy overflow = OverflowPolicy::error;
  std::int64_t pad_multiple = 1;
  bool check_finite = true;  // CPU reference: reject NaN/Inf in hidden and weights
  DispatchLayout layout = DispatchLayout::expert_major;
  // expert_major: the backend may skip the expert-major copy of the rows. Then `tokens` holds the
  // rows once each and `expert_rows` is the row of `tokens` behind each expert-major row, -1 for
  // padding, for experts that read the rows in place (gather_gemm.h). The single-GPU backend returns
  // the input hidden itself as `tokens` (a view: the caller keeps it alive until the backwards);
  // deepep (blocking mode, bf16) its received rank-major rows, a token once per rank rather than
  // once per local expert. Other backends, and deepep in budget mode or FP8, copy as usual and leave
  // expert_rows undefined.
  bool rows_in_place = false;
};

// One rank's input, in exactly one of the two routing forms.
struct DispatchInput {
  TensorView hidden;   // [T, H]
  TensorView indices;  // top-k form: [T, k] int32/int64, -1 = no expert
  TensorView weights;  // top-k form: [T, k] f32 (f64 on CPU)
  TensorView routing_map;  // multihot form: [T, E] bool
  TensorView probs;        // multihot form: [T, E] f32 (f64 on CPU)
  bool multihot() const { return routing_map.defined(); }
};

// State a dispatch leaves for its combine and the two backwards. Backends derive from it.
class HandleState {
 public:
  virtual ~HandleState() = default;
  std::string backend;
  const void* owner = nullptr;  // the dispatcher that made it
  int rank = 0;
  std::int64_t tokens = 0;      // T on this rank
  std::int64_t topk = 0;        // k (top-k form) or E (multihot form)
  bool multihot = false;
  std::int64_t hidden = 0;      // H
  std::int64_t rows = 0;        // N, rows of the output (expert-major, or recv_x)
  int local_experts = 0;
  DispatchLayout layout = DispatchLayout::expert_major;
  DType hidden_dtype = DType::f32;
  DType prob_dtype = DType::f32;
};
using Handle = std::shared_ptr<const HandleState>;

struct DispatchResult {
  Tensor tokens;             // [N, H], dtype of hidden (rank_major: recv_x)
  Tensor token_probs;        // [N], dtype of the weights (rank_major: empty)
  Tensor tokens_per_expert;  // [E_local] int64: on the host in blocking mode, on the device in budget mode
  std::int64_t dropped = 0;  // pairs dropped on this rank as receiver (blocking / host backends)
  Handle handle;
  // rank_major only (core/rank_major.h):
  Tensor topk_indices;  // recv_topk_idx [N, k] int32: local expert ids, -1 for experts elsewhere
  Tensor topk_weights;  // recv_topk_weights [N, k], dtype of the weights: 0 where -1
  Tensor expert_rows;   // [sum tokens_per_expert] int32 (budget: expert_rows_capacity) rows of
                        // recv_x per local expert, end to end in expert order; -1 = padding.
                        // expert_major with rows_in_place (single-GPU backend, deepep): [N] int32,
                        // the row of `tokens` behind each expert-major row, -1 = padding
};

// An FP8 dispatch (hybridep's and deepep's dispatch_fp8): `dispatch.tokens` [N, H] e4m3 and `scales`
// [N, H / 128] f32, one scale per 128 consecutive elements of a row, moved with it (views of the
// receive window where the bf16 tokens would be views, valid as long); the rest as for a bf16
// dispatch. The handle combines bf16 expert outputs: combine and the backwards stay bf16.
struct Fp8DispatchResult {
  DispatchResult dispatch;
  Tensor scales;
};

struct DispatchGrads {
  Tensor hidden;   // [T, H]
  Tensor weights;  // [T, k] (top-k form) or probs [T, E] (multihot form)
};

class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  virtual std::string_view backend() const = 0;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  virtual int num_experts() const = 0;
  int local_experts() const { return num_experts() / world_size(); }

  virtual DispatchResult dispatch(const DispatchInput& input, const DispatchOptions& options) = 0;
  // expert_out [N, H] -> out [T, H]: the unweighted sum of a token's rows (docs/semantics.md, "Combine").
  // rank_major: one row per received token, already summed over this rank's experts; out sums
  // them over the ranks in ascending rank order.
  virtual Tensor combine(const Handle& handle, const TensorView& expert_out) = 0;
  // grad_tokens [N, H], grad_token_probs [N] -> grads of hidden and of the routing weights.
  // rank_major: grad_token_probs is the gradient of topk_weights, [N, k].
  virtual DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                          const TensorView& grad_token_probs) = 0;
  // grad_out [T, H] -> grad of expert_out [N, H] (the dispatch of grad_out along the handle).
  virtual Tensor combine_backward(const Handle& handle, const TensorView& grad_out) = 0;

  // A new dispatcher of this backend over the same ranks with the same options, its buffers sized
  // for `max_tokens_per_rank` tokens a call (0: as this one's). The MoE layer's chunks
  // (BackendConfig::dispatch_chunks) each dispatch with their own, because on some backends a
  // handle and the rows it received live only until that dispatcher's next dispatch. Collective
  // where the backend's creation is: every rank makes its siblings in the same order. The default
  // refuses, naming backend.dispatch_chunks.
  virtual std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t max_tokens_per_rank) const;
  // The most tokens a rank may pass to one dispatch, where the backend's buffers are sized for it;
  // 0: no such bound (buffers sized per call).
  virtual std::int64_t max_tokens_per_rank() const { return 0; }

 protected:
  // Common handle validation: the handle is not empty and was made by this dispatcher object
  // (HandleState::owner). Throws ArgumentError naming "handle".
  void check_handle(const Handle& handle) const;
  // An argument of combine or a backward must match what the handle recorded: shape [rows, cols]
  // (cols < 0: a 1-D tensor [rows]) and `dtype`. Throws ArgumentError naming `arg`.
  static void check_handle_tensor(const TensorView& t, std::int64_t rows, std::int64_t cols, DType dtype,
                                  const std::string& arg);
};

// A layer's routed path in `chunks` chunks of rows (BackendConfig::dispatch_chunks): chunk c of T
// tokens is rows [chunk_begin(T, c, chunks), chunk_begin(T, c + 1, chunks)).
inline std::int64_t chunk_begin(std::int64_t tokens, int chunk, int chunks) { return tokens * chunk / chunks; }
// Its dispatchers: `first`, then chunks - 1 siblings sized for ceil(T_max / chunks) tokens (the
// most a chunk holds). Collective where the backend's creation is.
std::vector<std::shared_ptr<TokenDispatcher>> make_chunk_dispatchers(std::shared_ptr<TokenDispatcher> first,
                                                                     int chunks);

}  // namespace flexep
