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
//   per replay;
// - FP8 (e4m3 rows with their scales): the rank-major dispatch, blocking and budget;
// - decode-sized calls: the low-latency mode (one kernel per direction, every (token, expert) row
//   on its own), dispatch, combine, both in a CUDA graph, and an FP8 dispatch.
// The notes start with the layout; scripts/perf_table.py makes it the record's pass.
#include <algorithm>
#include <tuple>

#include "bench_dispatch_common.h"
#include "flexep/cuda/graph.h"
#include "flexep/dispatch/deepep.h"

namespace flexep::tools {

namespace {

// Decode-sized calls also run the low-latency mode (DeepEP's LL serves up to a few hundred tokens).
constexpr std::int64_t kLowLatencyTokens = 1024;

void bench_low_latency(const DispatchBench& b, DeepEpDispatcher& d) {
  const BenchArgs& a = b.args;
  Communicator& comm = *b.comm;
  const Device dev = b.in.hidden.device;
  const std::int64_t L = b.experts / comm.size();
  const Tensor y = Tensor::zeros({L, comm.size() * b.tokens, b.hidden}, DType::bf16, dev);
  LowLatencyResult r;
  b.record("deepep", "dispatch",
           timed_collective(comm, [&] { r = d.low_latency_dispatch(b.in.hidden, b.in.indices); }, a.warmup, a.reps,
                            b.stream),
           "low-latency: one kernel, each (token, expert) row to its expert's rank, packed there; no host sync");
  b.record("deepep", "combine",
           timed_collective(comm, [&] { d.low_latency_combine(r.handle, y, b.in.indices, b.in.weights); }, a.warmup,
                            a.reps, b.stream),
           "low-latency: one kernel, each row back to its token's rank, the weighted sum there; no host sync");
  {
    const cuda::CapturedGraph graph(b.stream, cudaStreamCaptureModeThreadLocal, [&] {
      const LowLatencyResult g = d.low_latency_dispatch(b.in.hidden, b.in.indices);
      d.low_latency_combine(g.handle, y, b.in.indices, b.in.weights);
    });
    b.record("deepep", "dispatch+combine",
             timed_collective(comm, [&] { graph.launch(b.stream); }, a.warmup, a.reps, b.stream),
             "low-latency: a dispatch + combine captured in a CUDA graph, timed per replay", "graph");
  }
  if (b.hidden % 128 == 0) {
    const TensorView x8(b.in.hidden.data, DType::e4m3, {b.tokens, b.hidden}, dev);
    const Tensor scales = Tensor::zeros({b.tokens, b.hidden / 128}, DType::f32, dev);
    b.record("deepep", "dispatch",
             timed_collective(comm, [&] { r = d.low_latency_dispatch(x8, b.in.indices, scales); }, a.warmup, a.reps,
                              b.stream),
             "low-latency fp8: one kernel, e4m3 rows and their scales; no host sync");
  }
  d.check_errors();
}

}  // namespace

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
    o.low_latency_max_tokens = b.tokens <= kLowLatencyTokens ? b.tokens : 0;
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
    if (b.hidden % 128 == 0) {
      // FP8 rows (e4m3, one f32 scale per 128 elements): about half the bytes of bf16 rows. The
      // bf16 input's first H bytes of each row serve as e4m3 bytes: rows are moved, not read.
      DispatchInput in8 = b.in;
      in8.hidden = TensorView(b.in.hidden.data, DType::e4m3, {b.tokens, b.hidden}, b.in.hidden.device);
      const Tensor scales = Tensor::zeros({b.tokens, b.hidden / 128}, DType::f32, b.in.hidden.device);
      Fp8DispatchResult f8;
      b.record("deepep", "dispatch",
               timed_collective(comm, [&] { f8 = d->dispatch_fp8(in8, scales, rank_major); }, a.warmup, a.reps,
                                b.stream),
               "rank-major fp8: the blocking dispatch of e4m3 rows and their scales");
      b.record("deepep", "dispatch",
               timed_collective(comm, [&] { f8 = d->dispatch_fp8(in8, scales, budget); }, a.warmup, a.reps,
                                b.stream),
               "rank-major fp8 budget: the budget dispatch of e4m3 rows and their scales; no host sync");
      d->check_errors();
    }
    if (o.low_latency_max_tokens > 0) bench_low_latency(b, *d);
    for (std::size_t i = first; i < b.mine.size(); ++i) b.mine[i].sms = sms;
  }
}

}  // namespace flexep::tools
