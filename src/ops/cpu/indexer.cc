// DeepSeek-V3.2 indexer pieces; see ops/indexer.h. Plain loops: the scores'
// cost is the gemm (oneDNN), everything here is linear in the keys.
#include "ops/indexer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "ops/matmul.h"

namespace ds::ops {

namespace {

constexpr float kFp8Max = 448.0f;

// 2^ceil(log2(x)) for x > 0, exact (as the reference's bit-level
// log2-ceil on a float32).
float pow2_ceil(float x) {
  int e = 0;
  const float m = std::frexp(x, &e);  // x = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.0f, m == 0.5f ? e - 1 : e);
}

// The fp8 scale of the n values at v: amax (at least 1e-4) / 448, or with
// ue8m0 the power of two at or above it.
float fp8_block_scale(const float* v, int64_t n, bool ue8m0) {
  float amax = 1e-4f;
  for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(v[c]));
  return ue8m0 ? pow2_ceil(amax * (1.0f / kFp8Max)) : amax * (1.0f / kFp8Max);
}

}  // namespace

void hadamard_rows(float* x, int64_t rows, int64_t d) {
  DS_CHECK(d >= 1 && (d & (d - 1)) == 0, "hadamard_rows: dimension {} is not a power of two", d);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t r = 0; r < rows; ++r) {
    float* v = x + r * d;
    for (int64_t len = 1; len < d; len <<= 1)
      for (int64_t i = 0; i < d; i += 2 * len)
        for (int64_t j = i; j < i + len; ++j) {
          const float a = v[j], b = v[j + len];
          v[j] = a + b;
          v[j + len] = a - b;
        }
    for (int64_t j = 0; j < d; ++j) v[j] *= scale;
  }
}

namespace {

// A row's mean and 1 / sqrt(biased variance + eps), in double.
struct MeanRstd {
  double mean, rstd;
};
MeanRstd mean_rstd(const float* x, int64_t d, float eps) {
  double mean = 0;
  for (int64_t j = 0; j < d; ++j) mean += x[j];
  mean /= static_cast<double>(d);
  double var = 0;
  for (int64_t j = 0; j < d; ++j) var += (x[j] - mean) * (x[j] - mean);
  var /= static_cast<double>(d);
  return {mean, 1.0 / std::sqrt(var + eps)};
}

}  // namespace

void layer_norm_rows(float* y, const float* x, const float* w, const float* b, int64_t rows, int64_t d, float eps) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const auto [mean, rstd] = mean_rstd(xr, d, eps);
    for (int64_t j = 0; j < d; ++j) y[r * d + j] = static_cast<float>((xr[j] - mean) * rstd) * w[j] + b[j];
  }
}

void layer_norm_backward(float* dx, float* dw, float* db, const float* dy, const float* x, const float* w, int64_t rows,
                         int64_t d, float eps) {
  std::vector<double> gw(static_cast<size_t>(d), 0.0), gb(static_cast<size_t>(d), 0.0);
  std::vector<double> xhat(static_cast<size_t>(d));
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * d;
    const float* g = dy + r * d;
    const auto [mean, rstd] = mean_rstd(xr, d, eps);
    double m1 = 0, m2 = 0;  // means of dxhat and dxhat * xhat
    for (int64_t j = 0; j < d; ++j) {
      xhat[j] = (xr[j] - mean) * rstd;
      const double dxh = static_cast<double>(g[j]) * w[j];
      m1 += dxh;
      m2 += dxh * xhat[j];
      gw[j] += static_cast<double>(g[j]) * xhat[j];
      gb[j] += g[j];
    }
    m1 /= static_cast<double>(d);
    m2 /= static_cast<double>(d);
    if (dx)
      for (int64_t j = 0; j < d; ++j)
        dx[r * d + j] = static_cast<float>(rstd * (static_cast<double>(g[j]) * w[j] - m1 - xhat[j] * m2));
  }
  for (int64_t j = 0; j < d; ++j) {
    if (dw) dw[j] += static_cast<float>(gw[j]);
    if (db) db[j] += static_cast<float>(gb[j]);
  }
}

void fp8_quantize_rows(uint8_t* codes, float* scales, const float* x, int64_t rows, int64_t d, bool ue8m0) {
  const int64_t nb = indexer_scale_blocks(d);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t c0 = b * kIndexerQuantBlock, c1 = std::min(d, c0 + kIndexerQuantBlock);
      const float* v = x + r * d;
      const float s = fp8_block_scale(v + c0, c1 - c0, ue8m0);
      scales[r * nb + b] = s;
      for (int64_t c = c0; c < c1; ++c) codes[r * d + c] = f32_to_e4m3(std::clamp(v[c] / s, -kFp8Max, kFp8Max));
    }
}

void fp8_dequantize_rows(float* y, const uint8_t* codes, const float* scales, int64_t rows, int64_t d) {
  static const auto table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i) t[i] = e4m3_to_f32(static_cast<uint8_t>(i));
    return t;
  }();
  const int64_t nb = indexer_scale_blocks(d);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) y[r * d + c] = table[codes[r * d + c]] * scales[r * nb + c / kIndexerQuantBlock];
}

void fp8_round_blocks(float* y, const float* x, int64_t n, int64_t block, bool ue8m0) {
  DS_CHECK(block > 0 && n >= 0 && n % block == 0, "fp8_round_blocks: {} values in blocks of {}", n, block);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const float s = fp8_block_scale(x + b0, block, ue8m0);
    for (int64_t c = b0; c < b0 + block; ++c)
      y[c] = e4m3_to_f32(f32_to_e4m3(std::clamp(x[c] / s, -kFp8Max, kFp8Max))) * s;
  }
}

namespace {

// The e8m0 byte of a power of two.
uint8_t e8m0_of(float pow2) { return static_cast<uint8_t>(std::ilogb(pow2) + 127); }

// fp4 (e2m1, max 6) in blocks: a block's scale from its amax, either the
// power of two 2^ceil(log2(max(amax, 6 2^-126) / 6)) (an e8m0 byte) or
// e4m3(max(amax, 6 2^-9) / 6) (an e4m3 byte); each value e2m1(clamp(x / s)).
// Writes the rounded values y, and / or the codes packed two a byte with
// each block's scale byte (any of y, packed + scales may be null).
enum class Fp4Scale { Pow2, E4m3 };
void fp4_blocks(float* y, uint8_t* packed, uint8_t* scales, const float* x, int64_t n, int64_t block, Fp4Scale kind,
                const char* who) {
  DS_CHECK(block > 0 && (!packed || block % 2 == 0) && n >= 0 && n % block == 0, "{}: {} values in blocks of {}", who,
           n, block);
  constexpr float kFp4Max = 6.0f;
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    float amax = kFp4Max * (kind == Fp4Scale::Pow2 ? 0x1p-126f : 0x1p-9f);  // the scale's smallest
    for (int64_t c = b0; c < b0 + block; ++c) amax = std::max(amax, std::fabs(x[c]));
    float s;
    uint8_t byte;
    if (kind == Fp4Scale::Pow2) {
      s = pow2_ceil(amax / kFp4Max);
      byte = e8m0_of(s);
    } else {
      byte = f32_to_e4m3(amax / kFp4Max);
      s = e4m3_to_f32(byte);
    }
    if (scales) scales[b0 / block] = byte;
    for (int64_t c = b0; c < b0 + block; ++c) {
      const uint8_t code = f32_to_e2m1(std::clamp(x[c] / s, -kFp4Max, kFp4Max));
      if (y) y[c] = e2m1_to_f32(code) * s;
      if (packed) packed[c / 2] = static_cast<uint8_t>(c % 2 ? (packed[c / 2] & 0x0F) | (code << 4) : code & 0x0F);
    }
  }
}

}  // namespace

void fp4_round_blocks(float* y, const float* x, int64_t n, int64_t block) {
  fp4_blocks(y, nullptr, nullptr, x, n, block, Fp4Scale::Pow2, "fp4_round_blocks");
}

void fp4_round_blocks_e4m3(float* y, const float* x, int64_t n, int64_t block) {
  fp4_blocks(y, nullptr, nullptr, x, n, block, Fp4Scale::E4m3, "fp4_round_blocks_e4m3");
}

void fp4_encode_blocks(uint8_t* packed, uint8_t* scales, const float* x, int64_t n, int64_t block) {
  fp4_blocks(nullptr, packed, scales, x, n, block, Fp4Scale::Pow2, "fp4_encode_blocks");
}

void fp4_encode_blocks_e4m3(uint8_t* packed, uint8_t* scales, const float* x, int64_t n, int64_t block) {
  fp4_blocks(nullptr, packed, scales, x, n, block, Fp4Scale::E4m3, "fp4_encode_blocks_e4m3");
}

void fp8_encode_blocks(uint8_t* codes, uint8_t* scales, const float* x, int64_t n, int64_t block) {
  DS_CHECK(block > 0 && n >= 0 && n % block == 0, "fp8_encode_blocks: {} values in blocks of {}", n, block);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const float s = fp8_block_scale(x + b0, block, /*ue8m0=*/true);
    scales[b0 / block] = e8m0_of(s);
    for (int64_t c = b0; c < b0 + block; ++c) codes[c] = f32_to_e4m3(std::clamp(x[c] / s, -kFp8Max, kFp8Max));
  }
}

void fp4_decode_blocks_e4m3(float* y, const uint8_t* packed, const uint8_t* scales, int64_t n, int64_t block) {
  DS_CHECK(block > 0 && block % 2 == 0 && n >= 0 && n % block == 0, "fp4_decode_blocks_e4m3: {} values in blocks of {}",
           n, block);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const float s = e4m3_to_f32(scales[b0 / block]);
    for (int64_t c = b0; c < b0 + block; c += 2) {
      y[c] = e2m1_to_f32(packed[c / 2]) * s;
      y[c + 1] = e2m1_to_f32(static_cast<uint8_t>(packed[c / 2] >> 4)) * s;
    }
  }
}

void fp8_decode_blocks(float* y, const uint8_t* codes, const uint8_t* scales, int64_t n, int64_t block) {
  DS_CHECK(block > 0 && n >= 0 && n % block == 0, "fp8_decode_blocks: {} values in blocks of {}", n, block);
  for (int64_t b0 = 0; b0 < n; b0 += block) {
    const float s = e8m0_to_f32(scales[b0 / block]);
    for (int64_t c = b0; c < b0 + block; ++c) y[c] = e4m3_to_f32(codes[c]) * s;
  }
}

void indexer_scores(float* scores, int64_t lds, const float* q, const float* w, int64_t n, int64_t heads, int64_t d,
                    const uint8_t* key_codes, const float* key_scales, int64_t T) {
  if (n == 0 || T == 0) return;
  const int64_t nb = indexer_scale_blocks(d);
  constexpr int64_t kTile = 512;  // keys per tile: fixed, so results never depend on threads
  const int64_t tile = std::min(kTile, T);
  Buffer<float> k(tile * d), dots(n * heads * tile);
  for (int64_t s0 = 0; s0 < T; s0 += kTile) {
    const int64_t m = std::min(kTile, T - s0);
    fp8_dequantize_rows(k.data(), key_codes + s0 * d, key_scales + s0 * nb, m, d);
    gemm(false, true, n * heads, m, d, 1.0f, q, d, k.data(), d, 0.0f, dots.data(), m);
    for (int64_t j = 0; j < n; ++j) {
      float* out = scores + j * lds + s0;
      std::fill(out, out + m, 0.0f);
      for (int64_t h = 0; h < heads; ++h) {
        const float wh = w[j * heads + h];
        const float* row = dots.data() + (j * heads + h) * m;
        for (int64_t s = 0; s < m; ++s) out[s] += wh * std::max(row[s], 0.0f);
      }
    }
  }
}

int64_t topk_indices(int32_t* out, const float* scores, int64_t visible, int64_t k) {
  DS_CHECK(visible >= 0 && k >= 0, "topk_indices: visible {} and k {} must be non-negative", visible, k);
  if (visible <= k) {
    std::iota(out, out + visible, 0);
    return visible;
  }
  if (k == 0) return 0;
  // Radix select on order-preserving keys (NaN lowest, -0 as +0): the k-th
  // largest key t, a byte at a time; then one ascending pass takes every key
  // above t and as many equal to t as are still missing, lowest index first.
  thread_local std::vector<uint32_t> keys;
  keys.resize(static_cast<size_t>(visible));
  for (int64_t i = 0; i < visible; ++i) {
    const float v = scores[i] == 0.0f ? 0.0f : scores[i];
    uint32_t b;
    std::memcpy(&b, &v, sizeof b);
    keys[i] = std::isnan(v) ? 0u : (b & 0x80000000u) ? ~b : b | 0x80000000u;
  }
  // After the top byte, only the keys in its chosen bucket stay candidates.
  thread_local std::vector<uint32_t> cand;
  uint32_t prefix = 0;
  int64_t need = k;  // how many of the keys matching prefix, counted from the top, are taken
  for (int shift = 24; shift >= 0; shift -= 8) {
    const uint32_t* src = shift == 24 ? keys.data() : cand.data();
    const int64_t n = shift == 24 ? visible : static_cast<int64_t>(cand.size());
    int64_t hist[256] = {};
    for (int64_t i = 0; i < n; ++i) ++hist[(src[i] >> shift) & 255u];
    int b = 255;
    for (; b > 0 && hist[b] < need; --b) need -= hist[b];
    prefix |= static_cast<uint32_t>(b) << shift;
    if (shift == 0) break;
    const uint32_t mask = ~0u << shift;
    if (shift == 24) {
      cand.clear();
      for (int64_t i = 0; i < n; ++i)
        if ((src[i] & mask) == prefix) cand.push_back(src[i]);
    } else {
      cand.erase(std::remove_if(cand.begin(), cand.end(), [&](uint32_t x) { return (x & mask) != prefix; }),
                 cand.end());
    }
  }
  int64_t m = 0;
  for (int64_t i = 0; i < visible; ++i)
    if (keys[i] > prefix || (keys[i] == prefix && need-- > 0)) out[m++] = static_cast<int32_t>(i);
  return m;
}

}  // namespace ds::ops
