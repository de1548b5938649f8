// Host side of plan_local: argument checks, the plan's storage, the kernel sequence and, in
// blocking mode, the one synchronisation.
#include <climits>
#include <memory>

#include "flexep/core/checks.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/runtime.h"
#include "cuda/local_plan_launch.h"

namespace flexep::cuda {

namespace {

using local_plan_detail::Workspace;

constexpr std::int64_t kMaxTopk = 1024;  // unpermute keeps a token's rows in shared memory
constexpr std::size_t kAlign = 256;

std::size_t align_up(std::size_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

// Byte offsets of the workspace pieces, in the order of Workspace's fields.
struct WorkspaceLayout {
  std::size_t keys_in = 0, keys_out = 0, pairs_in = 0, pairs_out = 0, sorted_begin = 0, sort_temp = 0, total = 0;
};

WorkspaceLayout workspace_layout(std::int64_t n, int experts, std::size_t sort_bytes) {
  const std::size_t n4 = align_up(static_cast<std::size_t>(n) * 4);
  WorkspaceLayout w;
  w.keys_in = 0;
  w.keys_out = w.keys_in + n4;
  w.pairs_in = w.keys_out + n4;
  w.pairs_out = w.pairs_in + n4;
  w.sorted_begin = w.pairs_out + n4;
  w.sort_temp = w.sorted_begin + align_up(static_cast<std::size_t>(experts) * 8);
  w.total = w.sort_temp + align_up(sort_bytes);
  return w;
}

Workspace workspace_of(const LocalPlan& plan) {
  const std::int64_t n = plan.tokens * plan.topk;
  const WorkspaceLayout l = workspace_layout(n, plan.num_experts(), plan.sort_temp_bytes);
  char* base = static_cast<char*>(plan.workspace.raw());
  Workspace ws;
  ws.keys_in = reinterpret_cast<std::uint32_t*>(base + l.keys_in);
  ws.keys_out = reinterpret_cast<std::uint32_t*>(base + l.keys_out);
  ws.pairs_in = reinterpret_cast<std::int32_t*>(base + l.pairs_in);
  ws.pairs_out = reinterpret_cast<std::int32_t*>(base + l.pairs_out);
  ws.sorted_begin = reinterpret_cast<std::int64_t*>(base + l.sorted_begin);
  ws.sort_temp = plan.sort_temp_bytes ? base + l.sort_temp : nullptr;
  ws.sort_temp_bytes = plan.sort_temp_bytes;
  return ws;
}

// A view of part of `whole` that keeps all of it alive.
Tensor part_of(const Tensor& whole, std::int64_t begin, std::int64_t end) {
  return Tensor::wrap(whole.view().rows(begin, end), std::make_shared<Tensor>(whole));
}

}  // namespace

LocalPlan make_local_plan(std::int64_t tokens, std::int64_t topk, const PlanParams& params, int device,
                          cudaStream_t stream) {
  validate(params);
  FLEXEP_CHECK_ARG(params.ranks == 1, "ranks", "plan_local is the single-GPU plan; ranks must be 1, got ",
                   params.ranks);
  FLEXEP_CHECK_ARG(tokens >= 0 && tokens <= INT32_MAX, "tokens", tokens, " is out of range [0, 2^31)");
  FLEXEP_CHECK_ARG(topk >= 1 && topk <= kMaxTopk, "topk", topk, " is out of range; allowed: 1 <= topk <= ", kMaxTopk);
  const std::int64_t n = tokens * topk;
  FLEXEP_CHECK_ARG(n <= INT32_MAX, "tokens", "tokens * topk = ", n, " slots exceed the 2^31 - 1 the plan indexes");
  const int E = params.experts;
  FLEXEP_CHECK_ARG(E < INT32_MAX, "num_experts", E, " is too large");
  // Slot rows are int32: bound the rows any routing could need (every group padded by pad - 1).
  FLEXEP_CHECK_ARG(params.pad_multiple <= INT32_MAX, "pad_multiple", params.pad_multiple, " is too large");
  if (params.budget_rows) {
    FLEXEP_CHECK_ARG(*params.budget_rows <= INT32_MAX, "budget_rows", *params.budget_rows,
                     " exceeds the 2^31 - 1 rows slot_rows can address");
  } else {
    const std::int64_t worst = n + static_cast<std::int64_t>(E) * (params.pad_multiple - 1);
    FLEXEP_CHECK_ARG(worst <= INT32_MAX, "pad_multiple", "tokens * topk + experts * (pad_multiple - 1) = ", worst,
                     " rows could be needed, more than the 2^31 - 1 slot_rows can address; use budget mode");
  }

  init();
  DeviceGuard dg(device);
  StreamGuard sg(stream);  // the allocations below are ordered on the caller's stream
  LocalPlan plan;
  plan.params = params;
  plan.tokens = tokens;
  plan.topk = topk;
  plan.device = device;
  plan.out_rows = params.budget_rows ? *params.budget_rows : -1;
  const Device dev = Device::cuda(device);

  // One int64 block for the per-expert outputs: [tokens_per_expert | used | dropped] first, so that
  // blocking mode brings back all it needs with one copy.
  const Tensor meta = Tensor::empty({3 * static_cast<std::int64_t>(E) + 2}, DType::i64, dev);
  plan.tokens_per_expert = part_of(meta, 0, E);
  plan.used_rows = part_of(meta, E, E + 1);
  plan.dropped = part_of(meta, E + 1, E + 2);
  plan.expert_begin = part_of(meta, E + 2, 2 * static_cast<std::int64_t>(E) + 2);
  plan.kept_rows = part_of(meta, 2 * static_cast<std::int64_t>(E) + 2, 3 * static_cast<std::int64_t>(E) + 2);
  plan.slot_rows = Tensor::empty({tokens, topk}, DType::i32, dev);

  plan.sort_temp_bytes =
      n ? local_plan_detail::sort_temp_bytes(static_cast<int>(n), local_plan_detail::sort_key_bits(E)) : 0;
  const std::size_t bytes = workspace_layout(n, E, plan.sort_temp_bytes).total;
  plan.workspace = Tensor::empty({static_cast<std::int64_t>((bytes + 7) / 8)}, DType::i64, dev);
  return plan;
}

void plan_local_into(LocalPlan& plan, const TensorView& indices, DeviceErrors& errors, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(plan.workspace.defined(), "plan", "has no storage; create it with make_local_plan");
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  check::device(indices, Device::cuda(plan.device), "indices");
  check::shape(indices, {plan.tokens, plan.topk}, "indices");
  DeviceGuard dg(plan.device);

  const std::int64_t n = plan.tokens * plan.topk;
  const int E = plan.num_experts();
  const Workspace ws = workspace_of(plan);
  local_plan_detail::Outputs out;
  out.tokens_per_expert = plan.tokens_per_expert.data<std::int64_t>();
  out.used_rows = plan.used_rows.data<std::int64_t>();
  out.dropped = plan.dropped.data<std::int64_t>();
  out.expert_begin = plan.expert_begin.data<std::int64_t>();
  out.kept_rows = plan.kept_rows.data<std::int64_t>();
  out.slot_rows = plan.slot_rows.data<std::int32_t>();
  local_plan_detail::Layout layout;
  layout.experts = E;
  layout.pad_multiple = plan.params.pad_multiple;
  layout.budget = plan.params.budget_rows ? *plan.params.budget_rows : -1;
  layout.drop = plan.params.overflow == OverflowPolicy::drop;

  local_plan_detail::launch_make_sort_keys(indices.data, indices.dtype, plan.tokens, static_cast<int>(plan.topk), E,
                                           ws, errors.record(), stream);
  if (n) local_plan_detail::sort_pairs(ws, static_cast<int>(n), local_plan_detail::sort_key_bits(E), stream);
  local_plan_detail::launch_build_layout(ws, n, layout, out, errors.record(), stream);
  local_plan_detail::launch_write_slot_rows(ws, n, E, out, stream);
  if (plan.budget_mode()) return;  // out_rows is the budget; nothing to wait for

  // Blocking mode: the one synchronisation. The copy into pageable memory returns once it is done
  // (after the kernels); errors.check then waits on the already idle stream and throws what the
  // kernels recorded.
  plan.out_rows = -1;
  Tensor host = Tensor::empty({static_cast<std::int64_t>(E) + 2}, DType::i64);
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(host.raw(), plan.tokens_per_expert.raw(), host.nbytes(), cudaMemcpyDeviceToHost,
                                    stream));
  errors.check(stream, "plan_local");
  plan.out_rows = host.data<std::int64_t>()[E];  // used rows = every padded group: the rows needed
  plan.host_tokens_per_expert = part_of(host, 0, E);
}

LocalPlan plan_local(const TensorView& indices, const PlanParams& params, DeviceErrors& errors, cudaStream_t stream) {
  check::rank(indices, 2, "indices");
  check::dtype(indices, {DType::i32, DType::i64}, "indices");
  FLEXEP_CHECK_ARG(indices.device.is_cuda(), "indices", "must be on a CUDA device, got ", indices.device.str());
  LocalPlan plan = make_local_plan(indices.size(0), indices.size(1), params, indices.device.index, stream);
  plan_local_into(plan, indices, errors, stream);
  return plan;
}

}  // namespace flexep::cuda
