#include "train_common.h"

#include <algorithm>

#include "flexep/core/random.h"

namespace flexep::tools {

// Rows [begin, end) of the global batch owned by `rank`.
std::pair<std::int64_t, std::int64_t> rank_rows(std::int64_t tokens, int ranks, int rank) {
  return {tokens * rank / ranks, tokens * (rank + 1) / ranks};
}

Batch make_batch(const TrainOptions& o, int step, int rank, int ranks) {
  const auto [b, e] = rank_rows(o.tokens, ranks, rank);
  const std::int64_t dim = o.moe.dim;
  Batch batch{Tensor::empty({e - b, dim}, DType::f32), Tensor::empty({e - b}, DType::b8)};
  const std::uint64_t base = static_cast<std::uint64_t>(step) * static_cast<std::uint64_t>(o.tokens);
  fill_normal(batch.x, o.seed, stream_id("train.x"), 0.0, 1.0, (base + static_cast<std::uint64_t>(b)) * dim);
  for (std::int64_t t = 0; t < o.tokens; ++t) {
    const bool pad = uniform01(o.seed, stream_id("train.padding"), base + static_cast<std::uint64_t>(t)) <
                     o.padding_fraction;
    if (!pad) ++batch.global_valid;
    if (t >= b && t < e) batch.padding.data<bool>()[t - b] = pad;
  }
  return batch;
}

std::unique_ptr<MoELayer> make_teacher(const TrainOptions& o) {
  MoEConfig tc = o.moe;
  tc.dtype = DType::f32;
  tc.gate_bias_update_factor = 0;  // the teacher is fixed
  // A narrower teacher: an over-parameterised student fits it, so the check measures the machinery
  // (routing, dispatch, gradients), not the hardness of teacher-student regression.
  tc.moe_inter_dim = std::max(1, o.moe.moe_inter_dim / 4);
  tc.shared_expert_inter_dim =
      std::max(1, (o.moe.shared_expert_inter_dim ? o.moe.shared_expert_inter_dim : o.moe.moe_inter_dim) / 4);
  MoELayerOptions to;
  to.seed = o.seed + 1000;
  to.init_std = o.teacher_std;
  BackendConfig tb = o.backend;
  tb.dispatcher = DispatcherKind::host;
  auto teacher = std::make_unique<MoELayer>(tc, tb, nullptr, to);
  // The teacher routes like the student's initial router: its experts are what there is to learn.
  // (With an unrelated random router the routed part is barely learnable from the weights' gradient
  // alone; docs/training.md.) The student's router starts from Gate::init(seed, 0.02).
  if (Gate* tg = teacher->gate()) {
    Gate student_gate(o.moe, o.backend.gate_precision, DType::f32);
    student_gate.init(o.seed, 0.02);
    tg->weight().value = student_gate.weight().value.clone();
  }
  return teacher;
}

std::pair<double, Tensor> squared_error(const Tensor& out, const Tensor& target, const Batch& batch, std::int64_t dim) {
  const std::int64_t T = batch.x.size(0);
  Tensor grad = Tensor::zeros({T, dim}, DType::f32);
  double sq = 0;
  const double scale = 2.0 / (static_cast<double>(std::max<std::int64_t>(batch.global_valid, 1)) * dim);
  for (std::int64_t t = 0; t < T; ++t) {
    if (batch.padding.data<bool>()[t]) continue;
    for (std::int64_t h = 0; h < dim; ++h) {
      const double d = read_as_double(out, t * dim + h) - target.data<float>()[t * dim + h];
      sq += d * d;
      grad.data<float>()[t * dim + h] = static_cast<float>(scale * d);
    }
  }
  return {sq, grad};
}

void record_losses(TrainReport& report, const std::vector<double>& losses) {
  report.losses = losses;
  const int steps = static_cast<int>(losses.size());
  const int w = std::max(1, std::min(5, steps / 10));
  for (int i = 0; i < w; ++i) {
    report.first_loss += losses[static_cast<std::size_t>(i)] / w;
    report.last_loss += losses[static_cast<std::size_t>(steps - 1 - i)] / w;
  }
  report.loss_check = report.last_loss < 0.25 * report.first_loss;
}

}  // namespace flexep::tools
