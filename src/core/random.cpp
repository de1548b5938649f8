#include "flexep/core/random.h"

namespace flexep {

std::uint64_t stream_id(const char* name) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (const char* p = name; *p; ++p) h = (h ^ static_cast<unsigned char>(*p)) * 1099511628211ull;
  return h;
}

void fill_normal(const TensorView& t, std::uint64_t seed, std::uint64_t stream, double mean, double std,
                 std::uint64_t offset) {
  FLEXEP_CHECK(t.device.is_cpu(), "fill_normal is CPU only");
  for (std::int64_t i = 0; i < t.numel(); ++i)
    write_from_double(t, i, mean + std * normal01(seed, stream, offset + static_cast<std::uint64_t>(i)));
}

void fill_uniform(const TensorView& t, std::uint64_t seed, std::uint64_t stream, double lo, double hi,
                  std::uint64_t offset) {
  FLEXEP_CHECK(t.device.is_cpu(), "fill_uniform is CPU only");
  for (std::int64_t i = 0; i < t.numel(); ++i)
    write_from_double(t, i, lo + (hi - lo) * uniform01(seed, stream, offset + static_cast<std::uint64_t>(i)));
}

}  // namespace flexep
