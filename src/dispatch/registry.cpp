// The table of dispatcher backends (include/flexep/dispatch/registry.h). Adding a backend: its
// folder under src/dispatch/, its public factory header under include/flexep/dispatch/, and one
// entry below (docs/architecture.md, "Adding a backend").
#include "flexep/dispatch/registry.h"

#include <array>

#include "flexep/comm/host_world.h"
#include "flexep/core/checks.h"
#include "flexep/dispatch/host.h"

#ifdef FLEXEP_WITH_CUDA
#include "flexep/comm/communicator.h"
#include "flexep/dispatch/alltoall.h"
#include "flexep/dispatch/deepep.h"
#include "flexep/dispatch/hybridep.h"
#endif

namespace flexep {

namespace {

std::unique_ptr<TokenDispatcher> make_host(const DispatcherSpec& s) {
  auto group = std::dynamic_pointer_cast<HostProcessGroup>(s.group);
  FLEXEP_CHECK_ARG(group != nullptr, "group", "the host backend needs a HostProcessGroup (simulated ranks)");
  return make_host_dispatcher(group->world(), group->rank(), s.num_experts);
}

#ifdef FLEXEP_WITH_CUDA
std::shared_ptr<Communicator> communicator_of(const DispatcherSpec& s, std::string_view backend) {
  auto comm = std::dynamic_pointer_cast<Communicator>(s.group);
  FLEXEP_CHECK_ARG(comm != nullptr, "group", "the ", backend, " backend needs a flexep Communicator (one GPU per rank)");
  return comm;
}

std::unique_ptr<TokenDispatcher> make_alltoall(const DispatcherSpec& s) {
  AlltoallOptions o;
  o.stream = static_cast<cudaStream_t>(s.stream);
  return make_alltoall_dispatcher(communicator_of(s, "alltoall"), s.num_experts, o);
}

std::unique_ptr<TokenDispatcher> make_hybridep(const DispatcherSpec& s) {
  HybridEpOptions o = HybridEpOptions::from_backend(s.backend, s.max_tokens_per_rank, s.hidden);
  o.max_topk = s.max_topk;
  o.max_recv_rows = s.max_recv_rows;
  o.stream = static_cast<cudaStream_t>(s.stream);
  o.check_blocking_calls = s.check_blocking_calls;
  o.kernel_timing = s.kernel_timing;
  o.part_tokens = s.part_tokens;
  if (s.timeout_seconds > 0) o.timeout_seconds = s.timeout_seconds;
  return make_hybridep_dispatcher(communicator_of(s, "hybridep"), s.num_experts, o);
}
std::unique_ptr<TokenDispatcher> make_deepep(const DispatcherSpec& s) {
  DeepEpOptions o;
  o.hidden = s.hidden;
  o.max_tokens_per_rank = s.max_tokens_per_rank;
  o.max_topk = s.max_topk;
  o.max_recv_rows = s.max_recv_rows;
  o.sms = s.backend.deepep_num_sms > 0 ? s.backend.deepep_num_sms : s.backend.dispatcher_num_sms;
  o.stream = s.stream;
  if (s.timeout_seconds > 0) o.timeout_seconds = s.timeout_seconds;
  o.check_blocking_calls = s.check_blocking_calls;
  return make_deepep_dispatcher(communicator_of(s, "deepep"), s.num_experts, o);
}
constexpr std::string_view kNoCuda = "needs a CUDA build";
#else
constexpr std::string_view kNoCuda = "needs a CUDA build (this one has none)";
#endif

const std::array<DispatcherBackend, 4>& table() {
  static const std::array<DispatcherBackend, 4> backends{{
      {"host", "simulated ranks on the CPU (threads of one process): the oracle of every other backend", false,
       false, make_host, ""},
#ifdef FLEXEP_WITH_CUDA
      {"alltoall", "NCCL grouped send/recv after an all-gather of the counts (Automodel's `torch`)", true, false,
       make_alltoall, ""},
      {"hybridep", "NVLink kernels on NCCL symmetric windows, expert-major output, no host sync in budget mode",
       true, true, make_hybridep, ""},
#else
      {"alltoall", "NCCL grouped send/recv after an all-gather of the counts (Automodel's `torch`)", true, false,
       nullptr, kNoCuda},
      {"hybridep", "NVLink kernels on NCCL symmetric windows, expert-major output, no host sync in budget mode",
       true, true, nullptr, kNoCuda},
#endif
#ifdef FLEXEP_WITH_CUDA
      {"deepep", "DeepEP's rank-major layout (and expert-major from it) over NVLink windows, blocking mode", true,
       true, make_deepep, ""},
#else
      {"deepep", "DeepEP's rank-major layout (and expert-major from it) over NVLink windows, blocking mode", true,
       true, nullptr, kNoCuda},
#endif
  }};
  return backends;
}

}  // namespace

std::span<const DispatcherBackend> dispatcher_backends() { return table(); }

std::string built_dispatcher_names(bool gpu_only) {
  std::string names;
  for (const DispatcherBackend& b : table())
    if (b.make && (!gpu_only || b.needs_gpu)) names += (names.empty() ? "" : ", ") + std::string(b.name);
  return names.empty() ? "none" : names;
}

const DispatcherBackend& dispatcher_backend(std::string_view name, const std::string& arg) {
  for (const DispatcherBackend& b : table())
    if (b.name == name) return b;
  throw_argument_error(arg, "'", name, "' is not a dispatcher backend; known: host, alltoall (alias torch), hybridep, "
                       "deepep; built here: ", built_dispatcher_names());
}

std::unique_ptr<TokenDispatcher> make_dispatcher(std::string_view name, const DispatcherSpec& spec,
                                                 const std::string& arg) {
  const DispatcherBackend& b = dispatcher_backend(name == "torch" ? std::string_view("alltoall") : name, arg);
  FLEXEP_CHECK_ARG(b.make != nullptr, arg, "'", name, "' ", b.missing, "; built here: ", built_dispatcher_names());
  FLEXEP_CHECK_ARG(spec.group != nullptr, "group", "is empty; the ", name, " backend needs this rank's group");
  FLEXEP_CHECK_ARG(!b.needs_sizes || (spec.hidden > 0 && spec.max_tokens_per_rank > 0), "hidden", "the ", name,
                   " backend sizes its buffers once: pass hidden and max_tokens_per_rank (got ", spec.hidden, ", ",
                   spec.max_tokens_per_rank, ")");
  return b.make(spec);
}

}  // namespace flexep
