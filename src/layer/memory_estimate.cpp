#include "flexep/layer/memory_estimate.h"

#include "flexep/layer/moe_weights.h"

namespace flexep {

LayerMemoryEstimate estimate_gpu_layer_memory(const MoEConfig& c, const BackendConfig& backend, int ep_size,
                                              std::int64_t tokens_per_rank) {
  LayerMemoryEstimate m;
  // In doubles: a size that would not fit 64 bits is still a (huge) number to report.
  double params = 0;
  for (const MoEWeightSpec& s : moe_weight_specs(c, backend, c.n_routed_experts / ep_size))
    params += static_cast<double>(s.shape.numel());
  const double T = static_cast<double>(tokens_per_rank), rows = T * c.n_activated_experts;
  const double D = c.expert_dim(), up = c.up_dim(), I = c.moe_inter_dim, E = c.n_routed_experts;
  const double S = c.shared_inter(), shared_up = c.shared_expert_activation == Activation::relu2 ? S : 2 * S;
  // Kept for backward, bf16 unless said: the routed rows (D; a copy unless the experts read them in
  // place), x W_gu (up) and the activation (I) per row; the router's scores and probabilities (f32,
  // E per token); the shared expert's x W_gu and activation, and x itself per token. The experts'
  // outputs are released once combined.
  const double kept = 2 * rows * (D + up + I) + 2 * 4 * T * E + 2 * T * (shared_up + S) + 2 * T * c.dim;
  auto bytes = [](double b) { return static_cast<std::size_t>(b); };
  m.weights = bytes(2 * params);
  m.gradients = bytes(4 * params);
  m.activations = bytes(2 * kept);
  return m;
}

}  // namespace flexep
