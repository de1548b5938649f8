// The `host` backend. Each call is one or two exchanges over the HostWorld:
//   dispatch:          count-exchange (signature, local check result, per-expert counts) -> every
//                      rank builds the same DispatchPlan -> row-exchange (inputs + slot rows) ->
//                      receivers pull their rows -> done barrier (senders may free their inputs);
//   combine, backwards: exchange (local check result, handle sequence, data) -> work -> done.
// The rank-major layout (DispatchLayout::rank_major, core/rank_major.h) takes the same steps, with
// the rows per destination rank in the count exchange and rank_major_rows.h's data movements.
// Local argument errors never throw alone: they travel with the first exchange and every rank
// raises (see rank_failure.h), so a bad input on one rank cannot hang the others.
//
// tokens_per_expert is returned on the host in both modes: this backend has no device, so the
// budget mode's "no host sync" has nothing to avoid.
#include <string>

#include "dispatch/host/dispatcher/handle.h"
#include "dispatch/host/dispatcher/rank_failure.h"
#include "dispatch/host/dispatcher/rank_major_rows.h"
#include "dispatch/host/dispatcher/row_ops.h"
#include "dispatch/common/call_signature.h"
#include "flexep/core/checks.h"
#include "flexep/core/rank_major.h"
#include "flexep/core/routing.h"
#include "flexep/dispatch/host.h"

namespace flexep {
namespace host {
namespace {

// This rank's routing in the top-k form, whatever form the caller used.
struct LocalRouting {
  Tensor indices;      // [T, k] int64
  TensorView weights;  // [T, k] f32/f64 (the caller's, or owned_weights)
  Tensor owned_weights;
};

LocalRouting prepare(const DispatchInput& in, const DispatchOptions& opt, int ranks, int experts) {
  check::rank(in.hidden, 2, "hidden");
  check::device(in.hidden, Device::cpu(), "hidden");
  check::dtype(in.hidden, {DType::f32, DType::f64, DType::bf16}, "hidden");
  const std::int64_t T = in.hidden.size(0);
  LocalRouting r;
  if (in.multihot()) {
    FLEXEP_CHECK_ARG(opt.layout == DispatchLayout::expert_major, "routing_map",
                     "the rank_major layout takes the top-k form (indices, weights), as DeepEP's dispatch does");
    FLEXEP_CHECK_ARG(!in.indices.defined() && !in.weights.defined(), "indices",
                     "was given together with routing_map; pass either the top-k form (indices, weights) or the "
                     "multihot form (routing_map, probs)");
    check::device(in.routing_map, Device::cpu(), "routing_map");
    check::shape(in.routing_map, {T, experts}, "routing_map");
    check::dtype(in.routing_map, {DType::b8}, "routing_map");
    check::device(in.probs, Device::cpu(), "probs");
    check::shape(in.probs, {T, experts}, "probs");
    check::dtype(in.probs, {DType::f32, DType::f64}, "probs");
    if (opt.check_finite) {
      check::finite(in.hidden, "hidden");
      check::finite(in.probs, "probs");
    }
    TopK tk = multihot_to_topk(in.routing_map, in.probs);
    r.indices = tk.indices;
    r.owned_weights = tk.weights;
    r.weights = r.owned_weights.view();
  } else {
    FLEXEP_CHECK_ARG(in.indices.defined(), "indices",
                     "is required; pass the top-k form (indices, weights) or the multihot form (routing_map, probs)");
    check::device(in.indices, Device::cpu(), "indices");
    check::shape(in.indices, {T, -1}, "indices");
    check::expert_indices(in.indices, experts, "indices");
    check::device(in.weights, Device::cpu(), "weights");
    check::shape(in.weights, {T, in.indices.size(1)}, "weights");
    check::dtype(in.weights, {DType::f32, DType::f64}, "weights");
    if (opt.check_finite) {
      check::finite(in.hidden, "hidden");
      check::finite(in.weights, "weights");
    }
    r.indices =
        in.indices.dtype == DType::i64 ? Tensor::wrap(in.indices).clone() : Tensor::wrap(in.indices).to(DType::i64);
    r.weights = in.weights;
  }
  validate(call_signature::plan_params(opt, ranks, experts));
  return r;
}

struct CountExchange {
  RankFailure status;
  call_signature::CallSignature sig;
  std::vector<std::int64_t> counts;  // [E]
  std::vector<std::int64_t> dest_rows;  // [R] rank_major: the rows this rank sends to each rank
};

struct RowExchange {
  RankFailure status;
  SenderRows rows;
};

// What combine and the backwards publish: the handle's sender side and this rank's tensors.
struct HandleExchange {
  RankFailure status;
  std::uint64_t sequence = 0;
  SenderRows sender;  // sender.hidden carries grad_out (combine_backward)
  RankMajorSender rank_sender;  // the same, rank_major
  TensorView rows;    // [N, H]: expert_out or grad_tokens
  TensorView probs;   // [N] (rank_major: [N, k]): grad_token_probs
};

class HostDispatcher final : public TokenDispatcher {
 public:
  HostDispatcher(std::shared_ptr<HostWorld> world, int rank, int num_experts)
      : world_(std::move(world)), rank_(rank), experts_(num_experts) {}

  std::string_view backend() const override { return "host"; }
  int rank() const override { return rank_; }
  int world_size() const override { return world_->size(); }
  int num_experts() const override { return experts_; }
  std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t) const override {
    return std::make_unique<HostDispatcher>(world_, rank_, experts_);
  }

  DispatchResult dispatch(const DispatchInput& input, const DispatchOptions& options) override {
    return leaving_on_error(*world_, rank_, [&] { return dispatch_rows(input, options); });
  }
  Tensor combine(const Handle& handle, const TensorView& expert_out) override {
    return leaving_on_error(*world_, rank_, [&] { return combine_rows(handle, expert_out); });
  }
  DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                  const TensorView& grad_token_probs) override {
    return leaving_on_error(*world_, rank_,
                            [&] { return dispatch_backward_rows(handle, grad_tokens, grad_token_probs); });
  }
  Tensor combine_backward(const Handle& handle, const TensorView& grad_out) override {
    return leaving_on_error(*world_, rank_, [&] { return combine_backward_rows(handle, grad_out); });
  }

 private:
  DispatchResult dispatch_rows(const DispatchInput& input, const DispatchOptions& options);
  Tensor combine_rows(const Handle& handle, const TensorView& expert_out);
  DispatchGrads dispatch_backward_rows(const Handle& handle, const TensorView& grad_tokens,
                                       const TensorView& grad_token_probs);
  Tensor combine_backward_rows(const Handle& handle, const TensorView& grad_out);

  const HostHandle& host_handle(const Handle& handle) const {
    check_handle(handle);
    const auto* h = dynamic_cast<const HostHandle*>(handle.get());
    FLEXEP_CHECK_ARG(h != nullptr, "handle", "claims this dispatcher as owner but is not a host handle");
    return *h;
  }
  // Exchange for combine and the backwards: local checks travel with it, and all ranks must pass
  // the handle of the same dispatch call.
  std::vector<HandleExchange> exchange(const HandleExchange& mine, const std::string& op);
  std::shared_ptr<HostHandle> make_handle(const DispatchInput& input, const LocalRouting& local,
                                          const DispatchOptions& options, std::uint64_t sequence) const;
  DispatchResult finish_expert_major(const DispatchInput& input, const LocalRouting& local,
                                     std::shared_ptr<HostHandle> handle, const DispatchPlan& plan);
  DispatchResult finish_rank_major(const DispatchInput& input, const LocalRouting& local,
                                   std::shared_ptr<HostHandle> handle, const std::vector<RankMajorLayout>& layouts,
                                   const std::vector<std::int64_t>& counts, const DispatchOptions& options);

  std::shared_ptr<HostWorld> world_;
  int rank_;
  int experts_;
  std::uint64_t calls_ = 0;
};

DispatchResult HostDispatcher::dispatch_rows(const DispatchInput& input, const DispatchOptions& options) {
  const std::uint64_t sequence = ++calls_;
  const int R = world_->size();
  const bool rank_major = options.layout == DispatchLayout::rank_major;
  const PlanParams params = call_signature::plan_params(options, R, experts_);
  LocalRouting local;
  CountExchange mine;
  try {
    local = prepare(input, options, R, experts_);
    // k is compared only in the top-k form (the multihot form derives it from the data).
    call_signature::set_call(mine.sig, experts_, input.multihot(), input.hidden.size(1),
                             input.multihot() ? 0 : local.indices.size(1), options, input.hidden.size(0));
    mine.sig.hidden_dtype = input.hidden.dtype;
    mine.sig.weight_dtype = local.weights.dtype;
    mine.counts = expert_counts(local.indices, experts_);
    if (rank_major) mine.dest_rows = rank_major_row_counts(local.indices, params);
  } catch (...) {
    mine.status.capture(std::current_exception());
  }
  DispatchPlan plan;
  std::vector<RankMajorLayout> layouts;
  std::vector<std::int64_t> counts;
  publish(*world_, rank_, mine, "dispatch:count-exchange", "dispatch:abort",
          [&](const std::vector<CountExchange>& all) {
            std::vector<call_signature::CallSignature> sigs;
            for (const auto& c : all) sigs.push_back(c.sig);
            if (auto err = call_signature::compare_headers(sigs)) return err;
            std::vector<std::int64_t> rows;
            for (const auto& c : all) {
              counts.insert(counts.end(), c.counts.begin(), c.counts.end());
              rows.insert(rows.end(), c.dest_rows.begin(), c.dest_rows.end());
            }
            // Every rank builds the same layout from the same counts, so an overflow raises everywhere.
            try {
              if (rank_major)
                layouts = rank_major_layouts(rows, params);
              else
                plan = DispatchPlan::build(counts, params);
            } catch (...) {
              return std::current_exception();
            }
            return std::exception_ptr();
          });
  auto handle = make_handle(input, local, options, sequence);
  return rank_major ? finish_rank_major(input, local, std::move(handle), layouts, counts, options)
                    : finish_expert_major(input, local, std::move(handle), plan);
}

std::shared_ptr<HostHandle> HostDispatcher::make_handle(const DispatchInput& input, const LocalRouting& local,
                                                        const DispatchOptions& options,
                                                        std::uint64_t sequence) const {
  auto handle = std::make_shared<HostHandle>();
  handle->backend = "host";
  handle->owner = this;
  handle->rank = rank_;
  handle->tokens = input.hidden.size(0);
  handle->multihot = input.multihot();
  handle->slots = local.indices.size(1);
  handle->topk = handle->multihot ? experts_ : handle->slots;
  handle->hidden = input.hidden.size(1);
  handle->local_experts = local_experts();
  handle->hidden_dtype = input.hidden.dtype;
  handle->prob_dtype = local.weights.dtype;
  handle->layout = options.layout;
  handle->sequence = sequence;
  const std::int64_t* idx = local.indices.data<std::int64_t>();
  handle->indices.assign(idx, idx + local.indices.numel());
  return handle;
}

DispatchResult HostDispatcher::finish_expert_major(const DispatchInput& input, const LocalRouting& local,
                                                   std::shared_ptr<HostHandle> handle, const DispatchPlan& plan) {
  const int L = local_experts();
  handle->slot_rows = slot_rows(plan, rank_, local.indices);
  const RankLayout& layout = plan.ranks[static_cast<std::size_t>(rank_)];
  handle->rows = layout.out_rows;

  RowExchange rows_mine;
  rows_mine.rows = {input.hidden,   local.weights, handle->indices.data(), handle->slot_rows.data(),
                    handle->tokens, handle->slots};
  const auto senders = publish(*world_, rank_, rows_mine, "dispatch:row-exchange", "dispatch:abort",
                               [](const std::vector<RowExchange>&) { return std::exception_ptr(); });
  std::vector<SenderRows> sender_rows;
  for (const auto& s : senders) sender_rows.push_back(s.rows);

  DispatchResult result;
  result.tokens = Tensor::zeros({layout.out_rows, handle->hidden}, handle->hidden_dtype);
  result.token_probs = Tensor::zeros({layout.out_rows}, handle->prob_dtype);
  pull_rows(rank_, L, sender_rows, result.tokens, result.token_probs);
  world_->barrier(rank_, "dispatch:done");
  result.tokens_per_expert = Tensor::from_vector(layout.tokens_per_expert, {L});
  result.dropped = layout.dropped;
  result.handle = std::move(handle);
  return result;
}

DispatchResult HostDispatcher::finish_rank_major(const DispatchInput& input, const LocalRouting& local,
                                                 std::shared_ptr<HostHandle> handle,
                                                 const std::vector<RankMajorLayout>& layouts,
                                                 const std::vector<std::int64_t>& counts,
                                                 const DispatchOptions& options) {
  const int R = world_->size(), L = local_experts();
  const PlanParams params = call_signature::plan_params(options, R, experts_);
  handle->dest_rows = rank_major_rows(layouts, rank_, local.indices, params);
  const RankMajorLayout& layout = layouts[static_cast<std::size_t>(rank_)];
  const std::int64_t N = layout.out_rows, k = handle->slots;
  handle->rows = N;

  struct Rows {
    RankFailure status;
    RankMajorSender sender;
  } rows_mine;
  rows_mine.sender = {input.hidden, local.weights, handle->indices.data(), handle->dest_rows.data(), handle->tokens, k};
  const auto senders = publish(*world_, rank_, rows_mine, "dispatch:row-exchange", "dispatch:abort",
                               [](const std::vector<Rows>&) { return std::exception_ptr(); });
  std::vector<RankMajorSender> sender_rows;
  for (const auto& s : senders) sender_rows.push_back(s.sender);

  DispatchResult result;
  result.tokens = Tensor::zeros({N, handle->hidden}, handle->hidden_dtype);
  result.topk_indices = Tensor::empty({N, k}, DType::i32);
  std::fill_n(result.topk_indices.data<std::int32_t>(), N * k, -1);
  result.topk_weights = Tensor::zeros({N, k}, handle->prob_dtype);
  pull_rank_rows(rank_, R, L, sender_rows, result.tokens, result.topk_indices.data<std::int32_t>(),
                 result.topk_weights);
  world_->barrier(rank_, "dispatch:done");

  const bool budget = options.mode == DispatchMode::budget;
  const ExpertRows lists = expert_rows(result.topk_indices.data<std::int32_t>(), N, k, L, options.pad_multiple,
                                       budget ? expert_rows_capacity(N, k, L, options.pad_multiple) : -1);
  result.tokens_per_expert = Tensor::from_vector(lists.tokens_per_expert, {L});
  result.expert_rows = Tensor::from_vector(lists.rows, {static_cast<std::int64_t>(lists.rows.size())});
  std::int64_t sent_here = 0;  // pairs every source routed to this rank's experts
  for (int s = 0; s < R; ++s)
    for (int le = 0; le < L; ++le) sent_here += counts[static_cast<std::size_t>(s * experts_ + rank_ * L + le)];
  result.dropped = sent_here - lists.pairs;
  result.handle = std::move(handle);
  return result;
}

std::vector<HandleExchange> HostDispatcher::exchange(const HandleExchange& mine, const std::string& op) {
  return publish(*world_, rank_, mine, op + ":exchange", op + ":abort", [](const std::vector<HandleExchange>& all) {
    for (std::size_t r = 1; r < all.size(); ++r)
      if (all[r].sequence != all[0].sequence)
        return std::make_exception_ptr(ArgumentError(
            "handle", "rank " + std::to_string(r) + " passes the handle of dispatch call #" +
                          std::to_string(all[r].sequence) + " but rank 0 that of call #" +
                          std::to_string(all[0].sequence) + "; every rank must pass the handle of the same dispatch"));
    return std::exception_ptr();
  });
}

Tensor HostDispatcher::combine_rows(const Handle& handle, const TensorView& expert_out) {
  const HostHandle* h = nullptr;
  HandleExchange mine;
  try {
    h = &host_handle(handle);
    check_handle_tensor(expert_out, h->rows, h->hidden, h->hidden_dtype, "expert_out");
    check::device(expert_out, Device::cpu(), "expert_out");
    mine.sequence = h->sequence;
    mine.rows = expert_out;
  } catch (...) {
    mine.status.capture(std::current_exception());
  }
  const auto all = exchange(mine, "combine");
  std::vector<TensorView> rows;
  for (const auto& a : all) rows.push_back(a.rows);
  Tensor out = Tensor::empty({h->tokens, h->hidden}, h->hidden_dtype);
  if (h->layout == DispatchLayout::rank_major)
    sum_rank_rows(world_->size(), h->dest_rows.data(), rows, out);
  else
    sum_rows(h->local_experts, h->indices.data(), h->slot_rows.data(), h->slots, rows, out);
  world_->barrier(rank_, "combine:done");
  return out;
}

Tensor HostDispatcher::combine_backward_rows(const Handle& handle, const TensorView& grad_out) {
  const HostHandle* h = nullptr;
  HandleExchange mine;
  try {
    h = &host_handle(handle);
    check_handle_tensor(grad_out, h->tokens, h->hidden, h->hidden_dtype, "grad_out");
    check::device(grad_out, Device::cpu(), "grad_out");
    mine.sequence = h->sequence;
    mine.sender = {grad_out, TensorView(), h->indices.data(), h->slot_rows.data(), h->tokens, h->slots};
    mine.rank_sender = {grad_out, TensorView(), h->indices.data(), h->dest_rows.data(), h->tokens, h->slots};
  } catch (...) {
    mine.status.capture(std::current_exception());
  }
  const auto all = exchange(mine, "combine_backward");
  Tensor grad = Tensor::zeros({h->rows, h->hidden}, h->hidden_dtype);
  if (h->layout == DispatchLayout::rank_major) {
    std::vector<RankMajorSender> senders;
    for (const auto& a : all) senders.push_back(a.rank_sender);
    pull_rank_rows(rank_, world_->size(), h->local_experts, senders, grad, nullptr, TensorView());
  } else {
    std::vector<SenderRows> senders;
    for (const auto& a : all) senders.push_back(a.sender);
    pull_rows(rank_, h->local_experts, senders, grad, TensorView());
  }
  world_->barrier(rank_, "combine_backward:done");
  return grad;
}

DispatchGrads HostDispatcher::dispatch_backward_rows(const Handle& handle, const TensorView& grad_tokens,
                                                     const TensorView& grad_token_probs) {
  const HostHandle* h = nullptr;
  HandleExchange mine;
  try {
    h = &host_handle(handle);
    check_handle_tensor(grad_tokens, h->rows, h->hidden, h->hidden_dtype, "grad_tokens");
    check::device(grad_tokens, Device::cpu(), "grad_tokens");
    const bool rank_major = h->layout == DispatchLayout::rank_major;  // the grads of topk_weights [N, k]
    check_handle_tensor(grad_token_probs, h->rows, rank_major ? h->slots : -1, h->prob_dtype, "grad_token_probs");
    check::device(grad_token_probs, Device::cpu(), "grad_token_probs");
    mine.sequence = h->sequence;
    mine.rows = grad_tokens;
    mine.probs = grad_token_probs;
  } catch (...) {
    mine.status.capture(std::current_exception());
  }
  const auto all = exchange(mine, "dispatch_backward");
  std::vector<TensorView> rows, probs;
  for (const auto& a : all) {
    rows.push_back(a.rows);
    probs.push_back(a.probs);
  }
  DispatchGrads g;
  g.hidden = Tensor::empty({h->tokens, h->hidden}, h->hidden_dtype);
  g.weights = Tensor::zeros({h->tokens, h->multihot ? experts_ : h->slots}, h->prob_dtype);
  if (h->layout == DispatchLayout::rank_major) {
    sum_rank_rows(world_->size(), h->dest_rows.data(), rows, g.hidden);
    gather_rank_weights(world_->size(), h->local_experts, h->indices.data(), h->dest_rows.data(), h->slots, probs,
                        g.weights);
  } else {
    sum_rows(h->local_experts, h->indices.data(), h->slot_rows.data(), h->slots, rows, g.hidden);
    gather_probs(h->local_experts, h->indices.data(), h->slot_rows.data(), h->slots, h->multihot, probs, g.weights);
  }
  world_->barrier(rank_, "dispatch_backward:done");
  return g;
}

}  // namespace
}  // namespace host

std::unique_ptr<TokenDispatcher> make_host_dispatcher(std::shared_ptr<HostWorld> world, int rank, int num_experts) {
  FLEXEP_CHECK_ARG(world != nullptr, "world", "is null; create a HostWorld shared by all ranks");
  FLEXEP_CHECK_ARG(rank >= 0 && rank < world->size(), "rank", rank, " is out of range [0, ", world->size(), ")");
  PlanParams p;
  p.ranks = world->size();
  p.experts = num_experts;
  validate(p);  // E >= 1 and divisible by the ranks, named "num_experts"
  return std::make_unique<host::HostDispatcher>(std::move(world), rank, num_experts);
}

}  // namespace flexep
