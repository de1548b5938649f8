#include "layer/shared_layout.h"

#include <cstring>

#include "flexep/core/error.h"

namespace flexep {

namespace {

bool gated(const MoEConfig& c) { return c.shared_expert_activation != Activation::relu2; }

// dst[i * dst_cols + j] = src[(row0 + j) * src_cols + col0 + i] for i < rows, j < cols: a transposed
// block copy, element by element in the common dtype.
void copy_transposed(const TensorView& src, std::int64_t src_cols, std::int64_t row0, std::int64_t col0,
                     const TensorView& dst, std::int64_t dst_cols, std::int64_t dst_col0, std::int64_t rows,
                     std::int64_t cols) {
  const std::size_t size = element_size(src.dtype);
  const char* s = static_cast<const char*>(src.data);
  char* d = static_cast<char*>(dst.data);
  for (std::int64_t i = 0; i < rows; ++i)
    for (std::int64_t j = 0; j < cols; ++j)
      std::memcpy(d + static_cast<std::size_t>(i * dst_cols + dst_col0 + j) * size,
                  s + static_cast<std::size_t>((row0 + j) * src_cols + col0 + i) * size, size);
}

// n contiguous elements of src from `from` to dst at `to`.
void copy_range(const TensorView& src, std::int64_t from, const TensorView& dst, std::int64_t to, std::int64_t n) {
  const std::size_t size = element_size(src.dtype);
  std::memcpy(static_cast<char*>(dst.data) + static_cast<std::size_t>(to) * size,
              static_cast<const char*>(src.data) + static_cast<std::size_t>(from) * size,
              static_cast<std::size_t>(n) * size);
}

void check_cpu(const TensorView& t, const char* what) {
  FLEXEP_CHECK(!t.defined() || t.device.is_cpu(), "shared-expert layout: ", what, " must be on the CPU, is on ",
               t.device.str());
}

}  // namespace

SharedMlpGradients shared_to_linear(const MoEConfig& c, const ExpertWeights& g, const TensorView& shared_expert_gate) {
  const std::int64_t I = c.shared_inter(), D = c.dim, up = gated(c) ? 2 * I : I;
  check_cpu(g.gate_and_up_projs, "gate_and_up_projs");
  check_cpu(g.down_projs, "down_projs");
  check_cpu(g.gate_up_proj_bias, "gate_up_proj_bias");
  check_cpu(g.down_proj_bias, "down_proj_bias");
  SharedMlpGradients l;
  if (g.gate_and_up_projs.defined()) {
    const TensorView& gu = g.gate_and_up_projs;
    if (gated(c)) {
      l.gate_proj = Tensor::empty({I, D}, gu.dtype);
      copy_transposed(gu, up, 0, 0, l.gate_proj, D, 0, I, D);
    }
    l.up_proj = Tensor::empty({I, D}, gu.dtype);
    copy_transposed(gu, up, 0, up - I, l.up_proj, D, 0, I, D);
  }
  if (g.down_projs.defined()) {
    l.down_proj = Tensor::empty({D, I}, g.down_projs.dtype);
    copy_transposed(g.down_projs, D, 0, 0, l.down_proj, I, 0, D, I);
  }
  if (g.gate_up_proj_bias.defined()) {
    const TensorView& gb = g.gate_up_proj_bias;
    if (gated(c)) {
      l.gate_proj_bias = Tensor::empty({I}, gb.dtype);
      copy_range(gb, 0, l.gate_proj_bias, 0, I);
    }
    l.up_proj_bias = Tensor::empty({I}, gb.dtype);
    copy_range(gb, up - I, l.up_proj_bias, 0, I);
  }
  if (g.down_proj_bias.defined()) {
    l.down_proj_bias = Tensor::empty({D}, g.down_proj_bias.dtype);
    copy_range(g.down_proj_bias, 0, l.down_proj_bias, 0, D);
  }
  if (shared_expert_gate.defined()) l.shared_expert_gate = Tensor::wrap(shared_expert_gate).clone();
  return l;
}

ExpertGradients shared_to_grouped(const MoEConfig& c, const SharedMlpWeights& l) {
  const std::int64_t I = c.shared_inter(), D = c.dim, up = gated(c) ? 2 * I : I;
  for (const TensorView* t : {&l.gate_proj, &l.up_proj, &l.down_proj, &l.gate_proj_bias, &l.up_proj_bias,
                              &l.down_proj_bias})
    check_cpu(*t, "a linear-layout tensor");
  ExpertGradients g;
  if (l.up_proj.defined()) {
    g.gate_and_up_projs = Tensor::empty({1, D, up}, l.up_proj.dtype);
    // gate_and_up[d, i] = gate_proj[i, d]; gate_and_up[d, up - I + i] = up_proj[i, d].
    if (gated(c)) copy_transposed(l.gate_proj, D, 0, 0, g.gate_and_up_projs, up, 0, D, I);
    copy_transposed(l.up_proj, D, 0, 0, g.gate_and_up_projs, up, up - I, D, I);
  }
  if (l.down_proj.defined()) {
    g.down_projs = Tensor::empty({1, I, D}, l.down_proj.dtype);
    copy_transposed(l.down_proj, I, 0, 0, g.down_projs, D, 0, I, D);
  }
  if (l.up_proj_bias.defined()) {
    g.gate_up_proj_bias = Tensor::empty({1, up}, l.up_proj_bias.dtype);
    if (gated(c)) copy_range(l.gate_proj_bias, 0, g.gate_up_proj_bias, 0, I);
    copy_range(l.up_proj_bias, 0, g.gate_up_proj_bias, up - I, I);
  }
  if (l.down_proj_bias.defined()) {
    g.down_proj_bias = Tensor::empty({1, D}, l.down_proj_bias.dtype);
    copy_range(l.down_proj_bias, 0, g.down_proj_bias, 0, D);
  }
  return g;
}

}  // namespace flexep
