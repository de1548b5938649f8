#include "flexep/layer/moe_layer.h"

#include "flexep/core/checks.h"
#include "layer/add_into.h"
#include "layer/shared_layout.h"

namespace flexep {

namespace {

const MoELayerOptions& checked(const MoELayerOptions& o) {
  FLEXEP_CHECK_ARG(o.param_dtype == DType::f32 || o.param_dtype == DType::f64, "param_dtype",
                   "the CPU reference layer computes in f32 or f64, got ", dtype_name(o.param_dtype));
  return o;
}

// A backward's fresh gradient into the parameter: taken over when p has none, else added.
void accumulate(Parameter& p, const Tensor& g) {
  if (!p.value.defined() || !p.requires_grad || !g.defined()) return;
  if (!p.grad.defined()) p.grad = g;
  else ref::add_into(p.grad, g);
}

}  // namespace

struct MoELayer::Views {
  MoEWeights weights;
  ExpertGradients shared_grouped;  // the grouped copy the shared views point into
};

MoELayer::MoELayer(const MoEConfig& config, const BackendConfig& backend, std::shared_ptr<TokenDispatcher> dispatcher,
                   const MoELayerOptions& options)
    : config_(config),
      backend_(backend),
      options_(checked(options)),
      compute_(config, backend, std::move(dispatcher), options.dispatch) {
  const int local = compute_.num_local_experts(), rank = compute_.ep_rank();
  FLEXEP_CHECK_ARG(!options.gate_input_dtype || *options.gate_input_dtype == DType::bf16 ||
                       *options.gate_input_dtype == DType::f16,
                   "gate_input_dtype", "is ", options.gate_input_dtype ? dtype_name(*options.gate_input_dtype) : "",
                   "; allowed: bf16, f16 or unset");
  compute_.set_gate_input_dtype(options.gate_input_dtype);
  if (backend_.fake_balanced_gate) fake_gate_ = std::make_unique<FakeBalancedGate>(config_, backend_.fake_gate_noise);
  else gate_ = std::make_unique<Gate>(config_, backend_.gate_precision, options_.param_dtype);
  experts_ = std::make_unique<GroupedExperts>(config_.routed_expert_config(), local, rank * local, options_.param_dtype);
  if (config_.n_shared_experts > 0) shared_ = std::make_unique<SharedExperts>(config_, options_.param_dtype);
  if (config_.latent()) latent_ = std::make_unique<LatentProjections>(config_, options_.param_dtype);

  if (gate_) gate_->init(options_.seed, options_.init_std);
  experts_->init(options_.seed, options_.init_std);
  if (shared_) shared_->init(options_.seed, options_.init_std);
  if (latent_) latent_->init(options_.seed, options_.init_std);
}

MoELayer::Views MoELayer::views() const {
  Views v;
  if (gate_) v.weights.gate = gate_->weights();
  v.weights.experts = experts_->weights();
  if (shared_) {
    const SharedMlpWeights lin = shared_->weights();
    v.shared_grouped = shared_to_grouped(config_, lin);
    v.weights.shared_experts = views_of(v.shared_grouped);
    v.weights.shared_expert_gate = lin.shared_expert_gate;
  }
  if (latent_) {
    v.weights.fc1_latent_proj = latent_->fc1();
    v.weights.fc2_latent_proj = latent_->fc2();
  }
  return v;
}

MoEOutput MoELayer::forward(const TensorView& x, const TensorView& padding_mask, bool training,
                            const TensorView& replay_indices) {
  check::shape(x, {-1, config_.dim}, "x");
  check::dtype(x, {options_.param_dtype}, "x");
  if (padding_mask.defined()) {
    check::shape(padding_mask, {x.size(0)}, "padding_mask");
    check::dtype(padding_mask, {DType::b8}, "padding_mask");
  }
  RoutingOverride replay;
  replay.indices = replay_indices;
  MoEOutput out = compute_.forward(views().weights, x, padding_mask, training, replay);
  if (gate_ && training && config_.gate_bias_update_factor > 0) {
    const std::int64_t* load = out.expert_load.data<std::int64_t>();
    gate_->add_to_cumulative_load(std::vector<std::int64_t>(load, load + out.expert_load.numel()));
  }
  return out;
}

Tensor MoELayer::backward(const MoEOutput& forward_output, const TensorView& grad_out) {
  FLEXEP_CHECK_ARG(forward_output.saved != nullptr, "forward_output", "has no saved state (was forward called?)");
  check::shape(grad_out, {forward_output.out.size(0), config_.dim}, "grad_out");
  check::dtype(grad_out, {options_.param_dtype}, "grad_out");
  MoEBackward b = compute_.backward(views().weights, *forward_output.saved, grad_out,
                                    gate_ ? gate_->aux_loss_scale : 1.0);
  const MoEGradients& g = b.gradients;
  if (gate_) {
    accumulate(gate_->weight(), g.gate.weight);
    accumulate(gate_->bias(), g.gate.bias);
  }
  accumulate(experts_->gate_and_up_projs(), g.experts.gate_and_up_projs);
  accumulate(experts_->down_projs(), g.experts.down_projs);
  accumulate(experts_->gate_up_proj_bias(), g.experts.gate_up_proj_bias);
  accumulate(experts_->down_proj_bias(), g.experts.down_proj_bias);
  if (shared_) {
    const SharedMlpGradients lin =
        shared_to_linear(config_, views_of(g.shared_experts), g.shared_expert_gate);
    const std::vector<Parameter*> ps = shared_->parameters();
    auto param = [&](const char* name) -> Parameter* {
      for (Parameter* p : ps)
        if (p->name == name) return p;
      return nullptr;
    };
    const std::pair<const char*, const Tensor*> named[] = {
        {"shared_experts.gate_proj.weight", &lin.gate_proj},     {"shared_experts.up_proj.weight", &lin.up_proj},
        {"shared_experts.down_proj.weight", &lin.down_proj},     {"shared_experts.gate_proj.bias", &lin.gate_proj_bias},
        {"shared_experts.up_proj.bias", &lin.up_proj_bias},      {"shared_experts.down_proj.bias", &lin.down_proj_bias},
        {"shared_expert_gate.weight", &lin.shared_expert_gate}};
    for (const auto& [name, grad] : named)
      if (Parameter* p = param(name)) accumulate(*p, *grad);
  }
  if (latent_) {
    accumulate(latent_->fc1_weight(), g.fc1_latent_proj.weight);
    accumulate(latent_->fc1_bias(), g.fc1_latent_proj.bias);
    accumulate(latent_->fc2_weight(), g.fc2_latent_proj.weight);
    accumulate(latent_->fc2_bias(), g.fc2_latent_proj.bias);
  }
  return b.grad_x;
}

std::vector<Parameter*> MoELayer::parameters() {
  std::vector<Parameter*> all;
  auto add = [&all](Parameter* p, const std::string& prefix) {
    if (!p->value.defined()) return;
    if (p->name.rfind(prefix, 0) != 0) p->name = prefix + p->name;
    all.push_back(p);
  };
  if (gate_)
    for (Parameter* p : gate_->parameters()) add(p, "gate.");
  for (Parameter* p : experts_->parameters()) add(p, "experts.");
  if (shared_)
    for (Parameter* p : shared_->parameters()) add(p, "");
  if (latent_)
    for (Parameter* p : latent_->parameters()) add(p, "");
  return all;
}

std::vector<Parameter*> MoELayer::replicated_parameters() {
  std::vector<Parameter*> rep;
  for (Parameter* p : parameters())
    if (p->name.rfind("experts.", 0) != 0) rep.push_back(p);
  return rep;
}

void MoELayer::zero_grad() {
  for (Parameter* p : parameters())
    if (p->grad.defined()) p->grad.fill_zero();
}

}  // namespace flexep
