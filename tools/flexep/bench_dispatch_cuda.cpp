// Cases `dsv3-ep2` and `decode`: dispatch and combine on all GPUs of the machine (one rank per GPU,
// one thread each), per backend, next to a plain NCCL all-to-all of the same bytes with no layout
// work. Times are whole calls ("call": from the inputs to the GEMM-ready expert-major rows, host
// synchronisation included), median over repetitions after a warm-up, each repetition started
// together on all ranks by a barrier; rank 0's numbers are reported.
//   algorithm bandwidth = received (token, rank) rows, own rank included, * H * 2 bytes / time
//   NVLink bandwidth    = remote rows only * H * 2 bytes / time
// The hybridep backend adds, per SM count of --sms (default: its process-wide 20): call records in
// blocking mode (one host sync per call), a budget-mode dispatch (budget = the exact rows, no host
// sync), and "kernel" records timed with CUDA events around its own kernels, from an aligned start
// (dispatch kernel, with the preprocess kernel and the step stamps of phase_trace.h in parts_us - a
// small call's one fused kernel holds the preprocess steps; combine kernel; a second dispatcher, so
// that the calls run without events and with dependent launch), a "graph" record
// (a budget-mode dispatch + combine captured once in a CUDA graph, timed per replay), every record
// with `sms` set (and the part size in its note when --hybridep-part-tokens sets one).
#include <cstdio>
#include <mutex>
#include <tuple>

#include "bench_cases.h"
#include "bench_processes.h"
#include "bench_spin.h"
#include "bench_timing_cuda.h"
#include "flexep/comm/communicator.h"
#include "flexep/core/plan.h"
#include "flexep/core/routing.h"
#include "flexep/core/synthetic_routing.h"
#include "flexep/cuda/graph.h"
#include "flexep/cuda/layer_ops.h"
#include "flexep/dispatch/hybridep.h"
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

TimeStats timed_collective(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                           cudaStream_t stream) {
  for (int i = 0; i < warmup; ++i) fn();
  EventTimer timer;
  std::vector<double> us;
  for (int i = 0; i < reps; ++i) {
    comm.barrier("bench barrier");
    us.push_back(timer.time_us(fn, stream));
  }
  return stats_of(us);
}

// The same call started as a training step starts it: on a busy stream, with the ranks together on
// the GPU. A spin kernel keeps the stream busy while the host enqueues the call (its launch work is
// not idle GPU time), and a one-element all-reduce right before the start event lines the ranks up
// (the host barrier above lets them go up to its 50 us polling interval apart, which the call's
// first exchange would otherwise absorb and charge to the call).
constexpr double kSpinUs = 300;
constexpr const char* kAlignedNote = " (aligned start: busy stream, ranks lined up on the GPU)";

class AlignedStart {
 public:
  AlignedStart(Communicator& comm, cudaStream_t stream)
      : comm_(comm), stream_(stream), flag_(Tensor::empty({1}, DType::i32, Device::cuda(comm.device()))) {
    FLEXEP_CUDA_CHECK(cudaMemsetAsync(flag_.raw(), 0, sizeof(std::int32_t), stream));
  }
  // Enqueues the spin and the all-reduce: what the stream runs next starts with the ranks together.
  void line_up() {
    comm_.barrier("bench barrier");
    launch_spin(kSpinUs, stream_);
    FLEXEP_NCCL_CHECK(ncclAllReduce(flag_.raw(), flag_.raw(), 1, ncclInt32, ncclSum, comm_.get(), stream_));
    comm_.wait_enqueued("bench:aligned start");  // a non-blocking communicator takes no call before that
  }

 private:
  Communicator& comm_;
  cudaStream_t stream_;
  Tensor flag_;
};

TimeStats timed_collective_aligned(Communicator& comm, const std::function<void()>& fn, int warmup, int reps,
                                   cudaStream_t stream) {
  AlignedStart start(comm, stream);
  EventTimer timer;
  std::vector<double> us;
  for (int i = 0; i < warmup + reps; ++i) {
    start.line_up();
    const double t = timer.time_us(fn, stream);
    if (i >= warmup) us.push_back(t);
  }
  return stats_of(us);
}

// One budget-mode dispatch + combine captured in a CUDA graph, then timed per replay: shows that
// budget mode needs no host synchronisation (a host sync cannot be captured at all).
TimeStats graph_replay_time(const BenchArgs& a, Communicator& comm, HybridEpDispatcher& d, const DispatchInput& in,
                            const DispatchOptions& budget, int sms, cudaStream_t stream) {
  d.set_num_sms(sms, sms, sms);
  DispatchResult warm = d.dispatch(in, budget);  // loads the kernels outside the capture
  d.combine(warm.handle, warm.tokens);
  d.check_errors();
  const cuda::CapturedGraph graph(stream, cudaStreamCaptureModeThreadLocal, [&] {
    DispatchResult r = d.dispatch(in, budget);
    d.combine(r.handle, r.tokens);
  });
  const TimeStats t = timed_collective(comm, [&] { graph.launch(stream); }, a.warmup, a.reps, stream);
  d.check_errors();
  return t;
}

// hybridep on this rank; `record` appends a record to `mine` (as for the other backends).
template <class Record>
void bench_hybridep(const BenchArgs& a, Communicator& comm, std::shared_ptr<Communicator> comm_ptr,
                    const DispatchInput& in, std::int64_t T, int H, int k, int E, std::int64_t exact_rows,
                    cudaStream_t stream, std::vector<BenchRecord>& mine, Record record) {
  DispatcherSpec ho;
  ho.group = std::move(comm_ptr);
  ho.num_experts = E;
  ho.max_tokens_per_rank = T;
  ho.hidden = H;
  ho.max_topk = k;
  ho.stream = stream;
  ho.part_tokens = a.hybridep_part_tokens;
  // Three dispatchers. `d` times the calls as a training step runs them: no events between the
  // kernels, each launched as a programmatic dependent of the one before. `timed` has kernel_timing
  // (events around its kernels, which also turns dependent launch off, and the step stamps) for the
  // kernel records. `graphed`, sized to the exact rows, for the graph record (no events in a capture).
  DispatcherSpec to = ho;
  to.kernel_timing = true;
  DispatcherSpec go = ho;
  go.max_recv_rows = exact_rows;
  // The records below read hybridep's own kernel times and SM settings.
  auto make = [](const DispatcherSpec& s) {
    std::unique_ptr<TokenDispatcher> made = make_dispatcher("hybridep", s, "--backend");
    auto* h = dynamic_cast<HybridEpDispatcher*>(made.get());
    FLEXEP_CHECK(h != nullptr, "the hybridep backend made no HybridEpDispatcher");
    made.release();
    return std::unique_ptr<HybridEpDispatcher>(h);
  };
  auto graphed = make(go);
  auto timed = make(to);
  auto d = make(ho);
  const std::vector<int> sweep = a.sms.empty() ? std::vector<int>{hybridep_num_sms().dispatch} : a.sms;
  for (int sms : sweep) {
    d->set_num_sms(sms, sms, sms);
    timed->set_num_sms(sms, sms, sms);
    auto tag = [&](std::size_t first) {
      for (std::size_t i = first; i < mine.size(); ++i) mine[i].sms = sms;
    };
    const std::size_t first = mine.size();
    DispatchOptions opt;  // blocking: tokens_per_expert on the host, one sync per call
    DispatchOptions budget;
    budget.mode = DispatchMode::budget;
    budget.budget_rows = exact_rows;
    DispatchResult res;
    // The three calls, each timed from an idle stream (timed_collective) and from an aligned start
    // (timed_collective_aligned); the combine combines the latest dispatch's rows.
    const std::vector<std::tuple<const char*, std::function<void()>, const char*>> calls = {
        {"dispatch", [&] { res = d->dispatch(in, opt); },
         "blocking: plan + count exchange + NVLink dispatch kernel + one host sync"},
        {"combine", [&] { d->combine(res.handle, res.tokens); },
         "two-level combine of the dispatched rows (identity experts; the owners push the partial rows) + "
         "host check"},
        {"dispatch", [&] { res = d->dispatch(in, budget); },
         "budget mode (budget = this run's exact rows): no host synchronisation"}};
    for (const auto& [phase, fn, note] : calls)
      record("hybridep", phase, timed_collective(comm, fn, a.warmup, a.reps, stream), note);
    for (const auto& [phase, fn, note] : calls)
      record("hybridep", phase, timed_collective_aligned(comm, fn, a.warmup, a.reps, stream), note, "call", "aligned");
    d->check_errors();
    const TimeStats tdc = timed_collective(comm, [&] {
      DispatchResult r2 = d->dispatch(in, opt);
      d->combine(r2.handle, r2.tokens);
    }, a.warmup, a.reps, stream);
    record("hybridep", "dispatch+combine", tdc, "one blocking dispatch and its combine");

    // Kernels alone: events around the dispatch kernel (preprocess kernel in parts_us) and the
    // combine kernel, budget mode so that no host sync sits between the repetitions' kernels.
    std::vector<double> disp, pre, plan, comb;
    std::vector<std::pair<std::string, std::vector<double>>> phases;  // "<step>.first" / ".last", us
    const auto phase = [&phases](const std::string& name) -> std::vector<double>& {
      for (auto& [n, us] : phases)
        if (n == name) return us;
      return phases.emplace_back(name, std::vector<double>{}).second;
    };
    // Aligned starts: the fused small-call kernel holds the count exchange, whose wait for the
    // slower rank would otherwise be charged to it.
    AlignedStart start(comm, stream);
    bool one_kernel = false;
    for (int i = 0; i < a.warmup + a.reps; ++i) {
      start.line_up();
      DispatchResult r3 = timed->dispatch(in, budget);
      timed->combine(r3.handle, r3.tokens);
      const HybridEpKernelTimes kt = timed->kernel_times();
      if (i < a.warmup) continue;
      one_kernel = kt.one_kernel;
      disp.push_back(kt.dispatch);
      pre.push_back(kt.preprocess);
      plan.push_back(kt.plan);
      comb.push_back(kt.combine);
      for (const HybridEpPhase& p : kt.dispatch_phases) {
        phase(p.name + ".first").push_back(p.first);
        phase(p.name + ".last").push_back(p.last);
      }
    }
    timed->check_errors();
    record("hybridep", "dispatch", stats_of(disp),
           one_kernel ? "fused small-call kernel alone (preprocess steps inside; events around it; aligned start)"
                      : "dispatch kernel alone (events around it; aligned start)",
           "kernel");
    mine.back().parts_us = {{"plan", stats_of(plan).median},
                            {"preprocess_kernel", stats_of(pre).median},
                            {"dispatch_kernel", stats_of(disp).median}};
    // When each step was reached on this GPU (device clock, from the first preprocess CTA).
    for (const auto& [name, us] : phases) mine.back().parts_us.emplace_back("step." + name, stats_of(us).median);
    record("hybridep", "combine", stats_of(comb), "combine kernel alone (events around it)", "kernel");
    record("hybridep", "dispatch+combine", graph_replay_time(a, comm, *graphed, in, budget, sms, stream),
           "CUDA graph replay of a budget-mode dispatch + combine (no host sync inside; the host launches the "
           "graph once per repetition)", "graph");
    tag(first);
    if (a.hybridep_part_tokens)
      for (std::size_t i = first; i < mine.size(); ++i)
        mine[i].note = "parts of " + std::to_string(a.hybridep_part_tokens) + " tokens: " + mine[i].note;
  }
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
    if (want_hybridep) {
      DispatchInput in;
      in.hidden = x;
      in.indices = idx;
      in.weights = w;
      // A failing hybridep run (a new backend) must not cost the other backends' records.
      try {
        bench_hybridep(a, *comm, comm, in, T, H, k, E, exact_rows, stream, mine, record);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "flexep bench: rank %d: hybridep skipped: %s\n", rank, e.what());
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
