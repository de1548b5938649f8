// Epochs: operation n of a buffer writes n into its flags and waiting means "flag - n >= 0" in 32-bit
// modular arithmetic, so no flag is ever reset and replays of a captured graph keep working.
#pragma once

namespace flexep::hybridep {

constexpr unsigned kFullMask = 0xffffffffu;  // every lane of a warp

__device__ __forceinline__ bool epoch_reached(unsigned value, unsigned epoch) {
  return static_cast<int>(value - epoch) >= 0;
}

}  // namespace flexep::hybridep
