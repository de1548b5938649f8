// The hybridep dispatcher's set-up and bookkeeping: options and buffers (init, resize, release,
// memory), SM counts, handles, the host checks that turn the device status into exceptions, and
// the factory.
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <thread>

#include "dispatch/hybridep/dispatcher/dispatcher.h"
#include "dispatch/hybridep/kernels/parts.h"
#include "flexep/core/backoff.h"
#include "flexep/core/checks.h"
#include "flexep/core/plan.h"
#include "flexep/cuda/runtime.h"

namespace flexep {

namespace {
// Process-wide SM counts (set_hybridep_num_sms); BackendConfig::dispatcher_num_sms's default.
std::atomic<int> g_dispatch_sms{20}, g_combine_sms{20}, g_preprocess_sms{20};

hybridep::BufferConfig config_of(const HybridEpOptions& o, int ranks, int experts) {
  FLEXEP_CHECK_ARG(o.timeout_seconds > 0, "timeout_seconds", "must be > 0, got ", o.timeout_seconds);
  FLEXEP_CHECK_ARG(o.dispatch_sms >= 0 && o.combine_sms >= 0 && o.preprocess_sms >= 0, "sms",
                   "SM counts must be >= 0 (0 = the process-wide setting)");
  FLEXEP_CHECK_ARG(o.part_tokens == 0 || hybridep::valid_part_tokens(o.part_tokens), "part_tokens",
                   "must be 0 (chosen per call) or 1, 2, 4, 8, 16 or 32, got ", o.part_tokens);
  const hybridep::BufferConfig c = hybridep::make_buffer_config(
      ranks, experts, o.max_tokens_per_rank, o.hidden, o.max_topk, o.max_recv_rows, o.max_pad_multiple, o.fp8);
  const long long row_bytes = c.fp8 ? c.hidden : 2 * c.hidden, scale_bytes = c.fp8 ? c.hidden / hybridep::kFp8ScaleBlock * 4 : 0;
  FLEXEP_CHECK(hybridep::dispatch_supported(row_bytes, scale_bytes) && hybridep::combine_supported(c.hidden) &&
                   hybridep::combine_backward_supported(c.hidden),
               "hybridep: H = ", c.hidden, " passed the buffer checks but does not fit the kernels' rings ",
               "(internal error: kMaxHidden in layout.h disagrees with the kernels)");
  return c;
}

HybridEpMemory memory_of(const hybridep::DispatchGeometry& d, const hybridep::CombineGeometry& c) {
  HybridEpMemory m;
  m.dispatch_window = d.window_bytes;
  m.dispatch_flags = d.flag_bytes;
  m.dispatch_local = d.local_bytes;
  m.combine_window = c.window_bytes;
  m.combine_flags = c.flag_bytes;
  m.combine_local = c.local_bytes;
  return m;
}
}  // namespace

void set_hybridep_num_sms(int dispatch, int combine, int preprocess) {
  FLEXEP_CHECK_ARG(dispatch >= 1, "dispatch", "SM count must be >= 1, got ", dispatch);
  FLEXEP_CHECK_ARG(combine >= 0 && preprocess >= 0, "sms",
                   "combine and preprocess SM counts must be >= 0 (0 = the "
                   "dispatch count), got ",
                   combine, " and ", preprocess);
  g_dispatch_sms = dispatch;
  g_combine_sms = combine ? combine : dispatch;
  g_preprocess_sms = preprocess ? preprocess : dispatch;
}

HybridEpSms hybridep_num_sms() { return {g_dispatch_sms.load(), g_combine_sms.load(), g_preprocess_sms.load()}; }

HybridEpOptions HybridEpOptions::from_backend(const BackendConfig& backend, std::int64_t max_tokens_per_rank,
                                              std::int64_t hidden) {
  HybridEpOptions o;
  o.max_tokens_per_rank = max_tokens_per_rank;
  o.hidden = hidden;
  o.dispatch_sms = backend.dispatch_sms();
  o.combine_sms = backend.combine_sms();
  o.preprocess_sms = backend.preprocess_sms();
  return o;
}

HybridEpMemory HybridEpDispatcher::size_hint(const HybridEpOptions& options, int ranks, int num_experts) {
  const hybridep::BufferConfig c = config_of(options, ranks, num_experts);
  return memory_of(hybridep::dispatch_geometry(c), hybridep::combine_geometry(c));
}

namespace hybridep {

namespace {
// The phases whose kernels carry a peer's failed checks (stop_together's abort words).
bool combine_side(Phase p) {
  return p == Phase::combine_partials || p == Phase::dispatch_backward_partials || p == Phase::combine_backward_rows;
}
}  // namespace

Dispatcher::Dispatcher(std::shared_ptr<Communicator> comm, int num_experts, const HybridEpOptions& options)
    : comm_(std::move(comm)),
      experts_(num_experts),
      options_(options),
      config_(config_of(options, comm_->size(), num_experts)),
      errors_(comm_->device()) {
  comm_->require_queue_per_rank("hybridep");
  cuda::DeviceGuard guard(comm_->device());
  own_sms_ = {options.dispatch_sms, options.combine_sms, options.preprocess_sms};
  FLEXEP_CUDA_CHECK(cudaMalloc(&status_, sizeof(Status)));
  FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));
  FLEXEP_CUDA_CHECK(cudaMalloc(&trace_, sizeof(PhaseTrace)));
  FLEXEP_CUDA_CHECK(cudaMallocHost(&readback_, sizeof(Readback)));
  std::memset(static_cast<void*>(readback_), 0, sizeof(Readback));
  FLEXEP_CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&readback_device_), readback_, 0));
  for (cudaEvent_t& e : events_) FLEXEP_CUDA_CHECK(cudaEventCreate(&e));
}

Dispatcher::~Dispatcher() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(comm_->device());
  cudaDeviceSynchronize();
  dispatch_.reset();  // local teardown, unless outputs still hold the storage
  combine_.reset();
  for (cudaEvent_t e : events_)
    if (e) cudaEventDestroy(e);
  if (readback_) cudaFreeHost(readback_);
  if (status_) cudaFree(status_);
  if (trace_) cudaFree(trace_);
  cudaSetDevice(previous);
}

cudaStream_t Dispatcher::stream() const { return options_.stream ? options_.stream : cuda::current_stream(); }

void Dispatcher::require_usable() const {
  FLEXEP_CHECK(!broken_, "this hybridep dispatcher is unusable after an earlier failure (", broken_why_,
               "); the ranks' buffers are out of step: create a new dispatcher (and communicator)");
  FLEXEP_CHECK(!comm_->aborted(), "the communicator of this hybridep dispatcher was aborted after an earlier failure");
}

void Dispatcher::init() {
  if (dispatch_ && combine_) return;
  require_usable();
  cuda::init();
  cuda::DeviceGuard guard(comm_->device());
  // Every rank verifies that every rank sizes its buffers alike, before any window is registered.
  const std::vector<long long> mine = config_words(config_);
  const std::vector<long long> all = comm_->all_gather_i64(mine, "hybridep:init");
  const std::size_t n = mine.size();
  for (int r = 1; r < comm_->size(); ++r) {
    const long long e_r = all[static_cast<std::size_t>(r) * n + 1], e_0 = all[1];  // word 1: num_experts
    FLEXEP_CHECK_ARG(e_r == e_0, "num_experts", "rank ", r, " has E=", e_r, " but rank 0 has E=", e_0,
                     "; all ranks must create their dispatcher with the same num_experts");
  }
  for (int r = 1; r < comm_->size(); ++r)
    for (std::size_t i = 0; i < n; ++i)
      FLEXEP_CHECK_ARG(all[static_cast<std::size_t>(r) * n + i] == all[i], "options", "rank ", r,
                       " configures its hybridep buffers differently from rank 0 (ranks, experts, max_tokens_per_rank, "
                       "hidden, max_topk, max_recv_rows, max_pad_multiple, fp8: word ",
                       i, " is ", all[static_cast<std::size_t>(r) * n + i], " vs ", all[i],
                       "); create every rank's dispatcher with the same options and num_experts");
  dispatch_ = std::make_shared<DispatchStorage>(comm_, config_);
  combine_ = std::make_shared<CombineStorage>(comm_, config_);
}

void Dispatcher::ensure_initialized() {
  if (!dispatch_ || !combine_) init();
}

void Dispatcher::release() {
  if (!dispatch_ && !combine_) return;
  {
    cuda::DeviceGuard guard(comm_->device());
    FLEXEP_CUDA_CHECK(cudaDeviceSynchronize());
  }
  // No rank tears down while another may still run a kernel that writes into its window.
  if (!comm_->aborted()) comm_->barrier("hybridep:release");
  dispatch_.reset();
  combine_.reset();
}

void Dispatcher::resize(const HybridEpOptions& options) {
  // Validate first, then agree: a rank with bad options must not leave the others in a barrier.
  BufferConfig next;
  std::exception_ptr local;
  try {
    next = config_of(options, comm_->size(), experts_);
    require_memory(options, comm_->size(), experts_, comm_->device(), memory().total());
  } catch (...) {
    local = std::current_exception();
  }
  const std::vector<long long> failed = comm_->all_gather_i64({local ? 1 : 0}, "hybridep:resize");
  if (local) std::rethrow_exception(local);
  for (int r = 0; r < comm_->size(); ++r)
    FLEXEP_CHECK_ARG(failed[static_cast<std::size_t>(r)] == 0, "options", "rank ", r,
                     " rejected its resize options, so the resize stops on every rank: see the error raised there");
  release();
  options_ = options;
  config_ = next;
  own_sms_ = {options.dispatch_sms, options.combine_sms, options.preprocess_sms};
  init();
}

HybridEpMemory Dispatcher::memory() const {
  HybridEpMemory m;
  if (dispatch_) {
    m.dispatch_window = dispatch_->window_bytes();
    m.dispatch_flags = dispatch_->flag_bytes();
    m.dispatch_local = dispatch_->local_bytes();
  }
  if (combine_) {
    m.combine_window = combine_->window_bytes();
    m.combine_flags = combine_->flag_bytes();
    m.combine_local = combine_->local_bytes();
  }
  return m;
}

void Dispatcher::set_num_sms(int dispatch, int combine, int preprocess) {
  const int sms = comm_->sms_per_rank();
  for (int v : {dispatch, combine, preprocess})
    FLEXEP_CHECK_ARG(v >= 0 && v <= sms, "num_sms", "SM counts must be in [0, ", sms, "] for this rank (", sms_source(),
                     "; 0 = the process-wide setting), got ", v);
  own_sms_ = {dispatch, combine, preprocess};
}

std::string Dispatcher::sms_source() const {
  if (!comm_->simulated()) return "the GPU's SMs";
  return detail::concat("1 / ", 2 * comm_->size(), " of the GPU's ", cuda::sm_count(comm_->device()), ": ",
                        comm_->size(), " simulated ranks share it");
}

HybridEpSms Dispatcher::num_sms() const {
  const HybridEpSms global = hybridep_num_sms();
  const HybridEpSms s{own_sms_.dispatch > 0 ? own_sms_.dispatch : global.dispatch,
                      own_sms_.combine > 0 ? own_sms_.combine : global.combine,
                      own_sms_.preprocess > 0 ? own_sms_.preprocess : global.preprocess};
  const int sms = comm_->sms_per_rank();
  for (int v : {s.dispatch, s.combine, s.preprocess})
    FLEXEP_CHECK_ARG(v >= 1 && v <= sms, "num_sms",
                     "the hybridep kernels are persistent grids of one CTA per SM: ", "SM counts must be in [1, ", sms,
                     "] for this rank (", sms_source(), "), got ", v);
  return s;
}

const HepHandle& Dispatcher::own_handle(const Handle& handle) const {
  check_handle(handle);
  const auto* h = dynamic_cast<const HepHandle*>(handle.get());
  FLEXEP_CHECK_ARG(h != nullptr, "handle", "claims this dispatcher as owner but is not a hybridep handle");
  FLEXEP_CHECK_ARG(h->storage == dispatch_ && h->sequence == dispatch_seq_, "handle",
                   "is stale: it belongs to dispatch #", h->sequence, " of this hybridep dispatcher, but dispatch #",
                   dispatch_seq_, (h->storage == dispatch_ ? "" : " (after a resize or release)"),
                   " has since overwritten its receive window and metadata. A dispatch's outputs and handle are valid "
                   "until the next dispatch on the same dispatcher: finish combine and the backwards first, or use "
                   "one dispatcher per layer");
  return *h;
}

void Dispatcher::check_tensor(const TensorView& t, const std::string& arg) const {
  check::device(t, Device::cuda(comm_->device()), arg);
  FLEXEP_CHECK_ARG(reinterpret_cast<std::uintptr_t>(t.data) % 16 == 0, arg,
                   "must be 16-byte aligned (rows move as 16-byte vectors)");
}

void Dispatcher::record(Event e, cudaStream_t s) {
  if (!options_.kernel_timing) return;
  FLEXEP_CUDA_CHECK(cudaEventRecord(events_[e], s));
  recorded_[e] = true;
}

HybridEpKernelTimes Dispatcher::kernel_times() {
  HybridEpKernelTimes t;
  auto span = [&](Event a, Event b) {
    if (!recorded_[a] || !recorded_[b]) return 0.0;
    FLEXEP_CUDA_CHECK(cudaEventSynchronize(events_[b]));
    float ms = 0;
    FLEXEP_CUDA_CHECK(cudaEventElapsedTime(&ms, events_[a], events_[b]));
    return 1000.0 * ms;
  };
  t.plan = span(ev_plan, ev_preprocess);
  t.preprocess = span(ev_preprocess, ev_dispatch);
  t.dispatch = span(ev_dispatch, ev_dispatch_end);
  t.combine = span(ev_combine, ev_combine_end);
  t.one_kernel = one_kernel_;
  if (traced_) {
    PhaseTrace trace;
    FLEXEP_CUDA_CHECK(cudaMemcpy(&trace, trace_, sizeof trace, cudaMemcpyDeviceToHost));  // after the events
    const unsigned long long origin = trace.first[kTracePreprocessStart];
    const auto us = [origin](unsigned long long ns) {
      return (static_cast<double>(ns) - static_cast<double>(origin)) / 1000.0;
    };
    for (int p = 0; p < kTracePoints; ++p)
      if (trace.first[p] != ~0ull && origin != ~0ull)  // reached
        t.dispatch_phases.push_back(HybridEpPhase{kTracePointNames[p], us(trace.first[p]), us(trace.last[p])});
  }
  return t;
}

bool Dispatcher::wait_until(cudaStream_t s, const std::string& op, const char* failure,
                            const std::function<bool()>& done) {
  // Every device wait has its own deadline, so the stream finishes; this bound only guards against
  // a GPU that stopped making progress altogether.
  const double seconds = 3 * options_.timeout_seconds + 30;
  const auto start = std::chrono::steady_clock::now();
  const auto deadline = start + std::chrono::duration<double>(seconds);
  const PollBackoff backoff(std::chrono::microseconds(20));
  while (!done()) {
    const cudaError_t q = cudaStreamQuery(s);
    if (q == cudaSuccess) return done();
    if (q != cudaErrorNotReady) cuda::throw_cuda_error(q, "cudaStreamQuery", __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() > deadline) {
      broken_ = true;
      broken_why_ = "the GPU did not finish " + op;
      throw TimeoutError(op, -1,
                         detail::concat("rank ", rank(), ": ", failure, " within ", seconds,
                                        " s although every device wait has a deadline"));
    }
    backoff.pause();
  }
  return true;
}

void Dispatcher::wait_stream(cudaStream_t s, const std::string& op) {
  wait_until(s, op, "the hybridep kernels did not finish", [] { return false; });
}

bool Dispatcher::wait_control(cudaStream_t s, unsigned seq, const std::string& op) {
  const volatile unsigned* published = &readback_->control_seq;
  if (!wait_until(s, op, "the hybridep preprocess kernel did not publish the layout",
                  [&] { return *published == seq; }))
    return false;
  std::atomic_thread_fence(std::memory_order_acquire);  // the layout was written before the number
  return true;
}

void Dispatcher::check(cudaStream_t s, const std::string& op) {
  cuda::DeviceGuard guard(comm_->device());
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(&readback_->status, status_, sizeof(Status), cudaMemcpyDeviceToHost, s));
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(&readback_->errors, errors_.record(), sizeof(cuda::DeviceErrorRecord),
                                    cudaMemcpyDeviceToHost, s));
  wait_stream(s, op);
  const Status st = readback_->status;
  const bool device_arg = readback_->errors.arg != 0;
  if (st.code == 0 && !device_arg) return;

  std::exception_ptr err;
  if (st.code == static_cast<int>(StatusCode::timeout) || st.code == static_cast<int>(StatusCode::corrupt)) {
    broken_ = true;
    broken_why_ = phase_name(static_cast<Phase>(st.phase)) + " failed";
    err = status_error(st, rank(), options_.timeout_seconds);
  } else if (st.code == static_cast<int>(StatusCode::abort) && combine_side(static_cast<Phase>(st.phase))) {
    // A peer failed its checks in combine or a backward (stop_together): its error, named here.
    try {
      raise_peer_failure(st.peer, phase_name(static_cast<Phase>(st.phase)), static_cast<FailedArg>(st.value), rank(),
                         op);
    } catch (...) {
      err = std::current_exception();
    }
  } else if (st.code == static_cast<int>(StatusCode::abort) && dispatch_) {
    const DispatchGeometry& g = dispatch_->geometry();
    std::vector<long long> words(static_cast<std::size_t>(g.cfg.ranks) * g.slot_bytes / 8);
    FLEXEP_CUDA_CHECK(cudaMemcpyAsync(words.data(), dispatch_->local() + g.off_snapshot, words.size() * 8,
                                      cudaMemcpyDeviceToHost, s));
    FLEXEP_CUDA_CHECK(cudaStreamSynchronize(s));
    const Snapshot snap = parse_snapshot(words, g.cfg.ranks, g.cfg.experts, g.slot_bytes / 8);
    err = abort_reason(snap, rank(), g.cfg.capacity_rows);
  }
  if (st.code != 0) FLEXEP_CUDA_CHECK(cudaMemsetAsync(status_, 0, sizeof(Status), s));
  // This rank's own bad expert ids: the most precise error (DeviceErrors::check clears the record).
  if (device_arg && (!err || st.code == static_cast<int>(StatusCode::abort))) errors_.check(s, op);
  if (device_arg) FLEXEP_CUDA_CHECK(cudaMemsetAsync(errors_.record(), 0, sizeof(cuda::DeviceErrorRecord), s));
  if (err) std::rethrow_exception(err);
}

void Dispatcher::check_errors() {
  cuda::DeviceGuard guard(comm_->device());
  check(stream(), "hybridep:check_errors");
}

std::int64_t Dispatcher::last_dropped() {
  cuda::DeviceGuard guard(comm_->device());
  const cudaStream_t s = stream();
  check(s, "hybridep:last_dropped");
  if (!dispatch_) return 0;
  FLEXEP_CUDA_CHECK(cudaMemcpyAsync(&readback_->dropped, &dispatch_->control()->dropped, sizeof(long long),
                                    cudaMemcpyDeviceToHost, s));
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(s));
  return readback_->dropped;
}

HandleView Dispatcher::storage_view(const DispatchStorage& st) {
  const DispatchGeometry& g = st.geometry();
  HandleView v;
  v.records = reinterpret_cast<const unsigned char*>(st.window() + g.off_records);
  v.record_bytes = g.record_bytes;
  v.max_tokens = g.cfg.max_tokens;
  v.control = st.control();
  return v;
}

HandleView Dispatcher::handle_view(const HepHandle& h) const {
  const DispatchStorage& st = *h.storage;
  const DispatchGeometry& g = st.geometry();
  HandleView v = storage_view(st);
  v.tpe = st.at<long long>(g.off_tpe);
  v.begin = st.at<long long>(g.off_begin);
  v.kept = st.at<long long>(g.off_kept);
  v.staging = st.at<unsigned char>(g.off_staging);
  v.slot_entry = st.at<int>(g.off_slot_entry);
  v.slot_expert = st.at<int>(g.off_slot_expert);
  v.slots = h.slots;
  v.multihot = h.multihot ? 1 : 0;
  v.experts = experts_;
  v.local_experts = h.local_experts;
  v.tokens = h.tokens;
  v.rows = h.rows;
  return v;
}

// Buffers that cannot fit are refused before the collective set-up, by every rank (the outcome is
// agreed), rather than by a failed allocation inside it. `reusable`: what a resize frees first.
void require_memory(const HybridEpOptions& options, int ranks, int experts, int device, std::size_t reusable) {
  const HybridEpMemory need = HybridEpDispatcher::size_hint(options, ranks, experts);
  cuda::require_device_memory(need.total(), reusable, device, "options",
                              detail::concat("the hybridep buffers (dispatch window ", need.dispatch_window,
                                             " bytes, combine window ", need.combine_window, " bytes, ",
                                             need.dispatch_local + need.combine_local, " bytes of this rank's own)"));
}

std::unique_ptr<TokenDispatcher> Dispatcher::make_sibling(std::int64_t max_tokens_per_rank) const {
  HybridEpOptions o = options_;
  if (max_tokens_per_rank > 0) o.max_tokens_per_rank = max_tokens_per_rank;
  return make_hybridep_dispatcher(comm_, experts_, o);
}

}  // namespace hybridep

std::unique_ptr<HybridEpDispatcher> make_hybridep_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                             const HybridEpOptions& options) {
  FLEXEP_CHECK_ARG(comm != nullptr, "comm", "is null; create the rank's Communicator first");
  cuda::init();
  // Local validation first, then one exchange of the outcome: a rank with bad arguments must not
  // leave the others waiting in the collective set-up.
  std::exception_ptr local;
  try {
    PlanParams p;
    p.ranks = comm->size();
    p.experts = num_experts;
    validate(p);  // E >= 1 and divisible by the ranks, named "num_experts"
    (void)config_of(options, comm->size(), num_experts);
    hybridep::require_memory(options, comm->size(), num_experts, comm->device(), 0);
  } catch (...) {
    local = std::current_exception();
  }
  const std::vector<long long> failed = comm->all_gather_i64({local ? 1 : 0}, "hybridep:create");
  if (local) std::rethrow_exception(local);
  for (int r = 0; r < comm->size(); ++r)
    FLEXEP_CHECK_ARG(failed[static_cast<std::size_t>(r)] == 0, "options", "rank ", r,
                     " rejected its hybridep options, so the set-up stops on every rank: see the error raised there");
  auto d = std::make_unique<hybridep::Dispatcher>(std::move(comm), num_experts, options);
  d->init();
  return d;
}

}  // namespace flexep
