#include "ops/block_quant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/error.h"
#include "core/parallel.h"
#include "io/gguf_quants.h"

namespace ds::ops {

bool is_block_format(DType t) { return t == DType::Q8_0 || t == DType::Q4_K || t == DType::Q4_1 || t == DType::Q6_K; }

int64_t block_values(DType t) {
  DS_CHECK(is_block_format(t), "block_values: {} is not a block format", dtype_name(t));
  return t == DType::Q8_0 ? kQ8_0Values : t == DType::Q4_1 ? kQ4_1Values : t == DType::Q6_K ? kQ6_KValues : kQ4_KValues;
}

int64_t block_bytes(DType t) {
  DS_CHECK(is_block_format(t), "block_bytes: {} is not a block format", dtype_name(t));
  return t == DType::Q8_0 ? kQ8_0Bytes : t == DType::Q4_1 ? kQ4_1Bytes : t == DType::Q6_K ? kQ6_KBytes : kQ4_KBytes;
}

bool fits_block_format(DType t, int64_t cols) { return cols > 0 && cols % block_values(t) == 0; }

int64_t block_row_bytes(DType t, int64_t cols) {
  DS_CHECK(fits_block_format(t, cols), "a row of {} values is not whole blocks of {} ({} values a block)", cols,
           dtype_name(t), block_values(t));
  return cols / block_values(t) * block_bytes(t);
}

namespace {

void put_half(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

float get_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return f16_to_f32(h);
}

// A scale as f16 stores it, or an error when f16 cannot (the value is past
// 65504 or not finite).
float rounded_scale(float s, DType t) {
  const float r = f16_to_f32(f32_to_f16(s));
  DS_CHECK(std::isfinite(s) && std::isfinite(r), "a {} block's scale {} does not fit an f16 (weights too large)",
           dtype_name(t), s);
  return r;
}

void check_finite(const float* x, int64_t n, DType t) {
  const int64_t i = find_non_finite(x, DType::F32, static_cast<size_t>(n));
  DS_CHECK(i < 0, "value {} to quantize to {} is not finite ({})", i, dtype_name(t), i < 0 ? 0.0f : x[i]);
}

}  // namespace

namespace detail {

void q8_0_put_scale(uint8_t* out, float d) { put_half(out, rounded_scale(d, DType::Q8_0)); }

// ggml's rule (quantize_row_q8_0_ref), so the blocks are llama-quantize's
// bit for bit: d = amax / 127 stored as f16, q = x / d (the unrounded d)
// rounded half away from zero.
void q8_0_blocks_plain(const float* x, int64_t blocks, uint8_t* out) {
  for (int64_t b = 0; b < blocks; ++b, x += kQ8_0Values, out += kQ8_0Bytes) {
    float amax = 0;
    for (int i = 0; i < kQ8_0Values; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float d = amax / 127.0f;
    q8_0_put_scale(out, d);
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    for (int i = 0; i < kQ8_0Values; ++i)
      out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::clamp(std::roundf(x[i] * id), -127.0f, 127.0f)));
  }
}

}  // namespace detail

namespace {

// The best (scale a >= 0, offset b >= 0) with x ~ a q - b, q in [0, 15],
// for one sub-block, by the weighted squared error.
struct Fit {
  float a = 0, b = 0;
};

// The weighted squared error of x ~ a q + c for codes q with sums swq =
// sum w q, swqq = sum w q^2, swqx = sum w q x (and sw, swx, swxx of w
// alone): the square expanded, so no second pass over the values.
double fit_error(double a, double c, double swq, double swqq, double swqx, double sw, double swx, double swxx) {
  return a * a * swqq + 2 * a * c * swq + c * c * sw - 2 * a * swqx - 2 * c * swx + swxx;
}

}  // namespace

namespace detail {

void q4_sweep_sums_plain(const float* xl, const double* w, const double* xd, float range, double* sums) {
  constexpr int n = static_cast<int>(kQ4_KSubBlock);
  for (int k = 0; k < kQ4SweepSteps; ++k) {
    const float iscale = (15.0f + 0.1f * static_cast<float>(k - kQ4SweepFirst)) / range;
    // Four partial sums of each: the additions of one value need not wait
    // for the previous value's.
    double p[3][4] = {};
    for (int i = 0; i < n; i += 4)
      for (int j = 0; j < 4; ++j) {
        // floor(v + 0.5) by truncation: v = iscale (x - lo) >= 0.
        const double q = std::min(static_cast<int>(iscale * xl[i + j] + 0.5f), 15);
        const double wq = w[i + j] * q;
        p[0][j] += wq;
        p[1][j] += wq * q;
        p[2][j] += wq * xd[i + j];
      }
    for (int s = 0; s < 3; ++s) sums[s * kQ4SweepPad + k] = (p[s][0] + p[s][1]) + (p[s][2] + p[s][3]);
  }
  for (int s = 0; s < 3; ++s)
    for (int k = kQ4SweepSteps; k < kQ4SweepPad; ++k) sums[s * kQ4SweepPad + k] = 0;
}

void q4_sweep_fits_plain(const double* sums, double sw, double swx, double swxx, bool any_offset, double* fits) {
  for (int k = 0; k < kQ4SweepPad; ++k) {
    const double swq = sums[k], swqq = sums[kQ4SweepPad + k], swqx = sums[2 * kQ4SweepPad + k];
    double& a = fits[k];
    double& c = fits[kQ4SweepPad + k];
    double& e = fits[2 * kQ4SweepPad + k];
    a = c = 0;
    e = std::numeric_limits<double>::infinity();
    // x ~ a q + c by weighted least squares (c = -b <= 0 unless any_offset).
    const double det = sw * swqq - swq * swq;
    if (!(det > 0)) continue;
    a = (sw * swqx - swq * swx) / det;
    c = (swqq * swx - swq * swqx) / det;
    if (c > 0 && !any_offset) {
      c = 0;
      a = swqq > 0 ? swqx / swqq : 0;
    }
    if (a > 0) e = fit_error(a, c, swq, swqq, swqx, sw, swx, swxx);
  }
}

}  // namespace detail

namespace {

// any_offset: b may be negative too (q4_1 stores its m as a signed f16;
// q4_k's six-bit mins are offsets down only).
Fit fit_sub_block(const float* x, bool any_offset = false) {
  constexpr int n = static_cast<int>(kQ4_KSubBlock);
  float lo = any_offset ? x[0] : 0.0f, hi = x[0], sq = 0;
  for (int i = 0; i < n; ++i) {
    lo = std::min(lo, x[i]);
    hi = std::max(hi, x[i]);
    sq += x[i] * x[i];
  }
  if (hi <= lo) return {0.0f, -lo};  // constant (zero or negative) values: the offset alone
  const float rms = std::sqrt(sq / n);
  // Per value, once for the whole sweep: its weight, and x - lo (float32,
  // as the codes take it) and x as doubles.
  double w[n], xd[n];
  float xl[n];
  double sw = 0, swx = 0, swxx = 0;
  for (int i = 0; i < n; ++i) {
    w[i] = rms + std::fabs(x[i]);
    xd[i] = x[i];
    xl[i] = x[i] - lo;
    sw += w[i];
    swx += w[i] * xd[i];
    swxx += w[i] * xd[i] * xd[i];
  }
  // Every candidate scale's sums swq = sum w q, swqq = sum w q^2,
  // swqx = sum w q x, then its fit and the fit's error (SIMD kernels: most
  // of quantize's time).
  double sums[3 * detail::kQ4SweepPad], fits[3 * detail::kQ4SweepPad];
  detail::q4_sweep_sums(xl, w, xd, hi - lo, sums);
  detail::q4_sweep_fits(sums, sw, swx, swxx, any_offset, fits);
  Fit best{(hi - lo) / 15.0f, -lo};
  double best_err = std::numeric_limits<double>::infinity();
  for (int k = 0; k < detail::kQ4SweepSteps; ++k) {
    if (k == detail::kQ4SweepFirst) {  // the plain rule: scale (hi - lo) / 15, offset lo
      const double e = fit_error(best.a, lo, sums[k], sums[detail::kQ4SweepPad + k], sums[2 * detail::kQ4SweepPad + k],
                                 sw, swx, swxx);
      if (e < best_err) best_err = e;
    }
    const double e = fits[2 * detail::kQ4SweepPad + k];
    if (e < best_err) {
      best_err = e;
      best = {static_cast<float>(fits[k]), static_cast<float>(-fits[detail::kQ4SweepPad + k])};
    }
  }
  return best;
}

void q4_k_block(const float* x, uint8_t* out) {
  Fit fits[8];
  float max_a = 0, max_b = 0;
  for (int j = 0; j < 8; ++j) {
    fits[j] = fit_sub_block(x + j * kQ4_KSubBlock);
    max_a = std::max(max_a, fits[j].a);
    max_b = std::max(max_b, fits[j].b);
  }
  const float d = rounded_scale(max_a / 63.0f, DType::Q4_K), dmin = rounded_scale(max_b / 63.0f, DType::Q4_K);
  put_half(out, d);
  put_half(out + 2, dmin);
  int sc[8], mn[8];
  for (int j = 0; j < 8; ++j) {
    sc[j] = d > 0 ? static_cast<int>(std::clamp(std::nearbyint(fits[j].a / d), 0.0f, 63.0f)) : 0;
    mn[j] = dmin > 0 ? static_cast<int>(std::clamp(std::nearbyint(fits[j].b / dmin), 0.0f, 63.0f)) : 0;
  }
  uint8_t* s = out + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
  }
  // The codes under the rounded scales and mins.
  uint8_t q[kQ4_KValues];
  for (int j = 0; j < 8; ++j) {
    const float a = d * static_cast<float>(sc[j]), b = dmin * static_cast<float>(mn[j]);
    if (a > 0)
      detail::q4_codes(x + j * kQ4_KSubBlock, a, b, q + j * kQ4_KSubBlock);
    else
      std::memset(q + j * kQ4_KSubBlock, 0, kQ4_KSubBlock);
  }
  uint8_t* codes = out + 16;
  for (int c = 0; c < 4; ++c)
    for (int l = 0; l < 32; ++l) codes[32 * c + l] = static_cast<uint8_t>(q[64 * c + l] | (q[64 * c + 32 + l] << 4));
}

void q4_1_block(const float* x, uint8_t* out) {
  const Fit f = fit_sub_block(x, /*any_offset=*/true);
  const float d = rounded_scale(f.a, DType::Q4_1), m = rounded_scale(-f.b, DType::Q4_1);
  put_half(out, d);
  put_half(out + 2, m);
  uint8_t q[kQ4_1Values];
  for (int i = 0; i < kQ4_1Values; ++i)
    q[i] = d > 0 ? static_cast<uint8_t>(std::clamp(std::nearbyint((x[i] - m) / d), 0.0f, 15.0f)) : uint8_t{0};
  for (int l = 0; l < 16; ++l) out[4 + l] = static_cast<uint8_t>(q[l] | (q[16 + l] << 4));
}

// ggml's Q6_K layout (ops/block_quant.h) under the plain rule.
void q6_k_block(const float* x, uint8_t* out) {
  float s[16], smax = 0;
  for (int j = 0; j < 16; ++j) {
    float v = 0;
    for (int i = 0; i < 16; ++i)
      if (std::fabs(x[16 * j + i]) > std::fabs(v)) v = x[16 * j + i];
    s[j] = v / -32.0f;
    smax = std::max(smax, std::fabs(s[j]));
  }
  // d as f16 holds it, raised a step where rounding took it below smax / 127
  // (small subnormal d), so no scale is clipped.
  float d = rounded_scale(smax / 127.0f, DType::Q6_K);
  if (d * 127.0f < smax) d = rounded_scale(f16_to_f32(static_cast<uint16_t>(f32_to_f16(d) + 1)), DType::Q6_K);
  // |sc_j| rounded up: the group's step d |sc_j| is at least |s_j|, so its
  // largest value is not clipped (a step rounded down could clip it by
  // many steps in a group whose scale is small).
  int8_t sc[16];
  for (int j = 0; j < 16; ++j)
    sc[j] =
        d > 0 ? static_cast<int8_t>(std::copysign(std::min(std::ceil(std::fabs(s[j]) / d), 127.0f), s[j])) : int8_t{0};
  uint8_t q[kQ6_KValues];
  for (int v = 0; v < kQ6_KValues; ++v) {
    const float a = d * static_cast<float>(sc[v / 16]);
    q[v] = static_cast<uint8_t>(a != 0 ? std::clamp(std::nearbyint(x[v] / a), -32.0f, 31.0f) + 32.0f : 32.0f);
  }
  uint8_t* ql = out;
  uint8_t* qh = out + 128;
  for (int h = 0; h < 2; ++h)
    for (int l = 0; l < 32; ++l) {
      const uint8_t* qb = q + 128 * h;
      ql[64 * h + l] = static_cast<uint8_t>((qb[l] & 0xF) | (qb[64 + l] & 0xF) << 4);
      ql[64 * h + 32 + l] = static_cast<uint8_t>((qb[32 + l] & 0xF) | (qb[96 + l] & 0xF) << 4);
      qh[32 * h + l] =
          static_cast<uint8_t>(qb[l] >> 4 | (qb[32 + l] >> 4) << 2 | (qb[64 + l] >> 4) << 4 | (qb[96 + l] >> 4) << 6);
    }
  std::memcpy(out + 192, sc, 16);
  put_half(out + 208, d);
}

}  // namespace

void quantize_blocks(DType t, const float* x, int64_t n, uint8_t* out) {
  const int64_t B = block_values(t), bytes = block_bytes(t);
  DS_CHECK(n % B == 0, "quantize_blocks: {} values are not whole blocks of {}", n, dtype_name(t));
  check_finite(x, n, t);
  if (t == DType::Q8_0) return detail::q8_0_blocks(x, n / B, out);
  for (int64_t b = 0; b < n / B; ++b) {
    if (t == DType::Q4_1)
      q4_1_block(x + b * B, out + b * bytes);
    else if (t == DType::Q6_K)
      q6_k_block(x + b * B, out + b * bytes);
    else
      q4_k_block(x + b * B, out + b * bytes);
  }
}

void quantize_rows(DType t, const float* x, int64_t rows, int64_t cols, uint8_t* out) {
  const int64_t row_bytes = block_row_bytes(t, cols);
  parallel_ranges(rows, rows * cols >= (int64_t{1} << 14), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) quantize_blocks(t, x + r * cols, cols, out + r * row_bytes);
  });
}

int64_t blocks_not_finite(DType t, const uint8_t* blocks, int64_t n) {
  const int64_t B = block_values(t), bytes = block_bytes(t), halves = t == DType::Q8_0 || t == DType::Q6_K ? 1 : 2;
  const int64_t at = t == DType::Q6_K ? 208 : 0;  // q6_k's d comes last
  for (int64_t b = 0; b < n / B; ++b)
    for (int64_t k = 0; k < halves; ++k)
      if (!std::isfinite(get_half(blocks + b * bytes + at + 2 * k))) return b;
  return -1;
}

void dequantize_blocks(DType t, const uint8_t* blocks, int64_t n, float* out) {
  DS_CHECK(n % block_values(t) == 0, "dequantize_blocks: {} values are not whole blocks of {}", n, dtype_name(t));
  io::gguf::dequantize(t == DType::Q8_0   ? io::gguf::TensorType::Q8_0
                       : t == DType::Q4_1 ? io::gguf::TensorType::Q4_1
                       : t == DType::Q6_K ? io::gguf::TensorType::Q6_K
                                          : io::gguf::TensorType::Q4_K,
                       blocks, n, out);
}

}  // namespace ds::ops
