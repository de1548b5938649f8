// Element types and the two 16-bit float formats, with host-side conversions that round to
// nearest-even exactly like the CUDA intrinsics (__float2bfloat16_rn, __float2half_rn), so CPU
// references and GPU kernels agree bit for bit on conversions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace flexep {

enum class DType : std::uint8_t { bf16, f16, f32, f64, i32, i64, b8, e4m3 };

std::size_t element_size(DType t);
std::string_view dtype_name(DType t);
// Accepts our names and PyTorch's spellings: "bf16", "bfloat16", "torch.bfloat16", "float32", ...
std::optional<DType> parse_dtype(std::string_view s);
inline bool is_floating(DType t) { return t == DType::bf16 || t == DType::f16 || t == DType::f32 || t == DType::f64; }

struct bf16 {
  std::uint16_t bits = 0;
  static bf16 from_float(float f) {
    std::uint32_t u;
    std::memcpy(&u, &f, 4);
    bf16 r;
    if ((u & 0x7fffffffu) > 0x7f800000u) {  // NaN: keep it quiet, keep the sign
      r.bits = static_cast<std::uint16_t>((u >> 16) | 0x0040u);
      return r;
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    r.bits = static_cast<std::uint16_t>(u >> 16);
    return r;
  }
  float to_float() const {
    std::uint32_t u = static_cast<std::uint32_t>(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct f16 {
  std::uint16_t bits = 0;
  static f16 from_float(float f);
  float to_float() const;
};

// Maps a C++ element type to its DType tag.
template <class T> struct dtype_of;
template <> struct dtype_of<bf16> { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<f16> { static constexpr DType value = DType::f16; };
template <> struct dtype_of<float> { static constexpr DType value = DType::f32; };
template <> struct dtype_of<double> { static constexpr DType value = DType::f64; };
template <> struct dtype_of<std::int32_t> { static constexpr DType value = DType::i32; };
template <> struct dtype_of<std::int64_t> { static constexpr DType value = DType::i64; };
template <> struct dtype_of<bool> { static constexpr DType value = DType::b8; };
template <class T> inline constexpr DType dtype_of_v = dtype_of<T>::value;

}  // namespace flexep
