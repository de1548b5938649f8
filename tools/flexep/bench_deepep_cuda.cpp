// The deepep part of the `dsv3-ep2` and `decode` cases, per SM count of --sms (default 20; one
// dispatcher per count, since DeepEpOptions::sms is fixed at creation). Whole calls, from an idle
// and from an aligned start, in blocking mode (the counts cross through one host all-gather):
// - rank-major (DeepEP's layout): dispatch to recv_x and the expert lists, combine of one row per
//   received token (identity experts: recv_x itself), one dispatch and its combine, and the rows
//   alone along a saved handle (combine_backward: no count exchange, no layout work);
// - expert-major (the layout the MoE layers read): dispatch, the rows then gathered into their
//   experts' lists on the receiver; combine, each received row's entries summed there first;
// - rank-major budget (budget = the busiest receiver's rows): the counts exchanged on the device,
//   no host sync: a dispatch call, and a dispatch + combine captured once in a CUDA graph and timed
//   per replay.
// The notes start with the layout; scripts/perf_table.py makes it the record's pass.
#include <algorithm>
#include <tuple>

#include "bench_dispatch_common.h"
#include "flexep/cuda/graph.h"
#include "flexep/dispatch/deepep.h"

namespace flexep::tools {

void bench_deepep(const DispatchBench& b) {
  const BenchArgs& a = b.args;
  Communicator& comm = *b.comm;
  for (int sms : b.sm_sweep(20)) {
    DeepEpOptions o;
    o.hidden = b.hidden;
    o.max_tokens_per_rank = std::max<std::int64_t>(b.tokens, 1);
    o.max_topk = b.topk;
    o.sms = sms;
    o.stream = b.stream;
    const std::unique_ptr<DeepEpDispatcher> d = make_deepep_dispatcher(b.comm, b.experts, o);
    const std::size_t first = b.mine.size();
    DispatchOptions rank_major;
    rank_major.layout = DispatchLayout::rank_major;
    const DispatchOptions expert_major;
    DispatchResult rm, em;
    using Call = std::tuple<const char*, std::function<void()>, std::string>;
    const std::vector<Call> calls = {
        {"dispatch", [&] { rm = d->dispatch(b.in, rank_major); },
         "rank-major: count kernel + counts all-gather (host) + rank rows + NVLink row stores + receive/list kernel "
         "+ one host sync"},
        {"combine", [&] { d->combine(rm.handle, rm.tokens); },
         "rank-major: one row per received token back to its source + fp32 sum over ranks + host check"},
        {"dispatch", [&] { em = d->dispatch(b.in, expert_major); },
         "expert-major: the rank-major dispatch + the rows gathered into their experts' lists"},
        {"combine", [&] { d->combine(em.handle, em.tokens); },
         "expert-major: each received row's entries summed (level 1) + the rank-major combine"}};
    for (const auto& [phase, fn, note] : calls)
      b.record("deepep", phase, timed_collective(comm, fn, a.warmup, a.reps, b.stream), note);
    for (const auto& [phase, fn, note] : calls)
      b.record("deepep", phase, timed_collective_aligned(comm, fn, a.warmup, a.reps, b.stream), note, "call",
               "aligned");
    b.record("deepep", "dispatch+combine", timed_collective(comm, [&] {
               DispatchResult r = d->dispatch(b.in, rank_major);
               d->combine(r.handle, r.tokens);
             }, a.warmup, a.reps, b.stream),
             "rank-major: one blocking dispatch and its combine");
    b.record("deepep", "dispatch", timed_collective(comm, [&] { d->combine_backward(rm.handle, b.in.hidden); },
                                                    a.warmup, a.reps, b.stream),
             "rank-major: the rows along a saved handle (combine_backward: no count exchange, no layout work; "
             "row stores + receive kernel + one host sync)",
             "handle");
    // Budget mode, the budget the busiest receiver's rows of this routing.
    DispatchOptions budget = rank_major;
    budget.mode = DispatchMode::budget;
    for (long long n : comm.all_gather_i64({rm.tokens.size(0)}, "bench:budget"))
      budget.budget_rows = std::max<std::int64_t>(budget.budget_rows, n);
    DispatchResult bm;
    b.record("deepep", "dispatch", timed_collective(comm, [&] { bm = d->dispatch(b.in, budget); }, a.warmup, a.reps,
                                                    b.stream),
             "rank-major budget: count kernel + on-device count exchange + rank rows + NVLink row stores + "
             "receive/list kernels; no host sync");
    d->check_errors();
    d->combine(bm.handle, bm.tokens);
    {
      const cuda::CapturedGraph graph(b.stream, cudaStreamCaptureModeThreadLocal, [&] {
        DispatchResult r = d->dispatch(b.in, budget);
        d->combine(r.handle, r.tokens);
      });
      b.record("deepep", "dispatch+combine",
               timed_collective(comm, [&] { graph.launch(b.stream); }, a.warmup, a.reps, b.stream),
               "rank-major budget: a dispatch + combine captured in a CUDA graph, timed per replay", "graph");
    }
    d->check_errors();
    for (std::size_t i = first; i < b.mine.size(); ++i) b.mine[i].sms = sms;
  }
}

}  // namespace flexep::tools
