// A kernel that keeps a stream busy for a given time, for `flexep bench`: timing a call that starts on
// a busy stream, as it does inside a training step, so that the host's launch work is not charged
// to the call as idle GPU time.
#pragma once

#include <cuda_runtime.h>

namespace flexep::tools {

// One thread spins on the GPU's global timer for `microseconds`.
void launch_spin(double microseconds, cudaStream_t stream);

}  // namespace flexep::tools
