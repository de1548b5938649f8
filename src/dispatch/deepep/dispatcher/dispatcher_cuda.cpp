// The deepep dispatcher's set-up: the window (its layout, the flags, the operation state), the
// stream helpers, the error check every call ends with, and the factory.
#include "dispatch/deepep/dispatcher/dispatcher.h"
#include "flexep/core/error.h"
#include "flexep/cuda/runtime.h"

namespace flexep {
namespace deepep {

namespace {

std::string phase_name(int phase) {
  switch (static_cast<Phase>(phase)) {
    case Phase::dispatch_counts: return "deepep dispatch:count-exchange";
    case Phase::dispatch_tokens: return "deepep dispatch:rows";
    case Phase::combine_partials: return "deepep combine:rows";
    case Phase::dispatch_backward_partials: return "deepep dispatch_backward:rows";
    case Phase::combine_backward_rows: return "deepep combine_backward:rows";
    case Phase::low_latency_dispatch: return "deepep low_latency_dispatch:rows";
    case Phase::low_latency_combine: return "deepep low_latency_combine:rows";
    default: return "deepep";
  }
}

}  // namespace

Dispatcher::Dispatcher(std::shared_ptr<Communicator> comm, int num_experts, const DeepEpOptions& options)
    : comm_(std::move(comm)), experts_(num_experts), sym_(comm_, "deepep buffer"), errors_(comm_->device()) {
  agree_on_options(options, "deepep:create");
  allocate();
}

void Dispatcher::check_options(int num_experts) {
  const int R = comm_->size();
  PlanParams p;
  p.ranks = R;
  p.experts = num_experts;
  validate(p);
  comm_->require_queue_per_rank("deepep");
  FLEXEP_CHECK_ARG(R <= kMaxSymmetricRanks, "comm", "has ", R, " ranks; the deepep backend supports at most ",
                   kMaxSymmetricRanks, " (one NVLink domain)");
  FLEXEP_CHECK_ARG(options_.hidden >= 8 && options_.hidden % 8 == 0, "options.hidden", options_.hidden,
                   " must be a positive multiple of 8 (rows move as 16-byte vectors)");
  FLEXEP_CHECK_ARG(options_.max_tokens_per_rank >= 1, "options.max_tokens_per_rank", "must be >= 1, got ",
                   options_.max_tokens_per_rank);
  FLEXEP_CHECK_ARG(options_.max_topk >= 0, "options.max_topk", "must be >= 0 (0: the number of experts), got ",
                   options_.max_topk);
  FLEXEP_CHECK_ARG(options_.max_recv_rows >= 0, "options.max_recv_rows",
                   "must be >= 0 (0: ranks x max_tokens_per_rank), got ", options_.max_recv_rows);
  const Sizes sizes = sizes_of(options_, R, num_experts);
  max_topk_ = sizes.max_topk;
  FLEXEP_CHECK_ARG(max_topk_ <= num_experts, "options.max_topk", max_topk_, " exceeds the ", num_experts, " experts");
  capacity_rows_ = sizes.capacity_rows;
  FLEXEP_CHECK_ARG(capacity_rows_ <= static_cast<std::int64_t>(INT32_MAX), "options.max_recv_rows", capacity_rows_,
                   " rows exceed the 32-bit row indices of the kernels");
  FLEXEP_CHECK_ARG(options_.sms >= 0 && options_.sms <= 1024, "options.sms", options_.sms, " is outside [0, 1024]");
  FLEXEP_CHECK_ARG(options_.timeout_seconds > 0, "options.timeout_seconds", "must be > 0, got ",
                   options_.timeout_seconds);
  const std::int64_t ll = options_.low_latency_max_tokens;
  FLEXEP_CHECK_ARG(ll >= 0 && ll <= 65536, "options.low_latency_max_tokens", ll,
                   " is outside [0, 65536] (0: no low-latency buffers)");
  if (ll > 0) {
    // The low-latency kernels wait, inside one grid, for what the grid's other CTAs publish: all
    // of them must be resident at once, one per SM of this rank's share.
    FLEXEP_CHECK_ARG(low_latency_ctas() <= comm_->sms_per_rank(), "options.sms", low_latency_ctas(),
                     " CTAs of the low-latency kernels exceed the ", comm_->sms_per_rank(),
                     " SMs this rank may hold at once (a GPU's SMs, shared by its simulated ranks)");
    FLEXEP_CHECK_ARG(num_experts / R <= 4096, "num_experts", num_experts, " experts over ", R,
                     " ranks: the low-latency kernels hold at most 4096 local experts (shared memory)");
    FLEXEP_CHECK_ARG(static_cast<std::int64_t>(R) * ll * ll_slots() <= INT32_MAX, "options.low_latency_max_tokens",
                     ll, " x ", R, " ranks x ", ll_slots(), " slots exceed the kernels' 32-bit routes");
  }
}

Dispatcher::~Dispatcher() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(comm_->device());
  cudaDeviceSynchronize();  // no kernel may still use the operation state
  cudaFree(local_);  // null after release()
  cudaSetDevice(previous);
}

cudaStream_t Dispatcher::stream() const {
  return options_.stream ? static_cast<cudaStream_t>(options_.stream) : cuda::current_stream();
}

const unsigned* Dispatcher::own_flags() const {
  return reinterpret_cast<const unsigned*>(sym_.peer_flags(comm_->rank()));
}

void Dispatcher::require_usable() const {
  FLEXEP_CHECK(!broken_, "rank ", comm_->rank(), ": this deepep dispatcher is unusable after an earlier error (",
               broken_why_, "); create a new one");
}

void Dispatcher::require_buffers() const {
  FLEXEP_CHECK_ARG(local_ != nullptr, "handle",
                   "is stale: this deepep dispatcher's buffers were released after its dispatch (dispatch again)");
}

void Dispatcher::check_generation(std::uint64_t generation) const {
  FLEXEP_CHECK_ARG(generation == generation_, "handle",
                   "is stale: this deepep dispatcher's buffers were released or resized after its dispatch");
}

const DeepEpHandle& Dispatcher::own_handle(const Handle& handle) const {
  check_handle(handle);
  const auto* h = dynamic_cast<const DeepEpHandle*>(handle.get());
  FLEXEP_CHECK_ARG(h != nullptr, "handle", "claims this dispatcher as owner but is not a deepep handle");
  check_generation(h->generation);
  FLEXEP_CHECK_ARG(!h->budget || h->sequence == budget_sequence_, "handle",
                   "is from an earlier budget-mode dispatch, whose buffers a later budget-mode dispatch of this "
                   "dispatcher reused; combine and the backwards take the latest budget-mode handle (one dispatcher "
                   "per layer keeps each layer's)");
  return *h;
}

void Dispatcher::check_errors() {
  const CallScope call = open_call();
  require_usable();
  if (local_ != nullptr) check(call.stream, "check_errors");  // released: release() waited for the device
  errors_.check(call.stream, "check_errors");  // a bad id of a low-latency dispatch (this rank's)
}

std::int64_t Dispatcher::last_dropped() {
  const CallScope call = open_call();
  require_usable();
  if (local_ == nullptr) return 0;
  check(call.stream, "last_dropped");
  return last_was_budget_ ? cuda::to_host(dropped_, call.stream).data<std::int64_t>()[0] : 0;
}

void Dispatcher::check(cudaStream_t s, const std::string& op) {
  // Every device wait has a deadline, so the stream finishes even when a peer never arrives.
  FLEXEP_CUDA_CHECK(cudaStreamSynchronize(s));
  Status st;
  FLEXEP_CUDA_CHECK(cudaMemcpy(&st, status_, sizeof st, cudaMemcpyDeviceToHost));
  if (st.code == static_cast<int>(hybridep::StatusCode::abort) && st.phase != static_cast<int>(Phase::dispatch_counts)) {
    FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));  // an argument error: the dispatcher stays usable
    raise_peer_failure(st, op);
  }
  if (st.code == static_cast<int>(hybridep::StatusCode::abort)) {
    try {
      errors_.check(s, op);  // this rank's own bad id (budget mode) is the error it raises
    } catch (...) {
      FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));
      throw;
    }
    raise_abort();
    return;
  }
  // A bad id of a budget-mode dispatch aborts it (the count exchange carries it); blocking mode
  // raised its own already: no second wait for the error record here.
  if (st.code == 0) return;
  broken_ = true;
  broken_why_ = op + " failed";
  if (st.code == static_cast<int>(hybridep::StatusCode::timeout))
    throw TimeoutError(phase_name(st.phase), st.peer,
                       detail::concat("rank ", comm_->rank(), ": ", op, " waited ", options_.timeout_seconds,
                                      " s for rank ", st.peer, "'s rows (DeepEpOptions::timeout_seconds); ",
                                      epochs(st)));
  throw Error(detail::concat("rank ", comm_->rank(), ": deepep ", op, " failed on the device (status ", st.code,
                             ", phase ", phase_name(st.phase), ", rank ", st.peer, ")"));
}

std::string Dispatcher::epochs(const Status& st) const {
  // What a hang looks like from here: the epoch the wait wanted, what the peer's flags hold and how
  // many operations of each kind this rank ran (ranks out of step differ in these).
  const int R = world_size();
  std::vector<unsigned> flags(static_cast<std::size_t>(kKinds * R));
  std::vector<OpControl> ops(kKinds);
  if (cudaMemcpy(flags.data(), own_flags(), flags.size() * sizeof(unsigned), cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(ops.data(), ops_, ops.size() * sizeof(OpControl), cudaMemcpyDeviceToHost) != cudaSuccess)
    return "epochs unreadable";
  const char* names[kKinds] = {"dispatch", "combine", "dispatch_backward", "combine_backward",
                               "counts", "low_latency_dispatch", "low_latency_combine"};
  std::string own, peer;
  for (int k = 0; k < kKinds; ++k) {
    own += detail::concat(k ? ", " : "", names[k], " ", ops[static_cast<std::size_t>(k)].epoch);
    if (st.peer >= 0 && st.peer < R)
      peer += detail::concat(k ? ", " : "", names[k], " ", flags[static_cast<std::size_t>(k * R + st.peer)]);
  }
  return detail::concat("waited for epoch ", st.value, " and saw ", st.limit, " at the deadline; rank ", st.peer,
                        "'s flags here now: ", peer, "; this rank's operations: ", own);
}

void Dispatcher::raise_peer_failure(const Status& st, const std::string& op) {
  flexep::raise_peer_failure(st.peer, phase_name(st.phase), static_cast<FailedArg>(st.value), comm_->rank(), op);
}

void Dispatcher::raise_abort() {
  // The words every rank exchanged: the same rules as blocking mode's, so every rank raises the
  // error blocking mode would have raised. The status is cleared: an argument error leaves the
  // dispatcher usable, as in blocking mode.
  const int R = world_size(), me = rank();
  std::vector<long long> all(static_cast<std::size_t>(R) * exchange_word::words(experts_, R));
  FLEXEP_CUDA_CHECK(cudaMemcpy(all.data(), snapshot_, all.size() * 8, cudaMemcpyDeviceToHost));
  FLEXEP_CUDA_CHECK(cudaMemset(status_, 0, sizeof(Status)));
  const Gathered g = read_gathered(all.data());
  // This rank's own failure was raised by its own dispatch (or by check's error record) already.
  const call_signature::CallSignature& own = g.headers[static_cast<std::size_t>(me)];
  if (own.failed || own.device_arg != 0) return;
  DispatchOptions o;  // the call's layout options, as every rank gave them (compared in agree)
  o.mode = g.headers[0].mode;
  o.budget_rows = g.headers[0].budget_rows;
  o.pad_multiple = g.headers[0].pad_multiple;
  o.overflow = g.headers[0].overflow;
  o.layout = g.headers[0].layout;
  agree(g, o);
  throw_error("rank ", me, ": a budget-mode deepep dispatch aborted on the device for a reason its count exchange "
              "does not show (internal error)");
}

std::unique_ptr<TokenDispatcher> Dispatcher::make_sibling(std::int64_t max_tokens_per_rank) const {
  DeepEpOptions o = options_;
  if (max_tokens_per_rank > 0 && max_tokens_per_rank != o.max_tokens_per_rank) {
    o.max_tokens_per_rank = max_tokens_per_rank;
    o.max_recv_rows = 0;  // the receive window of the new size (ranks * max_tokens_per_rank)
  }
  return make_deepep_dispatcher(comm_, experts_, o);
}

}  // namespace deepep

std::unique_ptr<DeepEpDispatcher> make_deepep_dispatcher(std::shared_ptr<Communicator> comm, int num_experts,
                                                        const DeepEpOptions& options) {
  FLEXEP_CHECK_ARG(comm != nullptr, "comm", "is null; pass the rank's Communicator");
  return std::make_unique<deepep::Dispatcher>(std::move(comm), num_experts, options);
}

}  // namespace flexep
