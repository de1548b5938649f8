// The backends of the TokenDispatcher, by name: the one table from which the Python binding,
// `flexep train` and `flexep bench` make dispatchers. A new backend is its folder under
// src/dispatch/ plus one entry in src/dispatch/registry.cpp (docs/architecture.md, "Adding a
// backend").
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>

#include "flexep/comm/process_group.h"
#include "flexep/core/config.h"
#include "flexep/dispatch/dispatcher.h"

namespace flexep {

// What a backend may need to make one rank's dispatcher. Fields a backend does not use are ignored.
struct DispatcherSpec {
  // This rank's group: a HostProcessGroup for `host`, a Communicator for the GPU backends.
  std::shared_ptr<ProcessGroup> group;
  int num_experts = 0;
  BackendConfig backend;  // SM counts and the backend's own fields
  // Sizes of backends that allocate their buffers once (hybridep); 0 = not given.
  std::int64_t hidden = 0, max_tokens_per_rank = 0;
  int max_topk = 0;              // 0 = num_experts
  std::int64_t max_recv_rows = 0;  // 0 = the worst case
  void* stream = nullptr;          // cudaStream_t of every call; nullptr = the current stream per call
  // false: combine and the backwards return without waiting for the GPU (as DeepEP's buffer under
  // Megatron / Automodel); a device error they record is raised by the next blocking dispatch.
  bool check_blocking_calls = true;
  bool kernel_timing = false;  // events around the backend's kernels (benchmarks)
  int part_tokens = 0;         // tokens per work item of backends that split calls into parts; 0 = theirs
  double timeout_seconds = 0;  // deadline of the backend's device waits; 0 = the backend's default
};

struct DispatcherBackend {
  std::string_view name;     // as BackendConfig::dispatcher spells it
  std::string_view summary;  // one line for --help and error messages
  bool needs_gpu = false;
  bool needs_sizes = false;  // hidden and max_tokens_per_rank are required
  // Empty when this build does not have the backend; `missing` then says why.
  std::function<std::unique_ptr<TokenDispatcher>(const DispatcherSpec&)> make;
  std::string_view missing;
};

// Every backend flexep knows, built in this build or not, in a fixed order.
std::span<const DispatcherBackend> dispatcher_backends();
// The backend called `name`; ArgumentError naming `arg` (with the known names) when there is none.
const DispatcherBackend& dispatcher_backend(std::string_view name, const std::string& arg = "backend.dispatcher");
// The names of the backends this build can make, comma separated (for messages and --help).
std::string built_dispatcher_names(bool gpu_only = false);
// Makes one rank's dispatcher. ArgumentError naming `arg` when the backend is unknown, not in this
// build, or `spec` lacks what it needs.
std::unique_ptr<TokenDispatcher> make_dispatcher(std::string_view name, const DispatcherSpec& spec,
                                                 const std::string& arg = "backend.dispatcher");

}  // namespace flexep
