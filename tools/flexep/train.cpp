#include "train.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include <unistd.h>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "adam.h"
#include "flexep/comm/host_world.h"
#include "flexep/core/config_json.h"
#include "flexep/core/random.h"
#include "flexep/core/warn_once.h"
#include "flexep/dispatch/registry.h"
#include "flexep/layer/moe_layer.h"
#include "progress.h"
#include "train_common.h"

namespace flexep::tools {

TrainOptions default_train_options() {
  TrainOptions o;
  MoEConfig& m = o.moe;
  m.dim = 64;
  m.n_routed_experts = 16;
  m.n_activated_experts = 4;
  m.moe_inter_dim = 64;
  m.n_shared_experts = 1;
  m.score_func = ScoreFunc::sigmoid;
  m.norm_topk_prob = true;
  m.route_scale = 1.0;
  m.gate_bias_update_factor = 1e-3;
  m.aux_loss_coeff = 0.0;
  m.n_expert_groups = 1;
  m.n_limited_groups = 1;
  m.dtype = DType::f32;
  o.backend.dispatcher = DispatcherKind::host;
  return o;
}

namespace {

// The train section's values, each checked for its JSON type and range before it is used.
std::string given(const nlohmann::json& v) { return describe_json_value(v.type_name(), v.dump()); }

long long train_integer(const nlohmann::json& v, const std::string& arg, long long lo, long long hi) {
  bool ok = v.is_number_integer();  // lo >= 0 here: an unsigned value compares as unsigned
  if (ok && v.is_number_unsigned()) {
    const auto u = v.get<unsigned long long>();
    ok = u >= static_cast<unsigned long long>(lo) && u <= static_cast<unsigned long long>(hi);
  } else if (ok) {
    ok = v.get<long long>() >= lo && v.get<long long>() <= hi;
  }
  if (!ok) throw_argument_error(arg, "expected a whole number from ", lo, " to ", hi, ", got ", given(v));
  return v.get<long long>();
}

double train_positive(const nlohmann::json& v, const std::string& arg) {
  const double x = v.is_number() ? v.get<double>() : NAN;
  if (!(std::isfinite(x) && x > 0)) throw_argument_error(arg, "expected a finite number above 0, got ", given(v));
  return x;
}

double train_fraction(const nlohmann::json& v, const std::string& arg) {
  const double x = v.is_number() ? v.get<double>() : NAN;
  if (!(x >= 0 && x < 1)) throw_argument_error(arg, "expected a number in [0, 1), got ", given(v));
  return x;
}

}  // namespace

void apply_train_json(TrainOptions& o, const std::string& json_text) {
  const nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) throw_argument_error("train", "expected a JSON object, got ", json_text);
  for (const auto& [key, value] : j.items()) {
    const std::string arg = "train." + key;
    if (key == "ranks") o.ranks = static_cast<int>(train_integer(value, arg, 1, 64));
    else if (key == "steps") o.steps = static_cast<int>(train_integer(value, arg, 1, 1000000000));
    else if (key == "tokens") o.tokens = static_cast<int>(train_integer(value, arg, 1, 1 << 30));
    else if (key == "seed") o.seed = static_cast<std::uint64_t>(train_integer(value, arg, 0, LLONG_MAX));
    else if (key == "lr") o.lr = train_positive(value, arg);
    else if (key == "teacher_std") o.teacher_std = train_positive(value, arg);
    else if (key == "padding_fraction") o.padding_fraction = train_fraction(value, arg);
    else if (key == "device") {
      if (!value.is_string()) throw_argument_error(arg, "expected a string (cpu or cuda), got ", given(value));
      o.device = value.get<std::string>();
    } else {
      throw_argument_error(arg, "is not a train option; known: ranks, steps, tokens, seed, lr, teacher_std, "
                           "padding_fraction, device");
    }
  }
}

std::string train_json(const TrainOptions& o) {
  nlohmann::json j = {{"ranks", o.ranks}, {"steps", o.steps}, {"tokens", o.tokens}, {"seed", o.seed},
                      {"lr", o.lr}, {"teacher_std", o.teacher_std}, {"padding_fraction", o.padding_fraction},
                      {"device", o.device}};
  return j.dump(2);
}

namespace {

// The job's host memory, roughly, before any of it is allocated: the student's parameters with
// their gradients and two Adam moments (f32; replicated parameters on every rank), the teacher
// (experts a quarter as wide), the 1-rank replica of check 2, and the experts' activations of a
// step. A job that cannot fit is refused with the size it would need rather than run into the
// allocator (or for minutes) first.
void check_host_memory(const TrainOptions& o) {
  const MoEConfig& m = o.moe;
  const double D = m.dim, I = m.moe_inter_dim, E = m.n_routed_experts, k = m.n_activated_experts;
  const double experts = E * 3 * D * I;
  const double replicated = D * E + 3 * D * m.shared_inter() + D;
  const double student = experts + o.ranks * replicated;
  const double floats = 4 * student + experts / 4 + replicated + (experts + replicated) * 2 +
                        static_cast<double>(o.tokens) * k * (3 * I + 2 * D) * 2;
  const double need = 4 * floats;
  const double have = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  FLEXEP_CHECK_ARG(have <= 0 || need <= 0.8 * have, "moe", "this job needs about ", need / (1 << 30),
                   " GiB of host memory (", E, " experts of ", D, " x ", I, ", a shared MLP ", m.shared_inter(),
                   " wide, ", o.ranks, " ranks, ", o.tokens, " tokens: parameters, gradients, Adam state, the teacher "
                   "and the 1-rank check), more than 80% of this machine's ", have / (1 << 30),
                   " GiB; allowed: sizes that fit");
}

}  // namespace

void validate_train_options(const TrainOptions& o) {
  FLEXEP_CHECK_ARG(o.ranks >= 1 && o.ranks <= 64, "train.ranks", "must be in [1, 64], got ", o.ranks);
  FLEXEP_CHECK_ARG(o.steps >= 1, "train.steps", "must be >= 1, got ", o.steps);
  FLEXEP_CHECK_ARG(o.tokens >= o.ranks, "train.tokens", "must be >= train.ranks (", o.ranks, "), got ", o.tokens);
  FLEXEP_CHECK_ARG(o.lr > 0 && o.lr <= 10, "train.lr", "must be above 0, up to 10 (Adam's step size), got ", o.lr);
  FLEXEP_CHECK_ARG(o.padding_fraction >= 0 && o.padding_fraction < 1, "train.padding_fraction",
                   "must be in [0, 1), got ", o.padding_fraction);
  // Each token is padding with this probability: a step needs some valid ones to have a loss.
  FLEXEP_CHECK_ARG(o.tokens * (1 - o.padding_fraction) >= 8, "train.padding_fraction", "is ", o.padding_fraction,
                   ", which leaves ", o.tokens * (1 - o.padding_fraction), " valid tokens of ", o.tokens,
                   " per step on average; allowed: a fraction that leaves at least 8");
#ifdef FLEXEP_WITH_CUDA
  FLEXEP_CHECK_ARG(o.device == "cpu" || o.device == "cuda", "train.device", "'", o.device,
                   "' is not a device; allowed: cpu, cuda");
#else
  FLEXEP_CHECK_ARG(o.device == "cpu", "train.device", "'", o.device,
                   "' is not available in this build (built without CUDA); allowed: cpu");
#endif
  if (const DispatcherBackend& b = dispatcher_backend(to_string(o.backend.dispatcher)); !b.make)
    throw_argument_error("backend.dispatcher", "'", b.name, "' ", b.missing, "; built here: ", built_dispatcher_names());
  FLEXEP_CHECK_ARG(o.device == "cuda" || o.backend.dispatcher == DispatcherKind::host, "backend.dispatcher", "'",
                   to_string(o.backend.dispatcher), "' needs GPUs; on the CPU the allowed value is host");
  FLEXEP_CHECK_ARG(o.teacher_std > 0 && o.teacher_std <= 1e3, "train.teacher_std", "must be above 0, up to 1000, got ",
                   o.teacher_std);
  validate(o.moe);
  validate(o.backend);
  validate_ep(o.moe, o.ranks);
  // The job's precision is fixed by its device: said, not silently overridden.
  if (o.device == "cpu" && o.moe.dtype != DType::f32)
    warn_once(std::string("moe.dtype is ") + std::string(dtype_name(o.moe.dtype)) +
              ", but flexep train on the CPU computes in float32 (the reference precision); the GPU layer in bf16");
  if (o.device == "cuda" && o.moe.dtype != DType::f32 && o.moe.dtype != DType::bf16)
    warn_once(std::string("moe.dtype is ") + std::string(dtype_name(o.moe.dtype)) +
              ", but flexep train on GPUs computes in bf16 (float32 masters on the host)");
  check_host_memory(o);
}

namespace {

// One rank of the job: student, teacher and optimiser.
struct Rank {
  Rank(const TrainOptions& o, std::shared_ptr<HostWorld> world, int rank)
      : group(world, rank), adam(o.lr) {
    MoELayerOptions so;
    so.seed = o.seed;
    so.init_std = 0.02;
    DispatcherSpec spec;
    spec.group = std::make_shared<HostProcessGroup>(world, rank);
    spec.num_experts = o.moe.n_routed_experts;
    auto dispatcher = std::shared_ptr<TokenDispatcher>(make_dispatcher("host", spec));
    student = std::make_unique<MoELayer>(o.moe, o.backend, world->size() > 1 ? dispatcher : nullptr, so);
    teacher = make_teacher(o);
  }

  // Forward + backward of one step; returns this rank's sum of squared errors. Gradients of
  // replicated parameters are all-reduced, so afterwards every rank holds the full gradient.
  double forward_backward(const Batch& batch, std::int64_t dim) {
    const Tensor target = teacher->forward(batch.x, batch.padding, false).out;
    student->zero_grad();
    MoEOutput out = student->forward(batch.x, batch.padding, true);
    const auto [sq, grad] = squared_error(out.out, target, batch, dim);
    student->backward(out, grad);
    for (Parameter* p : student->replicated_parameters())
      if (p->grad.defined()) group.all_reduce_sum(p->grad, "gradient all-reduce of " + p->name);
    return sq;
  }

  HostProcessGroup group;
  std::unique_ptr<MoELayer> student, teacher;
  Adam adam;
};

// Gradients of one step on `ranks` ranks, by full parameter name; expert tensors concatenated over
// ranks in expert order so they compare with the single-rank ones.
std::map<std::string, std::vector<double>> step_gradients(const TrainOptions& o, int ranks) {
  TrainOptions oc = o;
  oc.moe.aux_loss_coeff = 0;  // per-rank aux loss differs by design with the rank count (docs/training.md)
  auto world = std::make_shared<HostWorld>(ranks);
  std::vector<std::map<std::string, std::vector<double>>> per_rank(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](int r) {
    Rank rank(oc, world, r);
    rank.forward_backward(make_batch(oc, 0, r, ranks), oc.moe.dim);
    for (Parameter* p : rank.student->parameters()) {
      auto& v = per_rank[static_cast<std::size_t>(r)][p->name];
      for (std::int64_t i = 0; i < p->value.numel(); ++i)
        v.push_back(p->grad.defined() ? read_as_double(p->grad, i) : 0.0);
    }
  });
  std::map<std::string, std::vector<double>> merged = per_rank[0];
  for (auto& [name, values] : merged)
    if (name.rfind("experts.", 0) == 0)
      for (int r = 1; r < ranks; ++r) {
        const auto& more = per_rank[static_cast<std::size_t>(r)][name];
        values.insert(values.end(), more.begin(), more.end());
      }
  return merged;
}

}  // namespace

TrainReport run_training(const TrainOptions& o) {
  validate_train_options(o);
#ifdef FLEXEP_WITH_CUDA
  if (o.device == "cuda") return run_training_cuda(o);
#endif
  TrainReport report;

  // Check 2 first (fresh parameters): R ranks vs 1 rank on the first batch. It can take a while
  // before the progress bar starts (large layers): say so.
  if (!o.quiet) fmt::print(stderr, "check 2: the first batch on {} rank(s) and on 1 rank...\n", o.ranks);
  const auto g_many = step_gradients(o, o.ranks);
  const auto g_one = step_gradients(o, 1);
  for (const auto& [name, ref] : g_one) {
    const auto& got = g_many.at(name);
    double max_ref = 0, max_diff = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      max_ref = std::max(max_ref, std::fabs(ref[i]));
      max_diff = std::max(max_diff, std::fabs(ref[i] - got[i]));
    }
    const double rel = max_ref > 0 ? max_diff / max_ref : max_diff;
    if (rel >= report.max_grad_rel_diff) {
      report.max_grad_rel_diff = rel;
      report.worst_parameter = name;
    }
  }
  report.rank_check = report.max_grad_rel_diff < 1e-5;
  report.rank_check_label = fmt::format("{} ranks == 1 rank", o.ranks);
  report.rank_check_limit = 1e-5;

  // Training.
  auto world = std::make_shared<HostWorld>(o.ranks);
  std::vector<double> losses(static_cast<std::size_t>(o.steps));
  Progress progress(o.steps, fmt::format("train ({} ranks, {})", o.ranks, to_string(o.backend.dispatcher)));
  run_ranks(o.ranks, [&](int r) {
    Rank rank(o, world, r);
    Tensor loss = Tensor::zeros({1}, DType::f64);
    for (int step = 0; step < o.steps; ++step) {
      const Batch batch = make_batch(o, step, r, o.ranks);
      loss.data<double>()[0] = rank.forward_backward(batch, o.moe.dim);
      rank.group.all_reduce_sum(loss, "loss all-reduce");
      rank.adam.step(rank.student->parameters());
      if (Gate* g = rank.student->gate(); g && o.moe.gate_bias_update_factor > 0) g->update_bias(&rank.group);
      if (r == 0) {
        const double mse = loss.data<double>()[0] / (static_cast<double>(std::max<std::int64_t>(batch.global_valid, 1)) *
                                                     o.moe.dim);
        losses[static_cast<std::size_t>(step)] = mse;
        if (!o.quiet) progress.update(step + 1, fmt::format("loss {:.4e}", mse));
      }
    }
  });
  record_losses(report, losses);
  return report;
}

}  // namespace flexep::tools
