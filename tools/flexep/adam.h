// Adam (Kingma & Ba) over flexep Parameters, with fp64 moments so the optimiser adds no rounding
// of its own to the rank-count comparison.
#pragma once

#include <cmath>
#include <vector>

#include "flexep/core/tensor.h"

namespace flexep::tools {

class Adam {
 public:
  explicit Adam(double lr, double beta1 = 0.9, double beta2 = 0.999, double eps = 1e-8)
      : lr_(lr), b1_(beta1), b2_(beta2), eps_(eps) {}

  void step(const std::vector<Parameter*>& params) {
    ++t_;
    if (m_.size() != params.size()) {
      m_.assign(params.size(), {});
      v_.assign(params.size(), {});
    }
    const double c1 = 1.0 - std::pow(b1_, t_), c2 = 1.0 - std::pow(b2_, t_);
    for (std::size_t i = 0; i < params.size(); ++i) {
      Parameter& p = *params[i];
      if (!p.requires_grad || !p.grad.defined()) continue;
      const std::int64_t n = p.value.numel();
      m_[i].resize(static_cast<std::size_t>(n), 0.0);
      v_[i].resize(static_cast<std::size_t>(n), 0.0);
      for (std::int64_t j = 0; j < n; ++j) {
        const double g = read_as_double(p.grad, j);
        double& m = m_[i][static_cast<std::size_t>(j)];
        double& v = v_[i][static_cast<std::size_t>(j)];
        m = b1_ * m + (1 - b1_) * g;
        v = b2_ * v + (1 - b2_) * g * g;
        const double update = lr_ * (m / c1) / (std::sqrt(v / c2) + eps_);
        write_from_double(p.value, j, read_as_double(p.value, j) - update);
      }
    }
  }

 private:
  double lr_, b1_, b2_, eps_;
  int t_ = 0;
  std::vector<std::vector<double>> m_, v_;
};

}  // namespace flexep::tools
