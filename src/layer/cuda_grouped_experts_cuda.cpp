#include "flexep/layer/cuda_grouped_experts.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "flexep/core/checks.h"
#include "flexep/core/random.h"
#include "flexep/cuda/expert_activation.h"
#include "flexep/cuda/expert_bias.h"
#include "flexep/cuda/expert_prob.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/grouped_gemm.h"
#include "flexep/cuda/permute.h"
#include "flexep/cuda/runtime.h"
#include "flexep/cuda/wgrad_gemm.h"
#include "flexep/layer/grouped_experts.h"

namespace flexep {

namespace {

// Stream names as in GroupedExperts::init (fixed there too: values must not depend on renames).
constexpr const char* kGateUp = "gate_and_up_projs";
constexpr const char* kDown = "down_projs";
constexpr const char* kGateUpBias = "gate_up_proj_bias";
constexpr const char* kDownBias = "down_proj_bias";

void check_cuda_tensor(const TensorView& t, std::initializer_list<std::int64_t> shape, DType dtype, int device,
                       const std::string& arg) {
  check::shape(t, shape, arg);
  check::dtype(t, {dtype}, arg);
  check::device(t, Device::cuda(device), arg);
}

bool has_grad(const Parameter& p) { return p.value.defined() && p.requires_grad; }

// Whether flexep's Hopper kernel (gather_gemm.h) takes a grouped GEMM of a's rows, `groups` groups and
// `m` output columns: 16-byte rows and addresses, few enough groups.
bool gather_gemm_fits(const TensorView& a, const TensorView& w, std::int64_t m, std::size_t groups,
                      const TensorView& out) {
  auto aligned = [](const TensorView& t) { return reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0; };
  return a.size(1) % 8 == 0 && m % 8 == 0 && static_cast<std::int64_t>(groups) <= cuda::kGatherGemmMaxGroups &&
         aligned(a) && aligned(w) && aligned(out);
}

// The down projection on the experts' contiguous rows: flexep's Hopper kernel without a row table (A
// and B by TMA, the groups' offsets read on the device) where its shapes allow, 3-6% faster than
// cuBLAS's grouped GEMM at DeepSeek-V3's sizes on an H100 (docs/experts.md, "Measured"); else cuBLAS.
// The gate/up projection stays on cuBLAS, where the kernel is ~10% slower.
void down_forward(const TensorView& a, const TensorView& w, const std::vector<std::int64_t>& counts,
                  const Tensor& offsets, const TensorView& out, cudaStream_t stream) {
  if (gather_gemm_fits(a, w, w.size(2), counts.size(), out)) {
    cuda::gather_grouped_gemm(a, TensorView(), offsets, w, out, stream);
  } else {
    cuda::grouped_gemm_forward(a, w, counts, out, stream);
  }
}

std::atomic<ExpertDgrad> g_dgrad{ExpertDgrad::cublas};

// The data gradient c = d W^T per expert (w [E, K, M] as the forward reads it, d [A, M], c [A, K]): on
// the Hopper kernel when chosen and its shapes allow (as down_forward), else cuBLAS.
void data_grad(const TensorView& d, const TensorView& w, const std::vector<std::int64_t>& counts,
               const Tensor& offsets, const TensorView& out, cudaStream_t stream) {
  if (g_dgrad.load(std::memory_order_relaxed) == ExpertDgrad::gather_gemm &&
      gather_gemm_fits(d, w, w.size(1), counts.size(), out)) {
    cuda::gather_grouped_gemm(d, TensorView(), offsets, w, out, stream, nullptr, cuda::GatherGemmBLayout::m_by_k);
  } else {
    cuda::grouped_gemm_dgrad(d, w, counts, out, stream);
  }
}

std::atomic<ExpertWgrad> g_wgrad{ExpertWgrad::cublas};

// The gradient of p (`dtype`, same shape), zero-allocated on first use; undefined when p has no value
// or does not require grad.
TensorView grad_of(Parameter& p, DType dtype) {
  if (!has_grad(p)) return TensorView();
  if (!p.grad.defined()) p.grad = Tensor::zeros(p.value.shape(), dtype, p.value.device());
  FLEXEP_CHECK(p.grad.shape() == p.value.shape() && p.grad.dtype() == dtype && p.grad.device() == p.value.device(),
               "gradient of '", p.name, "' has shape ", p.grad.shape().str(), " ", dtype_name(p.grad.dtype()), " on ",
               p.grad.device().str(), ", expected ", p.value.shape().str(), " ", dtype_name(dtype), " on ",
               p.value.device().str());
  return p.grad.view();
}

// A new gradient tensor for p (fresh_bf16_weights), on the current stream. The old one is released
// first, so that its memory can serve the new one when nobody else holds it.
void renew_grad(Parameter& p, DType dtype, bool zeroed) {
  p.grad = Tensor();
  if (!has_grad(p)) return;
  p.grad = zeroed ? Tensor::zeros(p.value.shape(), dtype, p.value.device())
                  : Tensor::empty(p.value.shape(), dtype, p.value.device());
}

// A gradient target: undefined, or the weight's shape in one of `dtypes` on `device`.
void check_target(const TensorView& t, const TensorView& weight, std::initializer_list<DType> dtypes, int device,
                  const std::string& name) {
  if (!t.defined()) return;
  const std::string arg = name + " (gradient target)";
  FLEXEP_CHECK_ARG(weight.defined(), arg, "given, but the weight is absent");
  FLEXEP_CHECK_ARG(t.shape == weight.shape, arg, "has shape ", t.shape.str(), ", expected ", weight.shape.str());
  check::dtype(t, dtypes, arg);
  check::device(t, Device::cuda(device), arg);
}

// Uploads a host tensor (any floating dtype, same element count) into a bf16 device tensor.
void upload_as_bf16(const Tensor& host, const TensorView& dst, cudaStream_t stream) {
  const Tensor b = host.dtype() == DType::bf16 ? host : host.to(DType::bf16);
  cuda::copy_async(dst, b.view(), stream);
  // The source is pageable and dies with this scope: finish the copy.
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace

void set_expert_dgrad(ExpertDgrad kernel) { g_dgrad.store(kernel, std::memory_order_relaxed); }
ExpertDgrad expert_dgrad() { return g_dgrad.load(std::memory_order_relaxed); }
void set_expert_wgrad(ExpertWgrad kernel) { g_wgrad.store(kernel, std::memory_order_relaxed); }
ExpertWgrad expert_wgrad() { return g_wgrad.load(std::memory_order_relaxed); }

CudaGroupedExpertsCompute::CudaGroupedExpertsCompute(const MoEConfig& config, int num_local_experts, int device,
                                                     std::string name)
    : config_(config), local_(num_local_experts), device_(device), name_(std::move(name)) {
  FLEXEP_CHECK_ARG(config.dim >= 1, "moe.dim", "must be >= 1, got ", config.dim);
  FLEXEP_CHECK_ARG(config.moe_inter_dim >= 1, "moe.moe_inter_dim", "must be >= 1, got ", config.moe_inter_dim);
  FLEXEP_CHECK_ARG(num_local_experts >= 1 && num_local_experts <= config.n_routed_experts, "num_local_experts",
                   "must be in [1, moe.n_routed_experts = ", config.n_routed_experts, "], got ", num_local_experts);
  const int devices = cuda::device_count();
  FLEXEP_CHECK_ARG(device >= 0 && device < devices, "device", "must be in [0, ", devices, "), got ", device);
  act_ = activation_params(config, config.expert_activation);
}

void CudaGroupedExpertsCompute::check_weights(const ExpertWeights& w) const {
  const std::int64_t E = local_, dim = config_.dim, up = config_.up_dim(), inter = config_.moe_inter_dim;
  check_cuda_tensor(w.gate_and_up_projs, {E, dim, up}, DType::bf16, device_, name_ + "gate_and_up_projs");
  check_cuda_tensor(w.down_projs, {E, inter, dim}, DType::bf16, device_, name_ + "down_projs");
  auto bias = [&](const TensorView& v, std::initializer_list<std::int64_t> shape, const char* leaf) {
    const std::string name = name_ + leaf;
    FLEXEP_CHECK_ARG(v.defined() == config_.expert_bias, name, v.defined() ? "was given" : "is missing",
                     " but moe.expert_bias is ", config_.expert_bias ? "true" : "false");
    if (v.defined()) check_cuda_tensor(v, shape, DType::bf16, device_, name);
  };
  bias(w.gate_up_proj_bias, {E, up}, "gate_up_proj_bias");
  bias(w.down_proj_bias, {E, dim}, "down_proj_bias");
}

void CudaGroupedExpertsCompute::check_targets(const ExpertWeights& w, const CudaExpertGradTargets& t) const {
  check_target(t.gate_and_up_projs, w.gate_and_up_projs, {DType::bf16, DType::f32}, device_,
               name_ + "gate_and_up_projs");
  check_target(t.down_projs, w.down_projs, {DType::bf16, DType::f32}, device_, name_ + "down_projs");
  check_target(t.gate_up_proj_bias, w.gate_up_proj_bias, {DType::f32}, device_, name_ + "gate_up_proj_bias");
  check_target(t.down_proj_bias, w.down_proj_bias, {DType::f32}, device_, name_ + "down_proj_bias");
}

CudaGroupedExperts::CudaGroupedExperts(const MoEConfig& config, int num_local_experts, int first_expert, int device,
                                       GradMode grad_mode)
    : config_(config),
      local_(num_local_experts),
      first_(first_expert),
      device_(device),
      grad_mode_(grad_mode),
      compute_(config, num_local_experts, device) {
  FLEXEP_CHECK_ARG(config.dtype == DType::bf16, "moe.dtype", "the CUDA grouped experts hold bf16 parameters, got ",
                   dtype_name(config.dtype));
  FLEXEP_CHECK_ARG(first_expert >= 0 && first_expert + num_local_experts <= config.n_routed_experts, "first_expert",
                   "local experts [", first_expert, ", ", first_expert + num_local_experts,
                   ") must lie in [0, moe.n_routed_experts = ", config.n_routed_experts, ")");
  cuda::init();
  cuda::DeviceGuard dg(device_);
  cuda::StreamGuard sg(nullptr);
  const Device dev = Device::cuda(device_);
  const std::int64_t E = local_, dim = config.dim, up = config.up_dim(), inter = config.moe_inter_dim;
  gate_and_up_ = {kGateUp, Tensor::zeros({E, dim, up}, DType::bf16, dev), Tensor(), true};
  down_ = {kDown, Tensor::zeros({E, inter, dim}, DType::bf16, dev), Tensor(), true};
  gate_up_bias_.name = kGateUpBias;
  down_bias_.name = kDownBias;
  if (config.expert_bias) {
    gate_up_bias_.value = Tensor::zeros({E, up}, DType::bf16, dev);
    down_bias_.value = Tensor::zeros({E, dim}, DType::bf16, dev);
  }
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(nullptr));
}

void CudaGroupedExperts::init(std::uint64_t seed, double init_std, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(init_std >= 0 && std::isfinite(init_std), "init_std", "must be finite and >= 0, got ", init_std);
  cuda::DeviceGuard dg(device_);
  // One expert at a time, f32 first, exactly as GroupedExperts::init fills each expert's slice.
  auto fill = [&](Parameter& p, const char* name) {
    const std::int64_t per_expert = p.value.numel() / local_;
    const Shape s = p.value.shape();
    const Shape one = s.rank() == 3 ? Shape{1, s[1], s[2]} : Shape{1, s[1]};
    for (int e = 0; e < local_; ++e) {
      Tensor host = Tensor::empty(one, DType::f32);
      fill_normal(host, seed, stream_id(name), 0.0, init_std, static_cast<std::uint64_t>((first_ + e) * per_expert));
      upload_as_bf16(host, p.value.view().rows(e, e + 1), stream);
    }
  };
  fill(gate_and_up_, kGateUp);
  fill(down_, kDown);
  if (gate_up_bias_.value.defined()) cuda::zero_async(gate_up_bias_.value, stream);
  if (down_bias_.value.defined()) cuda::zero_async(down_bias_.value, stream);
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
}

void CudaGroupedExperts::load_from(GroupedExperts& cpu, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(cpu.num_local_experts() == local_ && cpu.first_expert() == first_, "cpu", "holds experts [",
                   cpu.first_expert(), ", ", cpu.first_expert() + cpu.num_local_experts(), "), this module [", first_,
                   ", ", first_ + local_, ")");
  cuda::DeviceGuard dg(device_);
  auto load = [&](Parameter& dst, Parameter& src) {
    FLEXEP_CHECK_ARG(dst.value.defined() == src.value.defined(), "cpu", "parameter '", src.name, "' is ",
                     src.value.defined() ? "present" : "absent", " on the CPU module but not on this one");
    if (!dst.value.defined()) return;
    FLEXEP_CHECK_ARG(src.value.shape() == dst.value.shape(), "cpu", "parameter '", src.name, "' has shape ",
                     src.value.shape().str(), ", expected ", dst.value.shape().str());
    upload_as_bf16(src.value, dst.value, stream);
  };
  load(gate_and_up_, cpu.gate_and_up_projs());
  load(down_, cpu.down_projs());
  load(gate_up_bias_, cpu.gate_up_proj_bias());
  load(down_bias_, cpu.down_proj_bias());
}

void CudaGroupedExperts::copy_values_to(GroupedExperts& cpu, cudaStream_t stream) {
  FLEXEP_CHECK_ARG(cpu.num_local_experts() == local_, "cpu", "has ", cpu.num_local_experts(),
                   " local experts, this module ", local_);
  cuda::DeviceGuard dg(device_);
  auto store = [&](Parameter& src, Parameter& dst) {
    FLEXEP_CHECK_ARG(dst.value.defined() == src.value.defined(), "cpu", "parameter '", src.name,
                     "' presence differs between the two modules");
    if (!src.value.defined()) return;
    FLEXEP_CHECK_ARG(src.value.shape() == dst.value.shape(), "cpu", "parameter '", dst.name, "' has shape ",
                     dst.value.shape().str(), ", expected ", src.value.shape().str());
    const Tensor host = cuda::to_host(src.value, stream).to(dst.value.dtype());
    std::memcpy(dst.value.raw(), host.raw(), host.nbytes());
  };
  store(gate_and_up_, cpu.gate_and_up_projs());
  store(down_, cpu.down_projs());
  store(gate_up_bias_, cpu.gate_up_proj_bias());
  store(down_bias_, cpu.down_proj_bias());
}

ExpertWeights CudaGroupedExperts::weights() const {
  return {gate_and_up_.value, down_.value, gate_up_bias_.value, down_bias_.value};
}

CudaExpertsOutput CudaGroupedExperts::forward(const TensorView& tokens, const TensorView& probs,
                                              const std::vector<std::int64_t>& tokens_per_expert,
                                              cudaStream_t stream) {
  return compute_.forward(weights(), tokens, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExperts::forward_gathered(const Tensor& source, const Tensor& row_ids,
                                                       const TensorView& probs,
                                                       const std::vector<std::int64_t>& tokens_per_expert,
                                                       cudaStream_t stream) {
  return compute_.forward_gathered(weights(), source, row_ids, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExperts::forward(const Tensor& tokens, const TensorView& probs,
                                              const std::vector<std::int64_t>& tokens_per_expert,
                                              cudaStream_t stream) {
  return compute_.forward(weights(), tokens, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExpertsCompute::forward(const ExpertWeights& weights, const TensorView& tokens,
                                                     const TensorView& probs,
                                                     const std::vector<std::int64_t>& tokens_per_expert,
                                                     cudaStream_t stream) const {
  return forward_impl(weights, tokens, nullptr, nullptr, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExpertsCompute::forward(const ExpertWeights& weights, const Tensor& tokens,
                                                     const TensorView& probs,
                                                     const std::vector<std::int64_t>& tokens_per_expert,
                                                     cudaStream_t stream) const {
  return forward_impl(weights, tokens.view(), &tokens, nullptr, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExpertsCompute::forward_gathered(const ExpertWeights& weights, const Tensor& source,
                                                              const Tensor& row_ids, const TensorView& probs,
                                                              const std::vector<std::int64_t>& tokens_per_expert,
                                                              cudaStream_t stream) const {
  return forward_impl(weights, source.view(), &source, &row_ids, probs, tokens_per_expert, stream);
}

CudaExpertsOutput CudaGroupedExpertsCompute::forward_impl(const ExpertWeights& weights, const TensorView& tokens,
                                                          const Tensor* keep, const Tensor* row_ids,
                                                          const TensorView& probs,
                                                          const std::vector<std::int64_t>& tokens_per_expert,
                                                          cudaStream_t stream) const {
  check_weights(weights);
  const bool gathered = row_ids != nullptr;
  check_cuda_tensor(tokens, {-1, config_.dim}, DType::bf16, device_, gathered ? "source" : "tokens");
  if (gathered) check_cuda_tensor(*row_ids, {-1}, DType::i32, device_, "row_ids");
  const std::int64_t N = gathered ? row_ids->size(0) : tokens.size(0);
  check_cuda_tensor(probs, {N}, DType::f32, device_, "probs");
  FLEXEP_CHECK_ARG(tokens_per_expert.size() == static_cast<std::size_t>(local_), "tokens_per_expert", "has ",
                   tokens_per_expert.size(), " entries, expected one per local expert (", local_, ")");
  std::int64_t active = 0;
  for (std::size_t e = 0; e < tokens_per_expert.size(); ++e) {
    FLEXEP_CHECK_ARG(tokens_per_expert[e] >= 0, "tokens_per_expert", "entry ", e, " is ", tokens_per_expert[e],
                     "; counts must be >= 0");
    FLEXEP_CHECK_ARG(tokens_per_expert[e] <= N - active, "tokens_per_expert", "sums past ", N,
                     gathered ? " but row_ids has only " : " but tokens has only ", N,
                     " rows; the sum must be <= the number of rows");
    active += tokens_per_expert[e];
  }
  cuda::DeviceGuard dg(device_);
  cuda::StreamGuard sg(stream);  // every tensor below is allocated on `stream`
  const Device dev = Device::cuda(device_);
  const std::int64_t dim = config_.dim, up = config_.up_dim(), inter = config_.moe_inter_dim;
  const std::vector<std::int64_t>& counts = tokens_per_expert;

  auto saved = std::make_shared<CudaExpertsSaved>();
  saved->owner = this;
  saved->tokens_per_expert = counts;
  saved->rows = N;
  saved->active = active;
  if (gathered) {
    saved->x = *keep;
    saved->row_ids = *row_ids;
  } else if (keep) {
    saved->x = *keep;
  } else {
    saved->x = Tensor::empty({active, dim}, DType::bf16, dev);
    cuda::copy_async(saved->x, tokens.rows(0, active), stream);
  }
  saved->p = Tensor::empty({active}, DType::f32, dev);
  cuda::copy_async(saved->p, probs.rows(0, active), stream);
  saved->offsets = cuda::expert_offsets(counts, device_, stream);
  saved->h = Tensor::empty({active, up}, DType::bf16, dev);
  saved->ap = Tensor::empty({active, inter}, DType::bf16, dev);
  Tensor y = Tensor::empty({N, dim}, DType::bf16, dev);
  cuda::zero_async(y.view().rows(active, N), stream);
  const TensorView y_active = y.view().rows(0, active);
  if (gathered) {
    cuda::gather_grouped_gemm(tokens, row_ids->view().rows(0, active), saved->offsets, weights.gate_and_up_projs,
                              saved->h, stream);
  } else {
    cuda::grouped_gemm_forward(tokens.rows(0, active), weights.gate_and_up_projs, counts, saved->h, stream);
  }
  if (config_.apply_router_weight_after_down) {
    // Automodel's order: act(h) with a prob of 1, u = a W_down (bf16) + b_down (rounded to bf16),
    // then y = bf16(u * p) in fp32.
    saved->u = Tensor::empty({active, dim}, DType::bf16, dev);
    cuda::activation_forward(act_, saved->h, weights.gate_up_proj_bias, TensorView(), saved->offsets,
                             saved->ap, stream);
    down_forward(saved->ap, weights.down_projs, counts, saved->offsets, saved->u, stream);
    if (weights.down_proj_bias.defined())
      cuda::down_bias_forward(saved->u, weights.down_proj_bias, TensorView(), saved->offsets, stream);
    cuda::prob_scale_rows(saved->u, saved->p, y_active, stream);
  } else {
    cuda::activation_forward(act_, saved->h, weights.gate_up_proj_bias, saved->p, saved->offsets, saved->ap,
                             stream);
    down_forward(saved->ap, weights.down_projs, counts, saved->offsets, y_active, stream);
    if (weights.down_proj_bias.defined())
      cuda::down_bias_forward(y_active, weights.down_proj_bias, saved->p, saved->offsets, stream);
  }

  CudaExpertsOutput out;
  out.out = std::move(y);
  out.saved = std::move(saved);
  return out;
}

CudaExpertGradTargets CudaGroupedExperts::grad_targets(cudaStream_t stream) {
  cuda::DeviceGuard dg(device_);
  cuda::StreamGuard sg(stream);
  if (grad_mode_ == GradMode::fresh_bf16_weights) renew_grads();
  const DType weight_grad_dtype = grad_mode_ == GradMode::fresh_bf16_weights ? DType::bf16 : DType::f32;
  CudaExpertGradTargets t;
  t.gate_and_up_projs = grad_of(gate_and_up_, weight_grad_dtype);
  t.down_projs = grad_of(down_, weight_grad_dtype);
  t.gate_up_proj_bias = grad_of(gate_up_bias_, DType::f32);
  t.down_proj_bias = grad_of(down_bias_, DType::f32);
  // After zero_grad the weight gradients are overwritten rather than accumulated (no zero fill).
  t.accumulate_weights = !weight_grads_stale_;
  weight_grads_stale_ = false;
  return t;
}

CudaExpertsGrads CudaGroupedExperts::backward(const CudaExpertsOutput& forward_output, const TensorView& grad_out,
                                              cudaStream_t stream) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  FLEXEP_CHECK_ARG(forward_output.saved->owner == &compute_, "forward_output",
                   "was produced by a different CudaGroupedExperts module");
  check_cuda_tensor(grad_out, {forward_output.saved->rows, config_.dim}, DType::bf16, device_, "grad_out");
  return compute_.backward(weights(), forward_output, grad_out, grad_targets(stream), stream);
}

CudaExpertsGrads CudaGroupedExpertsCompute::backward(const ExpertWeights& weights,
                                                     const CudaExpertsOutput& forward_output,
                                                     const TensorView& grad_out, const CudaExpertGradTargets& targets,
                                                     cudaStream_t stream) const {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  const CudaExpertsSaved& s = *forward_output.saved;
  FLEXEP_CHECK_ARG(s.owner == this, "forward_output", "was produced by a different grouped-experts computation");
  check_weights(weights);
  check_targets(weights, targets);
  check_cuda_tensor(grad_out, {s.rows, config_.dim}, DType::bf16, device_, "grad_out");
  cuda::DeviceGuard dg(device_);
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(device_);
  const std::int64_t N = s.rows, A = s.active;
  const std::int64_t dim = config_.dim, up = config_.up_dim(), inter = config_.moe_inter_dim;
  const std::vector<std::int64_t>& counts = s.tokens_per_expert;
  const TensorView &g_wgu = targets.gate_and_up_projs, &g_wd = targets.down_projs;
  const TensorView &g_bgu = targets.gate_up_proj_bias, &g_bd = targets.down_proj_bias;
  // grad [E, K, M] = a^T d per expert: bf16 targets are written, f32 ones accumulated or overwritten.
  // a's rows are `a_rows`, or with a table `a_rows[row_ids[i]]`: the kernel reads them in place, cuBLAS
  // from a gathered copy.
  const bool wgrad_kernel = g_wgrad.load(std::memory_order_relaxed) == ExpertWgrad::wgrad_gemm;
  auto weight_grad = [&](const TensorView& a_rows, const TensorView& row_ids, const TensorView& d,
                         const TensorView& grad) {
    const bool accumulate = grad.dtype == DType::f32 && targets.accumulate_weights;
    const bool add_bf16 = grad.dtype == DType::bf16 && targets.add_to_bf16_weights;  // cuBLAS only
    // The kernel's limits are the gathered GEMM's: 16-byte rows and addresses, at most 1024 experts.
    if (wgrad_kernel && !add_bf16 &&
        gather_gemm_fits(a_rows, d, d.size(1), static_cast<std::size_t>(grad.size(0)), grad)) {
      cuda::wgrad_grouped_gemm(a_rows, row_ids, d, s.offsets, grad, accumulate, stream);
      return;
    }
    Tensor gathered;  // a gathered forward's rows, for this GEMM only
    if (row_ids.defined()) {
      gathered = Tensor::empty({row_ids.size(0), a_rows.size(1)}, DType::bf16, dev);
      cuda::gather_rows(a_rows, row_ids, gathered, stream);
    }
    const TensorView a = row_ids.defined() ? gathered.view() : a_rows;
    if (grad.dtype == DType::bf16) cuda::grouped_gemm_wgrad_bf16(a, d, counts, grad, stream, add_bf16);
    else cuda::grouped_gemm_wgrad(a, d, counts, grad, stream, accumulate);
  };

  Tensor gx = Tensor::empty({N, dim}, DType::bf16, dev);
  Tensor gp = Tensor::empty({N}, DType::f32, dev);
  cuda::zero_async(gx.view().rows(A, N), stream);
  cuda::zero_async(gp.view().rows(A, N), stream);
  const bool after_down = config_.apply_router_weight_after_down;
  const TensorView gp_active = gp.view().rows(0, A);
  // After the down projection: grad p = <grad_y, u> and the FFN below sees bf16(grad_y * p) with a
  // prob of 1 (so the activation and the down bias add nothing to grad p).
  Tensor gu;
  if (after_down) {
    gu = Tensor::empty({A, dim}, DType::bf16, dev);
    cuda::prob_scale_rows_backward(grad_out.rows(0, A), s.u, s.p, gu, gp_active, stream);
  }
  const TensorView g = after_down ? gu.view() : grad_out.rows(0, A);
  const TensorView ffn_probs = after_down ? TensorView() : s.p.view();
  const TensorView ffn_grad_probs = after_down ? TensorView() : gp_active;

  // Down projection: the gradient reaching a_p, and W_down's gradient.
  Tensor gap = Tensor::empty({A, inter}, DType::bf16, dev);
  data_grad(g, weights.down_projs, counts, s.offsets, gap, stream);
  if (g_wd.defined()) weight_grad(s.ap, TensorView(), g, g_wd);
  // Activation (writes grad_probs), then the down bias (adds to grad_probs).
  Tensor gh = Tensor::empty({A, up}, DType::bf16, dev);
  cuda::activation_backward(act_, s.h, weights.gate_up_proj_bias, ffn_probs, s.offsets, gap, gh, ffn_grad_probs,
                            g_bgu, stream);
  if (weights.down_proj_bias.defined())
    cuda::down_bias_backward(g, weights.down_proj_bias, ffn_probs, s.offsets, g_bd, ffn_grad_probs, stream);
  // Gate/up projection.
  if (g_wgu.defined()) {
    if (s.row_ids.defined()) weight_grad(s.x, s.row_ids.view().rows(0, A), gh, g_wgu);
    else weight_grad(s.x.view().rows(0, A), TensorView(), gh, g_wgu);
  }
  data_grad(gh, weights.gate_and_up_projs, counts, s.offsets, gx.view().rows(0, A), stream);

  CudaExpertsGrads out;
  out.tokens = std::move(gx);
  out.probs = std::move(gp);
  return out;
}

// fresh_bf16_weights: this backward's tensors. The weight gradients need no fill (the wgrad GEMM
// overwrites every block); the bias kernels add to theirs.
void CudaGroupedExperts::renew_grads() {
  renew_grad(gate_and_up_, DType::bf16, false);
  renew_grad(down_, DType::bf16, false);
  renew_grad(gate_up_bias_, DType::f32, true);
  renew_grad(down_bias_, DType::f32, true);
}

void CudaGroupedExperts::zero_grad(cudaStream_t stream) {
  cuda::DeviceGuard dg(device_);
  if (grad_mode_ == GradMode::fresh_bf16_weights) {
    // The tensors belong to whoever holds them now: drop our references, write nothing.
    for (Parameter* p : parameters()) p->grad = Tensor();
    return;
  }
  // The weight gradients are the big ones (GBs at DeepSeek-V3 size): mark them instead of filling
  // them; the next backward overwrites them (beta = 0). Biases are small: zero them now.
  for (Parameter* p : parameters())
    if (p->grad.defined() && p != &gate_and_up_ && p != &down_) cuda::zero_async(p->grad, stream);
  weight_grads_stale_ = gate_and_up_.grad.defined() || down_.grad.defined();
}

void CudaGroupedExperts::materialize_grads(cudaStream_t stream) {
  if (!weight_grads_stale_) return;
  cuda::DeviceGuard dg(device_);
  for (Parameter* p : {&gate_and_up_, &down_})
    if (p->grad.defined()) cuda::zero_async(p->grad, stream);
  weight_grads_stale_ = false;
}

std::vector<Parameter*> CudaGroupedExperts::parameters() {
  std::vector<Parameter*> out = {&gate_and_up_, &down_};
  if (gate_up_bias_.value.defined()) out.push_back(&gate_up_bias_);
  if (down_bias_.value.defined()) out.push_back(&down_bias_);
  return out;
}

}  // namespace flexep
