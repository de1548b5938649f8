// Case `experts`: grouped experts of a DeepSeek-V3-like shape on one GPU (dim 7168, moe_inter 2048,
// swiglu, 32 local experts, 32768 routed rows), uniform and Zipf-skewed counts, forward and backward
// TFLOP/s, next to one dense cuBLAS GEMM of the forward's total FLOPs measured in the same run.
#include <cmath>

#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/dense.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/layer/cuda_grouped_experts.h"

namespace flexep::tools {
namespace {

std::vector<std::int64_t> counts_for(const std::string& routing, double s, int experts, std::int64_t rows) {
  std::vector<double> w(static_cast<std::size_t>(experts), 1.0);
  if (routing == "zipf")
    for (int e = 0; e < experts; ++e) w[static_cast<std::size_t>(e)] = std::pow(e + 1.0, -s);
  double sum = 0;
  for (double v : w) sum += v;
  std::vector<std::int64_t> c(static_cast<std::size_t>(experts));
  std::int64_t given = 0;
  for (int e = 0; e < experts; ++e) given += c[static_cast<std::size_t>(e)] = static_cast<std::int64_t>(rows * w[static_cast<std::size_t>(e)] / sum);
  c[0] += rows - given;  // the remainder to the hottest expert
  return c;
}

void run(const BenchArgs& a, BenchRun& run) {
  const int dim = a.hidden ? a.hidden : 7168, inter = 2048, experts = a.experts ? a.experts : 32;
  const std::int64_t rows = a.tokens ? a.tokens : 32768;
  MoEConfig c;
  c.dim = dim;
  c.moe_inter_dim = inter;
  c.n_routed_experts = experts;
  c.n_activated_experts = 1;
  c.dtype = DType::bf16;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  CudaGroupedExperts ex(c, experts, 0, 0);
  for (Parameter* p : ex.parameters()) cuda::fill_random(p->value, 17, 0.02f, stream);
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::empty({rows, dim}, DType::bf16, dev), probs = Tensor::empty({rows}, DType::f32, dev);
  Tensor gy = Tensor::empty({rows, dim}, DType::bf16, dev);
  cuda::fill_random(x, 1, 1.0f, stream);
  cuda::fill_random(gy, 2, 1.0f, stream);
  cuda::fill(probs, 0.125f, stream);
  const double fwd_flops = 2.0 * rows * dim * (2.0 * inter) + 2.0 * rows * inter * dim;

  // Dense reference: [rows, dim] x [dim, 3*inter], the forward's FLOPs in one GEMM.
  {
    Tensor w = Tensor::empty({dim, 3 * inter}, DType::bf16, dev), out = Tensor::empty({rows, 3 * inter}, DType::bf16, dev);
    cuda::fill_random(w, 3, 0.02f, stream);
    const TimeStats t = time_cuda([&] { cuda::gemm(x, false, w, false, out, stream); }, a.warmup, a.reps, stream);
    BenchRecord r;
    r.case_name = "experts-dsv3";
    r.routing = "-";
    r.backend = "cublas-dense";
    r.phase = "dense_gemm";
    r.timing = "kernel";
    r.tokens_per_rank = rows;
    r.hidden = dim;
    r.experts = 1;
    r.time_us = t;
    r.tflops = 2.0 * rows * dim * 3.0 * inter / (t.median * 1e-6) / 1e12;
    r.note = "one GEMM with the grouped forward's FLOPs";
    run.records.push_back(r);
  }
  for (const std::string routing : {"uniform", "zipf"}) {
    const auto counts = counts_for(routing, a.zipf_s, experts, rows);
    CudaExpertsOutput fwd;
    const TimeStats tf = time_cuda([&] { fwd = ex.forward(x, probs, counts, stream); }, a.warmup, a.reps, stream);
    // A training step's backward: zero_grad (lazy for the weight gradients) then backward.
    const TimeStats tb = time_cuda([&] {
      ex.zero_grad(stream);
      ex.backward(fwd, gy, stream);
    }, a.warmup, a.reps, stream);
    for (int pass = 0; pass < 2; ++pass) {
      BenchRecord r;
      r.case_name = "experts-dsv3";
      r.routing = routing;
      r.backend = "cublas-grouped";
      r.phase = "experts";
      r.pass = pass ? "backward" : "forward";
      r.timing = "kernel";
      r.tokens_per_rank = rows;
      r.hidden = dim;
      r.experts = experts;
      r.time_us = pass ? tb : tf;
      r.tflops = (pass ? 2 * fwd_flops : fwd_flops) / (r.time_us.median * 1e-6) / 1e12;
      r.note = "32 local experts, swiglu, moe_inter 2048, activation and prob fused";
      run.records.push_back(r);
    }
  }
}

FLEXEP_BENCH_CASE(experts, "experts", "grouped experts, DSV3-like shape, fwd/bwd TFLOP/s vs one dense GEMM", 1, run);

}  // namespace
}  // namespace flexep::tools
