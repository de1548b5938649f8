// Cases `dsv3-ep2` and `decode`: dispatch and combine on all GPUs of the machine (one rank per GPU,
// one thread each), per backend, next to a plain NCCL all-to-all of the same bytes with no layout
// work. Times are whole calls ("call": from the inputs to the GEMM-ready rows, expert-major or, for
// deepep's rank-major records, DeepEP's recv_x with its expert lists; host synchronisation included), median over repetitions after a warm-up, each repetition started
// together on all ranks by a barrier; rank 0's numbers are reported.
//   algorithm bandwidth = received (token, rank) rows, own rank included, * H * 2 bytes / time
//   NVLink bandwidth    = remote rows only * H * 2 bytes / time
// The hybridep and deepep parts are bench_hybridep_cuda.cpp and bench_deepep_cuda.cpp.
#include <cstdio>
#include <mutex>
#include <tuple>

#include "bench_cases.h"
#include "bench_dispatch_common.h"
#include "bench_processes.h"
#include "flexep/comm/communicator.h"
#include "flexep/core/plan.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/cuda/runtime.h"
#include "flexep/dispatch/registry.h"
#include "train_common.h"

namespace flexep::tools {
namespace {

struct Shape {
  std::string name;
  std::int64_t tokens;
  int hidden, topk, experts;
};

// Rows a deduplicating dispatch delivers to `rank` (own and remote), from every rank's routing.
std::pair<std::int64_t, std::int64_t> received_rows(const std::vector<TopK>& routing, int rank, int ranks, int experts) {
  const int local = experts / ranks;
  std::int64_t all = 0, remote = 0;
  for (int s = 0; s < ranks; ++s) {
    const TopK& r = routing[static_cast<std::size_t>(s)];
    const std::int64_t T = r.indices.size(0), k = r.indices.size(1);
    for (std::int64_t t = 0; t < T; ++t) {
      bool hit = false;
      for (std::int64_t j = 0; j < k; ++j) hit |= r.indices.data<std::int64_t>()[t * k + j] / local == rank;
      if (hit) ++all, remote += (s != rank);
    }
  }
  return {all, remote};
}

void run_shape(const BenchArgs& a, BenchRun& run, const Shape& shape) {
  const ProcessRank process = process_rank();  // one rank per process (bench_processes.h), or all here
  const int ranks = process.active ? process.size : cuda::device_count();
  run.gpus = std::max(run.gpus, ranks);  // one rank per GPU
  const std::int64_t T = a.tokens ? a.tokens : shape.tokens;
  const int H = a.hidden ? a.hidden : shape.hidden, k = a.topk ? a.topk : shape.topk;
  const int E = a.experts ? a.experts : shape.experts;
  RoutingSpec spec;
  spec.kind = parse_routing(a.routing, "--routing");
  spec.zipf_s = a.zipf_s;
  std::vector<TopK> routing;
  for (int r = 0; r < ranks; ++r) routing.push_back(synthetic_topk(T, k, E, spec, 21, r));
  const auto [rows_all, rows_remote] = received_rows(routing, 0, ranks, E);
  std::int64_t exact_rows = 0;  // budget of the hybridep budget-mode record: the largest rank's rows
  {
    std::vector<std::int64_t> counts;
    for (const TopK& r : routing) {
      const auto c = expert_counts(r.indices, E);
      counts.insert(counts.end(), c.begin(), c.end());
    }
    PlanParams p;
    p.ranks = ranks;
    p.experts = E;
    for (const auto& lay : DispatchPlan::build(counts, p).ranks) exact_rows = std::max(exact_rows, lay.required_rows);
  }
  const double row_bytes = 2.0 * H;
  if (a.backend != "all") {  // before any GPU work: a name the registry does not build is an error
    const DispatcherBackend& b = dispatcher_backend(a.backend == "torch" ? "alltoall" : a.backend, "--backend");
    FLEXEP_CHECK_ARG(b.make && b.needs_gpu, "--backend", "'", a.backend, "' ", b.make ? "is not a GPU backend" : b.missing,
                     "; allowed: all, ", built_dispatcher_names(true));
  }
  const bool want_alltoall = a.backend == "all" || a.backend == "alltoall" || a.backend == "torch";
  const bool want_hybridep = a.backend == "all" || a.backend == "hybridep";
  const bool want_deepep = a.backend == "all" || a.backend == "deepep";
  const ncclUniqueId id = process.active ? ncclUniqueId{} : Communicator::new_unique_id();
  std::mutex m;

  auto body = [&](int rank) {
    std::shared_ptr<Communicator> comm =
        process.active ? Communicator::from_environment() : Communicator::create(id, rank, ranks, rank);
    cuda::DeviceGuard guard(comm->device());
    const cuda::OwnedStream stream;  // destroyed after every tensor ordered on it (declared after comm)
    cuda::StreamGuard sg(stream);
    const Device dev = Device::cuda(comm->device());
    Tensor x = Tensor::empty({T, H}, DType::bf16, dev);
    cuda::fill_random(x, 7 + static_cast<std::uint64_t>(rank), 1.0f, stream);
    const Tensor idx = cuda::to_device(routing[static_cast<std::size_t>(rank)].indices, comm->device(), stream);
    const Tensor w = cuda::to_device(routing[static_cast<std::size_t>(rank)].weights, comm->device(), stream);
    std::vector<BenchRecord> mine;
    auto record = [&](const std::string& backend, const std::string& phase, const TimeStats& t, const std::string& note,
                    const std::string& timing = "call", const std::string& start = "") {
      BenchRecord r;
      r.case_name = shape.name;
      r.routing = a.routing;
      r.backend = backend;
      r.phase = phase;
      r.timing = timing;
      r.tokens_per_rank = T;
      r.hidden = H;
      r.topk = k;
      r.experts = E;
      r.time_us = t;
      const double mult = phase == "dispatch+combine" ? 2.0 : 1.0;
      r.algo_gbps = mult * rows_all * row_bytes / (t.median * 1e-6) / 1e9;
      r.nvlink_gbps = mult * rows_remote * row_bytes / (t.median * 1e-6) / 1e9;
      r.note = start == "aligned" ? note + kAlignedNote : note;
      r.start = start;
      mine.push_back(r);
    };

    // Baseline: NCCL all-to-all of exactly the rows a deduplicating dispatch moves, no layout work.
    {
      std::vector<std::int64_t> to(static_cast<std::size_t>(ranks), 0), from(static_cast<std::size_t>(ranks), 0);
      // Exact per-peer counts: tokens of `rank` needed by d, and tokens of s needed by `rank`.
      const int local = E / ranks;
      auto needed = [&](int s, int d) {
        const TopK& r = routing[static_cast<std::size_t>(s)];
        std::int64_t n = 0;
        for (std::int64_t t = 0; t < T; ++t) {
          bool hit = false;
          for (int j = 0; j < k; ++j) hit |= r.indices.data<std::int64_t>()[t * k + j] / local == d;
          n += hit;
        }
        return n;
      };
      for (int d = 0; d < ranks; ++d) to[static_cast<std::size_t>(d)] = needed(rank, d), from[static_cast<std::size_t>(d)] = needed(d, rank);
      std::int64_t send_rows = 0, recv_rows = 0;
      for (int d = 0; d < ranks; ++d) send_rows += to[static_cast<std::size_t>(d)], recv_rows += from[static_cast<std::size_t>(d)];
      Tensor send = Tensor::empty({std::max<std::int64_t>(send_rows, 1), H}, DType::bf16, dev);
      Tensor recv = Tensor::empty({std::max<std::int64_t>(recv_rows, 1), H}, DType::bf16, dev);
      cuda::fill_random(send, 3, 1.0f, stream);
      const TimeStats t = timed_collective(*comm, [&] {
        std::int64_t so = 0, ro = 0;
        FLEXEP_NCCL_CHECK(ncclGroupStart());
        for (int p = 0; p < ranks; ++p) {
          const auto sn = static_cast<std::size_t>(to[static_cast<std::size_t>(p)] * H);
          const auto rn = static_cast<std::size_t>(from[static_cast<std::size_t>(p)] * H);
          FLEXEP_NCCL_CHECK(ncclSend(static_cast<char*>(send.raw()) + so * H * 2, sn, ncclBfloat16, p, comm->get(), stream));
          FLEXEP_NCCL_CHECK(ncclRecv(static_cast<char*>(recv.raw()) + ro * H * 2, rn, ncclBfloat16, p, comm->get(), stream));
          so += to[static_cast<std::size_t>(p)];
          ro += from[static_cast<std::size_t>(p)];
        }
        FLEXEP_NCCL_CHECK(ncclGroupEnd());
        comm->wait(stream, "bench:nccl-alltoall");
      }, a.warmup, a.reps, stream);
      record("nccl-alltoall", "dispatch", t, "plain grouped ncclSend/ncclRecv of the dispatched rows, no layout");
    }

    if (want_alltoall) {
      DispatcherSpec spec;
      spec.group = comm;
      spec.num_experts = E;
      auto d = make_dispatcher("alltoall", spec, "--backend");
      DispatchInput in;
      in.hidden = x;
      in.indices = idx;
      in.weights = w;
      DispatchOptions opt;
      DispatchResult res;
      // Identity experts: the combine combines the latest dispatch's rows themselves.
      const std::vector<std::tuple<const char*, std::function<void()>, const char*>> calls = {
          {"dispatch", [&] { res = d->dispatch(in, opt); },
           "counts all-gather + host plan + pack + NCCL send/recv + expert-major placement"},
          {"combine", [&] { d->combine(res.handle, res.tokens); },
           "per-owner fp32 partial sums + NCCL send/recv + fp32 sum over ranks"}};
      for (const auto& [phase, fn, note] : calls)
        record("alltoall", phase, timed_collective(*comm, fn, a.warmup, a.reps, stream), note);
      for (const auto& [phase, fn, note] : calls)
        record("alltoall", phase, timed_collective_aligned(*comm, fn, a.warmup, a.reps, stream), note, "call",
               "aligned");
      const TimeStats tb = timed_collective(*comm, [&] {
        DispatchResult r2 = d->dispatch(in, opt);
        d->combine(r2.handle, r2.tokens);
      }, a.warmup, a.reps, stream);
      record("alltoall", "dispatch+combine", tb, "one dispatch and its combine");
      // Data movement alone: a dispatch along the saved layout (no count exchange, no host planning)
      // is exactly combine_backward.
      const TimeStats tk = timed_collective(*comm, [&] { d->combine_backward(res.handle, x); }, a.warmup, a.reps, stream);
      record("alltoall", "dispatch", tk, "pack + NCCL send/recv + placement along a saved handle (no planning)",
             "kernel");
    }
    DispatchBench part{a, comm, {}, T, H, k, E, exact_rows, stream, mine,
                       [&](const std::string& backend, const std::string& phase, const TimeStats& t,
                           const std::string& note, const std::string& timing,
                           const std::string& start) { record(backend, phase, t, note, timing, start); }};
    part.in.hidden = x;
    part.in.indices = idx;
    part.in.weights = w;
    const std::vector<std::pair<std::string, void (*)(const DispatchBench&)>> parts = {
        {want_hybridep ? "hybridep" : "", bench_hybridep}, {want_deepep ? "deepep" : "", bench_deepep}};
    for (const auto& [name, fn] : parts) {
      if (name.empty()) continue;
      // A failing backend must not cost the other backends' records.
      try {
        fn(part);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "flexep bench: rank %d: %s skipped: %s\n", rank, name.c_str(), e.what());
      }
    }
    if (rank == 0) {
      std::lock_guard<std::mutex> lock(m);
      for (BenchRecord& r : mine) run.records.push_back(r);
    }
  };
  if (process.active)
    body(process.rank);
  else
    run_ranks(ranks, body);
}

void run_dsv3(const BenchArgs& a, BenchRun& run) { run_shape(a, run, {"dsv3-ep2", 4096, 7168, 8, 64}); }
void run_decode(const BenchArgs& a, BenchRun& run) { run_shape(a, run, {"decode", 128, 7168, 8, 64}); }

// One GPU is enough: a one-rank run (every row local, no NVLink) is what scripts/ncu-hybridep.sh
// profiles, since ncu may replay a kernel that waits for no peer.
FLEXEP_BENCH_CASE(dsv3, "dsv3-ep2", "dispatch/combine, 4096 tokens/rank, H 7168, top-8 of 64 experts, all GPUs", 1,
                  run_dsv3);
FLEXEP_BENCH_CASE(decode, "decode", "dispatch/combine, 128 tokens/rank, H 7168, top-8 of 64 experts, all GPUs", 1,
                  run_decode);

}  // namespace
}  // namespace flexep::tools
