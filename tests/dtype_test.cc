// Tests for the element types: every bit pattern of bf16, f16, f8_e4m3 and
// f8_e5m2 is decoded and compared with a reference decoder that evaluates the
// format's defining formula in double; encoding is compared with a reference
// that searches the sorted table of every finite value of the format for the
// nearest one (ties to the even code), on inputs chosen where rounding is
// delicate (representable values, exact midpoints and their float neighbours)
// plus millions of sampled float32 bit patterns. Nothing here shares code or
// method with src/core/dtype.cc. convert()'s vector kernels are then compared
// bit for bit with the scalar functions, on every SIMD target the machine
// runs.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "test_util.h"

namespace ds {
namespace {
namespace dtype_test {

uint32_t bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// SplitMix64: a tiny generator for test inputs, independent of core/rng.
struct SplitMix {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
};

// One narrow format described by its parameters, plus the implementation's
// scalar functions under test.
struct Format {
  const char* name;
  int total_bits, exp_bits, man_bits, bias;
  bool ieee_inf;  // true: all-ones exponent is inf/NaN and overflow rounds to inf; false: e4m3fn rules
  uint32_t (*encode)(float);
  float (*decode)(uint32_t);
};

const Format kBF16{"bf16",
                   16,
                   8,
                   7,
                   127,
                   true,
                   [](float x) -> uint32_t { return f32_to_bf16(x); },
                   [](uint32_t c) { return bf16_to_f32(static_cast<uint16_t>(c)); }};
const Format kF16{"f16",
                  16,
                  5,
                  10,
                  15,
                  true,
                  [](float x) -> uint32_t { return f32_to_f16(x); },
                  [](uint32_t c) { return f16_to_f32(static_cast<uint16_t>(c)); }};
// e4m3fn: no infinities, S.1111.111 is NaN, every other pattern is finite.
const Format kE4M3{"e4m3",
                   8,
                   4,
                   3,
                   7,
                   false,
                   [](float x) -> uint32_t { return f32_to_e4m3(x); },
                   [](uint32_t c) { return e4m3_to_f32(static_cast<uint8_t>(c)); }};
// e5m2 is IEEE-like for decoding, but finite overflow saturates (see saturates()).
const Format kE5M2{"e5m2",
                   8,
                   5,
                   2,
                   15,
                   true,
                   [](float x) -> uint32_t { return f32_to_e5m2(x); },
                   [](uint32_t c) { return e5m2_to_f32(static_cast<uint8_t>(c)); }};

// fp8 formats saturate finite overflow; bf16/f16 follow IEEE and overflow to inf.
bool saturates(const Format& f) { return f.total_bits == 8; }
uint32_t sign_bit(const Format& f) { return 1u << (f.total_bits - 1); }
uint32_t inf_code(const Format& f) { return ((1u << f.exp_bits) - 1) << f.man_bits; }

// Reference decoder: sign * 2^(e - bias) * (1 + m / 2^M), or the subnormal
// sign * 2^(1 - bias) * (m / 2^M), evaluated in double (exact for these formats).
double ref_decode(const Format& f, uint32_t code) {
  const uint32_t emax = (1u << f.exp_bits) - 1, mmax = (1u << f.man_bits) - 1;
  const bool neg = (code >> (f.total_bits - 1)) & 1;
  const uint32_t e = (code >> f.man_bits) & emax, m = code & mmax;
  const double s = neg ? -1.0 : 1.0;
  const double frac = static_cast<double>(m) / static_cast<double>(1u << f.man_bits);
  if (f.ieee_inf && e == emax) return m ? std::numeric_limits<double>::quiet_NaN() : s * HUGE_VAL;
  if (!f.ieee_inf && e == emax && m == mmax) return std::numeric_limits<double>::quiet_NaN();
  if (e == 0) return s * std::pow(2.0, 1 - f.bias) * frac;
  return s * std::pow(2.0, static_cast<int>(e) - f.bias) * (1.0 + frac);
}

struct Entry {
  double value;
  uint32_t code;
};

// All finite non-negative values of a format in increasing order. For
// formats that overflow to infinity, one more entry stands for infinity at the
// value the next binade would start at (max + ulp), so rounding between max and
// "max + ulp" follows the same nearest/ties-to-even rule as everywhere else.
std::vector<Entry> value_table(const Format& f) {
  std::vector<Entry> t;
  for (uint32_t c = 0; c < sign_bit(f); ++c) {
    double v = ref_decode(f, c);
    if (std::isfinite(v)) t.push_back({v, c});
  }
  if (!saturates(f)) {
    const double ulp = t.back().value - t[t.size() - 2].value;
    t.push_back({t.back().value + ulp, inf_code(f)});
  }
  return t;
}

// Reference encoder. Returns the expected code; for NaN inputs returns
// kAnyNaN, meaning "any code that decodes to NaN".
constexpr uint32_t kAnyNaN = 0xffffffffu;
uint32_t ref_encode(const Format& f, const std::vector<Entry>& table, float x) {
  if (std::isnan(x)) return kAnyNaN;
  const uint32_t sign = std::signbit(x) ? sign_bit(f) : 0;
  const double a = std::fabs(static_cast<double>(x));
  // At or past the last entry: the max finite value (saturating formats) or
  // the infinity stand-in; an infinite input lands here too.
  if (a >= table.back().value) {
    if (std::isinf(a) && f.ieee_inf) return sign | inf_code(f);
    return sign | table.back().code;
  }
  auto it = std::upper_bound(table.begin(), table.end(), a, [](double v, const Entry& e) { return v < e.value; });
  const Entry& hi = *it;
  const Entry& lo = *(it - 1);
  if (a == lo.value) return sign | lo.code;
  const double mid = 0.5 * (lo.value + hi.value);  // exact in double: both have <= 11 significant bits
  if (a < mid) return sign | lo.code;
  if (a > mid) return sign | hi.code;
  return sign | ((lo.code & 1) == 0 ? lo.code : hi.code);  // tie: even mantissa
}

// Compares the implementation's encoder with the reference on every input;
// reports the first few disagreements and the total count.
void check_encode(const Format& f, const std::vector<Entry>& table, const std::vector<float>& inputs,
                  const char* what) {
  size_t bad = 0;
  for (float x : inputs) {
    const uint32_t want = ref_encode(f, table, x);
    const uint32_t got = f.encode(x);
    const bool ok = want == kAnyNaN ? std::isnan(ref_decode(f, got)) : got == want;
    if (!ok && ++bad <= 8) {
      ADD_FAILURE() << f.name << " " << what << ": encode(" << x << " = 0x" << std::hex << bits(x) << ") = 0x" << got
                    << ", want 0x" << want << std::dec;
    }
  }
  EXPECT_EQ(bad, 0u) << f.name << " " << what << ": mismatches out of " << inputs.size();
}

const Format* const kFormats[] = {&kBF16, &kF16, &kE4M3, &kE5M2};

TEST(DType, ReferenceTableIsSortedAndAsExpected) {
  // Guards the reference itself: strictly increasing values and the
  // published maxima of each format.
  for (const Format* f : kFormats) {
    auto t = value_table(*f);
    for (size_t i = 1; i < t.size(); ++i) ASSERT_LT(t[i - 1].value, t[i].value) << f->name;
  }
  auto max_finite = [](const Format& f) {
    auto t = value_table(f);
    return saturates(f) ? t.back().value : t[t.size() - 2].value;
  };
  EXPECT_EQ(max_finite(kBF16), 0x1.fep127);
  EXPECT_EQ(max_finite(kF16), 65504.0);
  EXPECT_EQ(max_finite(kE4M3), 448.0);
  EXPECT_EQ(max_finite(kE5M2), 57344.0);
}

TEST(DType, DecodeEveryBitPattern) {
  for (const Format* f : kFormats) {
    size_t bad = 0;
    for (uint32_t c = 0; c < (1u << f->total_bits); ++c) {
      const double want = ref_decode(*f, c);
      const float got = f->decode(c);
      bool ok;
      if (std::isnan(want)) {
        ok = std::isnan(got);
      } else {
        ASSERT_EQ(static_cast<double>(static_cast<float>(want)), want) << "reference value not a float";
        ok = bits(got) == bits(static_cast<float>(want));  // bitwise: also checks the sign of zero
      }
      if (!ok && ++bad <= 8)
        ADD_FAILURE() << f->name << " decode(0x" << std::hex << c << std::dec << ") = " << got << ", want " << want;
    }
    EXPECT_EQ(bad, 0u) << f->name;
  }
}

TEST(DType, KnownValues) {
  // Values stated by the format specifications (IEEE 754, OCP FP8).
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.0f), 0x7c00);  // the tie past max rounds to the even code: infinity
  EXPECT_EQ(f32_to_f16(0x1p-24f), 0x0001);
  EXPECT_EQ(f32_to_e4m3(1.0f), 0x38);
  EXPECT_EQ(f32_to_e4m3(448.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3(1e9f), 0x7e);  // finite overflow saturates
  EXPECT_EQ(f32_to_e4m3(std::numeric_limits<float>::infinity()), 0x7e);
  EXPECT_EQ(f32_to_e4m3(-std::numeric_limits<float>::infinity()), 0xfe);
  EXPECT_EQ(f32_to_e4m3(0x1p-9f), 0x01);
  EXPECT_EQ(f32_to_e4m3(0x1p-10f), 0x00);  // tie between 0 and the smallest subnormal: even is 0
  EXPECT_EQ(f32_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(f32_to_e4m3(std::nanf("")) & 0x7f, 0x7f);
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_to_f32(0xff)));
  EXPECT_EQ(e4m3_to_f32(0x7e), 448.0f);
  EXPECT_EQ(f32_to_e5m2(1.0f), 0x3c);
  EXPECT_EQ(f32_to_e5m2(57344.0f), 0x7b);
  EXPECT_EQ(f32_to_e5m2(1e9f), 0x7b);  // finite overflow saturates
  EXPECT_EQ(f32_to_e5m2(-1e9f), 0xfb);
  EXPECT_EQ(f32_to_e5m2(std::numeric_limits<float>::infinity()), 0x7c);
  EXPECT_EQ(f32_to_e5m2(-std::numeric_limits<float>::infinity()), 0xfc);
  EXPECT_EQ(f32_to_e5m2(0x1p-16f), 0x01);
  EXPECT_TRUE(std::isinf(e5m2_to_f32(0x7c)));
}

// Inputs where rounding is decided: every representable value (both signs),
// every exact midpoint between neighbours and the floats just above and below
// it, plus points past the largest finite value and special values.
std::vector<float> critical_inputs(const std::vector<Entry>& table) {
  std::vector<float> in;
  auto add = [&](double v) {
    if (v >= 0x1p128) return;  // bf16's infinity stand-in is not a float; inputs past it are covered below
    const float x = static_cast<float>(v);
    EXPECT_EQ(static_cast<double>(x), v) << "critical input not representable as float";
    for (float y : {x, std::nextafter(x, HUGE_VALF), std::nextafter(x, -HUGE_VALF)}) {
      in.push_back(y);
      in.push_back(-y);
    }
  };
  for (size_t i = 0; i < table.size(); ++i) {
    add(table[i].value);
    if (i + 1 < table.size()) add(0.5 * (table[i].value + table[i + 1].value));
  }
  // Past the top: the would-be next value, its midpoint with max, and far out.
  const double top = table.back().value, ulp = top - table[table.size() - 2].value;
  if (top + 2 * ulp < 0x1p127) {
    add(top + 0.5 * ulp);
    add(top + ulp);
    add(top + 1.5 * ulp);
    add(top * 4);
  }
  for (float x : {std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::infinity(), 0.0f}) {
    in.push_back(x);
    in.push_back(-x);
  }
  for (uint32_t nan : {0x7fc00000u, 0x7f800001u, 0x7fbfffffu, 0xffc00000u, 0xff800001u, 0x7fffffffu})
    in.push_back(from_bits(nan));
  return in;
}

TEST(DType, EncodeCriticalInputs) {
  for (const Format* f : kFormats) {
    const auto table = value_table(*f);
    check_encode(*f, table, critical_inputs(table), "critical inputs");
  }
}

TEST(DType, EncodeRandomBitPatterns) {
  // Uniform float32 bit patterns cover every exponent, mostly far outside the
  // fp8 range, so half the draws are narrowed to exponents around the format's
  // range, where the rounding work happens.
  for (const Format* f : kFormats) {
    const auto table = value_table(*f);
    SplitMix rng{0x5eed0000u + static_cast<uint64_t>(f->total_bits * 31 + f->man_bits)};
    const int emin = 1 - f->bias - f->man_bits - 2, emax = (1 << f->exp_bits) - f->bias + 1;
    std::vector<float> in;
    const size_t n = 1500000;
    in.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      const uint64_t r = rng.next();
      uint32_t u = static_cast<uint32_t>(r);
      if (i & 1) {
        const int e = emin + static_cast<int>((r >> 32) % static_cast<uint64_t>(emax - emin + 1));
        u = (u & 0x807fffffu) | (static_cast<uint32_t>(std::clamp(e + 127, 0, 254)) << 23);
      }
      in.push_back(from_bits(u));
    }
    check_encode(*f, table, in, "random");
  }
}

TEST(DType, EncodeStridedBitPatterns) {
  // Every 4099th float32 bit pattern (4099 is prime, so the low bits cycle
  // through all residues), for every format.
  std::vector<float> in;
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) in.push_back(from_bits(static_cast<uint32_t>(u)));
  for (const Format* f : kFormats) check_encode(*f, value_table(*f), in, "every 4099th pattern");
}

TEST(DType, Bf16RoundingBoundaries) {
  // For bf16 the dropped half of a float is its low 16 bits: 0x8000 is the
  // tie, 0x7fff/0x8001 are just below/above it. All 65536 upper halves.
  std::vector<float> in;
  for (uint32_t hi = 0; hi < 65536; ++hi)
    for (uint32_t lo : {0x0000u, 0x0001u, 0x7ffeu, 0x7fffu, 0x8000u, 0x8001u, 0x8002u, 0xffffu})
      in.push_back(from_bits(hi << 16 | lo));
  check_encode(kBF16, value_table(kBF16), in, "low-half boundaries");
}

TEST(DType, SizesAndNames) {
  EXPECT_EQ(dtype_size(DType::F32), 4u);
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::F16), 2u);
  EXPECT_EQ(dtype_size(DType::F8E4M3), 1u);
  EXPECT_EQ(dtype_size(DType::F8E5M2), 1u);
  EXPECT_EQ(dtype_size(DType::I32), 4u);
  EXPECT_EQ(dtype_size(DType::U32), 4u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_name(DType::F8E4M3), "f8_e4m3");
  EXPECT_TRUE(dtype_is_float(DType::BF16));
  EXPECT_FALSE(dtype_is_float(DType::I64));
  // Packed two a byte: no size per element, and convert() does not take it.
  EXPECT_EQ(dtype_name(DType::F4E2M1), "f4_e2m1");
  EXPECT_THROW(dtype_size(DType::F4E2M1), Error);
  EXPECT_FALSE(dtype_is_float(DType::F4E2M1));
  float out = 0;
  uint8_t in = 0;
  EXPECT_THROW(convert(&out, DType::F32, &in, DType::F4E2M1, 1), Error);
}

TEST(DType, E2m1AndE8m0FromTheirDefinitions) {
  // e2m1: sign, 2 exponent bits with bias 1, 1 mantissa bit; exponent 0 is
  // subnormal (0.m x 2^0). Only the low 4 bits of the byte count.
  for (int code = 0; code < 256; ++code) {
    const int c = code & 15, e = (c >> 1) & 3, m = c & 1;
    const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + 0.5 * m, e - 1);
    EXPECT_EQ(e2m1_to_f32(static_cast<uint8_t>(code)), static_cast<float>((c & 8) ? -mag : mag)) << code;
  }
  EXPECT_EQ(e2m1_to_f32(7), 6.0f);
  EXPECT_EQ(e2m1_to_f32(15), -6.0f);
  EXPECT_TRUE(std::signbit(e2m1_to_f32(8)));  // -0
  // e8m0: 2^(e - 127), 0xff NaN; e = 0 is the subnormal 2^-127.
  for (int e = 0; e < 255; ++e)
    EXPECT_EQ(e8m0_to_f32(static_cast<uint8_t>(e)), static_cast<float>(std::ldexp(1.0, e - 127))) << e;
  EXPECT_TRUE(std::isnan(e8m0_to_f32(0xff)));
}

TEST(DType, E2m1EncodesToTheNearestCodeTiesToEven) {
  // Against a search over the 8 magnitudes: the nearest, and on a tie the
  // even code; a dense grid through [0, 7] hits every midpoint exactly.
  for (int code = 0; code < 16; ++code)
    EXPECT_EQ(f32_to_e2m1(e2m1_to_f32(static_cast<uint8_t>(code))), code) << code;
  for (int i = 0; i <= 7 * 64; ++i)
    for (float sign : {1.0f, -1.0f}) {
      const float x = sign * static_cast<float>(i) / 64.0f;
      int best = 0;
      for (int m = 1; m < 8; ++m) {
        const float dm = std::fabs(std::fabs(x) - e2m1_to_f32(static_cast<uint8_t>(m)));
        const float db = std::fabs(std::fabs(x) - e2m1_to_f32(static_cast<uint8_t>(best)));
        if (dm < db || (dm == db && m % 2 == 0)) best = m;
      }
      EXPECT_EQ(f32_to_e2m1(x), (std::signbit(x) ? 8 : 0) | best) << x;
    }
  EXPECT_EQ(f32_to_e2m1(0.25f), 0);  // tie: to 0, not 0.5
  EXPECT_EQ(f32_to_e2m1(0.75f), 2);  // tie: to 1
  EXPECT_EQ(f32_to_e2m1(5.0f), 6);   // tie: to 4
  EXPECT_EQ(f32_to_e2m1(1e30f), 7);  // saturates
  EXPECT_EQ(f32_to_e2m1(-std::numeric_limits<float>::infinity()), 15);
}

const DType kFloatTypes[] = {DType::F32, DType::BF16, DType::F16, DType::F8E4M3, DType::F8E5M2};

float load(const std::vector<uint8_t>& buf, DType t, size_t i) {
  switch (t) {
    case DType::F32: {
      float v;
      std::memcpy(&v, buf.data() + 4 * i, 4);
      return v;
    }
    case DType::BF16: {
      uint16_t h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return bf16_to_f32(h);
    }
    case DType::F16: {
      uint16_t h;
      std::memcpy(&h, buf.data() + 2 * i, 2);
      return f16_to_f32(h);
    }
    case DType::F8E4M3:
      return e4m3_to_f32(buf[i]);
    case DType::F8E5M2:
      return e5m2_to_f32(buf[i]);
    default:
      return 0;
  }
}

// The scalar conversion of one float into `t`, as bytes.
std::vector<uint8_t> store(DType t, float v) {
  std::vector<uint8_t> b(dtype_size(t));
  switch (t) {
    case DType::F32:
      std::memcpy(b.data(), &v, 4);
      break;
    case DType::BF16: {
      uint16_t h = f32_to_bf16(v);
      std::memcpy(b.data(), &h, 2);
      break;
    }
    case DType::F16: {
      uint16_t h = f32_to_f16(v);
      std::memcpy(b.data(), &h, 2);
      break;
    }
    case DType::F8E4M3:
      b[0] = f32_to_e4m3(v);
      break;
    case DType::F8E5M2:
      b[0] = f32_to_e5m2(v);
      break;
    default:
      break;
  }
  return b;
}

void convert_matches_scalar_functions() {
  // 70000 elements: above the sizes where convert() goes parallel. Sources are
  // every bit pattern (16-bit formats), all 256 patterns repeated (fp8), or
  // random bits with specials (f32).
  const size_t n = 70000;
  SplitMix rng{42};
  for (DType st : kFloatTypes) {
    const size_t ss = dtype_size(st);
    std::vector<uint8_t> src(n * ss);
    for (size_t i = 0; i < n; ++i) {
      if (ss == 4) {
        uint32_t u = static_cast<uint32_t>(rng.next());
        if (i % 7 == 0) u = (u & 0x807fffffu) | ((110u + static_cast<uint32_t>(i % 40)) << 23);  // moderate range
        if (i == 0) u = 0x7f800000u;
        if (i == 1) u = 0x7fc00001u;
        std::memcpy(src.data() + 4 * i, &u, 4);
      } else if (ss == 2) {
        uint16_t h = static_cast<uint16_t>(i);
        std::memcpy(src.data() + 2 * i, &h, 2);
      } else {
        src[i] = static_cast<uint8_t>(i);
      }
    }
    for (DType dt : kFloatTypes) {
      const size_t ds_ = dtype_size(dt);
      std::vector<uint8_t> dst(n * ds_, 0xcd);
      convert(dst.data(), dt, src.data(), st, n);
      size_t bad = 0;
      for (size_t i = 0; i < n; ++i) {
        // Same type: a plain copy (NaN payloads kept); otherwise through float32.
        std::vector<uint8_t> want = st == dt ? std::vector<uint8_t>(src.begin() + i * ss, src.begin() + (i + 1) * ss)
                                             : store(dt, load(src, st, i));
        if (std::memcmp(dst.data() + i * ds_, want.data(), ds_) != 0 && ++bad <= 4)
          ADD_FAILURE() << dtype_name(st) << " -> " << dtype_name(dt) << " element " << i;
      }
      EXPECT_EQ(bad, 0u) << dtype_name(st) << " -> " << dtype_name(dt);
    }
  }
}

TEST(DType, ConvertMatchesScalarFunctions) {
  test::for_each_simd_target([](const char*) { convert_matches_scalar_functions(); });
}

TEST(DType, ConvertRejectsIntegerTypes) {
  std::vector<uint8_t> a(64), b(64);
  for (DType it : {DType::I32, DType::U32, DType::I64}) {
    EXPECT_THROW(convert(a.data(), it, b.data(), DType::F32, 4), Error);
    EXPECT_THROW(convert(a.data(), DType::BF16, b.data(), it, 4), Error);
    EXPECT_THROW(convert(a.data(), it, b.data(), it, 4), Error);
  }
  try {
    convert(a.data(), DType::I32, b.data(), DType::F32, 4);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("i32"), std::string::npos) << e.what();
  }
}

// ---------------------------------------------------------------- bulk kernels

// convert(src -> dst) against the scalar function, bit for bit, on slices of
// `src` that leave every remainder after whole vectors: the whole input (its
// length is odd), all but its first element (a misaligned start), and every
// length 0..67 from the first few offsets (67 covers a partial vector of every
// width up to 64 lanes). The element after each slice must stay untouched.
template <typename Src, typename Dst, typename Scalar>
void expect_bulk_matches(DType dt, DType st, const std::vector<Src>& src, Scalar scalar, const char* what) {
  ASSERT_EQ(sizeof(Src), dtype_size(st));
  ASSERT_EQ(sizeof(Dst), dtype_size(dt));
  std::vector<std::pair<size_t, size_t>> slices = {{0, src.size()}, {1, src.size() - 1}};
  for (size_t off = 0; off < 4; ++off)
    for (size_t len = 0; len <= 67 && off + len <= src.size(); ++len) slices.push_back({off, len});
  using SrcBits =
      std::conditional_t<sizeof(Src) == 4, uint32_t, std::conditional_t<sizeof(Src) == 2, uint16_t, uint8_t>>;
  const Dst sentinel = static_cast<Dst>(0xcdcdcdcdu);
  std::vector<Dst> dst(src.size() + 1);
  size_t bad = 0;
  for (const auto& [off, len] : slices) {
    std::fill(dst.begin(), dst.end(), sentinel);
    convert(dst.data(), dt, src.data() + off, st, len);
    for (size_t i = 0; i < len; ++i) {
      const Dst want = std::bit_cast<Dst>(scalar(src[off + i]));
      if (std::memcmp(&dst[i], &want, sizeof(Dst)) != 0 && ++bad <= 8)
        ADD_FAILURE() << what << ": slice [" << off << ", +" << len << ") element " << i << " input 0x" << std::hex
                      << static_cast<uint64_t>(std::bit_cast<SrcBits>(src[off + i])) << " gives 0x"
                      << static_cast<uint64_t>(dst[i]) << ", scalar 0x" << static_cast<uint64_t>(want) << std::dec;
    }
    if (dst[len] != sentinel && ++bad <= 8) ADD_FAILURE() << what << ": wrote past the slice [" << off << ", +" << len;
  }
  EXPECT_EQ(bad, 0u) << what;
}

TEST(DType, BulkWideningMatchesScalarOnEveryPattern) {
  // Every 16-bit pattern, then three more so that the length is odd.
  std::vector<uint16_t> h(65536 + 3);
  for (size_t i = 0; i < h.size(); ++i) h[i] = static_cast<uint16_t>(i * 40503u);  // odd multiplier: a permutation
  // Every 8-bit pattern, five times, plus three.
  std::vector<uint8_t> b(256 * 5 + 3);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<uint8_t>(i * 167u);
  test::for_each_simd_target([&](const char*) {
    expect_bulk_matches<uint16_t, uint32_t>(DType::F32, DType::BF16, h, bf16_to_f32, "bf16 -> f32");
    expect_bulk_matches<uint16_t, uint32_t>(DType::F32, DType::F16, h, f16_to_f32, "f16 -> f32");
    expect_bulk_matches<uint8_t, uint32_t>(DType::F32, DType::F8E4M3, b, e4m3_to_f32, "e4m3 -> f32");
    expect_bulk_matches<uint8_t, uint32_t>(DType::F32, DType::F8E5M2, b, e5m2_to_f32, "e5m2 -> f32");
  });
}

TEST(DType, BulkNarrowingMatchesScalar) {
  // Float bit patterns where rounding is decided for either format, specials
  // (NaN payloads of both signs, infinities, zeros, f32 subnormals), every
  // 4099th pattern, and random bits, in an odd count.
  std::vector<float> in = critical_inputs(value_table(kBF16));
  const auto f16_critical = critical_inputs(value_table(kF16));
  in.insert(in.end(), f16_critical.begin(), f16_critical.end());
  for (uint32_t e = 0; e < 256; ++e)
    for (uint32_t hi : {0x000000u, 0x002000u, 0x3fe000u, 0x7fe000u, 0x7fc000u, 0x400000u, 0x7f0000u})
      for (uint32_t lo : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x1fffu, 0x7fffu, 0x8000u, 0x8001u, 0xffffu})
        for (uint32_t sign : {0u, 0x80000000u}) in.push_back(from_bits(sign | e << 23 | hi | lo));
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) in.push_back(from_bits(static_cast<uint32_t>(u)));
  SplitMix rng{7};
  for (int i = 0; i < 300000; ++i) in.push_back(from_bits(static_cast<uint32_t>(rng.next())));
  if (in.size() % 2 == 0) in.push_back(from_bits(0x7f800001u));
  test::for_each_simd_target([&](const char*) {
    expect_bulk_matches<float, uint16_t>(DType::BF16, DType::F32, in, f32_to_bf16, "f32 -> bf16");
    expect_bulk_matches<float, uint16_t>(DType::F16, DType::F32, in, f32_to_f16, "f32 -> f16");
    // Rounding in place to bf16 values: the same bits as the scalar round trip.
    std::vector<float> r = in;
    round_to_bf16(r.data(), r.size());
    for (size_t i = 0; i < in.size(); ++i) {
      const uint32_t want = std::bit_cast<uint32_t>(bf16_to_f32(f32_to_bf16(in[i])));
      ASSERT_EQ(std::bit_cast<uint32_t>(r[i]), want) << "round_to_bf16 of bits " << std::hex
                                                      << std::bit_cast<uint32_t>(in[i]);
    }
  });
}

// find_non_finite on every dtype it scans, the elements starting at any
// byte offset (a checkpoint may pack a one-byte tensor of odd length before
// a bf16 one), finite values up to the largest, a hit in the vector body,
// the tail, a later block or the last element, and none at all.
TEST(FindNonFinite, AnyOffsetAnyPosition) {
  struct Case {
    DType t;
    size_t size;
    uint32_t finite, largest, bad;
  };
  for (const Case& c : {Case{DType::F32, 4, 0x3f800000u, 0xff7fffffu, 0x7fc00000u},
                        Case{DType::BF16, 2, 0x3f80u, 0xff7fu, 0xff80u}, Case{DType::F16, 2, 0x3c00u, 0x7bffu, 0x7c00u},
                        Case{DType::F8E4M3, 1, 0x38u, 0xfeu, 0xffu}, Case{DType::F8E5M2, 1, 0x3cu, 0x7bu, 0x7cu}})
    for (const size_t n : {size_t{5000}, size_t{140001}})
      for (size_t offset = 0; offset < 4; ++offset) {
        std::vector<unsigned char> buf(offset + n * c.size);
        auto put = [&](size_t i, uint32_t v) { std::memcpy(buf.data() + offset + i * c.size, &v, c.size); };
        auto find = [&] { return find_non_finite(buf.data() + offset, c.t, n); };
        for (size_t i = 0; i < n; ++i) put(i, i % 3 ? c.finite : c.largest);
        const std::string what = fmt::format("{} n {} offset {}", dtype_name(c.t), n, offset);
        EXPECT_EQ(find(), -1) << what;
        put(n - 1, c.bad);
        EXPECT_EQ(find(), static_cast<int64_t>(n - 1)) << what;
        if (n > 70000) {
          put(65536 + 77, c.bad);
          EXPECT_EQ(find(), 65536 + 77) << what;
        }
        put(n / 3, c.bad);
        EXPECT_EQ(find(), static_cast<int64_t>(n / 3)) << what;
        put(7, c.bad);
        EXPECT_EQ(find(), 7) << what;
      }
}

}  // namespace dtype_test
}  // namespace
}  // namespace ds
