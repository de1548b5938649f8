// Case `permute`: the single-GPU dispatch layout (plan + permute to expert-major rows) and the
// unpermute back, in HBM bytes moved per second, next to a device-to-device copy of the same bytes
// in the same run. Bytes count each element once read and once written: permute reads T rows and
// writes N = T*k rows, unpermute the reverse; the copy reads and writes N rows.
#include "bench_cases.h"
#include "bench_timing_cuda.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/local_plan.h"
#include "flexep/cuda/permute.h"

namespace flexep::tools {
namespace {

void run(const BenchArgs& a, BenchRun& run) {
  const int H = a.hidden ? a.hidden : 7168, k = a.topk ? a.topk : 8, E = a.experts ? a.experts : 64;
  const std::int64_t T = a.tokens ? a.tokens : 4096;
  cuda::init();
  const cuda::OwnedStream stream;  // first: destroyed after every tensor ordered on it
  cuda::StreamGuard sg(stream);
  const Device dev = Device::cuda(0);
  RoutingSpec spec;
  spec.kind = parse_routing(a.routing, "--routing");
  spec.zipf_s = a.zipf_s;
  const TopK routing = synthetic_topk(T, k, E, spec, 5);
  const Tensor indices = cuda::to_device(routing.indices, 0, stream);
  const Tensor weights = cuda::to_device(routing.weights, 0, stream);
  Tensor x = Tensor::empty({T, H}, DType::bf16, dev);
  cuda::fill_random(x, 1, 1.0f, stream);
  PlanParams params;
  params.experts = E;
  params.budget_rows = T * k;  // budget mode: no host sync inside the timed loop
  cuda::DeviceErrors errors(0);
  cuda::LocalPlan plan = cuda::make_local_plan(T, k, params, 0, stream);
  const std::int64_t N = plan.out_rows;
  Tensor rows = Tensor::empty({N, H}, DType::bf16, dev), probs = Tensor::empty({N}, DType::f32, dev);
  Tensor back = Tensor::empty({T, H}, DType::bf16, dev);
  const double row_bytes = 2.0 * H;

  auto record = [&](const std::string& phase, const std::string& backend, const TimeStats& t, double bytes,
                    const std::string& note) {
    BenchRecord r;
    r.case_name = "permute";
    r.routing = a.routing;
    r.backend = backend;
    r.phase = phase;
    r.timing = "kernel";
    r.tokens_per_rank = T;
    r.hidden = H;
    r.topk = k;
    r.experts = E;
    r.time_us = t;
    if (bytes > 0) r.hbm_gbps = bytes / (t.median * 1e-6) / 1e9;
    r.note = note;
    run.records.push_back(r);
  };
  const TimeStats tplan = time_cuda([&] { cuda::plan_local_into(plan, indices, errors, stream); }, a.warmup, a.reps,
                                    stream);
  record("permute", "cuda-local-plan", tplan, 0.0, "the layout alone (CUB stable sort by expert), budget mode");
  const TimeStats tp = time_cuda([&] { cuda::permute(x, weights, plan, rows, probs, stream); }, a.warmup, a.reps, stream);
  record("permute", "cuda-local", tp, (T + N) * row_bytes, "permute along a computed layout (x read once)");
  const TimeStats tpp = time_cuda([&] {
    cuda::plan_local_into(plan, indices, errors, stream);
    cuda::permute(x, weights, plan, rows, probs, stream);
  }, a.warmup, a.reps, stream);
  record("permute", "cuda-local+plan", tpp, (T + N) * row_bytes, "layout + permute: the whole local dispatch");
  const TimeStats tu = time_cuda([&] { cuda::unpermute(rows, plan, back, stream); }, a.warmup, a.reps, stream);
  record("unpermute", "cuda-local", tu, (T + N) * row_bytes, "fp32 sum in ascending expert order");
  Tensor copy = Tensor::empty({N, H}, DType::bf16, dev);
  const TimeStats tc = time_cuda([&] {
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(copy.raw(), rows.raw(), rows.nbytes(), cudaMemcpyDeviceToDevice, stream));
  }, a.warmup, a.reps, stream);
  record("copy", "cuda-memcpy", tc, 2.0 * N * row_bytes, "device-to-device copy of the N expert rows");
  errors.check(stream, "permute benchmark");
}

FLEXEP_BENCH_CASE(permute, "permute", "single-GPU permute/unpermute HBM GB/s vs a device copy", 1, run);

}  // namespace
}  // namespace flexep::tools
