// What one rank's GPU MoE layer holds on its device for a training step, before any of it is
// allocated: how a job that cannot fit is refused up front, naming the size it would need, rather
// than failing at whichever allocation comes first. An estimate of the layer's own memory (the
// dispatcher's buffers are checked by the backends themselves, and the CUDA context and cuBLAS
// workspaces are not counted): balanced routing, bf16 weights, f32 gradients.
#pragma once

#include <cstddef>
#include <cstdint>

#include "flexep/core/config.h"

namespace flexep {

struct LayerMemoryEstimate {
  std::size_t weights = 0;      // this rank's parameters, bf16
  std::size_t gradients = 0;    // their gradients, f32 (GradMode::accumulate_f32)
  std::size_t activations = 0;  // what forward keeps for backward, and as much again for backward's own
  std::size_t total() const { return weights + gradients + activations; }
};

// tokens_per_rank: T of one call on this rank; its T * k routed rows land on the ranks evenly.
LayerMemoryEstimate estimate_gpu_layer_memory(const MoEConfig& config, const BackendConfig& backend, int ep_size,
                                              std::int64_t tokens_per_rank);

}  // namespace flexep
