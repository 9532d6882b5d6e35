#include "model/mhc_block.h"

#include <algorithm>
#include <vector>

#include "core/error.h"
#include "model/weights.h"

namespace ds::model {

namespace {

// fn as float32 [(2 + k) k, k d] (a loaded checkpoint may hold it in another dtype).
std::vector<float> fn_f32(const ops::WeightView& fn) {
  std::vector<float> w(static_cast<size_t>(fn.rows * fn.cols));
  ops::widen_rows(w.data(), fn, 0, fn.rows);
  return w;
}

}  // namespace

ops::MhcDims mhc_dims(const ModelConfig& c, int64_t N) {
  ops::MhcDims d;
  d.tokens = N;
  d.streams = c.mhc_expansion_rate;
  d.dim = c.hidden_size;
  d.sinkhorn_iters = c.mhc_sinkhorn_iterations;
  d.norm_eps = static_cast<float>(c.rms_norm_eps);  // MaxText's normalization_layer_epsilon
  d.kind = ops::MhcKind::MaxTextV1;
  return d;
}

void mhc_block_pre(MhcState& m, const float* x, const MhcParams<ops::WeightView>& p, const ModelConfig& c,
                   int64_t N) {
  const ops::MhcDims d = mhc_dims(c, N);
  const int64_t k = d.streams, kd = k * d.dim, mixes = d.mixes();
  DS_CHECK(p.fn.rows == mixes && p.fn.cols == kd, "internal: mHC fn is [{}, {}], expected [{}, {}]", p.fn.rows,
           p.fn.cols, mixes, kd);
  const std::vector<float> fn = fn_f32(p.fn);
  const float* gamma = vector_data(p.norm);
  m.fn.resize(mixes * kd);
  for (int64_t r = 0; r < mixes; ++r)
    for (int64_t i = 0; i < kd; ++i) m.fn[r * kd + i] = fn[r * kd + i] * gamma[i];
  m.a.resize(N * d.dim);
  m.post.resize(N * k);
  m.comb.resize(N * k * k);
  ops::mhc_pre_forward(m.a.data(), m.post.data(), m.comb.data(), x, m.fn.data(), vector_data(p.base),
                       vector_data(p.scale), d);
}

void mhc_block_post(float* y, const float* f, const float* x, const MhcState& m, const ModelConfig& c, int64_t N) {
  ops::mhc_post_forward(y, f, x, m.post.data(), m.comb.data(), mhc_dims(c, N));
}

void mhc_block_post_backward(float* df, float* dx, MhcGrad& g, const float* dy, const float* f, const float* x,
                             const MhcState& m, const ModelConfig& c, int64_t N) {
  const int64_t k = c.mhc_expansion_rate;
  std::fill(df, df + N * c.hidden_size, 0.0f);
  g.dpost.resize(N * k);
  g.dcomb.resize(N * k * k);
  std::fill(g.dpost.begin(), g.dpost.end(), 0.0f);
  std::fill(g.dcomb.begin(), g.dcomb.end(), 0.0f);
  ops::mhc_post_backward(df, dx, g.dpost.data(), g.dcomb.data(), dy, f, x, m.post.data(), m.comb.data(),
                         mhc_dims(c, N));
}

void mhc_block_pre_backward(float* dx, MhcParams<float*>& dw, const float* da, const MhcGrad& g, const float* x,
                            const MhcState& m, const MhcParams<ops::WeightView>& p, const ModelConfig& c,
                            int64_t N) {
  const ops::MhcDims d = mhc_dims(c, N);
  const int64_t kd = d.streams * d.dim, mixes = d.mixes();
  const bool weights = dw.fn || dw.norm;
  Buffer<float> dfn;  // d(fn with gamma folded in)
  if (weights) {
    dfn.resize(mixes * kd);
    std::fill(dfn.begin(), dfn.end(), 0.0f);
  }
  ops::mhc_pre_backward(dx, weights ? dfn.data() : nullptr, dw.base, dw.scale, da, g.dpost.data(), g.dcomb.data(), x,
                        m.fn.data(), vector_data(p.base), vector_data(p.scale), d);
  if (!weights) return;
  const std::vector<float> fn = fn_f32(p.fn);
  const float* gamma = vector_data(p.norm);
  if (dw.fn)
    for (int64_t r = 0; r < mixes; ++r)
      for (int64_t i = 0; i < kd; ++i) dw.fn[r * kd + i] += dfn[r * kd + i] * gamma[i];
  if (dw.norm)
    for (int64_t i = 0; i < kd; ++i) {
      double s = 0;  // over the mixes, in a fixed order
      for (int64_t r = 0; r < mixes; ++r) s += double(dfn[r * kd + i]) * fn[r * kd + i];
      dw.norm[i] += static_cast<float>(s);
    }
}

void mhc_expand(float* x, const float* h, int64_t N, int64_t k, int64_t d) {
  for (int64_t t = 0; t < N; ++t)
    for (int64_t i = 0; i < k; ++i) std::copy(h + t * d, h + (t + 1) * d, x + (t * k + i) * d);
}

void mhc_reduce(float* h, const float* x, int64_t N, int64_t k, int64_t d) {
  for (int64_t t = 0; t < N; ++t) {
    float* o = h + t * d;
    std::copy(x + t * k * d, x + t * k * d + d, o);
    for (int64_t i = 1; i < k; ++i)
      for (int64_t j = 0; j < d; ++j) o[j] += x[(t * k + i) * d + j];
  }
}

}  // namespace ds::model
