// Case `router`: the router (gate) alone at DeepSeek-V3's shape (x [4096, 7168] bf16, 64 experts,
// top-8, sigmoid with a score correction bias, 8 groups of which 4 are kept, normalised weights
// times 2.5): forward, backward (grad_x, and grad_weight accumulated in f32), and both, beside the
// three cuBLAS GEMMs a router cannot do without (logits = x W^T, grad_x = g W, grad_W += g^T x)
// timed alone in the same run. The router's extra work over those GEMMs is its routing kernels and,
// for the unset precision, the two-term bf16 split of grad_logits (include/flexep/cuda/router.h).
// hbm_gbps counts the bytes of x read by the forward and by grad_W and of grad_x written: the three
// passes over [T, dim] that bound it.
#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/dense.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/router.h"
#include "flexep/cuda/runtime.h"

namespace flexep::tools {
namespace {

void run(const BenchArgs& a, BenchRun& run) {
  MoEConfig c;
  c.dim = a.hidden ? a.hidden : 7168;
  c.n_routed_experts = a.experts ? a.experts : 64;
  c.n_activated_experts = a.topk ? a.topk : 8;
  c.score_func = ScoreFunc::sigmoid;
  c.n_expert_groups = c.n_routed_experts % 8 == 0 ? 8 : 1;
  c.n_limited_groups = c.n_expert_groups > 1 ? 4 : 1;
  c.force_e_score_correction_bias = true;
  c.norm_topk_prob = true;
  c.route_scale = 2.5;
  const std::int64_t T = a.tokens ? a.tokens : 4096, E = c.n_routed_experts, k = c.n_activated_experts;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::empty({T, c.dim}, DType::bf16, dev), w = Tensor::empty({E, c.dim}, DType::bf16, dev);
  Tensor correction = Tensor::zeros({E}, DType::f32, dev);
  Tensor grad_weights = Tensor::empty({T, k}, DType::f32, dev), grad_w = Tensor::zeros({E, c.dim}, DType::f32, dev);
  cuda::fill_random(x, 1, 1.0f, stream);
  cuda::fill_random(w, 2, 0.02f, stream);
  cuda::fill_random(grad_weights, 3, 1.0f, stream);

  const double x_bytes = 2.0 * static_cast<double>(T) * c.dim;
  const double gemm_flops = 2.0 * static_cast<double>(T) * c.dim * static_cast<double>(E);
  auto record = [&](const std::string& phase, const std::string& backend, const TimeStats& t, double flops,
                    double bytes, const std::string& note) {
    BenchRecord r;
    r.case_name = "router";
    r.routing = "router";
    r.backend = backend;
    r.phase = phase;
    r.timing = "kernel";
    r.tokens_per_rank = T;
    r.hidden = c.dim;
    r.topk = static_cast<int>(k);
    r.experts = static_cast<int>(E);
    r.time_us = t;
    r.tflops = flops / (t.median * 1e-6) / 1e12;
    if (bytes > 0) r.hbm_gbps = bytes / (t.median * 1e-6) / 1e9;
    r.note = note;
    run.records.push_back(r);
  };

  const char* shape = "sigmoid, correction bias, 8 groups keep 4, normalised, route_scale 2.5, unset gate precision";
  auto forward = [&] {
    return cuda::router_forward(c, std::nullopt, x, w, TensorView(), correction, TensorView(), true, stream);
  };
  const TimeStats tf = time_cuda([&] { forward(); }, a.warmup, a.reps, stream);
  record("forward", "flexep", tf, gemm_flops, x_bytes, std::string("router_forward: ") + shape);
  const cuda::RouterOutput saved = forward();
  const TimeStats tb = time_cuda([&] {
    cuda::router_backward(saved, grad_weights, x, w, grad_w, TensorView(), 1.0, stream);
  }, a.warmup, a.reps, stream);
  record("backward", "flexep", tb, 2 * gemm_flops, 2 * x_bytes, "router_backward: grad_x and grad_weight (f32, +=)");
  const TimeStats tfb = time_cuda([&] {
    const cuda::RouterOutput o = forward();
    cuda::router_backward(o, grad_weights, x, w, grad_w, TensorView(), 1.0, stream);
  }, a.warmup, a.reps, stream);
  record("fwd_bwd", "flexep", tfb, 3 * gemm_flops, 3 * x_bytes, "forward + backward");

  // The baseline: the same three GEMMs on cuBLAS, nothing else (grad_logits taken as bf16 already).
  Tensor logits = Tensor::empty({T, E}, DType::f32, dev), g = Tensor::empty({T, E}, DType::bf16, dev);
  Tensor grad_x = Tensor::empty({T, c.dim}, DType::bf16, dev);
  cuda::fill_random(g, 4, 1.0f, stream);
  auto logits_gemm = [&] { cuda::gemm(x, false, w, true, logits, stream); };
  auto grad_x_gemm = [&] { cuda::gemm(g, false, w, false, grad_x, stream); };
  auto grad_w_gemm = [&] { cuda::gemm(g, true, x, false, grad_w, 1.f, 1.f, stream); };
  const TimeStats gf = time_cuda(logits_gemm, a.warmup, a.reps, stream);
  record("forward", "cublas-gemm", gf, gemm_flops, x_bytes, "logits = x W^T, f32 out");
  const TimeStats gb = time_cuda([&] {
    grad_x_gemm();
    grad_w_gemm();
  }, a.warmup, a.reps, stream);
  record("backward", "cublas-gemm", gb, 2 * gemm_flops, 2 * x_bytes, "grad_x = g W (bf16 out) and grad_W += g^T x (f32)");
  const TimeStats gfb = time_cuda([&] {
    logits_gemm();
    grad_x_gemm();
    grad_w_gemm();
  }, a.warmup, a.reps, stream);
  record("fwd_bwd", "cublas-gemm", gfb, 3 * gemm_flops, 3 * x_bytes, "the three GEMMs back to back");
}

FLEXEP_BENCH_CASE(router, "router", "router forward/backward alone vs its three cuBLAS GEMMs, DSV3 shape", 1, run);

}  // namespace
}  // namespace flexep::tools
