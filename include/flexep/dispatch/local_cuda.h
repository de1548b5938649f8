// The dispatcher of one GPU (expert-parallel size 1): the same interface as every backend, with no
// communication. Dispatch is the device plan plus a permute (include/flexep/cuda/local_plan.h,
// permute.h), combine an unpermute. It is the local path of the MoE layer at EP size 1 (Automodel's
// fallback when a deepep/hybridep dispatcher runs on one GPU). Work is issued on the calling thread's
// cuda::current_stream(). Built only with CUDA.
#pragma once

#include <memory>

#include "flexep/dispatch/dispatcher.h"

namespace flexep {

std::unique_ptr<TokenDispatcher> make_local_cuda_dispatcher(int device, int num_experts);

}  // namespace flexep
