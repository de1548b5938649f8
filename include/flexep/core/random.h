// A small counter-based generator (splitmix64 + Box-Muller) so that parameter initialisation and
// synthetic data are identical on every platform and for every rank count: a value depends only
// on (seed, stream, index), never on which rank or thread draws it.
#pragma once

#include <cmath>
#include <cstdint>

#include "flexep/core/tensor.h"

namespace flexep {

inline std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Stream id from a name ("experts.down_projs") so each tensor draws independent numbers.
std::uint64_t stream_id(const char* name);

// Uniform in [0, 1) from (seed, stream, index).
inline double uniform01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const std::uint64_t h = splitmix64(splitmix64(seed ^ splitmix64(stream)) + index);
  return static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0);
}
// uniform01 in two steps, for loops over many indices of one (seed, stream): the 53 random bits
// of index i are uniform01_bits(uniform01_key(seed, stream), i), and uniform01 is those bits
// times 2^-53 (so it orders indices as their bits do).
inline std::uint64_t uniform01_key(std::uint64_t seed, std::uint64_t stream) {
  return splitmix64(seed ^ splitmix64(stream));
}
inline std::uint64_t uniform01_bits(std::uint64_t key, std::uint64_t index) { return splitmix64(key + index) >> 11; }

// Standard normal from (seed, stream, index), Box-Muller on two independent uniforms.
inline double normal01(std::uint64_t seed, std::uint64_t stream, std::uint64_t index) {
  const double u1 = uniform01(seed, stream, 2 * index) + 1e-300;
  const double u2 = uniform01(seed, stream, 2 * index + 1);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Fills a CPU floating tensor: t[i] = mean + std * normal01(seed, stream, offset + i).
void fill_normal(const TensorView& t, std::uint64_t seed, std::uint64_t stream, double mean, double std,
                 std::uint64_t offset = 0);
void fill_uniform(const TensorView& t, std::uint64_t seed, std::uint64_t stream, double lo, double hi,
                  std::uint64_t offset = 0);

}  // namespace flexep
