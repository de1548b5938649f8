// A CUDA graph captured from one stream and instantiated, owned: what budget-mode callers (the
// graph-replay benchmark, the replay tests) do around their captures, in one place.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "flexep/cuda/runtime.h"

namespace flexep::cuda {

class CapturedGraph {
 public:
  // Captures the work fn() enqueues on `stream` and instantiates it. A throw from fn ends the
  // capture, drops the partial graph and propagates (the stream is usable again).
  template <class Fn>
  CapturedGraph(cudaStream_t stream, cudaStreamCaptureMode mode, Fn&& fn) {
    FLEXEP_CUDA_CHECK(cudaStreamBeginCapture(stream, mode));
    try {
      std::forward<Fn>(fn)();
    } catch (...) {
      cudaStreamEndCapture(stream, &graph_);
      if (graph_) cudaGraphDestroy(graph_);
      throw;
    }
    FLEXEP_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    const cudaError_t err = cudaGraphInstantiate(&exec_, graph_, 0);
    if (err != cudaSuccess) {
      cudaGraphDestroy(graph_);
      throw_cuda_error(err, "cudaGraphInstantiate", __FILE__, __LINE__);
    }
  }
  ~CapturedGraph() {
    cudaGraphExecDestroy(exec_);
    cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;

  void launch(cudaStream_t stream) const { FLEXEP_CUDA_CHECK(cudaGraphLaunch(exec_, stream)); }

 private:
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

}  // namespace flexep::cuda
