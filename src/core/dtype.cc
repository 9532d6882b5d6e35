// Element types and their conversions (formats and rounding: core/dtype.h).
//
// The scalar functions below define every conversion. convert() runs the
// bulk paths that weights and activations take (bf16 and f16 both ways, fp8
// to f32) as Highway kernels, compiled once per SIMD target and dispatched
// at run time (core/simd.h), that give the same bits as the scalar functions
// for every input: they round with integer operations rather than the
// library's or the CPU's own conversions, whose NaN payloads (and, in
// emulation, rounding) differ.
#include "core/dtype.h"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"

#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "core/dtype.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;
using DU = hn::ScalableTag<uint32_t>;
using VU = hn::Vec<DU>;
using DI = hn::RebindToSigned<DU>;
using DF = hn::RebindToFloat<DU>;

// The magnitudes compared below are at most 0x7fffffff, so signed compares
// order them as unsigned ones would.
HWY_INLINE auto Below(VU a, uint32_t b) {
  const DI di;
  return hn::RebindMask(DU(), hn::Lt(hn::BitCast(di, a), hn::Set(di, static_cast<int32_t>(b))));
}

// f32_to_bf16 on float bits: NaN keeps its top half, made quiet; everything
// else (inf and overflow included) rounds the dropped 16 bits to nearest even.
HWY_INLINE VU Bf16FromF32Bits(VU u) {
  const DU du;
  const VU rounded =
      hn::ShiftRight<16>(hn::Add(u, hn::Add(hn::Set(du, 0x7fffu), hn::And(hn::ShiftRight<16>(u), hn::Set(du, 1u)))));
  const VU quiet = hn::Or(hn::ShiftRight<16>(u), hn::Set(du, 0x40u));
  const auto is_nan = hn::Not(Below(hn::And(u, hn::Set(du, 0x7fffffffu)), 0x7f800001u));
  return hn::IfThenElse(is_nan, quiet, rounded);
}

// f32_to_f16 on float bits, round to nearest even: NaN -> 0x7e00, magnitudes
// from 65520 (where rounding reaches 2^16) -> inf, and below 2^-14 a float
// addition of 0.5 (in the default rounding mode) rounds the magnitude to a
// multiple of 2^-24, the f16 subnormal step, whose count then sits in the
// sum's low bits.
HWY_INLINE VU F16FromF32Bits(VU u) {
  const DU du;
  const DF df;
  const VU sign = hn::And(hn::ShiftRight<16>(u), hn::Set(du, 0x8000u));
  const VU a = hn::And(u, hn::Set(du, 0x7fffffffu));
  const VU sub = hn::Sub(hn::BitCast(du, hn::Add(hn::BitCast(df, a), hn::Set(df, 0.5f))), hn::Set(du, 0x3f000000u));
  // Normal: add (15 - 127) << 23 to rebias the exponent (0xc8000000, the sum
  // wraps) and 0xfff plus the kept mantissa's low bit to round the 13 dropped
  // bits to nearest even; a carry into the exponent is right, up to inf.
  const VU odd = hn::And(hn::ShiftRight<13>(a), hn::Set(du, 1u));
  const VU normal = hn::ShiftRight<13>(hn::Add(hn::Add(a, hn::Set(du, 0xc8000fffu)), odd));
  const VU special = hn::IfThenElse(Below(a, 0x7f800001u), hn::Set(du, 0x7c00u), hn::Set(du, 0x7e00u));
  VU v = hn::IfThenElse(Below(a, 0x38800000u), sub, normal);  // 0x38800000 = 2^-14
  v = hn::IfThenElse(Below(a, 0x47800000u), v, special);      // 0x47800000 = 2^16
  return hn::Or(v, sign);
}

// The float bits of a 1 + kEBits + kMBits bit IEEE-style code (in the low
// bits of each lane), as decode_mini gives them: subnormals scaled exactly
// in float, NaN as the quiet NaN 0x7fc00000 with the code's sign; without
// infinities (e4m3fn) only S.1111.111 is NaN.
template <int kEBits, int kMBits, bool kInf>
HWY_INLINE VU F32BitsFromMini(VU b) {
  const DU du;
  const DF df;
  const DI di;
  constexpr int kTotal = 1 + kEBits + kMBits, kBias = (1 << (kEBits - 1)) - 1;
  constexpr uint32_t kMagMask = (1u << (kTotal - 1)) - 1, kInfCode = ((1u << kEBits) - 1) << kMBits;
  constexpr float kSubScale = std::bit_cast<float>(static_cast<uint32_t>(127 + 1 - kBias - kMBits) << 23);
  const VU sign = hn::ShiftLeft<32 - kTotal>(hn::And(b, hn::Set(du, 1u << (kTotal - 1))));
  const VU mag = hn::And(b, hn::Set(du, kMagMask));
  const VU normal = hn::Add(hn::ShiftLeft<23 - kMBits>(mag), hn::Set(du, static_cast<uint32_t>(127 - kBias) << 23));
  const VU sub = hn::BitCast(du, hn::Mul(hn::ConvertTo(df, hn::BitCast(di, mag)), hn::Set(df, kSubScale)));
  VU v = hn::IfThenElse(Below(mag, 1u << kMBits), sub, normal);
  const VU qnan = hn::Set(du, 0x7fc00000u);
  if constexpr (kInf) {
    const VU special = hn::IfThenElse(hn::Eq(mag, hn::Set(du, kInfCode)), hn::Set(du, 0x7f800000u), qnan);
    v = hn::IfThenElse(Below(mag, kInfCode), v, special);
  } else {
    v = hn::IfThenElse(hn::Eq(mag, hn::Set(du, kMagMask)), qnan, v);
  }
  return hn::Or(v, sign);
}

// The bulk kernels: whole vectors, then the last n mod Lanes elements through
// the scalar functions, which give the same bits.
template <class Narrow>
using DN = hn::Rebind<Narrow, DU>;  // as many narrow lanes as DU has

void Bf16ToF32(float* out, const uint16_t* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::BitCast(DF(), hn::ShiftLeft<16>(hn::PromoteTo(du, hn::LoadU(DN<uint16_t>(), in + i)))), DF(),
               out + i);
  for (; i < n; ++i) out[i] = bf16_to_f32(in[i]);
}

void F32ToBf16(uint16_t* out, const float* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const VU h = Bf16FromF32Bits(hn::BitCast(du, hn::LoadU(DF(), in + i)));
    // Every lane is below 2^16, so the saturating narrowing is exact.
    hn::StoreU(hn::DemoteTo(DN<uint16_t>(), hn::BitCast(DI(), h)), DN<uint16_t>(), out + i);
  }
  for (; i < n; ++i) out[i] = f32_to_bf16(in[i]);
}

void RoundF32ToBf16(float* x, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N)
    hn::StoreU(hn::BitCast(DF(), hn::ShiftLeft<16>(Bf16FromF32Bits(hn::BitCast(du, hn::LoadU(DF(), x + i))))), DF(),
               x + i);
  for (; i < n; ++i) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

void F16ToF32(float* out, const uint16_t* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const VU f = F32BitsFromMini<5, 10, true>(hn::PromoteTo(du, hn::LoadU(DN<uint16_t>(), in + i)));
    hn::StoreU(hn::BitCast(DF(), f), DF(), out + i);
  }
  for (; i < n; ++i) out[i] = f16_to_f32(in[i]);
}

void F32ToF16(uint16_t* out, const float* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const VU h = F16FromF32Bits(hn::BitCast(du, hn::LoadU(DF(), in + i)));
    hn::StoreU(hn::DemoteTo(DN<uint16_t>(), hn::BitCast(DI(), h)), DN<uint16_t>(), out + i);
  }
  for (; i < n; ++i) out[i] = f32_to_f16(in[i]);
}

void E4m3ToF32(float* out, const uint8_t* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const VU f = F32BitsFromMini<4, 3, false>(hn::PromoteTo(du, hn::LoadU(DN<uint8_t>(), in + i)));
    hn::StoreU(hn::BitCast(DF(), f), DF(), out + i);
  }
  for (; i < n; ++i) out[i] = e4m3_to_f32(in[i]);
}

void E5m2ToF32(float* out, const uint8_t* in, size_t n) {
  const DU du;
  const size_t N = hn::Lanes(du);
  size_t i = 0;
  for (; i + N <= n; i += N) {
    const VU f = F32BitsFromMini<5, 2, true>(hn::PromoteTo(du, hn::LoadU(DN<uint8_t>(), in + i)));
    hn::StoreU(hn::BitCast(DF(), f), DF(), out + i);
  }
  for (; i < n; ++i) out[i] = e5m2_to_f32(in[i]);
}

// Whether any of the n elements of type U at p has every bit of mask set.
// The bytes are loaded as bytes (a tensor need not start on its element
// size) and reinterpreted in registers.
template <typename U>
bool AnyAllOnes(const unsigned char* p, size_t n, U mask) {
  bool any = false;
  size_t i = 0;
#if HWY_TARGET != HWY_SCALAR  // one lane a vector: bytes cannot be regrouped
  using D = hn::ScalableTag<U>;
  const D d;
  const hn::Repartition<uint8_t, D> d8;
  const size_t N = hn::Lanes(d);
  const auto m = hn::Set(d, mask);
  auto hits = hn::Zero(d);
  for (; i + 4 * N <= n; i += 4 * N) {
    const unsigned char* q = p + i * sizeof(U);
    const auto a = hn::And(hn::BitCast(d, hn::LoadU(d8, q)), m);
    const auto b = hn::And(hn::BitCast(d, hn::LoadU(d8, q + N * sizeof(U))), m);
    const auto c = hn::And(hn::BitCast(d, hn::LoadU(d8, q + 2 * N * sizeof(U))), m);
    const auto e = hn::And(hn::BitCast(d, hn::LoadU(d8, q + 3 * N * sizeof(U))), m);
    hits = hn::Or(hits, hn::Or(hn::Or(hn::VecFromMask(d, hn::Eq(a, m)), hn::VecFromMask(d, hn::Eq(b, m))),
                               hn::Or(hn::VecFromMask(d, hn::Eq(c, m)), hn::VecFromMask(d, hn::Eq(e, m)))));
  }
  any = !hn::AllTrue(d, hn::Eq(hits, hn::Zero(d)));
#endif
  for (; i < n; ++i) {
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    any |= (v & mask) == mask;
  }
  return any;
}

bool AnyAllOnes8(const unsigned char* p, size_t n, uint8_t mask) { return AnyAllOnes(p, n, mask); }
bool AnyAllOnes16(const unsigned char* p, size_t n, uint16_t mask) { return AnyAllOnes(p, n, mask); }
bool AnyAllOnes32(const unsigned char* p, size_t n, uint32_t mask) { return AnyAllOnes(p, n, mask); }

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds {

HWY_EXPORT(Bf16ToF32);
HWY_EXPORT(F32ToBf16);
HWY_EXPORT(RoundF32ToBf16);
HWY_EXPORT(F16ToF32);
HWY_EXPORT(F32ToF16);
HWY_EXPORT(E4m3ToF32);
HWY_EXPORT(E5m2ToF32);
HWY_EXPORT(AnyAllOnes8);
HWY_EXPORT(AnyAllOnes16);
HWY_EXPORT(AnyAllOnes32);

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
    case DType::F4E2M1:
      DS_FAIL("f4_e2m1 packs two elements in a byte: it has no size per element");
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q4_1:
    case DType::Q6_K:
      DS_FAIL("{} packs blocks of values with their scales: it has no size per element", dtype_name(t));
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
    case DType::F4E2M1:
      return "f4_e2m1";
    case DType::Q8_0:
      return "q8_0";
    case DType::Q4_K:
      return "q4_k";
    case DType::Q4_1:
      return "q4_1";
    case DType::Q6_K:
      return "q6_k";
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

float e2m1_to_f32(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float m = kMagnitude[code & 7];
  return (code & 8) ? -m : m;
}

uint8_t f32_to_e2m1(float x) {
  const uint8_t sign = std::signbit(x) ? 8 : 0;
  const float a = std::fabs(x);
  // Midpoints between neighbouring magnitudes {0, .5, 1, 1.5, 2, 3, 4, 6};
  // a tie goes to the even code (<= where the lower code is even).
  uint8_t m;
  if (a <= 0.25f)
    m = 0;
  else if (a < 0.75f)
    m = 1;
  else if (a <= 1.25f)
    m = 2;
  else if (a < 1.75f)
    m = 3;
  else if (a <= 2.5f)
    m = 4;
  else if (a < 3.5f)
    m = 5;
  else if (a <= 5.0f)
    m = 6;
  else
    m = 7;  // above 5, infinities and NaN
  return sign | m;
}

float e8m0_to_f32(uint8_t e) {
  if (e == 0xff) return std::numeric_limits<float>::quiet_NaN();
  // 2^(e - 127): a normal float's exponent field for e >= 1, and for e = 0
  // the subnormal 2^-127 (mantissa bit 22).
  return e == 0 ? float_of(0x00400000u) : float_of(static_cast<uint32_t>(e) << 23);
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
float f16_to_f32(uint16_t h) { return f16_bits_to_f32(h); }
uint8_t f32_to_e4m3(float x) { return static_cast<uint8_t>(encode_mini(x, kE4M3, 8)); }
float e4m3_to_f32(uint8_t b) { return decode_mini(b, kE4M3, 8); }
uint8_t f32_to_e5m2(float x) { return static_cast<uint8_t>(encode_mini(x, kE5M2, 8)); }
float e5m2_to_f32(uint8_t b) { return decode_mini(b, kE5M2, 8); }

namespace {

// Elements per step of convert(): a narrow-to-narrow conversion goes through
// a float buffer of this many elements on the stack.
constexpr size_t kConvertChunk = 4096;

// out[0, len) = src[i, i + len) of floating type t, as float.
void decode_f32(float* out, const void* src, DType t, size_t i, size_t len) {
  switch (t) {
    case DType::F32:
      std::memcpy(out, static_cast<const float*>(src) + i, len * sizeof(float));
      return;
    case DType::BF16:
      return DS_DISPATCH(Bf16ToF32)(out, static_cast<const uint16_t*>(src) + i, len);
    case DType::F16:
      return DS_DISPATCH(F16ToF32)(out, static_cast<const uint16_t*>(src) + i, len);
    case DType::F8E4M3:
      return DS_DISPATCH(E4m3ToF32)(out, static_cast<const uint8_t*>(src) + i, len);
    case DType::F8E5M2:
      return DS_DISPATCH(E5m2ToF32)(out, static_cast<const uint8_t*>(src) + i, len);
    default:
      return;  // convert() admits floating types only
  }
}

// dst[i, i + len) of floating type t = in[0, len), rounded. The fp8 encoders
// stay scalar (checkpoints are quantized once, offline).
void encode_f32(void* dst, DType t, size_t i, const float* in, size_t len) {
  switch (t) {
    case DType::F32:
      std::memcpy(static_cast<float*>(dst) + i, in, len * sizeof(float));
      return;
    case DType::BF16:
      return DS_DISPATCH(F32ToBf16)(static_cast<uint16_t*>(dst) + i, in, len);
    case DType::F16:
      return DS_DISPATCH(F32ToF16)(static_cast<uint16_t*>(dst) + i, in, len);
    case DType::F8E4M3:
      for (size_t j = 0; j < len; ++j) static_cast<uint8_t*>(dst)[i + j] = f32_to_e4m3(in[j]);
      return;
    case DType::F8E5M2:
      for (size_t j = 0; j < len; ++j) static_cast<uint8_t*>(dst)[i + j] = f32_to_e5m2(in[j]);
      return;
    default:
      return;  // convert() admits floating types only
  }
}

}  // namespace

void convert(void* dst, DType dst_type, const void* src, DType src_type, size_t n) {
  DS_CHECK(dtype_is_float(dst_type) && dtype_is_float(src_type), "convert: only floating dtypes convert ({} -> {})",
           dtype_name(src_type), dtype_name(dst_type));
  if (n == 0) return;  // pointers may be null for empty tensors
  if (dst_type == src_type) {
    std::memcpy(dst, src, n * dtype_size(dst_type));
    return;
  }
  // Elementwise, so any split gives the same bits. The vector kernels run at
  // memory speed and need a larger input than the scalar fp8 encoders to be
  // worth a thread team.
  const bool scalar_encode = dst_type == DType::F8E4M3 || dst_type == DType::F8E5M2;
  const size_t chunks = (n + kConvertChunk - 1) / kConvertChunk;
#pragma omp parallel for schedule(static) if (n > (scalar_encode ? (size_t{1} << 14) : (size_t{1} << 16)))
  for (size_t c = 0; c < chunks; ++c) {
    const size_t i = c * kConvertChunk, len = std::min(kConvertChunk, n - i);
    if (dst_type == DType::F32) {
      decode_f32(static_cast<float*>(dst) + i, src, src_type, i, len);
    } else if (src_type == DType::F32) {
      encode_f32(dst, dst_type, i, static_cast<const float*>(src) + i, len);
    } else {
      float buf[kConvertChunk];
      decode_f32(buf, src, src_type, i, len);
      encode_f32(dst, dst_type, i, buf, len);
    }
  }
}

namespace {

// Whether any of n elements has all exponent bits (mask) set: blocks are
// tested by the vector kernel, then the block with a hit is searched.
// Elements are read with memcpy: a checkpoint's tensors need not start on
// their element size (a file may pack a one-byte scale tensor of odd length
// before a bf16 one).
bool any_all_ones(const unsigned char* p, size_t n, uint8_t mask) { return DS_DISPATCH(AnyAllOnes8)(p, n, mask); }
bool any_all_ones(const unsigned char* p, size_t n, uint16_t mask) { return DS_DISPATCH(AnyAllOnes16)(p, n, mask); }
bool any_all_ones(const unsigned char* p, size_t n, uint32_t mask) { return DS_DISPATCH(AnyAllOnes32)(p, n, mask); }

// The blocks are shared among the threads (a model's weights are scanned
// once at load, and one core reads far below the memory's rate); the first
// block with a hit is searched.
template <typename U>
int64_t find_all_ones(const void* data, size_t n, U mask) {
  const auto* p = static_cast<const unsigned char*>(data);
  constexpr size_t kBlock = size_t{1} << 16;
  const int64_t blocks = static_cast<int64_t>((n + kBlock - 1) / kBlock);
  std::atomic<int64_t> first{blocks};
  parallel_ranges(blocks, blocks >= 8, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1 && b < first.load(std::memory_order_relaxed); ++b) {
      const size_t i0 = static_cast<size_t>(b) * kBlock;
      if (!any_all_ones(p + i0 * sizeof(U), std::min(kBlock, n - i0), mask)) continue;
      int64_t seen = first.load();
      while (b < seen && !first.compare_exchange_weak(seen, b)) {
      }
      break;
    }
  });
  if (first.load() == blocks) return -1;
  const size_t b = static_cast<size_t>(first.load()) * kBlock, e = std::min(n, b + kBlock);
  for (size_t i = b; i < e; ++i) {
    U v;
    std::memcpy(&v, p + i * sizeof(U), sizeof(U));
    if ((v & mask) == mask) return static_cast<int64_t>(i);
  }
  return -1;
}

}  // namespace

void round_to_bf16(float* x, size_t n) {
  if (n) DS_DISPATCH(RoundF32ToBf16)(x, n);
}

void f32_to_bf16_row(uint16_t* out, const float* in, size_t n) {
  if (n) DS_DISPATCH(F32ToBf16)(out, in, n);
}

void bf16_to_f32_row(float* out, const uint16_t* in, size_t n) {
  if (n) DS_DISPATCH(Bf16ToF32)(out, in, n);
}

int64_t find_non_finite(const void* data, DType t, size_t n) {
  switch (t) {
    case DType::F32:
      return find_all_ones(data, n, uint32_t{0x7f800000u});
    case DType::BF16:
      return find_all_ones(data, n, uint16_t{0x7f80u});
    case DType::F16:
      return find_all_ones(data, n, uint16_t{0x7c00u});
    case DType::F8E4M3:  // no infinities; S.1111.111 is NaN
      return find_all_ones(data, n, uint8_t{0x7fu});
    case DType::F8E5M2:
      return find_all_ones(data, n, uint8_t{0x7cu});
    default:
      return -1;
  }
}

}  // namespace ds
#endif  // HWY_ONCE
