// The token dispatcher: one interface, several communication backends (host, alltoall, deepep,
// hybridep). Every backend implements exactly the semantics of docs/semantics.md and core/plan.h; the
// host backend is the oracle the others are tested against.
//
// One TokenDispatcher object serves one rank. A call is collective: every rank of the group calls
// dispatch (and later combine, and the backwards) in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"

namespace flexep {

enum class DispatchMode { blocking, budget };

struct DispatchOptions {
  DispatchMode mode = DispatchMode::blocking;
  std::int64_t budget_rows = 0;  // budget mode: output rows on every rank (multiple of pad_multiple)
  OverflowPolicy overflow = OverflowPolicy::error;
  std::int64_t pad_multiple = 1;
  bool check_finite = true;  // CPU reference: reject NaN/Inf in hidden and weights
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
  std::int64_t rows = 0;        // N, rows of the expert-major output
  int local_experts = 0;
  DType hidden_dtype = DType::f32;
  DType prob_dtype = DType::f32;
};
using Handle = std::shared_ptr<const HandleState>;

struct DispatchResult {
  Tensor tokens;             // [N, H], dtype of hidden
  Tensor token_probs;        // [N], dtype of the weights
  Tensor tokens_per_expert;  // [E_local] int64: on the host in blocking mode, on the device in budget mode
  std::int64_t dropped = 0;  // pairs dropped on this rank as receiver (blocking / host backends)
  Handle handle;
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
  virtual Tensor combine(const Handle& handle, const TensorView& expert_out) = 0;
  // grad_tokens [N, H], grad_token_probs [N] -> grads of hidden and of the routing weights.
  virtual DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                          const TensorView& grad_token_probs) = 0;
  // grad_out [T, H] -> grad of expert_out [N, H] (the dispatch of grad_out along the handle).
  virtual Tensor combine_backward(const Handle& handle, const TensorView& grad_out) = 0;

 protected:
  // Common handle validation: the handle is not empty and was made by this dispatcher object
  // (HandleState::owner). Throws ArgumentError naming "handle".
  void check_handle(const Handle& handle) const;
  // An argument of combine or a backward must match what the handle recorded: shape [rows, cols]
  // (cols < 0: a 1-D tensor [rows]) and `dtype`. Throws ArgumentError naming `arg`.
  static void check_handle_tensor(const TensorView& t, std::int64_t rows, std::int64_t cols, DType dtype,
                                  const std::string& arg);
};

}  // namespace flexep
