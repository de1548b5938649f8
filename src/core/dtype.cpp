#include "flexep/core/dtype.h"

#include <array>
#include <cmath>
#include <string>

namespace flexep {

std::size_t element_size(DType t) {
  switch (t) {
    case DType::bf16:
    case DType::f16: return 2;
    case DType::f32:
    case DType::i32: return 4;
    case DType::f64:
    case DType::i64: return 8;
    case DType::b8:
    case DType::e4m3: return 1;
  }
  return 0;
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::f32: return "f32";
    case DType::f64: return "f64";
    case DType::i32: return "i32";
    case DType::i64: return "i64";
    case DType::b8: return "bool";
    case DType::e4m3: return "e4m3";
  }
  return "?";
}

std::optional<DType> parse_dtype(std::string_view s) {
  if (s.substr(0, 6) == "torch.") s.remove_prefix(6);
  struct Alias { std::string_view name; DType t; };
  static constexpr std::array<Alias, 19> kAliases{{
      {"bf16", DType::bf16}, {"bfloat16", DType::bf16},
      {"f16", DType::f16}, {"fp16", DType::f16}, {"float16", DType::f16}, {"half", DType::f16},
      {"f32", DType::f32}, {"fp32", DType::f32}, {"float32", DType::f32}, {"float", DType::f32},
      {"f64", DType::f64}, {"fp64", DType::f64}, {"float64", DType::f64}, {"double", DType::f64},
      {"i32", DType::i32}, {"int32", DType::i32},
      {"i64", DType::i64}, {"int64", DType::i64},
      {"bool", DType::b8},
  }};
  for (const auto& a : kAliases)
    if (a.name == s) return a.t;
  if (s == "e4m3" || s == "float8_e4m3fn") return DType::e4m3;
  return std::nullopt;
}

// IEEE binary16 conversion with round-to-nearest-even, subnormals and overflow to infinity.
f16 f16::from_float(float f) {
  std::uint32_t x;
  std::memcpy(&x, &f, 4);
  const std::uint32_t sign = (x >> 16) & 0x8000u;
  const std::uint32_t absx = x & 0x7fffffffu;
  f16 r;
  if (absx > 0x7f800000u) { r.bits = static_cast<std::uint16_t>(sign | 0x7e00u); return r; }  // NaN
  if (absx >= 0x477ff000u) { r.bits = static_cast<std::uint16_t>(sign | 0x7c00u); return r; }  // overflow -> inf
  if (absx < 0x38800000u) {  // subnormal or zero in half
    // value = absx as float; half subnormal unit is 2^-24.
    float a;
    std::memcpy(&a, &absx, 4);
    const float scaled = a * 16777216.0f;  // 2^24, exact
    const float rounded = std::nearbyint(scaled);  // default mode: nearest-even
    r.bits = static_cast<std::uint16_t>(sign | static_cast<std::uint32_t>(rounded));
    return r;
  }
  std::uint32_t mant = absx & 0x7fffffu;
  std::uint32_t exp = (absx >> 23) - 127 + 15;
  std::uint32_t half = (exp << 10) | (mant >> 13);
  const std::uint32_t rest = mant & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;
  r.bits = static_cast<std::uint16_t>(sign | half);
  return r;
}

float f16::to_float() const {
  const std::uint32_t sign = (static_cast<std::uint32_t>(bits) & 0x8000u) << 16;
  const std::uint32_t exp = (bits >> 10) & 0x1fu;
  const std::uint32_t mant = bits & 0x3ffu;
  float out;
  if (exp == 0) {
    out = std::ldexp(static_cast<float>(mant), -24);
    if (sign) out = -out;
    return out;
  }
  std::uint32_t u;
  if (exp == 31) u = sign | 0x7f800000u | (mant << 13);
  else u = sign | ((exp - 15 + 127) << 23) | (mant << 13);
  std::memcpy(&out, &u, 4);
  return out;
}

}  // namespace flexep
