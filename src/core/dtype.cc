#include "core/dtype.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"

namespace ds {

size_t dtype_size(DType t) {
  switch (t) {
    case DType::F32:
    case DType::I32:
    case DType::U32:
      return 4;
    case DType::BF16:
    case DType::F16:
      return 2;
    case DType::F8E4M3:
    case DType::F8E5M2:
      return 1;
    case DType::I64:
      return 8;
  }
  DS_FAIL("unknown dtype {}", static_cast<int>(t));
}

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32:
      return "f32";
    case DType::BF16:
      return "bf16";
    case DType::F16:
      return "f16";
    case DType::F8E4M3:
      return "f8_e4m3";
    case DType::F8E5M2:
      return "f8_e5m2";
    case DType::I32:
      return "i32";
    case DType::U32:
      return "u32";
    case DType::I64:
      return "i64";
  }
  return "?";
}

bool dtype_is_float(DType t) {
  return t == DType::F32 || t == DType::BF16 || t == DType::F16 || t == DType::F8E4M3 || t == DType::F8E5M2;
}

static inline uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
static inline float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// bf16 is the top half of a float32: round the dropped 16 bits to nearest even.
uint16_t f32_to_bf16(float x) {
  uint32_t u = bits_of(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf16_to_f32(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

// A small IEEE-style format: `mbits` mantissa bits, exponent bias `bias`,
// `max_finite` the largest finite magnitude. Rounding is done in float32 on the
// value itself: dividing by the format's quantum at that binade is an exact
// power-of-two scaling, and nearbyint rounds ties to even in the default mode.
struct MiniFloat {
  int mbits;
  int bias;
  float max_finite;
  bool has_inf;
  uint32_t nan_code;  // magnitude bits of the canonical NaN
  uint32_t inf_code;  // magnitude bits of infinity (if has_inf)
};

static uint32_t encode_mini(float x, const MiniFloat& f, int total_bits) {
  const uint32_t sign = (bits_of(x) >> 31) << (total_bits - 1);
  if (std::isnan(x)) return sign | f.nan_code;
  float a = std::fabs(x);
  if (std::isinf(a)) return sign | (f.has_inf ? f.inf_code : encode_mini(f.max_finite, f, total_bits));
  const int emin = 1 - f.bias;  // exponent of the smallest normal
  int e;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
  e -= 1;             // a in [2^e, 2^(e+1))
  if (a == 0.0f) return sign;
  const int qexp = std::max(e, emin) - f.mbits;
  float r = std::nearbyint(std::ldexp(a, -qexp));  // exact scaling, RNE
  float v = std::ldexp(r, qexp);
  if (v > f.max_finite) v = f.max_finite;  // saturate finite overflow
  if (v == 0.0f) return sign;
  std::frexp(v, &e);
  e -= 1;
  uint32_t mag;
  if (e < emin) {
    mag = static_cast<uint32_t>(std::ldexp(v, f.mbits - emin));  // subnormal
  } else {
    uint32_t mant = static_cast<uint32_t>(std::ldexp(v, f.mbits - e)) - (1u << f.mbits);
    mag = (static_cast<uint32_t>(e + f.bias) << f.mbits) | mant;
  }
  return sign | mag;
}

static float decode_mini(uint32_t b, const MiniFloat& f, int total_bits) {
  const uint32_t sign = b >> (total_bits - 1);
  const uint32_t mag = b & ((1u << (total_bits - 1)) - 1);
  const uint32_t exp = mag >> f.mbits, mant = mag & ((1u << f.mbits) - 1);
  const uint32_t exp_all = (1u << (total_bits - 1 - f.mbits)) - 1;
  float v;
  if (f.has_inf && exp == exp_all) {
    v = mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
  } else if (!f.has_inf && mag == f.nan_code) {
    v = std::numeric_limits<float>::quiet_NaN();
  } else if (exp == 0) {
    v = std::ldexp(static_cast<float>(mant), 1 - f.bias - f.mbits);
  } else {
    v = std::ldexp(static_cast<float>(mant | (1u << f.mbits)), static_cast<int>(exp) - f.bias - f.mbits);
  }
  return sign ? -v : v;
}

static constexpr MiniFloat kF16{10, 15, 65504.0f, true, 0x7e00, 0x7c00};
static constexpr MiniFloat kE4M3{3, 7, 448.0f, false, 0x7f, 0};
static constexpr MiniFloat kE5M2{2, 15, 57344.0f, true, 0x7e, 0x7c};

// f16 overflow goes to infinity as IEEE requires (values at or past the
// rounding boundary 65520), unlike fp8 which saturates.
uint16_t f32_to_f16(float x) {
  if (!std::isnan(x) && std::fabs(x) >= 65520.0f) return static_cast<uint16_t>((std::signbit(x) ? 0x8000 : 0) | 0x7c00);
  return static_cast<uint16_t>(encode_mini(x, kF16, 16));
}
float f16_to_f32(uint16_t h) { return decode_mini(h, kF16, 16); }
uint8_t f32_to_e4m3(float x) { return static_cast<uint8_t>(encode_mini(x, kE4M3, 8)); }
float e4m3_to_f32(uint8_t b) { return decode_mini(b, kE4M3, 8); }
uint8_t f32_to_e5m2(float x) { return static_cast<uint8_t>(encode_mini(x, kE5M2, 8)); }
float e5m2_to_f32(uint8_t b) { return decode_mini(b, kE5M2, 8); }

static float load_f32(const void* src, DType t, size_t i) {
  switch (t) {
    case DType::F32:
      return static_cast<const float*>(src)[i];
    case DType::BF16:
      return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
    case DType::F16:
      return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
    case DType::F8E4M3:
      return e4m3_to_f32(static_cast<const uint8_t*>(src)[i]);
    case DType::F8E5M2:
      return e5m2_to_f32(static_cast<const uint8_t*>(src)[i]);
    default:
      DS_FAIL("convert: {} is not a floating dtype", dtype_name(t));
  }
}

static void store_f32(void* dst, DType t, size_t i, float v) {
  switch (t) {
    case DType::F32:
      static_cast<float*>(dst)[i] = v;
      return;
    case DType::BF16:
      static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
      return;
    case DType::F16:
      static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
      return;
    case DType::F8E4M3:
      static_cast<uint8_t*>(dst)[i] = f32_to_e4m3(v);
      return;
    case DType::F8E5M2:
      static_cast<uint8_t*>(dst)[i] = f32_to_e5m2(v);
      return;
    default:
      DS_FAIL("convert: {} is not a floating dtype", dtype_name(t));
  }
}

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  DS_CHECK(dtype_is_float(dst_type) && dtype_is_float(src_type), "convert: only floating dtypes convert ({} -> {})",
           dtype_name(src_type), dtype_name(dst_type));
  if (n == 0) return;  // pointers may be null for empty tensors
  if (dst_type == src_type) {
    std::memcpy(dst, src, n * dtype_size(dst_type));
    return;
  }
  // bf16 -> f32 is the hot path when widening checkpoint weights.
  if (src_type == DType::BF16 && dst_type == DType::F32) {
    const auto* s = static_cast<const uint16_t*>(src);
    auto* d = static_cast<uint32_t*>(dst);
#pragma omp parallel for simd schedule(static) if (n > (1u << 16))
    for (size_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
    return;
  }
#pragma omp parallel for schedule(static) if (n > (1u << 14))
  for (size_t i = 0; i < n; ++i) store_f32(dst, dst_type, i, load_f32(src, src_type, i));
}

}  // namespace ds
