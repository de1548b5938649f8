#include "flexep/layer/latent_projections.h"

#include <cmath>

#include "flexep/core/error.h"
#include "flexep/core/random.h"

namespace flexep {

namespace {
// Also the random streams' names, fixed here so a rename by an owner cannot change initial values.
constexpr const char* kFc1W = "fc1_latent_proj.weight";
constexpr const char* kFc1B = "fc1_latent_proj.bias";
constexpr const char* kFc2W = "fc2_latent_proj.weight";
constexpr const char* kFc2B = "fc2_latent_proj.bias";
}  // namespace

LatentProjections::LatentProjections(const MoEConfig& c, DType dtype) {
  FLEXEP_CHECK_ARG(c.latent(), "moe.moe_latent_size", "is 0; latent projections need a latent size >= 1");
  const std::int64_t dim = c.dim, latent = c.moe_latent_size;
  auto make = [&](Parameter& p, const char* name, Shape shape, bool present) {
    p.name = name;
    if (present) p.value = Tensor::zeros(shape, dtype);
  };
  make(fc1_w_, kFc1W, {latent, dim}, true);
  make(fc1_b_, kFc1B, {latent}, c.expert_bias);
  make(fc2_w_, kFc2W, {dim, latent}, true);
  make(fc2_b_, kFc2B, {dim}, c.expert_bias);
}

void LatentProjections::init(std::uint64_t seed, double init_std) {
  FLEXEP_CHECK_ARG(init_std >= 0 && std::isfinite(init_std), "init_std", "must be finite and >= 0, got ", init_std);
  fill_normal(fc1_w_.value, seed, stream_id(kFc1W), 0.0, init_std);
  fill_normal(fc2_w_.value, seed, stream_id(kFc2W), 0.0, init_std);
  for (Parameter* b : {&fc1_b_, &fc2_b_})
    if (b->value.defined()) b->value.fill_zero();
}

LinearWeights LatentProjections::fc1() const {
  return {fc1_w_.value.view(), fc1_b_.value.defined() ? fc1_b_.value.view() : TensorView()};
}

LinearWeights LatentProjections::fc2() const {
  return {fc2_w_.value.view(), fc2_b_.value.defined() ? fc2_b_.value.view() : TensorView()};
}

std::vector<Parameter*> LatentProjections::parameters() {
  std::vector<Parameter*> out;
  for (Parameter* p : {&fc1_w_, &fc1_b_, &fc2_w_, &fc2_b_})
    if (p->value.defined()) out.push_back(p);
  return out;
}

}  // namespace flexep
