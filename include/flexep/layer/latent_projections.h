// Automodel's latent projections (moe.moe_latent_size) as parameters, for the owner layers
// (MoELayer, CudaMoELayer): fc1_latent_proj (dim -> latent) before the routed experts,
// fc2_latent_proj (latent -> dim) after the combine, nn.Linear-shaped, biases with moe.expert_bias.
// The math lives in the compute objects (moe_compute.h, cuda_moe_compute.h); this holds values
// and gradients only.
#pragma once

#include <cstdint>
#include <vector>

#include "flexep/core/config.h"
#include "flexep/core/tensor.h"
#include "flexep/layer/moe_weights.h"

namespace flexep {

class LatentProjections {
 public:
  // CPU parameters in `dtype`; the configuration must set moe.moe_latent_size.
  LatentProjections(const MoEConfig& config, DType dtype);
  // Weights N(0, init_std) (Automodel's _init_weights), biases zero.
  void init(std::uint64_t seed, double init_std);
  LinearWeights fc1() const;
  LinearWeights fc2() const;
  // "fc1_latent_proj.weight", ... (full state_dict names), the present ones.
  std::vector<Parameter*> parameters();
  // Each parameter (a bias is undefined without moe.expert_bias).
  Parameter& fc1_weight() { return fc1_w_; }
  Parameter& fc1_bias() { return fc1_b_; }
  Parameter& fc2_weight() { return fc2_w_; }
  Parameter& fc2_bias() { return fc2_b_; }

 private:
  Parameter fc1_w_, fc1_b_, fc2_w_, fc2_b_;
};

}  // namespace flexep
