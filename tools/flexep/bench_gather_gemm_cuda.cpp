// Case `gather-gemm`: the experts' two forward GEMMs at DeepSeek-V3's sizes (gate_up: K 7168, M 4096;
// down: K 2048, M 7168), 32768 routed rows in groups of 512 or 1024, four ways, in the same run:
//   cublas-dense      one GEMM of the same FLOPs (the ceiling),
//   cublas-grouped    the layer's grouped GEMM on contiguous rows (grouped_gemm.h),
//   gather-contiguous the gathered kernel without a row table (the same GEMM on contiguous rows),
//   gather            the gathered kernel reading 4096 tokens through a row table, each token 8 times
//                     at random places (the permute fused into the loads; its target: >= 97% of
//                     gather-contiguous).
// And each GEMM's data gradient (phases gate_up-dgrad: dh [rows, 4096] * W_gu^T; down-dgrad: dy
// [rows, 7168] * W_down^T), three ways: cublas-dense, cublas-grouped (grouped_gemm_dgrad, the
// layer's today) and gather-contiguous, the kernel reading the weights transposed (m_by_k).
// And each GEMM's weight gradient (phases gate_up-wgrad: x^T dh per expert into [E, 7168, 4096];
// down-wgrad: a^T dy into [E, 2048, 7168]): cublas-dense (one GEMM of the same FLOPs), cublas-grouped
// (f32 gradients accumulated, the layer's default: one cublasGemmEx per expert), cublas-grouped-bf16
// (new bf16 gradients: cuBLAS's grouped call), flexep's kernel (wgrad_gemm.h) on contiguous rows
// (wgrad-contiguous, f32 accumulated; -bf16) and, for gate/up, reading the tokens through the row
// table (wgrad-bf16; its target, as the forward's: the same kernel on contiguous rows).
#include <algorithm>
#include <numeric>
#include <random>

#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/dense.h"
#include "flexep/cuda/gather_gemm.h"
#include "flexep/cuda/grouped_gemm.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/wgrad_gemm.h"

namespace flexep::tools {
namespace {

template <class T>
Tensor to_device_vector(const std::vector<T>& v, cudaStream_t s) {
  return cuda::to_device(Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())}), 0, s);
}

// The experts' two forward GEMMs at DeepSeek-V3's sizes: c [rows, m] = x [rows, k] W [k, m].
struct Gemm {
  const char* name;
  int k, m;
};
constexpr Gemm kGemms[] = {{"gate_up", 7168, 4096}, {"down", 2048, 7168}};

// `rows` rows in groups of `per_expert`: the counts (host) and their offsets (device).
struct Groups {
  std::vector<std::int64_t> counts;
  Tensor offsets;
  int experts() const { return static_cast<int>(counts.size()); }
};
Groups uniform_groups(std::int64_t rows, std::int64_t per_expert, cudaStream_t stream) {
  Groups g;
  g.counts.assign(static_cast<std::size_t>(rows / per_expert), per_expert);
  std::vector<std::int64_t> offsets(g.counts.size() + 1, 0);
  std::partial_sum(g.counts.begin(), g.counts.end(), offsets.begin() + 1);
  g.offsets = to_device_vector(offsets, stream);
  return g;
}

// One kernel timing of `phase` (a GEMM of `flops` whose reduction is `hidden` wide).
BenchRecord gemm_record(const std::string& phase, const std::string& backend, const std::string& routing,
                        std::int64_t rows, int hidden, int experts, double flops, const TimeStats& t,
                        const std::string& note) {
  BenchRecord r;
  r.case_name = "gather-gemm";
  r.routing = routing;
  r.backend = backend;
  r.phase = phase;
  r.timing = "kernel";
  r.tokens_per_rank = rows;
  r.hidden = hidden;
  r.experts = experts;
  r.time_us = t;
  r.tflops = flops / (t.median * 1e-6) / 1e12;
  r.note = note;
  return r;
}

// The weight gradients: c [E, k, m] = x_e^T d_e per expert over 32768 rows (see the file's comment).
void run_wgrad(const BenchArgs& a, BenchRun& run, const Tensor& ids_d, std::int64_t tokens, cudaStream_t stream) {
  const Device dev = Device::cuda(0);
  const std::int64_t rows = ids_d.size(0);
  for (const Gemm& g : kGemms) {
    Tensor x = Tensor::empty({rows, g.k}, DType::bf16, dev), d = Tensor::empty({rows, g.m}, DType::bf16, dev);
    cuda::fill_random(x, 1, 1.0f, stream);
    cuda::fill_random(d, 2, 1.0f, stream);
    const double flops = 2.0 * rows * g.k * g.m;
    const std::string phase = std::string(g.name) + "-wgrad";
    auto record = [&](const std::string& backend, const std::string& routing, int experts, const TimeStats& t,
                      const std::string& note) {
      run.records.push_back(gemm_record(phase, backend, routing, rows, g.k, experts, flops, t, note));
    };
    {
      Tensor c = Tensor::empty({g.k, g.m}, DType::bf16, dev);
      record("cublas-dense", "-", 1,
             time_cuda([&] { cuda::gemm(x, true, d, false, c, stream); }, a.warmup, a.reps, stream),
             "one GEMM of the same FLOPs (x^T d)");
    }
    for (const std::int64_t per_expert : {512, 1024}) {
      const Groups groups = uniform_groups(rows, per_expert, stream);
      const int experts = groups.experts();
      const std::vector<std::int64_t>& counts = groups.counts;
      const Tensor& off_d = groups.offsets;
      const std::string routing = "rows" + std::to_string(per_expert);
      Tensor c32 = Tensor::zeros({experts, g.k, g.m}, DType::f32, dev);
      Tensor c16 = Tensor::empty({experts, g.k, g.m}, DType::bf16, dev);
      record("cublas-grouped", routing, experts,
             time_cuda([&] { cuda::grouped_gemm_wgrad(x, d, counts, c32, stream, true); }, a.warmup, a.reps, stream),
             "cuBLAS, one GEMM per expert, f32 gradients accumulated (the layer's default)");
      record("cublas-grouped-bf16", routing, experts,
             time_cuda([&] { cuda::grouped_gemm_wgrad_bf16(x, d, counts, c16, stream); }, a.warmup, a.reps, stream),
             "cuBLAS grouped call, new bf16 gradients");
      const TensorView tokens_x = x.view().rows(0, tokens);
      for (const cuda::GatherGemmB sharing : {cuda::GatherGemmB::own, cuda::GatherGemmB::pair_multicast}) {
        cuda::set_gather_gemm_b_sharing(sharing);
        const bool pair = sharing == cuda::GatherGemmB::pair_multicast;
        const std::string suffix = pair ? "-pair" : "";
        const std::string how = pair ? "CTA pairs multicasting d" : "each CTA loads its d";
        record("wgrad-contiguous" + suffix, routing, experts, time_cuda([&] {
                 cuda::wgrad_grouped_gemm(x, TensorView(), d, off_d, c32, true, stream);
               }, a.warmup, a.reps, stream),
               "flexep's wgrad kernel, contiguous rows, f32 gradients accumulated; " + how);
        record("wgrad-contiguous-bf16" + suffix, routing, experts, time_cuda([&] {
                 cuda::wgrad_grouped_gemm(x, TensorView(), d, off_d, c16, false, stream);
               }, a.warmup, a.reps, stream),
               "flexep's wgrad kernel, contiguous rows, new bf16 gradients; " + how);
        if (g.k != 7168) continue;  // the down projection's input is the experts' own, never gathered
        record("wgrad-bf16" + suffix, routing, experts, time_cuda([&] {
                 cuda::wgrad_grouped_gemm(tokens_x, ids_d, d, off_d, c16, false, stream);
               }, a.warmup, a.reps, stream),
               "flexep's wgrad kernel, each of rows/8 tokens read 8 times through the row table, new bf16 "
               "gradients; " + how);
      }
      cuda::set_gather_gemm_b_sharing(cuda::GatherGemmB::pair_multicast);
    }
  }
}

void run(const BenchArgs& a, BenchRun& run) {
  const std::int64_t rows = a.tokens ? a.tokens : 32768, tokens = rows / 8;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(0);
  // Each token 8 times at random places of the row table.
  std::vector<std::int32_t> ids(static_cast<std::size_t>(rows));
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), std::mt19937_64(7));
  for (auto& id : ids) id = static_cast<std::int32_t>(id % tokens);
  const Tensor ids_d = to_device_vector(ids, stream);

  // The forward c [rows, m] = x [rows, k] W [k, m], then its data gradient dx [rows, k] = dc W^T: the
  // same weights read transposed (m_by_k), contiguous rows only.
  for (const bool dgrad : {false, true})
    for (const Gemm& g : kGemms) {
      const int in = dgrad ? g.m : g.k, out = dgrad ? g.k : g.m;  // a's columns (the reduction), c's
      Tensor x = Tensor::empty({rows, in}, DType::bf16, dev), c = Tensor::empty({rows, out}, DType::bf16, dev);
      cuda::fill_random(x, dgrad ? 5 : 1, 1.0f, stream);
      const double flops = 2.0 * rows * g.k * g.m;
      const std::string phase = std::string(g.name) + (dgrad ? "-dgrad" : "");
      const auto layout = dgrad ? cuda::GatherGemmBLayout::m_by_k : cuda::GatherGemmBLayout::k_by_m;
      auto record = [&](const std::string& backend, const std::string& routing, int experts, const TimeStats& t,
                        const std::string& note) {
        run.records.push_back(gemm_record(phase, backend, routing, rows, in, experts, flops, t, note));
      };
      {
        Tensor w = Tensor::empty({g.k, g.m}, DType::bf16, dev);
        cuda::fill_random(w, 3, 0.02f, stream);
        record("cublas-dense", "-", 1,
               time_cuda([&] { cuda::gemm(x, false, w, dgrad, c, stream); }, a.warmup, a.reps, stream),
               "one GEMM of the same FLOPs");
      }
      for (const std::int64_t per_expert : {512, 1024}) {
        const Groups groups = uniform_groups(rows, per_expert, stream);
        const int experts = groups.experts();
        const std::vector<std::int64_t>& counts = groups.counts;
        const Tensor& off_d = groups.offsets;
        Tensor w = Tensor::empty({experts, g.k, g.m}, DType::bf16, dev);
        cuda::fill_random(w, 4, 0.02f, stream);
        const std::string routing = "rows" + std::to_string(per_expert);
        record("cublas-grouped", routing, experts, time_cuda([&] {
                 if (dgrad) cuda::grouped_gemm_dgrad(x, w, counts, c, stream);
                 else cuda::grouped_gemm_forward(x, w, counts, c, stream);
               }, a.warmup, a.reps, stream),
               dgrad ? "cuBLAS grouped dgrad (the layer's), contiguous rows" : "cuBLAS grouped GEMM, contiguous rows");
        // Both ways of sharing B (gather_gemm.h, GatherGemmB), each on contiguous rows and (forward)
        // through the row table.
        const TensorView tokens_x = x.view().rows(0, tokens);
        for (const cuda::GatherGemmB sharing : {cuda::GatherGemmB::own, cuda::GatherGemmB::pair_multicast}) {
          cuda::set_gather_gemm_b_sharing(sharing);
          const bool pair = sharing == cuda::GatherGemmB::pair_multicast;
          const std::string suffix = pair ? "-pair" : "";
          const std::string how = pair ? "CTA pairs multicasting B" : "each CTA loads its B";
          record("gather-contiguous" + suffix, routing, experts, time_cuda([&] {
                   cuda::gather_grouped_gemm(x, TensorView(), off_d, w, c, stream, nullptr, layout);
                 }, a.warmup, a.reps, stream),
                 std::string("gathered kernel, no row table; ") + (dgrad ? "weights read transposed; " : "") + how);
          if (dgrad) continue;
          record("gather" + suffix, routing, experts,
                 time_cuda([&] { cuda::gather_grouped_gemm(tokens_x, ids_d, off_d, w, c, stream); }, a.warmup, a.reps,
                           stream),
                 "gathered kernel, each of rows/8 tokens read 8 times through the row table; " + how);
        }
        cuda::set_gather_gemm_b_sharing(cuda::GatherGemmB::pair_multicast);
      }
    }
  run_wgrad(a, run, ids_d, tokens, stream);
}

FLEXEP_BENCH_CASE(gather_gemm, "gather-gemm",
                  "gathered grouped GEMM vs the same GEMM on contiguous rows, cuBLAS grouped and dense", 1, run);

}  // namespace
}  // namespace flexep::tools
