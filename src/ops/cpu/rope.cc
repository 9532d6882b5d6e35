// Rotary position embedding with YaRN frequencies (math and layouts: ops/rope.h).
//
// Forward rotates each pair by +angle, backward by -angle (the transpose of a
// rotation is its inverse), so both share one kernel that takes the sign of sin.
// cos and sin of each position come from a per-thread table (AngleTable) and
// are reused by every head and every call.
#include "ops/rope.h"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"
#include "core/parallel.h"
#include "ops/backend.h"

namespace ds::ops {
namespace {

// One head: y = R x over the dim/2 pairs, with c/s the per-pair cos and sin
// and sin_sign +1 or -1 (exact: the same bits as a negated table). y may
// equal x: each pair is read before it is written.
void rotate_head(float* y, const float* x, const float* c, const float* s, float sin_sign, int64_t half,
                 RopeLayout layout) {
  if (layout == RopeLayout::Interleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[2 * i], b = x[2 * i + 1], si = sin_sign * s[i];
      y[2 * i] = a * c[i] - b * si;
      y[2 * i + 1] = b * c[i] + a * si;
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i], b = x[i + half], si = sin_sign * s[i];
      y[i] = a * c[i] - b * si;
      y[i + half] = b * c[i] + a * si;
    }
  }
}

// cos and sin of pair i's angle at position p: the angle is rounded to
// float32 as the reference implementations do; cos and sin of that angle are
// then taken in double and rounded once.
void angles(float* c, float* s, const float* freqs, int64_t half, int32_t pos) {
  const float p = static_cast<float>(pos);
  for (int64_t i = 0; i < half; ++i) {
    const double angle = static_cast<double>(p * freqs[i]);
    c[i] = static_cast<float>(std::cos(angle));
    s[i] = static_cast<float>(std::sin(angle));
  }
}

// The angles of positions [0, positions) for one set of frequencies, kept by
// each thread between calls: every layer of a step (and a step's backward)
// rotates the same positions again, and cos and sin in double cost more than
// the rotations themselves (at a 128-token prefill of the `small` preset the
// calls ran on the main thread alone while the others waited; see
// docs/performance.md, "the main thread alone"). The table
// is filled by the same `angles` as a direct call, so the bits are the same.
// It grows to the largest position met, up to kTableFloats floats per array;
// positions past that are computed per call. A thread keeps a table for
// each of the last kTables sets of frequencies it met: DeepSeek-V4 rotates
// with two, alternating by layer, and rebuilding a table at every call
// would cost a decode step far more than the angles it saves.
struct AngleTable {
  std::vector<float> freqs;
  std::vector<float> cos, sin;  // [positions, half]
  int64_t positions = 0;
  uint64_t last_use = 0;
};
constexpr int64_t kTableFloats = int64_t{1} << 20;  // 4 MiB per array
constexpr int kTables = 4;

// The table covering positions [0, max_pos] for freqs [half], or null when
// it would outgrow kTableFloats.
const AngleTable* angle_table(const float* freqs, int64_t half, int32_t max_pos) {
  thread_local AngleTable mine[kTables];
  thread_local uint64_t clock = 0;
  const int64_t need = static_cast<int64_t>(max_pos) + 1;
  if (need * half > kTableFloats) return nullptr;
  auto same = [&](const AngleTable& t) {
    return static_cast<int64_t>(t.freqs.size()) == half && std::equal(freqs, freqs + half, t.freqs.begin());
  };
  AngleTable* found = std::find_if(mine, mine + kTables, same);
  if (found == mine + kTables) {  // a new set of frequencies takes the least recently used table
    found = std::min_element(mine, mine + kTables,
                             [](const AngleTable& a, const AngleTable& b) { return a.last_use < b.last_use; });
    found->freqs.assign(freqs, freqs + half);
    found->positions = 0;
  }
  AngleTable& table = *found;  // the workers below fill this thread's table, not their own
  table.last_use = ++clock;
  if (need > table.positions) {
    // Grow geometrically so that a decode adding one position a step fills
    // the table in few, large steps.
    const int64_t grown = std::min(std::max(need, 2 * table.positions), kTableFloats / half);
    table.cos.resize(static_cast<size_t>(grown * half));
    table.sin.resize(table.cos.size());
    const int64_t from = table.positions;
    parallel_ranges(grown - from, (grown - from) * half >= 512, [&](int64_t p0, int64_t p1) {
      for (int64_t p = from + p0; p < from + p1; ++p)
        angles(table.cos.data() + p * half, table.sin.data() + p * half, freqs, half, static_cast<int32_t>(p));
    });
    table.positions = grown;
  }
  return &table;
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
  const bool parallel = tokens * heads * dim >= (int64_t{1} << 14);
  int32_t max_pos = 0;
  for (int64_t t = 0; t < tokens; ++t) max_pos = std::max(max_pos, positions[t]);
  if (const AngleTable* table = angle_table(freqs, half, max_pos)) {
    parallel_ranges(tokens, parallel, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        const float* c = table->cos.data() + positions[t] * half;
        const float* s = table->sin.data() + positions[t] * half;
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t off = t * token_stride + h * head_stride;
          rotate_head(y + off, x + off, c, s, sin_sign, half, layout);
        }
      }
    });
    return;
  }
  parallel_ranges(tokens, parallel, [&](int64_t t0, int64_t t1) {
    std::vector<float> c(half), s(half);
    for (int64_t t = t0; t < t1; ++t) {
      angles(c.data(), s.data(), freqs, half, positions[t]);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t off = t * token_stride + h * head_stride;
        rotate_head(y + off, x + off, c.data(), s.data(), sin_sign, half, layout);
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

void cpu::rope_forward(float* y, const float* x, const int32_t* positions, const float* freqs, int64_t tokens,
                       int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  rope_apply(y, x, positions, freqs, tokens, heads, dim, token_stride, head_stride, layout, 1.0f, "rope_forward");
}

// dx = R(angle)^T dy = R(-angle) dy: the same rotation with sin negated.
void rope_backward(float* dx, const float* dy, const int32_t* positions, const float* freqs, int64_t tokens,
                   int64_t heads, int64_t dim, int64_t token_stride, int64_t head_stride, RopeLayout layout) {
  rope_apply(dx, dy, positions, freqs, tokens, heads, dim, token_stride, head_stride, layout, -1.0f, "rope_backward");
}

}  // namespace ds::ops
