// `flexep train --device cuda`: the student MoE layer on GPUs (one rank per GPU, one thread each;
// EP size 1 uses the single-GPU dispatcher, larger sizes the alltoall backend over NCCL, or the
// hybridep backend with --backend hybridep: one dispatcher per rank for the one layer), the
// teacher and the optimiser on the host. Check 2 here compares one GPU step (all ranks) with the
// CPU reference step on the same bf16-rounded weights and inputs.
#include <algorithm>
#include <cmath>
#include <map>

#include <fmt/core.h>

#include "adam.h"
#include "flexep/comm/communicator.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/registry.h"
#include "flexep/layer/cuda_moe_layer.h"
#include "flexep/layer/memory_estimate.h"
#include "progress.h"
#include "train_common.h"

namespace flexep::tools {

namespace {

Tensor round_bf16(const Tensor& t) { return t.to(DType::bf16).to(DType::f32); }

// One GPU rank: the student on the device, fp32 master weights and Adam on the host.
struct CudaRank {
  CudaRank(const TrainOptions& o, const ncclUniqueId& id, int rank, int ranks) : adam(o.lr), device(rank) {
    cuda::init();
    cuda::DeviceGuard guard(device);
    FLEXEP_CUDA_CHECK(cudaStreamCreate(&stream));
    std::shared_ptr<TokenDispatcher> dispatcher;
    if (ranks > 1) {
      comm = Communicator::create(id, rank, ranks, device);
      DispatcherSpec spec;
      spec.group = comm;
      spec.num_experts = o.moe.n_routed_experts;
      spec.backend = o.backend;
      spec.hidden = o.moe.dim;
      spec.max_tokens_per_rank = (o.tokens + ranks - 1) / ranks;  // ragged split: at most ceil(tokens / ranks)
      spec.max_topk = o.moe.n_activated_experts;
      // `host` on GPUs means the default: alltoall.
      dispatcher = make_dispatcher(o.backend.dispatcher == DispatcherKind::host ? "alltoall"
                                                                              : to_string(o.backend.dispatcher),
                                   spec);
    }
    CudaMoELayerOptions so;
    so.device = device;
    so.seed = o.seed;
    so.init_std = 0.02;
    student = std::make_unique<CudaMoELayer>(o.moe, o.backend, dispatcher, so);
    teacher = make_teacher(o);
    for (Parameter* p : student->parameters()) master.push_back(cuda::to_host(p->value, stream).to(DType::f32));
  }
  ~CudaRank() {
    student.reset();
    if (stream) cuda::destroy_stream(stream);
  }

  // Forward and backward of one step; replicated gradients all-reduced. Returns the squared error.
  double forward_backward(const TrainOptions& o, const Batch& batch) {
    cuda::DeviceGuard guard(device);
    cuda::StreamGuard sg(stream);
    const Tensor target = teacher->forward(batch.x, batch.padding, false).out;
    student->zero_grad(stream);
    const Tensor x = cuda::to_device(batch.x.to(DType::bf16), device, stream);
    const Tensor pad = cuda::to_device(batch.padding, device, stream);
    CudaMoEOutput out = student->forward(x, pad, true, stream);
    const Tensor y = cuda::to_host(out.out, stream);
    const auto [sq, grad] = squared_error(y, target, batch, o.moe.dim);
    student->backward(out, cuda::to_device(grad.to(DType::bf16), device, stream), stream);
    if (comm)
      for (Parameter* p : student->replicated_parameters())
        if (p->grad.defined()) comm->all_reduce_sum(p->grad, "gradient all-reduce of " + p->name);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
    return sq;
  }

  // Adam on the fp32 masters, then the bf16 values back to the device.
  void step() {
    cuda::DeviceGuard guard(device);
    std::vector<Parameter> host;
    const std::vector<Parameter*> ps = student->parameters();
    for (std::size_t i = 0; i < ps.size(); ++i)
      host.push_back({ps[i]->name, master[i],
                      ps[i]->grad.defined() ? cuda::to_host(ps[i]->grad, stream) : Tensor(), ps[i]->requires_grad});
    std::vector<Parameter*> hp;
    for (Parameter& p : host) hp.push_back(&p);
    adam.step(hp);
    for (std::size_t i = 0; i < ps.size(); ++i) cuda::copy_async(ps[i]->value, master[i].to(DType::bf16), stream);
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }

  Adam adam;
  int device;
  cudaStream_t stream = nullptr;
  std::shared_ptr<Communicator> comm;
  std::unique_ptr<CudaMoELayer> student;
  std::unique_ptr<MoELayer> teacher;
  std::vector<Tensor> master;
};

// Check 2 on GPUs: gradients of the first step on `ranks` GPUs vs the CPU reference layer (one
// rank, f32, routing bf16 x as the GPU does) holding the same bf16-rounded weights, on the same
// bf16-rounded inputs. Returns the
// worst ||gpu - cpu|| / ||cpu|| over the parameters and its name.
std::pair<double, std::string> gpu_vs_cpu_step(const TrainOptions& o, int ranks) {
  // CPU reference.
  MoELayerOptions co;
  co.seed = o.seed;
  co.init_std = 0.02;
  co.gate_input_dtype = DType::bf16;  // the GPU router's bf16 logits and weights
  MoEConfig cm = o.moe;
  cm.dtype = DType::f32;
  BackendConfig cb = o.backend;
  cb.dispatcher = DispatcherKind::host;
  MoELayer cpu(cm, cb, nullptr, co);
  for (Parameter* p : cpu.parameters()) p->value = round_bf16(p->value);
  auto teacher = make_teacher(o);
  Batch full = make_batch(o, 0, 0, 1);
  full.x = round_bf16(full.x);
  const Tensor target = teacher->forward(full.x, full.padding, false).out;
  MoEOutput ref = cpu.forward(full.x, full.padding, true);
  cpu.zero_grad();
  cpu.backward(ref, squared_error(ref.out, target, full, o.moe.dim).second);
  std::map<std::string, Tensor> want;
  for (Parameter* p : cpu.parameters()) want[p->name] = p->grad.defined() ? p->grad : Tensor::zeros(p->value.shape(), DType::f32);

  // GPUs.
  const ncclUniqueId id = ranks > 1 ? Communicator::new_unique_id() : ncclUniqueId{};
  std::vector<std::vector<std::pair<std::string, Tensor>>> got(static_cast<std::size_t>(ranks));
  run_ranks(ranks, [&](int r) {
    CudaRank rank(o, id, r, ranks);
    rank.forward_backward(o, make_batch(o, 0, r, ranks));
    got[static_cast<std::size_t>(r)] = rank.student->host_gradients(rank.stream);
  });
  double worst = 0;
  std::string worst_name;
  for (std::size_t i = 0; i < got[0].size(); ++i) {
    const std::string& name = got[0][i].first;
    std::vector<double> g;
    const bool expert = name.rfind("experts.", 0) == 0;
    for (int r = 0; r < (expert ? ranks : 1); ++r) {
      const Tensor& t = got[static_cast<std::size_t>(r)][i].second;
      for (std::int64_t j = 0; j < t.numel(); ++j) g.push_back(t.data<float>()[j]);
    }
    const Tensor& w = want.at(name);
    FLEXEP_CHECK(static_cast<std::int64_t>(g.size()) == w.numel(), "gradient ", name, " has ", g.size(),
                 " values on the GPUs and ", w.numel(), " on the CPU");
    double num = 0, den = 0;
    for (std::int64_t j = 0; j < w.numel(); ++j) {
      const double d = g[static_cast<std::size_t>(j)] - read_as_double(w, j);
      num += d * d;
      den += read_as_double(w, j) * read_as_double(w, j);
    }
    const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
    if (rel >= worst) worst = rel, worst_name = name;
  }
  return {worst, worst_name};
}

}  // namespace

TrainReport run_training_cuda(const TrainOptions& o) {
  const int gpus = cuda::device_count();
  FLEXEP_CHECK_ARG(gpus > 0, "train.device", "is cuda, but this machine has no GPU; allowed here: cpu");
  FLEXEP_CHECK_ARG(o.ranks <= gpus, "train.ranks", o.ranks, " ranks need as many GPUs; this machine has ", gpus);
  if (o.backend.dispatcher != DispatcherKind::host) {
    const DispatcherBackend& b = dispatcher_backend(to_string(o.backend.dispatcher));
    FLEXEP_CHECK_ARG(b.make && b.needs_gpu, "backend.dispatcher", "'", b.name, "' ",
                     b.make ? "is not a GPU backend" : b.missing, "; for training on GPUs: ",
                     built_dispatcher_names(true), " (host means the default, alltoall)");
  }
  // Each GPU's share of the layer, refused up front if it cannot fit (the dispatchers check their
  // own buffers when they are made).
  const std::int64_t tokens_per_rank = (o.tokens + o.ranks - 1) / o.ranks;
  const LayerMemoryEstimate need = estimate_gpu_layer_memory(o.moe, o.backend, o.ranks, tokens_per_rank);
  const double gib = 1024.0 * 1024.0 * 1024.0;
  for (int r = 0; r < o.ranks; ++r)
    cuda::require_device_memory(
        need.total(), 0, r, "moe",
        fmt::format("this job's layer (weights {:.2f} GiB, f32 gradients {:.2f} GiB, activations {:.2f} GiB at {} "
                    "tokens per rank) would",
                    static_cast<double>(need.weights) / gib, static_cast<double>(need.gradients) / gib,
                    static_cast<double>(need.activations) / gib, tokens_per_rank));
  TrainOptions oc = o;
  oc.moe.aux_loss_coeff = 0;  // as on the CPU: the per-rank aux loss depends on the split
  TrainReport report;
  if (!o.quiet) fmt::print(stderr, "check 2: the first batch on {} GPU rank(s) and on the CPU...\n", o.ranks);
  std::tie(report.max_grad_rel_diff, report.worst_parameter) = gpu_vs_cpu_step(oc, o.ranks);
  report.rank_check = report.max_grad_rel_diff < 5e-2;
  report.rank_check_label = fmt::format("{} GPU rank(s) == CPU reference", o.ranks);
  report.rank_check_limit = 5e-2;

  std::vector<double> losses(static_cast<std::size_t>(o.steps));
  Progress progress(o.steps, fmt::format("train ({} GPU ranks)", o.ranks));
  const ncclUniqueId id = o.ranks > 1 ? Communicator::new_unique_id() : ncclUniqueId{};
  run_ranks(o.ranks, [&](int r) {
    CudaRank rank(o, id, r, o.ranks);
    for (int step = 0; step < o.steps; ++step) {
      const Batch batch = make_batch(o, step, r, o.ranks);
      Tensor loss = Tensor::from_vector<double>({rank.forward_backward(o, batch)}, {1});
      if (rank.comm) rank.comm->all_reduce_sum(loss, "loss all-reduce");
      rank.step();
      if (o.moe.gate_bias_update_factor > 0) rank.student->update_bias(rank.comm.get(), rank.stream);
      if (r == 0) {
        const double mse =
            loss.data<double>()[0] / (static_cast<double>(std::max<std::int64_t>(batch.global_valid, 1)) * o.moe.dim);
        losses[static_cast<std::size_t>(step)] = mse;
        if (!o.quiet) progress.update(step + 1, fmt::format("loss {:.4e}", mse));
      }
    }
  });
  record_losses(report, losses);
  return report;
}

}  // namespace flexep::tools
