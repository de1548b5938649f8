// The hybridep part of the `dsv3-ep2` and `decode` cases, per SM count of --sms (default: its
// process-wide 20): call records in blocking mode (one host sync per call), a budget-mode dispatch
// (budget = the exact rows, no host sync), and "kernel" records timed with CUDA events around its own
// kernels, from an aligned start (dispatch kernel, with the preprocess kernel and the step stamps of
// phase_trace.h in parts_us - a small call's one fused kernel holds the preprocess steps; combine
// kernel; a second dispatcher, so that the calls run without events and with dependent launch), a
// "graph" record (a budget-mode dispatch + combine captured once in a CUDA graph, timed per replay),
// every record with `sms` set (and the part size in its note when --hybridep-part-tokens sets one).
#include <tuple>

#include "bench_dispatch_common.h"
#include "bench_timing_cuda.h"
#include "flexep/cuda/graph.h"
#include "flexep/dispatch/hybridep.h"
#include "flexep/dispatch/registry.h"

namespace flexep::tools {
namespace {

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

}  // namespace

void bench_hybridep(const DispatchBench& b) {
  const BenchArgs& a = b.args;
  Communicator& comm = *b.comm;
  const DispatchInput& in = b.in;
  const std::int64_t T = b.tokens;
  const int H = b.hidden, k = b.topk, E = b.experts;
  const cudaStream_t stream = b.stream;
  std::vector<BenchRecord>& mine = b.mine;
  DispatcherSpec ho;
  ho.group = b.comm;
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
  go.max_recv_rows = b.exact_rows;
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
  for (int sms : b.sm_sweep(hybridep_num_sms().dispatch)) {
    d->set_num_sms(sms, sms, sms);
    timed->set_num_sms(sms, sms, sms);
    auto tag = [&](std::size_t first) {
      for (std::size_t i = first; i < mine.size(); ++i) mine[i].sms = sms;
    };
    const std::size_t first = mine.size();
    DispatchOptions opt;  // blocking: tokens_per_expert on the host, one sync per call
    DispatchOptions budget;
    budget.mode = DispatchMode::budget;
    budget.budget_rows = b.exact_rows;
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
      b.record("hybridep", phase, timed_collective(comm, fn, a.warmup, a.reps, stream), note);
    for (const auto& [phase, fn, note] : calls)
      b.record("hybridep", phase, timed_collective_aligned(comm, fn, a.warmup, a.reps, stream), note, "call",
               "aligned");
    d->check_errors();
    const TimeStats tdc = timed_collective(comm, [&] {
      DispatchResult r2 = d->dispatch(in, opt);
      d->combine(r2.handle, r2.tokens);
    }, a.warmup, a.reps, stream);
    b.record("hybridep", "dispatch+combine", tdc, "one blocking dispatch and its combine");

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
    b.record("hybridep", "dispatch", stats_of(disp),
           one_kernel ? "fused small-call kernel alone (preprocess steps inside; events around it; aligned start)"
                      : "dispatch kernel alone (events around it; aligned start)",
           "kernel");
    mine.back().parts_us = {{"plan", stats_of(plan).median},
                            {"preprocess_kernel", stats_of(pre).median},
                            {"dispatch_kernel", stats_of(disp).median}};
    // When each step was reached on this GPU (device clock, from the first preprocess CTA).
    for (const auto& [name, us] : phases) mine.back().parts_us.emplace_back("step." + name, stats_of(us).median);
    b.record("hybridep", "combine", stats_of(comb), "combine kernel alone (events around it)", "kernel");
    b.record("hybridep", "dispatch+combine", graph_replay_time(a, comm, *graphed, in, budget, sms, stream),
           "CUDA graph replay of a budget-mode dispatch + combine (no host sync inside; the host launches the "
           "graph once per repetition)", "graph");
    tag(first);
    if (a.hybridep_part_tokens)
      for (std::size_t i = first; i < mine.size(); ++i)
        mine[i].note = "parts of " + std::to_string(a.hybridep_part_tokens) + " tokens: " + mine[i].note;
  }
}

}  // namespace flexep::tools
