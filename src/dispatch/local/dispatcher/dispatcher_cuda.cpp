#include <optional>

#include "dispatch/common/routing_checks.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/device_errors.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/permute.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/local_cuda.h"

namespace flexep {

namespace {

struct LocalHandle final : HandleState {
  cuda::LocalPlan plan;
};

class LocalCudaDispatcher final : public TokenDispatcher {
 public:
  LocalCudaDispatcher(int device, int num_experts) : device_(device), experts_(num_experts), errors_(device) {
    FLEXEP_CHECK_ARG(num_experts >= 1, "num_experts", "must be >= 1, got ", num_experts);
  }

  std::string_view backend() const override { return "local"; }
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  int num_experts() const override { return experts_; }
  std::unique_ptr<TokenDispatcher> make_sibling(std::int64_t) const override {
    return std::make_unique<LocalCudaDispatcher>(device_, experts_);
  }

  DispatchResult dispatch(const DispatchInput& in, const DispatchOptions& options) override {
    FLEXEP_CHECK_ARG(!in.multihot(), "routing_map",
                     "the single-GPU dispatcher takes the top-k form (indices, weights); convert with "
                     "multihot_to_topk or use the hybridep backend");
    check::expert_major_layout(options, "local");
    const Device dev = Device::cuda(device_);
    check::rank(in.hidden, 2, "hidden");
    check::dtype(in.hidden, {DType::bf16, DType::f32}, "hidden");
    check::device(in.hidden, dev, "hidden");
    const std::int64_t T = in.hidden.size(0), H = in.hidden.size(1);
    check::shape(in.indices, {T, -1}, "indices");
    check::dtype(in.indices, {DType::i32, DType::i64}, "indices");
    check::device(in.indices, dev, "indices");
    const std::int64_t k = in.indices.size(1);
    check::shape(in.weights, {T, k}, "weights");
    check::dtype(in.weights, {DType::f32}, "weights");
    check::device(in.weights, dev, "weights");

    PlanParams params;
    params.ranks = 1;
    params.experts = experts_;
    params.pad_multiple = options.pad_multiple;
    params.overflow = options.overflow;
    if (options.mode == DispatchMode::budget) params.budget_rows = options.budget_rows;
    validate(params);

    cuda::DeviceGuard guard(device_);
    const cudaStream_t stream = cuda::current_stream();
    auto handle = std::make_shared<LocalHandle>();
    handle->plan = cuda::plan_local(in.indices, params, errors_, stream);
    const std::int64_t N = handle->plan.out_rows;

    DispatchResult r;
    r.token_probs = Tensor::empty({N}, DType::f32, dev);
    if (options.rows_in_place) {
      // The tokens stay where they are; the probs are permuted (the weights' pass writes them whole).
      r.tokens = Tensor::wrap(in.hidden);
      r.expert_rows = Tensor::empty({N}, DType::i32, dev);
      cuda::row_sources(handle->plan, r.expert_rows, stream);
      cuda::permute_probs(in.weights, handle->plan, r.token_probs, stream);
    } else {
      r.tokens = Tensor::empty({N, H}, in.hidden.dtype, dev);
      cuda::permute(in.hidden, in.weights, handle->plan, r.tokens, r.token_probs, stream);
    }
    r.tokens_per_expert =
        handle->plan.budget_mode() ? handle->plan.tokens_per_expert : handle->plan.host_tokens_per_expert;

    handle->backend = "local";
    handle->owner = this;
    handle->tokens = T;
    handle->topk = k;
    handle->hidden = H;
    handle->rows = N;
    handle->local_experts = experts_;
    handle->hidden_dtype = in.hidden.dtype;
    handle->prob_dtype = DType::f32;
    r.handle = handle;
    return r;
  }

  Tensor combine(const Handle& handle, const TensorView& expert_out) override {
    const LocalHandle& h = checked(handle);
    check_handle_tensor(expert_out, h.rows, h.hidden, h.hidden_dtype, "expert_out");
    cuda::DeviceGuard guard(device_);
    Tensor out = Tensor::empty({h.tokens, h.hidden}, h.hidden_dtype, Device::cuda(device_));
    cuda::unpermute(expert_out, h.plan, out, cuda::current_stream());
    return out;
  }

  DispatchGrads dispatch_backward(const Handle& handle, const TensorView& grad_tokens,
                                  const TensorView& grad_token_probs) override {
    const LocalHandle& h = checked(handle);
    check_handle_tensor(grad_tokens, h.rows, h.hidden, h.hidden_dtype, "grad_tokens");
    check::shape(grad_token_probs, {h.rows}, "grad_token_probs");
    check::dtype(grad_token_probs, {DType::f32}, "grad_token_probs");
    cuda::DeviceGuard guard(device_);
    const cudaStream_t stream = cuda::current_stream();
    DispatchGrads g;
    g.hidden = Tensor::empty({h.tokens, h.hidden}, h.hidden_dtype, Device::cuda(device_));
    cuda::unpermute(grad_tokens, h.plan, g.hidden, stream);
    g.weights = Tensor::empty({h.tokens, h.topk}, DType::f32, Device::cuda(device_));
    cuda::gather_slot_values(grad_token_probs, h.plan, g.weights, stream);
    return g;
  }

  Tensor combine_backward(const Handle& handle, const TensorView& grad_out) override {
    const LocalHandle& h = checked(handle);
    check::shape(grad_out, {h.tokens, h.hidden}, "grad_out");
    check::dtype(grad_out, {h.hidden_dtype}, "grad_out");
    cuda::DeviceGuard guard(device_);
    const cudaStream_t stream = cuda::current_stream();
    const Device dev = Device::cuda(device_);
    // The dispatch of grad_out along the saved plan; the probs it would carry are not needed.
    Tensor rows = Tensor::empty({h.rows, h.hidden}, h.hidden_dtype, dev);
    Tensor no_weights = Tensor::zeros({h.tokens, h.topk}, DType::f32, dev);
    Tensor scratch = Tensor::empty({h.rows}, DType::f32, dev);
    cuda::permute(grad_out, no_weights, h.plan, rows, scratch, stream);
    return rows;
  }

 private:
  const LocalHandle& checked(const Handle& handle) const {
    check_handle(handle);
    const auto* h = dynamic_cast<const LocalHandle*>(handle.get());
    FLEXEP_CHECK_ARG(h != nullptr, "handle", "was not made by the single-GPU dispatcher");
    return *h;
  }

  int device_, experts_;
  cuda::DeviceErrors errors_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_local_cuda_dispatcher(int device, int num_experts) {
  cuda::init();
  FLEXEP_CHECK_ARG(device >= 0 && device < cuda::device_count(), "device", device, " is out of range [0, ",
                   cuda::device_count(), ")");
  return std::make_unique<LocalCudaDispatcher>(device, num_experts);
}

}  // namespace flexep
