// The hybridep dispatch. On every rank, all on the caller's stream:
//   1. local argument checks (a failure is not raised yet: the rank still takes part in the count
//      exchange, with a header that says it failed, so that every rank stops together);
//   2. (multihot) the routing map -> ascending slots; the single-GPU plan of this rank's pairs
//      (the chunk plan: counts and each slot's rank among its chunk's pairs of its expert);
//   3. the preprocess kernel (count exchange through the windows, every rank's layout, the abort
//      decision, staging records) and the dispatch kernel (rows over NVLink, expert-major output);
//   4. blocking mode: one wait, tokens_per_expert and the row count copied back, device errors
//      raised; budget mode: nothing waits (errors surface at the next host check).
#include <algorithm>
#include <climits>
#include <cstring>

#include "dispatch/common/routing_checks.h"
#include "dispatch/hybridep/kernels/chunk_plan_math.h"
#include "dispatch/hybridep/dispatcher/dispatcher.h"
#include "flexep/core/checks.h"
#include "flexep/cuda/runtime.h"

namespace flexep::hybridep {

struct Dispatcher::Routing {
  std::int64_t tokens = 0, hidden = 0;
  int slots = 1;  // k, or the buffer's slots (multihot)
  bool multihot = false;
};

namespace {

Dispatcher::Routing check_input(const DispatchInput& in, const TensorView& scales, const DispatchOptions& opt,
                    const BufferConfig& cfg, int device, bool fp8) {
  const Device dev = Device::cuda(device);
  check::rank(in.hidden, 2, "hidden");
  if (fp8) {
    FLEXEP_CHECK_ARG(cfg.fp8, "hidden", "FP8 dispatch needs a dispatcher created with HybridEpOptions::fp8 = true");
    check::dtype(in.hidden, {DType::e4m3}, "hidden");
  } else {
    check::dtype(in.hidden, {DType::bf16}, "hidden");
  }
  check::device(in.hidden, dev, "hidden");
  Dispatcher::Routing r;
  r.tokens = in.hidden.size(0);
  r.hidden = in.hidden.size(1);
  if (fp8) {
    check::shape(scales, {r.tokens, r.hidden / kFp8ScaleBlock}, "scales");
    check::dtype(scales, {DType::f32}, "scales");
    check::device(scales, dev, "scales");
    FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(scales.data) % 16 == 0, "scales",
                     "must be 16-byte aligned (scales move as 16-byte vectors)");
  }
  FLEXEP_CHECK_ARG(r.hidden == cfg.hidden, "hidden", "has H=", r.hidden,
                   " but this hybridep dispatcher was created for "
                   "HybridEpOptions::hidden=",
                   cfg.hidden);
  FLEXEP_CHECK_ARG(r.tokens <= cfg.max_tokens, "hidden", "has ", r.tokens, " tokens, more than the ", cfg.max_tokens,
                   " the buffers hold (HybridEpOptions::max_tokens_per_rank; resize() to raise it)");
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(in.hidden.data) % 16 == 0, "hidden",
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
  r.multihot = in.multihot();
  check::routing_form(in, r.tokens, cfg.experts, dev, [&](std::int64_t k) {
    FLEXEP_CHECK_ARG(k >= 1 && k <= cfg.slots, "indices", "has k=", k, " columns; this hybridep dispatcher holds 1 to ",
                     cfg.slots, " slots per token (HybridEpOptions::max_topk)");
  });
  r.slots = r.multihot ? cfg.slots : static_cast<int>(in.indices.size(1));
  check::expert_major_layout(opt, "hybridep");
  validate(call_signature::plan_params(opt, cfg.ranks, cfg.experts));
  if (opt.mode == DispatchMode::budget)
    FLEXEP_CHECK_ARG(opt.budget_rows <= cfg.capacity_rows, "options.budget_rows", opt.budget_rows, " rows exceed the ",
                     cfg.capacity_rows,
                     " rows of the receive buffer (HybridEpOptions::max_recv_rows; resize() to raise it)");
  return r;
}

}  // namespace

DispatchResult Dispatcher::dispatch(const DispatchInput& input, const DispatchOptions& options) {
  return dispatch_impl(input, TensorView(), options, false, nullptr);
}

HybridEpFp8Result Dispatcher::dispatch_fp8(const DispatchInput& input, const TensorView& scales,
                                           const DispatchOptions& options) {
  HybridEpFp8Result r;
  r.dispatch = dispatch_impl(input, scales, options, true, &r.scales);
  return r;
}

DispatchResult Dispatcher::dispatch_impl(const DispatchInput& input, const TensorView& scales,
                                         const DispatchOptions& options, bool fp8, Tensor* scales_out) {
  cuda::init();
  cuda::DeviceGuard device_guard(comm_->device());
  const cudaStream_t s = stream();
  cuda::StreamGuard stream_guard(s);
  require_usable();
  ensure_initialized();

  // 1. Local checks.
  Routing rt;
  RankHeader mine;
  const std::exception_ptr local = call_signature::run_local_checks(mine, [&] {
    (void)num_sms();  // checks the SM counts
    rt = check_input(input, scales, options, config_, comm_->device(), fp8);
  });
  // A failed rank still runs the protocol, on one CTA if need be.
  const HybridEpSms sms = local ? HybridEpSms{1, 1, 1} : num_sms();
  call_signature::set_call(mine, experts_, input.multihot(), rt.hidden, rt.multihot ? 0 : rt.slots, options,
                           local ? 0 : rt.tokens);
  mine.fp8 = fp8;

  // 2. The call's parameters and this rank's plan (skipped after a local failure: the inputs may
  //    not be safe to read; the rank then sends T = 0 and a failed header).
  ++dispatch_seq_;
  DispatchCall c = describe_call(mine, rt, options, fp8, local != nullptr);
  const bool overlap = !options_.kernel_timing && !cuda::capturing(s);
  record(ev_plan, s);
  const bool after_plan = local ? false : plan_routing(c, input, scales, rt, sms, overlap);

  // 3. The two kernels of the exchange (or one, for a call that fits one plan chunk).
  launch_exchange(c, sms, after_plan, overlap);
  if (local) abort_failed_call(s, local);

  // 4. Outputs: views of the receive window.
  DispatchResult result;
  const std::int64_t N =
      options.mode == DispatchMode::blocking ? read_layout(s, c.host_seq, result) : device_layout(options, result);
  FLEXEP_CHECK(N >= 0 && N <= config_.capacity_rows, "hybridep dispatch: ", N, " output rows outside the buffer's ",
               config_.capacity_rows, " (internal error)");
  wrap_rows(result, N, rt.hidden, fp8, scales_out);
  result.handle = make_handle(rt, N, options.mode);
  return result;
}

DispatchCall Dispatcher::describe_call(const RankHeader& mine, const Routing& rt, const DispatchOptions& options,
                                       bool fp8, bool failed) {
  DispatchCall c;
  const std::vector<long long> header = encode(mine);
  std::copy(header.begin(), header.end(), c.header);
  c.tokens = mine.tokens;
  c.slots = failed ? 1 : rt.slots;
  c.pad_multiple = options.pad_multiple >= 1 ? options.pad_multiple : 1;  // never a division by 0, even failed
  c.budget = options.mode == DispatchMode::budget && !failed ? options.budget_rows : -1;
  c.drop = options.overflow == OverflowPolicy::drop ? 1 : 0;
  c.errors = errors_.record();
  c.row_bytes = fp8 ? config_.hidden : 2 * config_.hidden;
  c.scale_bytes = fp8 ? config_.hidden / kFp8ScaleBlock * 4 : 0;
  if (options.mode == DispatchMode::blocking) {
    c.host_control = readback_device_->control;
    c.host_status = &readback_device_->published_status;
    c.host_seq_at = &readback_device_->control_seq;
    c.host_seq = static_cast<unsigned>(dispatch_seq_);
  }
  traced_ = options_.kernel_timing;
  if (traced_) {  // before the first event: the resets are not timed
    const cudaStream_t s = stream();
    FLEXEP_CUDA_CHECK(cudaMemsetAsync(trace_->first, 0xff, sizeof trace_->first, s));
    FLEXEP_CUDA_CHECK(cudaMemsetAsync(trace_->last, 0, sizeof trace_->last, s));
    c.trace = trace_;
  }
  return c;
}

bool Dispatcher::plan_routing(DispatchCall& c, const DispatchInput& input, const TensorView& scales,
                              const Routing& rt, const HybridEpSms& sms, bool overlap) {
  DispatchStorage& st = *dispatch_;
  const DispatchGeometry& g = st.geometry();
  const cudaStream_t s = stream();
  const std::int64_t T = rt.tokens;
  c.hidden = input.hidden.data;
  c.scales = scales.data;  // null unless dispatch_fp8
  if (rt.multihot) {
    int* slot_expert = st.at<int>(g.off_slot_expert);
    float* slot_weight = st.at<float>(g.off_slot_weight);
    launch_multihot_slots(static_cast<const unsigned char*>(input.routing_map.data), input.probs.ptr<float>(), T,
                          experts_, rt.slots, slot_expert, slot_weight, errors_.record(), s);
    c.indices = slot_expert;
    c.indices_i64 = 0;
    c.weights = slot_weight;
  } else {
    c.indices = input.indices.data;
    c.indices_i64 = input.indices.dtype == DType::i64 ? 1 : 0;
    c.weights = input.weights.ptr<float>();
  }
  // The single-GPU plan with pad 1 and no budget, one kernel on the preprocess SMs (chunk_plan.cu):
  // pair counts per expert, and every slot's rank among its chunk's pairs of its expert; bad ids
  // are reported and get -1. Tokens that fit one chunk (decode) are planned by the preprocess
  // kernel itself: a kernel and a dependent launch fewer on the call's critical path.
  c.plan_slot_rows = st.at<int>(g.off_plan_slot_rows);
  c.inline_plan = T <= kPlanChunkTokens ? 1 : 0;
  if (c.inline_plan) return false;
  ChunkPlanCall pc;
  pc.indices = c.indices;
  pc.indices_i64 = c.indices_i64;
  pc.tokens = T;
  pc.slots = rt.slots;
  pc.experts = experts_;
  pc.counts = st.at<long long>(g.off_plan_counts);
  pc.chunk_base = st.at<int>(g.off_plan_chunk_base);
  pc.slot_rank = c.plan_slot_rows;
  pc.done = st.at<unsigned>(g.off_plan_done);
  pc.errors = errors_.record();
  launch_chunk_plan(pc, sms.preprocess, s);
  c.plan_counts = pc.counts;
  c.plan_chunk_base = pc.chunk_base;
  return overlap;  // the chunk plan kernel is then the last launch before the preprocess kernel
}

// The dispatch kernel is launched as a programmatic dependent of the preprocess kernel when
// nothing sits between them on the stream (kernel_timing puts events there): it may be scheduled
// while the preprocess kernel runs, hiding its launch latency, and waits (griddepcontrol.wait, its
// first instruction) for the preprocess grid to complete before it reads anything, so the results
// cannot change. Not in a graph capture: a graph launches its kernels with little overhead anyway,
// and captured calls keep exactly the dependencies they had before.
// A call whose tokens fit one plan chunk (decode) takes ONE kernel instead: the preprocess steps in
// every CTA of the dispatch grid, then its roles (dispatch_small_kernel), on the largest grid
// within the dispatch SMs whose every pipeline sends a part of it (dispatch_small_grid says why):
// fewer SMs in one kernel beat more in two for such a call.
void Dispatcher::launch_exchange(DispatchCall& c, const HybridEpSms& sms, bool after_plan, bool overlap) {
  const cudaStream_t s = stream();
  DispatchView view = dispatch_->view(status_, options_.timeout_seconds);
  view.part_tokens = options_.part_tokens;
  const int small_grid = c.inline_plan ? dispatch_small_grid(c.row_bytes, c.scale_bytes, experts_, c.slots, c.tokens,
                                                             sms.dispatch, options_.part_tokens)
                                       : 0;
  one_kernel_ = small_grid > 0;
  record(ev_preprocess, s);
  if (!one_kernel_) launch_preprocess(view, c, sms.preprocess, s, after_plan);
  record(ev_dispatch, s);
  if (one_kernel_)
    launch_dispatch_small(view, c, small_grid, s);
  else
    launch_dispatch(view, c, sms.dispatch, s, overlap);
  record(ev_dispatch_end, s);
}

// The other ranks learn of the failure from the header and abort alike. Wait for the kernels so
// that the abort this rank caused does not linger in the status record (which keeps only the first
// error) and hide a later one; a capture cannot wait, and is broken by the error anyway.
void Dispatcher::abort_failed_call(cudaStream_t s, const std::exception_ptr& local) {
  if (!cuda::capturing(s)) {
    try {
      check(s, "dispatch");
    } catch (const TimeoutError&) {
      // A peer is missing as well: the local error below is still the one to report.
    } catch (const Error&) {
    }
  }
  std::rethrow_exception(local);
}

// The preprocess steps' CTA 0 (of the preprocess kernel, or of the fused small-call kernel)
// publishes [control | tokens_per_expert] into pinned memory; the call returns once it is there,
// while the dispatch kernel still moves the rows (stream-ordered before anything the caller
// enqueues next). An aborted call waits for its kernels and raises; an error of the data movement
// itself is raised by the next call that checks (as in budget mode, and as DeepEP's dispatch).
std::int64_t Dispatcher::read_layout(cudaStream_t s, unsigned seq, DispatchResult& result) {
  const int L = local_experts();
  if (!wait_control(s, seq, "dispatch")) {  // not published: only a bug, take the slow road
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(readback_->control, dispatch_->control(),
                                      sizeof(DispatchControl) + static_cast<std::size_t>(L) * 8,
                                      cudaMemcpyDeviceToHost, s));
    check(s, "dispatch");
  }
  DispatchControl control;
  std::memcpy(&control, readback_->control, sizeof control);
  if (control.abort || readback_->published_status.code != 0) {
    check(s, "dispatch");  // raises the reason: this call's abort, or an error an earlier call left
    if (control.abort)
      throw Error(detail::concat("rank ", rank(), ": hybridep dispatch aborted without a reported reason (internal)"));
  }
  result.dropped = control.dropped;
  std::vector<std::int64_t> tpe(static_cast<std::size_t>(L));
  std::memcpy(tpe.data(), readback_->control + sizeof(DispatchControl), tpe.size() * 8);
  result.tokens_per_expert = Tensor::from_vector(tpe, {L});
  return control.out_rows;
}

// Budget mode: the counts stay on the GPU, and the output holds the budget's rows.
std::int64_t Dispatcher::device_layout(const DispatchOptions& options, DispatchResult& result) {
  const DispatchStorage& st = *dispatch_;
  result.tokens_per_expert = Tensor::wrap(TensorView(st.local() + st.geometry().off_tpe, DType::i64,
                                                     {local_experts()}, Device::cuda(comm_->device())),
                                          dispatch_);
  return options.budget_rows;
}

void Dispatcher::wrap_rows(DispatchResult& result, std::int64_t N, std::int64_t H, bool fp8, Tensor* scales_out) {
  const DispatchStorage& st = *dispatch_;
  const DispatchGeometry& g = st.geometry();
  const Device dev = Device::cuda(comm_->device());
  result.tokens = Tensor::wrap(TensorView(st.window() + g.off_tokens, fp8 ? DType::e4m3 : DType::bf16, {N, H}, dev),
                               dispatch_);
  if (scales_out)
    *scales_out =
        Tensor::wrap(TensorView(st.window() + g.off_scales, DType::f32, {N, H / kFp8ScaleBlock}, dev), dispatch_);
  result.token_probs = Tensor::wrap(TensorView(st.window() + g.off_probs, DType::f32, {N}, dev), dispatch_);
}

std::shared_ptr<HepHandle> Dispatcher::make_handle(const Routing& rt, std::int64_t rows, DispatchMode mode) {
  auto h = std::make_shared<HepHandle>();
  h->backend = "hybridep";
  h->owner = this;
  h->rank = rank();
  h->tokens = rt.tokens;
  h->topk = rt.multihot ? experts_ : rt.slots;
  h->multihot = rt.multihot;
  h->hidden = rt.hidden;
  h->rows = rows;
  h->local_experts = local_experts();
  h->hidden_dtype = DType::bf16;  // of combine's expert_out and the gradients, also after dispatch_fp8
  h->prob_dtype = DType::f32;
  h->sequence = dispatch_seq_;
  h->storage = dispatch_;
  h->mode = mode;
  h->slots = rt.slots;
  return h;
}

}  // namespace flexep::hybridep
