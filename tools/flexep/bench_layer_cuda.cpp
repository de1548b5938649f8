// Case `layer`: the MoE layer forward + backward on one GPU at a DeepSeek-V3-like shape (dim 7168,
// moe_inter 2048, 32 experts, top-8, 4096 tokens: 32768 routed rows), with the per-phase split
// (router, dispatch = plan + permute, experts, combine = unpermute, shared join), with the experts on the
// dispatcher's copy of the rows (cuda-local, the default) and reading the tokens in place
// (cuda-local-in-place), and the memory each forward keeps for backward. Each with both gradient modes:
// f32 gradients the layer accumulates into (accumulate_f32, Megatron's main_grad; the default) and new
// bf16 weight gradients per backward (fresh_bf16_weights: what flexep.torch and autograd produce, so the
// mode to set beside Automodel's layer; labels ending in -fresh-bf16).
// Also backward's data gradients on flexep's grouped GEMM (-dgrad-kernel), its weight gradients on
// flexep's wgrad kernel (-wgrad-kernel) and both (-kernels); the routed path in two chunks
// (-chunks2); and each step's host enqueue time (host_us).
#include <chrono>
#include <string>
#include <vector>

#include "bench_cases.h"
#include "bench_spin.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/runtime.h"
#include "flexep/layer/cuda_grouped_experts.h"
#include "flexep/layer/cuda_moe_layer.h"

namespace flexep::tools {
namespace {

void run(const BenchArgs& a, BenchRun& run) {
  MoEConfig c;
  c.dim = a.hidden ? a.hidden : 7168;
  c.moe_inter_dim = 2048;
  c.n_routed_experts = a.experts ? a.experts : 32;
  c.n_activated_experts = a.topk ? a.topk : 8;
  c.n_shared_experts = 1;
  c.score_func = ScoreFunc::sigmoid;
  c.norm_topk_prob = true;
  c.dtype = DType::bf16;
  const std::int64_t T = a.tokens ? a.tokens : 4096;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::empty({T, c.dim}, DType::bf16, dev), gy = Tensor::empty({T, c.dim}, DType::bf16, dev);
  cuda::fill_random(x, 1, 1.0f, stream);
  cuda::fill_random(gy, 2, 1.0f, stream);
  // Both ways of feeding the routed experts in the same run: the rows copied by the dispatcher (the
  // default; kept for backward), and the tokens read in place through the row table.
  // Last, the routed path in two chunks (backend.dispatch_chunks; copied rows, cuBLAS, bf16
  // gradients): at EP 1 there is no communication to hide, so this is what chunking costs the GEMMs.
  struct LayerSetup {
    GradMode grad_mode;
    int chunks;
  };
  for (const LayerSetup setup : {LayerSetup{GradMode::accumulate_f32, 1}, LayerSetup{GradMode::fresh_bf16_weights, 1},
                                 LayerSetup{GradMode::fresh_bf16_weights, 2}}) {
    const GradMode grad_mode = setup.grad_mode;
    CudaMoELayerOptions o;
    o.fast_init = true;
    o.init_std = 0.02;
    o.grad_mode = grad_mode;
    BackendConfig backend;
    backend.dispatch_chunks = setup.chunks;
    CudaMoELayer layer(c, backend, nullptr, o);
    const bool fresh = grad_mode == GradMode::fresh_bf16_weights;
    const bool chunked = setup.chunks > 1;
    // Copied rows; in place; in place with CTA pairs multicasting B in the gathered GEMM (GatherGemmB);
    // then backward's data (ExpertDgrad) and weight (ExpertWgrad) gradients on flexep's kernels
    // instead of cuBLAS, each alone on copied rows and both, on copied rows and in place.
    struct Variant {
      bool in_place, pair, dgrad_kernel, wgrad_kernel;
    };
    for (const Variant v : {Variant{false, false, false, false}, Variant{true, false, false, false},
                            Variant{true, true, false, false}, Variant{false, true, true, false},
                            Variant{false, true, false, true}, Variant{false, true, true, true},
                            Variant{true, true, true, true}}) {
      if (chunked && (v.in_place || v.pair || v.dgrad_kernel || v.wgrad_kernel)) continue;
      // The kernels with B shared by CTA pairs (their faster way: bench gather-gemm's -dgrad rows).
      const bool in_place = v.in_place, pair = v.pair, dgrad_kernel = v.dgrad_kernel, wgrad_kernel = v.wgrad_kernel;
      layer.compute().set_rows_in_place(in_place);
      cuda::set_gather_gemm_b_sharing(pair ? cuda::GatherGemmB::pair_multicast : cuda::GatherGemmB::own);
      set_expert_dgrad(dgrad_kernel ? ExpertDgrad::gather_gemm : ExpertDgrad::cublas);
      set_expert_wgrad(wgrad_kernel ? ExpertWgrad::wgrad_gemm : ExpertWgrad::cublas);
      layer.set_timing(false);
      const TimeStats t = time_cuda([&] {
        layer.zero_grad(stream);
        CudaMoEOutput out = layer.forward(x, TensorView(), true, stream);
        layer.backward(out, gy, stream);
      }, a.warmup, a.reps, stream);
      // The host's time to enqueue one step, the GPU idle before it.
      std::vector<double> host;
      for (int i = 0; i < 3; ++i) {
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
        const auto t0 = std::chrono::steady_clock::now();
        layer.zero_grad(stream);
        CudaMoEOutput out = layer.forward(x, TensorView(), true, stream);
        layer.backward(out, gy, stream);
        host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
      }
      // Activation memory: what the forward's result holds in the pool beyond y, nothing else in flight.
      double saved_mb = 0;
      {
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
        const std::uint64_t before = cuda::pool_used_bytes(dev.index);
        CudaMoEOutput out = layer.forward(x, TensorView(), true, stream);
        FLEXEP_CUDA_CHECK(cudaStreamSynchronize(stream));
        saved_mb = (static_cast<double>(cuda::pool_used_bytes(dev.index)) - static_cast<double>(before) -
                    static_cast<double>(out.out.nbytes())) / 1e6;
        layer.backward(out, gy, stream);
      }
      // The split: one more pass with phase timing on. Reading the phases' events synchronises at the
      // end of forward and of backward; each then starts behind a 3 ms spin on the stream, so that
      // the host queues its first phase's launches while the GPU is busy, as it does inside a
      // training step, and the first phase (router, combine's backward) is not charged the host's
      // launch time as idle GPU time.
      std::vector<std::vector<double>> parts(5);
      layer.set_timing(true);
      for (int i = 0; i < std::max(3, a.reps / 4); ++i) {
        launch_spin(3000, stream);
        CudaMoEOutput out = layer.forward(x, TensorView(), true, stream);
        launch_spin(3000, stream);
        layer.backward(out, gy, stream);
        const CudaMoEPhaseTimes& p = layer.phase_times();
        const double v[5] = {p.router, p.dispatch, p.experts, p.combine, p.shared};
        for (int j = 0; j < 5; ++j) parts[static_cast<std::size_t>(j)].push_back(v[j]);
      }
      BenchRecord r;
      r.case_name = "layer-dsv3";
      r.routing = "router";
      r.backend = std::string(in_place ? "cuda-local-in-place" : "cuda-local") + (pair && in_place ? "-pair" : "") +
                  (dgrad_kernel && wgrad_kernel ? "-kernels"
                   : dgrad_kernel              ? "-dgrad-kernel"
                   : wgrad_kernel              ? "-wgrad-kernel"
                                               : "") +
                  (chunked ? "-chunks" + std::to_string(setup.chunks) : "") + (fresh ? "-fresh-bf16" : "");
      r.phase = "layer_fwd_bwd";
      r.timing = "call";
      r.tokens_per_rank = T;
      r.hidden = c.dim;
      r.topk = c.n_activated_experts;
      r.experts = c.n_routed_experts;
      r.time_us = t;
      r.saved_mb = saved_mb;
      r.host_us = stats_of(host).median;
      const char* names[5] = {"router", "dispatch(plan+permute)", "experts", "combine(unpermute)", "shared_join"};
      for (int j = 0; j < 5; ++j) r.parts_us.emplace_back(names[j], stats_of(parts[static_cast<std::size_t>(j)]).median);
      const double rows = static_cast<double>(T) * c.n_activated_experts;
      const double flops = 3 * (2.0 * rows * c.dim * 2 * c.moe_inter_dim + 2.0 * rows * c.moe_inter_dim * c.dim);
      r.tflops = flops / (t.median * 1e-6) / 1e12;
      r.note = in_place ? "as cuda-local, but the experts read the tokens in place through the row table (no copy kept)"
                        : "sigmoid router, 1 shared expert on a side stream, EP size 1, the dispatcher copies the rows; "
                          "tflops counts the routed experts only";
      if (pair && in_place) r.note += "; the gathered GEMM's CTAs run in pairs multicasting B";
      if (dgrad_kernel) r.note += "; backward's data gradients on flexep's grouped GEMM (CTA pairs), not cuBLAS";
      if (wgrad_kernel) r.note += "; backward's weight gradients on flexep's wgrad kernel (CTA pairs), not cuBLAS";
      if (chunked)
        r.note += "; the routed path in " + std::to_string(setup.chunks) +
                  " chunks (backend.dispatch_chunks), the experts on a second stream";
      r.note += fresh ? "; new bf16 weight gradients every backward (fresh_bf16_weights)"
                      : "; gradients accumulated in f32 (accumulate_f32)";
      run.records.push_back(r);
    }
  }
  cuda::set_gather_gemm_b_sharing(cuda::GatherGemmB::pair_multicast);
  set_expert_dgrad(ExpertDgrad::cublas);
  set_expert_wgrad(ExpertWgrad::cublas);
}

FLEXEP_BENCH_CASE(layer, "layer", "MoE layer fwd+bwd on one GPU, DSV3-like shape, per-phase split", 1, run);

}  // namespace
}  // namespace flexep::tools
