// Host side of permute.h: every argument is checked against the plan before anything is enqueued.
#include <cstdint>

#include "flexep/core/checks.h"
#include "flexep/cuda/permute.h"
#include "flexep/cuda/runtime.h"
#include "cuda/permute_launch.h"

namespace flexep::cuda {

namespace {

using permute_detail::PlanRefs;

PlanRefs refs_of(const LocalPlan& plan) {
  FLEXEP_CHECK_ARG(plan.workspace.defined(), "plan", "has no storage; create it with plan_local or make_local_plan");
  FLEXEP_CHECK_ARG(plan.out_rows >= 0, "plan", "has not been computed; call plan_local_into first");
  PlanRefs r;
  r.slot_rows = plan.slot_rows.data<std::int32_t>();
  r.expert_begin = plan.expert_begin.data<std::int64_t>();
  r.kept_rows = plan.kept_rows.data<std::int64_t>();
  r.tokens_per_expert = plan.tokens_per_expert.data<std::int64_t>();
  r.used_rows = plan.used_rows.data<std::int64_t>();
  r.tokens = plan.tokens;
  r.topk = plan.topk;
  r.out_rows = plan.out_rows;
  r.pad_multiple = plan.params.pad_multiple;
  r.experts = plan.num_experts();
  r.budget_mode = plan.budget_mode();
  return r;
}

void check_on(const TensorView& t, const LocalPlan& plan, const char* arg) {
  check::device(t, Device::cuda(plan.device), arg);
}

// The 16-byte vector paths: H a multiple of 8 and aligned rows.
void check_rows(const TensorView& t, const char* arg) {
  FLEXEP_CHECK_ARG(t.size(1) % 8 == 0, arg, "hidden size ", t.size(1),
                   " is not a multiple of 8 (rows are moved in 16-byte vectors)");
  FLEXEP_CHECK_ARG(t.numel() == 0 || reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg,
                   "data must be 16-byte aligned");
}

}  // namespace

void permute(const TensorView& x, const TensorView& weights, const LocalPlan& plan, const TensorView& out_tokens,
             const TensorView& out_probs, cudaStream_t stream) {
  const PlanRefs refs = refs_of(plan);
  check::shape(x, {plan.tokens, -1}, "hidden");
  check::dtype(x, {DType::bf16, DType::f32}, "hidden");
  check_on(x, plan, "hidden");
  check_rows(x, "hidden");
  const std::int64_t H = x.size(1);
  check::shape(weights, {plan.tokens, plan.topk}, "weights");
  check::dtype(weights, {DType::f32}, "weights");
  check_on(weights, plan, "weights");
  check::shape(out_tokens, {plan.out_rows, H}, "out_tokens");
  check::dtype(out_tokens, {x.dtype}, "out_tokens");
  check_on(out_tokens, plan, "out_tokens");
  check_rows(out_tokens, "out_tokens");
  check::shape(out_probs, {plan.out_rows}, "out_probs");
  check::dtype(out_probs, {DType::f32}, "out_probs");
  check_on(out_probs, plan, "out_probs");
  DeviceGuard dg(plan.device);
  const std::int64_t row_bytes = H * static_cast<std::int64_t>(element_size(x.dtype));
  permute_detail::launch_permute(x.data, weights.ptr<float>(), refs, row_bytes, out_tokens.data, out_probs.ptr<float>(),
                                 sm_count(plan.device), stream);
}

void unpermute(const TensorView& expert_rows, const LocalPlan& plan, const TensorView& out, cudaStream_t stream) {
  const PlanRefs refs = refs_of(plan);
  check::shape(expert_rows, {plan.out_rows, -1}, "expert_rows");
  check::dtype(expert_rows, {DType::bf16, DType::f32}, "expert_rows");
  check_on(expert_rows, plan, "expert_rows");
  check_rows(expert_rows, "expert_rows");
  const std::int64_t H = expert_rows.size(1);
  check::shape(out, {plan.tokens, H}, "out");
  check::dtype(out, {DType::bf16, DType::f32}, "out");
  check_on(out, plan, "out");
  check_rows(out, "out");
  DeviceGuard dg(plan.device);
  permute_detail::launch_unpermute(expert_rows.data, expert_rows.dtype, refs, H, out.data, out.dtype, stream);
}

void gather_slot_values(const TensorView& values, const LocalPlan& plan, const TensorView& out, cudaStream_t stream) {
  const PlanRefs refs = refs_of(plan);
  check::shape(values, {plan.out_rows}, "values");
  check::dtype(values, {DType::f32}, "values");
  check_on(values, plan, "values");
  check::shape(out, {plan.tokens, plan.topk}, "out");
  check::dtype(out, {DType::f32}, "out");
  check_on(out, plan, "out");
  DeviceGuard dg(plan.device);
  permute_detail::launch_gather_slot_values(values.ptr<float>(), refs, out.ptr<float>(), stream);
}

void permute_probs(const TensorView& weights, const LocalPlan& plan, const TensorView& out_probs, cudaStream_t stream) {
  const PlanRefs refs = refs_of(plan);
  check::shape(weights, {plan.tokens, plan.topk}, "weights");
  check::dtype(weights, {DType::f32}, "weights");
  check_on(weights, plan, "weights");
  check::shape(out_probs, {plan.out_rows}, "out_probs");
  check::dtype(out_probs, {DType::f32}, "out_probs");
  check_on(out_probs, plan, "out_probs");
  DeviceGuard dg(plan.device);
  permute_detail::launch_permute(nullptr, weights.ptr<float>(), refs, 0, nullptr, out_probs.ptr<float>(),
                                 sm_count(plan.device), stream);
}

void row_sources(const LocalPlan& plan, const TensorView& sources, cudaStream_t stream) {
  const PlanRefs refs = refs_of(plan);
  check::shape(sources, {plan.out_rows}, "sources");
  check::dtype(sources, {DType::i32}, "sources");
  check_on(sources, plan, "sources");
  DeviceGuard dg(plan.device);
  permute_detail::launch_row_sources(refs, sources.ptr<std::int32_t>(), stream);
}

void gather_rows(const TensorView& src, const TensorView& ids, const TensorView& out, cudaStream_t stream) {
  check::rank(src, 2, "src");
  check::dtype(src, {DType::bf16, DType::f32}, "src");
  FLEXEP_CHECK_ARG(src.device.is_cuda(), "src", "must be on a CUDA device, got ", src.device.str());
  check::rank(ids, 1, "ids");
  check::dtype(ids, {DType::i32}, "ids");
  check::device(ids, src.device, "ids");
  check::shape(out, {ids.size(0), src.size(1)}, "out");
  check::dtype(out, {src.dtype}, "out");
  check::device(out, src.device, "out");
  check_rows(src, "src");
  check_rows(out, "out");
  DeviceGuard dg(src.device.index);
  permute_detail::launch_gather_rows(src.data, src.size(0), ids.ptr<std::int32_t>(), ids.size(0),
                                     src.size(1) * static_cast<std::int64_t>(element_size(src.dtype)), out.data,
                                     stream);
}

}  // namespace flexep::cuda
