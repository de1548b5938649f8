// The few collective operations the layer and the training loop need outside the dispatcher
// (gradient all-reduce of replicated parameters, expert-load sums for the bias update). The host
// world implements it for simulated ranks; the NCCL communicator for GPUs.
#pragma once

#include <string>

#include "flexep/core/tensor.h"

namespace flexep {

class ProcessGroup {
 public:
  virtual ~ProcessGroup() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In-place sum over all ranks, in ascending rank order (deterministic). `what` names the
  // operation in timeout errors.
  virtual void all_reduce_sum(const TensorView& t, const std::string& what) = 0;
  virtual void barrier(const std::string& what) = 0;
};

}  // namespace flexep
