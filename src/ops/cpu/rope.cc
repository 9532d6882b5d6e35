// Rotary position embedding with YaRN frequencies (math and layouts: ops/rope.h).
//
// Forward rotates each pair by +angle, backward by -angle (the transpose of a
// rotation is its inverse), so both share one kernel that takes the sign of sin.
// cos and sin are computed once per token and pair and reused by every head.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"

namespace ds::ops {
namespace {

// One head: y = R x over the dim/2 pairs, with c/s the per-pair cos and
// (signed) sin. y may equal x: each pair is read before it is written.
void rotate_head(float* y, const float* x, const float* c, const float* s, int64_t half, RopeLayout layout) {
  if (layout == RopeLayout::Interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1];
      y[2 * i] = a * c[i] - b * s[i];
      y[2 * i + 1] = b * c[i] + a * s[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half];
      y[i] = a * c[i] - b * s[i];
      y[i + half] = b * c[i] + a * s[i];
    }
  }
}

void rope_apply(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens, int64_t heads,
                int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout, float sin_sign,
                const char* name) {
  DS_CHECK(dim > 0 && dim % 2 == 0, "{}: rotary dim must be positive and even, got {}", name, dim);
  DS_CHECK(tokens >= 0 && heads >= 0, "{}: tokens={} heads={}", name, tokens, heads);
  // Necessary (not sufficient) for heads and tokens not to overlap; covers both
  // token-major and head-major layouts.
  DS_CHECK(heads <= 1 || head_stride >= dim, "{}: head_stride {} < dim {} with {} heads", name, head_stride, dim,
           heads);
  DS_CHECK(tokens <= 1 || token_stride >= dim, "{}: token_stride {} < dim {} with {} tokens", name, token_stride, dim,
           tokens);
  // Check every position before writing anything, so a bad batch leaves y as it was.
  for (int64_t t = 0; t < tokens; ++t)
    DS_CHECK(positions[t] >= 0, "{}: position {} of token {} is negative", name, positions[t], t);
  const int64_t half = dim / 2;
  // The angle is rounded to float32 as the reference implementations do;
  // cos and sin of that angle are then taken in double and rounded once.
  auto angles = [&](float* c, float* s, int32_t pos) {
    const float p = static_cast<float>(pos);
    for (int64_t i = 0; i < half; ++i) {
      const double angle = static_cast<double>(p * freqs[i]);
      c[i] = static_cast<float>(std::cos(angle));
      s[i] = sin_sign * static_cast<float>(std::sin(angle));
    }
  };
  const bool parallel = tokens * heads * dim >= (int64_t{1} << 14);
  // A batch of several sequences repeats its positions: when there are fewer
  // positions than tokens, each position's cos and sin are taken once.
  int32_t max_pos = 0;
  for (int64_t t = 0; t < tokens; ++t) max_pos = std::max(max_pos, positions[t]);
  if (tokens > 1 && static_cast<int64_t>(max_pos) + 1 < tokens) {
    const int64_t P = static_cast<int64_t>(max_pos) + 1;
    std::vector<float> c(static_cast<size_t>(P * half)), s(c.size());
    parallel_ranges(P, parallel, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) angles(c.data() + p * half, s.data() + p * half, static_cast<int32_t>(p));
    });
    parallel_ranges(tokens, parallel, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = t * token_stride + h * head_stride;
          rotate_head(y + off, x + off, c.data() + positions[t] * half, s.data() + positions[t] * half, half, layout);
        }
    });
    return;
  }
  parallel_ranges(tokens, parallel, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(half), s(half);
    for (int64_t t = t0; t < t1; ++t) {
      angles(c.data(), s.data(), positions[t]);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t off = t * token_stride + h * head_stride;
        rotate_head(y + off, x + off, c.data(), s.data(), half, layout);
      }
    }
  });
}

}  // namespace

void rope_frequencies(float* freqs, const RopeConfig& cfg) {
  const int64_t dim = cfg.dim;
  DS_CHECK(dim > 0 && dim % 2 == 0, "rope: rotary dim must be positive and even, got {}", dim);
  DS_CHECK(cfg.theta > 1.0, "rope: theta must exceed 1, got {}", cfg.theta);
  DS_CHECK(cfg.factor > 0.0, "rope: YaRN factor must be positive, got {}", cfg.factor);
  DS_CHECK(cfg.original_max_position > 0 && cfg.beta_fast > 0.0 && cfg.beta_slow > 0.0,
           "rope: original_max_position={} beta_fast={} beta_slow={} must be positive", cfg.original_max_position,
           cfg.beta_fast, cfg.beta_slow);
  const int64_t half = dim / 2;
  const double two_pi = 2.0 * std::numbers::pi, log_theta = std::log(cfg.theta);
  const double orig = static_cast<double>(cfg.original_max_position);
  // Pair index range over which the wavelength crosses from beta_fast to
  // beta_slow rotations per original context: pairs below `low` keep their
  // frequency (high-frequency, local), pairs from `high` on are divided by the
  // factor (interpolated), with a linear ramp between.
  const double low = std::max(std::floor(dim * std::log(orig / (cfg.beta_fast * two_pi)) / (2 * log_theta)), 0.0);
  const double high =
      std::min(std::ceil(dim * std::log(orig / (cfg.beta_slow * two_pi)) / (2 * log_theta)), double(dim - 1));
  const double span = high > low ? high - low : 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double base = 1.0 / std::pow(cfg.theta, 2.0 * static_cast<double>(i) / static_cast<double>(dim));
    double f = base;
    // factor == 1 is plain RoPE; skipping the blend keeps base bit-exact.
    if (cfg.factor != 1.0) {
      const double smooth = 1.0 - std::clamp((static_cast<double>(i) - low) / span, 0.0, 1.0);
      f = base / cfg.factor * (1.0 - smooth) + base * smooth;
    }
    freqs[i] = static_cast<float>(f);
  }
}

void rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens, int64_t heads,
                  int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  rope_apply(y, x, positions, freqs, tokens, heads, dim, token_stride, head_stride, layout, 1.0f, "rope_forward");
}

// dx = R(angle)^T dy = R(-angle) dy: the same rotation with sin negated.
void rope_backward(float* dx, const float* dy, const int32_t* positions, const float* freqs, int64_t tokens,
                   int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  rope_apply(dx, dy, positions, freqs, tokens, heads, dim, token_stride, head_stride, layout, -1.0f, "rope_backward");
}

}  // namespace ds::ops
