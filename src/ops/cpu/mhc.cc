// mHC (ops/mhc.h): the mixes of all tokens are one product with fn (and
// their weight gradient one product over the tokens), so the results do not
// depend on the thread count; the rest is a few dozen numbers per token,
// computed per token in a fixed order.
#include "ops/mhc.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/matmul.h"

// The Sinkhorn normalizations run a vector of tokens at a time, one token per
// lane (Highway, dispatched at run time, core/simd.h): each lane does its
// token's sums, products and divisions in the order of the scalar loops, and
// the file is compiled without contraction into fused multiply-adds
// (CMakeLists.txt), so every target gives the scalar code's bits.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "ops/cpu/mhc.cc"
#include <hwy/foreach_target.h>  // must come before highway.h
#include <hwy/highway.h>

HWY_BEFORE_NAMESPACE();
namespace ds::ops {
namespace HWY_NAMESPACE {
// Internal linkage, so that same-named kernels of other files do not collide.
namespace {
namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

// M [cnt, n n] (each token's softmax already taken) through `steps`
// normalizations, alternating columns and rows (columns first when
// first_cols), each dividing by (its sum + eps), or with `clip` by max(its
// sum, eps), in place; with states [cnt, steps + 1, n n], states[t][0] is
// the input and states[t][i + 1] the matrix after normalization i.
void SinkhornNormalize(float* M, int64_t cnt, int64_t n, int64_t steps, bool first_cols, bool clip, float eps,
                       float* states) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), nn = n * n;
  std::vector<float> buf(static_cast<size_t>(nn * N));  // [nn][lanes]
  const VF veps = hn::Set(d, eps);
  for (int64_t t0 = 0; t0 < cnt; t0 += N) {
    const int64_t lanes = std::min(N, cnt - t0);
    // Lanes past the last token repeat it; their results are dropped.
    for (int64_t i = 0; i < nn; ++i)
      for (int64_t k = 0; k < N; ++k) buf[static_cast<size_t>(i * N + k)] = M[(t0 + std::min(k, lanes - 1)) * nn + i];
    if (states)
      for (int64_t k = 0; k < lanes; ++k)
        std::copy(M + (t0 + k) * nn, M + (t0 + k + 1) * nn, states + (t0 + k) * (steps + 1) * nn);
    for (int64_t step = 0; step < steps; ++step) {
      const bool cols = (step % 2 == 0) == first_cols;
      for (int64_t a = 0; a < n; ++a) {
        VF sum = hn::Zero(d);
        for (int64_t b = 0; b < n; ++b)
          sum = hn::Add(sum, hn::LoadU(d, buf.data() + (cols ? b * n + a : a * n + b) * N));
        const VF den = clip ? hn::Max(sum, veps) : hn::Add(sum, veps);
        for (int64_t b = 0; b < n; ++b) {
          float* v = buf.data() + (cols ? b * n + a : a * n + b) * N;
          hn::StoreU(hn::Div(hn::LoadU(d, v), den), d, v);
        }
      }
      if (states)
        for (int64_t k = 0; k < lanes; ++k)
          for (int64_t i = 0; i < nn; ++i)
            states[((t0 + k) * (steps + 1) + step + 1) * nn + i] = buf[static_cast<size_t>(i * N + k)];
    }
    for (int64_t k = 0; k < lanes; ++k)
      for (int64_t i = 0; i < nn; ++i) M[(t0 + k) * nn + i] = buf[static_cast<size_t>(i * N + k)];
  }
}

// The normalizations' backward, in reverse: g [cnt, n n] holds dcomb on entry
// and the gradient of the normalizations' input on return; states as
// SinkhornNormalize leaves them. A clipped sum (below eps) is a constant.
void SinkhornNormalizeBackward(float* g, const float* states, int64_t cnt, int64_t n, int64_t steps, bool first_cols,
                               bool clip, float eps) {
  const DF d;
  const int64_t N = static_cast<int64_t>(hn::Lanes(d)), nn = n * n;
  std::vector<float> gb(static_cast<size_t>(nn * N)), in(gb.size());
  const VF veps = hn::Set(d, eps);
  for (int64_t t0 = 0; t0 < cnt; t0 += N) {
    const int64_t lanes = std::min(N, cnt - t0);
    auto lane = [&](int64_t k) { return t0 + std::min(k, lanes - 1); };
    for (int64_t i = 0; i < nn; ++i)
      for (int64_t k = 0; k < N; ++k) gb[static_cast<size_t>(i * N + k)] = g[lane(k) * nn + i];
    for (int64_t step = steps - 1; step >= 0; --step) {
      const bool cols = (step % 2 == 0) == first_cols;
      for (int64_t i = 0; i < nn; ++i)  // the matrix this normalization divided
        for (int64_t k = 0; k < N; ++k)
          in[static_cast<size_t>(i * N + k)] = states[(lane(k) * (steps + 1) + step) * nn + i];
      for (int64_t a = 0; a < n; ++a) {
        VF sum = hn::Zero(d), dot = hn::Zero(d);
        for (int64_t b = 0; b < n; ++b) {
          const int64_t i = (cols ? b * n + a : a * n + b) * N;
          const VF x = hn::LoadU(d, in.data() + i);
          sum = hn::Add(sum, x);
          dot = hn::Add(dot, hn::Mul(hn::LoadU(d, gb.data() + i), x));
        }
        if (clip) {
          const auto kept = hn::Lt(sum, veps);
          const VF den = hn::Max(sum, veps);
          const VF den2 = hn::Mul(den, den);
          for (int64_t b = 0; b < n; ++b) {
            float* gi = gb.data() + (cols ? b * n + a : a * n + b) * N;
            const VF gv = hn::LoadU(d, gi);
            hn::StoreU(hn::IfThenElse(kept, hn::Div(gv, den), hn::Sub(hn::Div(gv, den), hn::Div(dot, den2))), d, gi);
          }
          continue;
        }
        const VF den = hn::Add(sum, veps);
        const VF den2 = hn::Mul(den, den);
        for (int64_t b = 0; b < n; ++b) {
          float* gi = gb.data() + (cols ? b * n + a : a * n + b) * N;
          hn::StoreU(hn::Sub(hn::Div(hn::LoadU(d, gi), den), hn::Div(dot, den2)), d, gi);
        }
      }
    }
    for (int64_t k = 0; k < lanes; ++k)
      for (int64_t i = 0; i < nn; ++i) g[(t0 + k) * nn + i] = gb[static_cast<size_t>(i * N + k)];
  }
}

}  // namespace
}  // namespace HWY_NAMESPACE
}  // namespace ds::ops
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "core/simd.h"

namespace ds::ops {

HWY_EXPORT(SinkhornNormalize);
HWY_EXPORT(SinkhornNormalizeBackward);

namespace {

void check_dims(const MhcDims& d) {
  DS_CHECK(d.tokens >= 0 && d.streams > 0 && d.dim > 0 && d.sinkhorn_iters >= 1,
           "mhc: tokens {} streams {} dim {} sinkhorn_iters {}", d.tokens, d.streams, d.dim, d.sinkhorn_iters);
}

float sigmoid(float z) { return 1.0f / (1.0f + std::exp(-z)); }

// mix [T, m] = (x fn^T) * s_t, s [T] = 1 / sqrt(mean(x_t^2) + norm_eps); raw
// [T, m] keeps x fn^T when given.
void mixes(float* mix, float* s, float* raw, const float* x, const float* fn, int64_t m, const MhcDims& d) {
  const int64_t T = d.tokens, nd = d.streams * d.dim;
  gemm(false, true, T, m, nd, 1.0f, x, nd, fn, nd, 0.0f, mix, m);
  parallel_ranges(T, T * nd >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = x + t * nd;
      double ss = 0;
      for (int64_t i = 0; i < nd; ++i) ss += static_cast<double>(v[i]) * v[i];
      s[t] = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(nd) + d.norm_eps));
      if (raw) std::copy(mix + t * m, mix + (t + 1) * m, raw + t * m);
      for (int64_t i = 0; i < m; ++i) mix[t * m + i] *= s[t];
    }
  });
}

// The gradient through mixes() given, per token, draw [T, m] (the mixes'
// gradient times s) and ds [T] (the gradient of s): dx += draw fn + (ds
// ds/dx), with ds/dx = -s^3 x / nd, and dfn += draw^T x.
void mixes_backward(float* dx, float* dfn, const float* draw, const float* ds, const float* s, const float* x,
                    const float* fn, int64_t m, const MhcDims& d) {
  const int64_t T = d.tokens, nd = d.streams * d.dim;
  parallel_ranges(T, T * nd >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float c = -ds[t] * s[t] * s[t] * s[t] / static_cast<float>(nd);
      for (int64_t i = 0; i < nd; ++i) dx[t * nd + i] += c * x[t * nd + i];
    }
  });
  gemm(false, false, T, nd, m, 1.0f, draw, m, fn, nd, 1.0f, dx, nd);
  if (dfn) gemm(true, false, m, nd, T, 1.0f, draw, m, x, nd, 1.0f, dfn, nd);
}

// The Sinkhorn projection of cnt n x n matrices M [cnt, n n] in place (the
// logits in, comb out): DeepSeek-V4's each row's softmax plus eps, MaxText
// v1's each column's softmax; then the normalizations. With states [cnt,
// steps + 1, n n]: the softmax, then the matrix after each normalization.
void sinkhorn(float* M, int64_t cnt, const MhcDims& d, float* states) {
  const int64_t n = d.streams;
  const bool rows_first = d.kind == MhcKind::DeepSeekV4;  // DeepSeek's: the softmax along rows
  const int64_t stride = rows_first ? 1 : n;              // along a row, or down a column
  const float add = rows_first ? d.eps : 0.0f;
  for (int64_t t = 0; t < cnt; ++t)
    for (int64_t j = 0; j < n; ++j) {
      float* r = M + t * n * n + (rows_first ? j * n : j);
      float mx = r[0];
      for (int64_t k = 1; k < n; ++k) mx = std::max(mx, r[k * stride]);
      float sum = 0;
      for (int64_t k = 0; k < n; ++k) sum += (r[k * stride] = std::exp(r[k * stride] - mx));
      for (int64_t k = 0; k < n; ++k) r[k * stride] = r[k * stride] / sum + add;
    }
  DS_DISPATCH(SinkhornNormalize)
  (M, cnt, n, d.sinkhorn_steps(), rows_first, !rows_first, rows_first ? d.eps : 1e-12f, states);
}

// dL [cnt, n n] (the logits' gradient, overwritten) from dcomb, through the
// normalizations in reverse and the softmax.
void sinkhorn_backward(float* dL, const float* dcomb, const float* states, int64_t cnt, const MhcDims& d) {
  const int64_t n = d.streams, nn = n * n, per = (d.sinkhorn_steps() + 1) * nn;
  const bool rows_first = d.kind == MhcKind::DeepSeekV4;  // DeepSeek's: the softmax along rows
  const int64_t stride = rows_first ? 1 : n;
  const float add = rows_first ? d.eps : 0.0f;
  std::copy(dcomb, dcomb + cnt * nn, dL);
  DS_DISPATCH(SinkhornNormalizeBackward)
  (dL, states, cnt, n, d.sinkhorn_steps(), rows_first, !rows_first, rows_first ? d.eps : 1e-12f);
  // states[t][0] = the softmax (plus eps): the softmax's own gradient.
  std::vector<float> g(static_cast<size_t>(nn));
  for (int64_t t = 0; t < cnt; ++t) {
    const float* s0 = states + t * per;
    float* dl = dL + t * nn;
    std::copy(dl, dl + nn, g.begin());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t at = rows_first ? j * n : j;
      float dot = 0;
      for (int64_t k = 0; k < n; ++k) dot += (s0[at + k * stride] - add) * g[static_cast<size_t>(at + k * stride)];
      for (int64_t k = 0; k < n; ++k)
        dl[at + k * stride] = (s0[at + k * stride] - add) * (g[static_cast<size_t>(at + k * stride)] - dot);
    }
  }
}

}  // namespace

void mhc_collapse(float* a, const float* x, const float* w, int64_t T, int64_t n, int64_t D) {
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* at = a + t * D;
      const float* xt = x + t * n * D;
      const float* wt = w + t * n;
      for (int64_t i = 0; i < D; ++i) {
        float acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += wt[j] * xt[j * D + i];
        at[i] = acc;
      }
    }
  });
}

void mhc_pre_forward(float* a, float* post, float* comb, const float* x, const float* fn, const float* base,
                     const float* scale, const MhcDims& d, float* pre_out) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim, m = d.mixes();
  if (T == 0) return;
  Buffer<float> mix(static_cast<size_t>(T * m)), s(static_cast<size_t>(T));
  mixes(mix.data(), s.data(), nullptr, x, fn, m, d);
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    std::vector<float> pre(n);
    for (int64_t t = t0; t < t1; ++t) {
      const float* z = mix.data() + t * m;
      float* c = comb + t * n * n;
      for (int64_t i = 0; i < n * n; ++i) c[i] = z[2 * n + i] * scale[2] + base[2 * n + i];
    }
    sinkhorn(comb + t0 * n * n, t1 - t0, d, nullptr);
    for (int64_t t = t0; t < t1; ++t) {
      const float* z = mix.data() + t * m;
      for (int64_t j = 0; j < n; ++j) {
        pre[j] = sigmoid(z[j] * scale[0] + base[j]) + d.pre_eps();
        post[t * n + j] = 2.0f * sigmoid(z[n + j] * scale[1] + base[n + j]);
      }
      if (pre_out) std::copy(pre.begin(), pre.end(), pre_out + t * n);
      if (!a) continue;
      float* at = a + t * D;
      const float* xt = x + t * n * D;
      for (int64_t i = 0; i < D; ++i) {
        float acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += pre[j] * xt[j * D + i];
        at[i] = acc;
      }
    }
  });
}

void mhc_collapse_backward(float* dx, float* dw, const float* da, const float* x, const float* w, int64_t T, int64_t n,
                           int64_t D) {
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* dat = da + t * D;
      for (int64_t j = 0; j < n; ++j) {
        const float* xj = x + (t * n + j) * D;
        float* dxj = dx + (t * n + j) * D;
        const float wj = w[t * n + j];
        float acc = 0;
        for (int64_t i = 0; i < D; ++i) {
          acc += xj[i] * dat[i];
          dxj[i] += wj * dat[i];
        }
        dw[t * n + j] = acc;
      }
    }
  });
}

void mhc_pre_backward(float* dx, float* dfn, float* dbase, float* dscale, const float* da, const float* dpost,
                      const float* dcomb, const float* x, const float* fn, const float* base, const float* scale,
                      const MhcDims& d, const float* dpre_in) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim, m = d.mixes(), nd = n * D;
  if (T == 0) return;
  Buffer<float> mix(static_cast<size_t>(T * m)), raw(static_cast<size_t>(T * m)), s(static_cast<size_t>(T));
  mixes(mix.data(), s.data(), raw.data(), x, fn, m, d);
  // Per token: dz (the gradient of mix) -> draw = dz s (for fn and x through
  // the product) and the norm's share of dx; dbase and dscale per token,
  // summed afterwards in token order.
  Buffer<float> draw(static_cast<size_t>(T * m)), dz_all(static_cast<size_t>(T * m)), ds_all(static_cast<size_t>(T));
  parallel_ranges(T, T * nd >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    // The comb logits' gradients of this range's tokens first, all at once.
    const int64_t nn = n * n, cnt = t1 - t0;
    std::vector<float> states(static_cast<size_t>(cnt * (d.sinkhorn_steps() + 1) * nn)),
        dL(static_cast<size_t>(cnt * nn)), logits(static_cast<size_t>(cnt * nn));
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t i = 0; i < nn; ++i)
        logits[static_cast<size_t>((t - t0) * nn + i)] = mix[t * m + 2 * n + i] * scale[2] + base[2 * n + i];
    sinkhorn(logits.data(), cnt, d, states.data());
    sinkhorn_backward(dL.data(), dcomb + t0 * nn, states.data(), cnt, d);
    for (int64_t t = t0; t < t1; ++t) {
      const float* z = mix.data() + t * m;
      const float* xt = x + t * nd;
      const float* dat = da ? da + t * D : nullptr;
      float* dz = dz_all.data() + t * m;
      for (int64_t j = 0; j < n; ++j) {
        float dpre = dpre_in ? dpre_in[t * n + j] : 0.0f;
        if (dat)
          for (int64_t i = 0; i < D; ++i) dpre += xt[j * D + i] * dat[i];
        const float sp = sigmoid(z[j] * scale[0] + base[j]);
        dz[j] = dpre * sp * (1.0f - sp);
        const float sq = sigmoid(z[n + j] * scale[1] + base[n + j]);
        dz[n + j] = dpost[t * n + j] * 2.0f * sq * (1.0f - sq);
      }
      std::copy(dL.begin() + (t - t0) * nn, dL.begin() + (t - t0 + 1) * nn, dz + 2 * n);
      // dz so far is d(logit); d(mix) = d(logit) scale_g.
      float ds = 0;
      for (int64_t i = 0; i < m; ++i) {
        const float g = dz[i] * scale[i < n ? 0 : i < 2 * n ? 1 : 2];
        draw[t * m + i] = g * s[t];
        ds += g * raw[t * m + i];
      }
      ds_all[t] = ds;
      // a = sum_j pre_j x_j.
      if (!dat) continue;
      float* dxt = dx + t * nd;
      for (int64_t j = 0; j < n; ++j) {
        const float pre = sigmoid(z[j] * scale[0] + base[j]) + d.pre_eps();
        for (int64_t i = 0; i < D; ++i) dxt[j * D + i] += pre * dat[i];
      }
    }
  });
  mixes_backward(dx, dfn, draw.data(), ds_all.data(), s.data(), x, fn, m, d);
  for (int64_t t = 0; t < T; ++t) {
    const float* dz = dz_all.data() + t * m;
    for (int64_t i = 0; i < m; ++i) {
      if (dbase) dbase[i] += dz[i];
      if (dscale) dscale[i < n ? 0 : i < 2 * n ? 1 : 2] += dz[i] * mix[t * m + i];
    }
  }
}

void mhc_post_forward(float* x_out, const float* o, const float* x, const float* post, const float* comb,
                      const MhcDims& d) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  DS_CHECK(x_out != x || T == 0, "mhc_post: the output must not alias the input streams");
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t k = 0; k < n; ++k) {
        float* y = x_out + (t * n + k) * D;
        const float* ot = o + t * D;
        const float pk = post[t * n + k];
        for (int64_t i = 0; i < D; ++i) y[i] = pk * ot[i];
        for (int64_t j = 0; j < n; ++j) {
          const float cjk = comb[(t * n + j) * n + k];
          const float* xj = x + (t * n + j) * D;
          for (int64_t i = 0; i < D; ++i) y[i] += cjk * xj[i];
        }
      }
  });
}

void mhc_post_backward(float* d_o, float* dx, float* dpost, float* dcomb, const float* dx_out, const float* o,
                       const float* x, const float* post, const float* comb, const MhcDims& d) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* ot = o + t * D;
      for (int64_t k = 0; k < n; ++k) {
        const float* g = dx_out + (t * n + k) * D;
        float dp = 0;
        for (int64_t i = 0; i < D; ++i) {
          d_o[t * D + i] += post[t * n + k] * g[i];
          dp += ot[i] * g[i];
        }
        dpost[t * n + k] += dp;
        for (int64_t j = 0; j < n; ++j) {
          const float* xj = x + (t * n + j) * D;
          float* dxj = dx + (t * n + j) * D;
          const float cjk = comb[(t * n + j) * n + k];
          float dc = 0;
          for (int64_t i = 0; i < D; ++i) {
            dxj[i] += cjk * g[i];
            dc += xj[i] * g[i];
          }
          dcomb[(t * n + j) * n + k] += dc;
        }
      }
    }
  });
}

void mhc_head_forward(float* y, const float* x, const float* fn, const float* base, const float* scale,
                      const MhcDims& d) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim;
  if (T == 0) return;
  Buffer<float> mix(static_cast<size_t>(T * n)), s(static_cast<size_t>(T));
  mixes(mix.data(), s.data(), nullptr, x, fn, n, d);
  parallel_ranges(T, T * n * D >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    std::vector<float> pre(n);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < n; ++j) pre[j] = sigmoid(mix[t * n + j] * scale[0] + base[j]) + d.eps;
      for (int64_t i = 0; i < D; ++i) {
        float acc = 0;
        for (int64_t j = 0; j < n; ++j) acc += pre[j] * x[(t * n + j) * D + i];
        y[t * D + i] = acc;
      }
    }
  });
}

void mhc_head_backward(float* dx, float* dfn, float* dbase, float* dscale, const float* dy, const float* x,
                       const float* fn, const float* base, const float* scale, const MhcDims& d) {
  check_dims(d);
  const int64_t T = d.tokens, n = d.streams, D = d.dim, nd = n * D;
  if (T == 0) return;
  Buffer<float> mix(static_cast<size_t>(T * n)), raw(static_cast<size_t>(T * n)), s(static_cast<size_t>(T));
  mixes(mix.data(), s.data(), raw.data(), x, fn, n, d);
  Buffer<float> draw(static_cast<size_t>(T * n)), dz_all(static_cast<size_t>(T * n)), ds_all(static_cast<size_t>(T));
  parallel_ranges(T, T * nd >= (int64_t{1} << 15), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* xt = x + t * nd;
      const float* dyt = dy + t * D;
      float* dxt = dx + t * nd;
      float* dz = dz_all.data() + t * n;
      float ds = 0;
      for (int64_t j = 0; j < n; ++j) {
        float dpre = 0;
        for (int64_t i = 0; i < D; ++i) dpre += xt[j * D + i] * dyt[i];
        const float sp = sigmoid(mix[t * n + j] * scale[0] + base[j]);
        dz[j] = dpre * sp * (1.0f - sp);
        draw[t * n + j] = dz[j] * scale[0] * s[t];
        ds += dz[j] * scale[0] * raw[t * n + j];
        for (int64_t i = 0; i < D; ++i) dxt[j * D + i] += (sp + d.eps) * dyt[i];
      }
      ds_all[t] = ds;
    }
  });
  mixes_backward(dx, dfn, draw.data(), ds_all.data(), s.data(), x, fn, n, d);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < n; ++j) {
      if (dbase) dbase[j] += dz_all[t * n + j];
      if (dscale) dscale[0] += dz_all[t * n + j] * mix[t * n + j];
    }
}

}  // namespace ds::ops
#endif  // HWY_ONCE
