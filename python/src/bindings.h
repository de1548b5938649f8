// One registration function per binding file; module.cpp calls them in order.
#pragma once

#include <nanobind/nanobind.h>

#include <cstdint>
#include <memory>
#include <string>

#include "flexep/core/config.h"
#include "flexep/dispatch/dispatcher.h"

#ifdef FLEXEP_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace flexep::py {

namespace nb = nanobind;

void bind_config(nb::module_& m);
void bind_comm(nb::module_& m);
void bind_dispatcher(nb::module_& m);
void bind_layer(nb::module_& m);
void bind_moe_compute(nb::module_& m);

// Makes the library's calls on this thread issue their CUDA work on `stream` (the caller's
// torch.cuda.current_stream()); a no-op in a CPU-only build or for stream 0 on the CPU path.
class StreamScope {
 public:
  explicit StreamScope(std::uintptr_t stream);
  ~StreamScope();
  StreamScope(const StreamScope&) = delete;
  StreamScope& operator=(const StreamScope&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Runs fn() without the GIL (the library may block on other ranks) with `stream` as the current
// stream, and returns its result.
template <class Fn>
auto on_stream_without_gil(std::uintptr_t stream, Fn&& fn) {
  nb::gil_scoped_release release;
  StreamScope scope(stream);
  return fn();
}

}  // namespace flexep::py
