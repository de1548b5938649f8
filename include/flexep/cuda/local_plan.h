// The dispatch layout of one GPU (EP size 1), computed on the device: where every (token, expert)
// pair of a top-k routing lands in the expert-major output. It is core/plan.h with R = 1, bit for
// bit: DispatchPlan::build on the expert counts followed by slot_rows(plan, 0, indices).
//
//   - rows are expert-major; inside one expert they are ordered by token index (and, should a
//     token list an expert twice, by slot), so the layout is deterministic;
//   - each group is padded with zero rows to a multiple of pad_multiple;
//   - budget mode (params.budget_rows set): out_rows = budget, no host synchronisation at all, so the
//     call can be captured in a CUDA graph. Overflow with the error policy is reported through
//     DeviceErrors as "budget_rows" (value = rows needed, limit = budget); the drop policy keeps the
//     deterministic prefix of core/plan.cpp and counts the dropped pairs. Either way no row at or past
//     the budget is ever written;
//   - blocking mode: out_rows = the rows needed, known on the host; the call waits for the device
//     once, copies tokens_per_expert back and reports any device error (DeviceErrors::check).
//
// Expert ids outside [-1, E) are reported as "indices" (with their [token, slot]) and treated as -1:
// they are never used as an index. An expert listed twice by one token is reported too.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "flexep/core/plan.h"
#include "flexep/core/tensor.h"
#include "flexep/cuda/device_errors.h"

namespace flexep::cuda {

struct LocalPlan {
  PlanParams params;           // ranks == 1; budget_rows set = budget mode
  std::int64_t tokens = 0;     // T
  std::int64_t topk = 0;       // k
  std::int64_t out_rows = -1;  // rows of the expert-major output; -1 until a plan was computed
  int device = 0;

  // Device tensors, valid once the planning kernels have run on the stream (int64 unless noted):
  Tensor tokens_per_expert;  // [E] padded group sizes (RankLayout::tokens_per_expert)
  Tensor used_rows;          // [1] rows covered by the groups (sum of tokens_per_expert); later rows are zero
  Tensor dropped;            // [1] pairs dropped by the budget (drop policy; also counted under overflow errors)
  Tensor expert_begin;       // [E] first row of each group (RankLayout::expert_begin)
  Tensor kept_rows;          // [E] real rows kept per group (RankLayout::kept_rows)
  Tensor slot_rows;          // [T, k] int32: row of each slot; -1 for -1 ids, invalid ids and dropped pairs
  // Blocking mode only: tokens_per_expert on the host (filled by the one synchronisation).
  Tensor host_tokens_per_expert;

  // Scratch of the planning kernels (sort keys and values, CUB's storage, per-expert offsets), kept
  // with the plan so that recomputing it allocates nothing.
  Tensor workspace;
  std::size_t sort_temp_bytes = 0;

  bool budget_mode() const { return params.budget_rows.has_value(); }
  int num_experts() const { return params.experts; }
};

// Allocates the storage of a plan for `tokens` x `topk` slots on `device` (stream-ordered on
// `stream`); nothing is computed yet. params.ranks must be 1. Limits: 1 <= topk <= 1024, tokens * topk
// and the output rows below 2^31 (slot rows are int32).
LocalPlan make_local_plan(std::int64_t tokens, std::int64_t topk, const PlanParams& params, int device,
                          cudaStream_t stream);

// Computes the plan of `indices` ([tokens, topk] int32/int64 on plan.device) into `plan`'s storage.
// Budget mode: enqueues kernels only (no allocation, no synchronisation; capturable). Blocking mode:
// also sets plan.out_rows and plan.host_tokens_per_expert, waiting for the device once, and throws
// what `errors` recorded.
void plan_local_into(LocalPlan& plan, const TensorView& indices, DeviceErrors& errors, cudaStream_t stream);

// make_local_plan + plan_local_into.
LocalPlan plan_local(const TensorView& indices, const PlanParams& params, DeviceErrors& errors, cudaStream_t stream);

}  // namespace flexep::cuda
