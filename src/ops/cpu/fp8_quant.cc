// fp8 quantization per channel (ops/fp8_quant.h).
#include "ops/fp8_quant.h"

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {

namespace {

struct Format {
  int mbits;          // mantissa bits
  float min_normal;   // smallest normal, 2^emin
  float quantum;      // spacing below it, 2^(emin - mbits) (exact powers of two)
  float max;          // largest finite value
};

constexpr Format kE4m3{3, 0x1p-6f, 0x1p-9f, 448.0f};
constexpr Format kE5m2{2, 0x1p-14f, 0x1p-16f, 57344.0f};

const Format& format(Fp8Kind k) { return k == Fp8Kind::kE4m3 ? kE4m3 : kE5m2; }

// bf16_to_f32(f32_to_bf16(x)) inline: to nearest even, NaN kept.
inline float bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return x;
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, 4);
  return x;
}

// Nearest value of the format, ties to even, saturating (NaN stays NaN).
// Normals keep mbits of float32's 23 mantissa bits (rounded on the bits:
// adding half the dropped quantum minus one, plus the kept last bit, rounds
// ties to even); below the smallest normal the quantum is fixed and the
// scaling by it is exact.
inline float round_to(float x, const Format& f) {
  const float a = std::fabs(x);
  if (!(a <= f.max)) return std::isnan(x) ? x : std::copysign(f.max, x);
  float v;
  if (a < f.min_normal) {
    v = std::nearbyint(a / f.quantum) * f.quantum;
  } else {
    uint32_t u;
    std::memcpy(&u, &a, 4);
    const int drop = 23 - f.mbits;
    u += ((1u << (drop - 1)) - 1) + ((u >> drop) & 1u);
    u &= ~((1u << drop) - 1);
    std::memcpy(&v, &u, 4);
    v = std::min(v, f.max);
  }
  return std::copysign(v, x);
}

// The channel's scale from its absolute maximum (see the header).
float scale_of(float absmax, const Format& f, bool use_bf16) {
  float s = absmax / f.max;
  if (use_bf16) s = bf16(s);
  return s < std::sqrt(FLT_MIN) ? 1.0f : s;
}

inline float quantize(float x, float scale, const Format& f, bool use_bf16) {
  float t = (use_bf16 ? bf16(x) : x) / scale;
  if (use_bf16) t = bf16(t);
  return round_to(std::clamp(t, -f.max, f.max), f);
}

std::atomic<Quantization> g_quantization{Quantization::kNone};

}  // namespace

void set_quantization(Quantization q) { g_quantization = q; }
Quantization quantization() { return g_quantization; }

Quantization parse_quantization(std::string_view name) {
  if (name.empty()) return Quantization::kNone;
  if (name == "fp8_full") return Quantization::kFp8Full;
  DS_FAIL("quantization '{}' is not one of: \"\" (none), fp8_full", name);
}

float fp8_max(Fp8Kind k) { return format(k).max; }
float fp8_round(float x, Fp8Kind k) { return round_to(x, format(k)); }

void fp8_quantize_rows(float* q, float* scale, const float* x, int64_t rows, int64_t cols, int64_t ld, Fp8Kind kind,
                       bool use_bf16) {
  const Format& f = format(kind);
  parallel_ranges(rows, rows * cols >= (int64_t{1} << 15), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = x + r * ld;
      float m = 0;
      for (int64_t c = 0; c < cols; ++c) m = std::max(m, std::fabs(use_bf16 ? bf16(xr[c]) : xr[c]));
      const float s = scale_of(m, f, use_bf16);
      scale[r] = s;
      for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = quantize(xr[c], s, f, use_bf16);
    }
  });
}

void fp8_quantize_cols(float* q, float* scale, const float* x, int64_t rows, int64_t cols, int64_t ld, Fp8Kind kind,
                       bool use_bf16) {
  const Format& f = format(kind);
  parallel_ranges(cols, rows * cols >= (int64_t{1} << 15), [&](int64_t c0, int64_t c1) {
    std::vector<float> m(static_cast<size_t>(c1 - c0), 0.0f);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c)
        m[c - c0] = std::max(m[c - c0], std::fabs(use_bf16 ? bf16(x[r * ld + c]) : x[r * ld + c]));
    for (int64_t c = c0; c < c1; ++c) scale[c] = scale_of(m[c - c0], f, use_bf16);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = c0; c < c1; ++c) q[r * cols + c] = quantize(x[r * ld + c], scale[c], f, use_bf16);
  });
}

}  // namespace ds::ops
