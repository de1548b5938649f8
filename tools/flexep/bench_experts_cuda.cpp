// Case `experts`: grouped experts of a DeepSeek-V3-like shape on one GPU (dim 7168, moe_inter 2048,
// swiglu, 32768 routed rows over 32 experts (experts-dsv3, 1024 rows each) and 64 (experts-dsv3-512)),
// uniform and Zipf-skewed counts, forward and backward TFLOP/s, next to one dense cuBLAS GEMM of the
// forward's total FLOPs measured in the same run.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include <fmt/format.h>

#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/dense.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/runtime.h"
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

// One expert count (rows per expert = rows / experts): the cuBLAS grouped experts forward and
// backward (f32 gradients accumulated, the default, and new bf16 weight gradients as autograd writes
// them), and the experts reading their rows in place through a shuffled row table (forward_gathered:
// the gathered GEMM for gate/up; its backward gathers the rows for the weight gradient).
void run_experts(const BenchArgs& a, BenchRun& run, int experts, const std::string& case_name, const Tensor& x,
                 const Tensor& gy, const Tensor& probs, const Tensor& row_ids, const BenchRecord& dense,
                 cudaStream_t stream) {
  const std::int64_t rows = x.size(0);
  const int dim = static_cast<int>(x.size(1)), inter = 2048;
  MoEConfig c;
  c.dim = dim;
  c.moe_inter_dim = inter;
  c.n_routed_experts = experts;
  c.n_activated_experts = 1;
  c.dtype = DType::bf16;
  const double fwd_flops = 2.0 * rows * dim * (2.0 * inter) + 2.0 * rows * inter * dim;
  BenchRecord d = dense;
  d.case_name = case_name;
  run.records.push_back(d);
  for (const GradMode mode : {GradMode::accumulate_f32, GradMode::fresh_bf16_weights}) {
    const bool fresh = mode == GradMode::fresh_bf16_weights;
    CudaGroupedExperts ex(c, experts, 0, 0, mode);
    for (Parameter* p : ex.parameters()) cuda::fill_random(p->value, 17, 0.02f, stream);
    for (const std::string routing : {"uniform", "zipf"}) {
      const auto counts = counts_for(routing, a.zipf_s, experts, rows);
      for (const bool gathered : {false, true}) {
        if (gathered && !fresh) continue;  // the in-place rows with the gradients flexep.torch writes
        CudaExpertsOutput fwd;
        const TimeStats tf = time_cuda([&] {
          fwd = gathered ? ex.forward_gathered(x, row_ids, probs, counts, stream) : ex.forward(x, probs, counts, stream);
        }, a.warmup, a.reps, stream);
        // A training step's backward: zero_grad (lazy for the f32 weight gradients) then backward,
        // with the data and weight gradients on cuBLAS or on flexep's kernels, side by side.
        struct Kernels {
          const char* suffix;
          ExpertDgrad dgrad;
          ExpertWgrad wgrad;
          const char* note;
        };
        const Kernels variants[] = {
            {"", ExpertDgrad::cublas, ExpertWgrad::cublas, ""},
            {"-dgrad-kernel", ExpertDgrad::gather_gemm, ExpertWgrad::cublas,
             "; data gradients on flexep's grouped GEMM (weights read transposed), not cuBLAS"},
            {"-wgrad-kernel", ExpertDgrad::cublas, ExpertWgrad::wgrad_gemm,
             "; weight gradients on flexep's wgrad kernel (wgrad_gemm.h), not cuBLAS"},
            {"-kernels", ExpertDgrad::gather_gemm, ExpertWgrad::wgrad_gemm,
             "; data and weight gradients on flexep's kernels, no cuBLAS"},
        };
        for (int pass = 0; pass <= 4; ++pass) {
          if (pass == 0 && fresh && !gathered) continue;  // the same forward as accumulate_f32's
          TimeStats t = tf;
          const Kernels& k = variants[pass == 0 ? 0 : pass - 1];
          if (pass > 0) {
            set_expert_dgrad(k.dgrad);
            set_expert_wgrad(k.wgrad);
            t = time_cuda([&] {
              ex.zero_grad(stream);
              ex.backward(fwd, gy, stream);
            }, a.warmup, a.reps, stream);
            set_expert_dgrad(ExpertDgrad::cublas);
            set_expert_wgrad(ExpertWgrad::cublas);
          }
          BenchRecord r;
          r.case_name = case_name;
          r.routing = routing;
          r.backend = std::string(gathered ? "gathered-fresh-bf16" : fresh ? "cublas-grouped-fresh-bf16" : "cublas-grouped") +
                      (pass > 0 ? k.suffix : "");
          r.phase = "experts";
          r.pass = pass ? "backward" : "forward";
          r.timing = "kernel";
          r.tokens_per_rank = rows;
          r.hidden = dim;
          r.experts = experts;
          r.time_us = t;
          r.tflops = (pass ? 2 * fwd_flops : fwd_flops) / (r.time_us.median * 1e-6) / 1e12;
          r.note = fmt::format("{} local experts ({} rows each), swiglu, moe_inter 2048, activation and prob fused; {}{}",
                               experts, rows / experts, gathered ? "rows read in place through a shuffled row table; " : "",
                               fresh ? "new bf16 weight gradients (fresh_bf16_weights)" : "f32 gradients (accumulate_f32)");
          if (pass > 0) r.note += k.note;
          run.records.push_back(r);
        }
      }
    }
  }
}

void run(const BenchArgs& a, BenchRun& run) {
  const int dim = a.hidden ? a.hidden : 7168, inter = 2048;
  const std::int64_t rows = a.tokens ? a.tokens : 32768;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(0);
  Tensor x = Tensor::empty({rows, dim}, DType::bf16, dev), probs = Tensor::empty({rows}, DType::f32, dev);
  Tensor gy = Tensor::empty({rows, dim}, DType::bf16, dev);
  cuda::fill_random(x, 1, 1.0f, stream);
  cuda::fill_random(gy, 2, 1.0f, stream);
  cuda::fill(probs, 0.125f, stream);
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(7));
  const Tensor row_ids = cuda::to_device(Tensor::from_vector(ids, {rows}), 0, stream);

  // Dense reference: [rows, dim] x [dim, 3*inter], the forward's FLOPs in one GEMM.
  BenchRecord dense;
  {
    Tensor w = Tensor::empty({dim, 3 * inter}, DType::bf16, dev), out = Tensor::empty({rows, 3 * inter}, DType::bf16, dev);
    cuda::fill_random(w, 3, 0.02f, stream);
    const TimeStats t = time_cuda([&] { cuda::gemm(x, false, w, false, out, stream); }, a.warmup, a.reps, stream);
    dense.routing = "-";
    dense.backend = "cublas-dense";
    dense.phase = "dense_gemm";
    dense.timing = "kernel";
    dense.tokens_per_rank = rows;
    dense.hidden = dim;
    dense.experts = 1;
    dense.time_us = t;
    dense.tflops = 2.0 * rows * dim * 3.0 * inter / (t.median * 1e-6) / 1e12;
    dense.note = "one GEMM with the grouped forward's FLOPs";
  }
  // 1024 and 512 rows per expert (DSV3's per-expert load at EP 8 and 16 with 4096 tokens per rank).
  if (a.experts) {
    run_experts(a, run, a.experts, "experts-dsv3", x, gy, probs, row_ids, dense, stream);
  } else {
    run_experts(a, run, 32, "experts-dsv3", x, gy, probs, row_ids, dense, stream);
    run_experts(a, run, 64, "experts-dsv3-512", x, gy, probs, row_ids, dense, stream);
  }
}

FLEXEP_BENCH_CASE(experts, "experts", "grouped experts, DSV3-like shape, fwd/bwd TFLOP/s vs one dense GEMM", 1, run);

}  // namespace
}  // namespace flexep::tools
