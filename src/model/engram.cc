#include "model/engram.h"

#include <cmath>
#include <cstring>

#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "core/system.h"
#include "model/weights.h"

namespace ds::model {

EngramDims engram_dims(const ModelConfig& c) {
  EngramDims d;
  d.streams = c.mhc_expansion_rate;
  d.dim = c.hidden_size;
  d.columns = c.engram_columns();
  d.head_dim = c.engram_head_dim;
  d.kernel = c.engram_kernel_size;
  d.dilation = c.engram_max_ngram_size;
  d.eps = static_cast<float>(c.rms_norm_eps);
  return d;
}

namespace {

// rstd of x [n] with eps inside the root.
float rstd_of(const float* x, int64_t n, float eps) {
  double ss = 0;
  for (int64_t j = 0; j < n; ++j) ss += static_cast<double>(x[j]) * x[j];
  return static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(n) + eps));
}

// dx = r (g - x r^2 mean(g x)) for y = x r w, g = dy w (dx `=`).
void rms_backward_row(float* dx, const float* dy, const float* x, const float* w, float r, int64_t n) {
  double dot = 0;
  for (int64_t j = 0; j < n; ++j) dot += static_cast<double>(dy[j]) * w[j] * x[j];
  const float c = static_cast<float>(dot / static_cast<double>(n)) * r * r;
  for (int64_t j = 0; j < n; ++j) dx[j] = r * (dy[j] * w[j] - x[j] * c);
}

// A small weight widened to float32 (vectors are float32 views already).
std::vector<float> widened(const ops::WeightView& w) {
  std::vector<float> out(static_cast<size_t>(w.rows * w.cols));
  ops::widen_rows(out.data(), w, 0, w.rows);
  return out;
}

float silu(float y) { return y / (1.0f + std::exp(-y)); }
float sigmoid(float y) { return 1.0f / (1.0f + std::exp(-y)); }

// The conv input row `back` taps before row i of segment sg (null: before
// the sequence, zero).
const float* conv_row(const float* n, const EngramSegment& sg, int64_t i, int64_t back, const EngramDims& d) {
  const int64_t t = i - back;
  if (t >= 0) return n + (sg.row0 + t) * d.width();
  if (sg.history && t >= -d.history()) return sg.history + (d.history() + t) * d.width();
  return nullptr;
}

void check_segments(const std::vector<EngramSegment>& segs, int64_t T) {
  int64_t covered = 0;
  for (const auto& s : segs) {
    DS_CHECK(s.row0 == covered && s.count >= 0, "internal: Engram segments must tile the rows in order");
    covered += s.count;
  }
  DS_CHECK(covered == T, "internal: Engram segments cover {} of {} rows", covered, T);
}

}  // namespace

void engram_forward(float* x, const int32_t* ids, const EngramParams<ops::WeightView>& p, const EngramDims& d,
                    const std::vector<EngramSegment>& segs, int64_t T, EngramActs* acts) {
  check_segments(segs, T);
  if (T == 0) return;
  const int64_t G = d.streams, D = d.dim, W = d.width(), C = d.columns, Dh = d.head_dim, E = C * Dh;
  EngramActs local;
  EngramActs& A = acts ? *acts : local;
  A.xn.resize(T * W);
  A.x_rstd.resize(T * G);
  A.e.resize(T * E);
  A.kappa.resize(T * W);
  A.k_rstd.resize(T * G);
  A.q_rstd.resize(T * G);
  A.a.resize(T * G);
  A.alpha.resize(T * G);
  A.v.resize(T * D);
  A.u.resize(T * W);
  A.n.resize(T * W);
  A.n_rstd.resize(T * G);
  A.y.resize(T * W);
  const float* g_in = vector_data(p.norm);
  const float* gq = vector_data(p.q_norm);
  const float* gk = vector_data(p.k_norm);
  const float* gc = vector_data(p.conv_norm);
  const float* bk = vector_data(p.key_bias);
  const float* bv = vector_data(p.value_bias);
  const std::vector<float> w = widened(p.conv);  // [K, W]
  const int64_t rows = p.table.rows;
  // The rows looked up (checked first: nothing may throw inside the threads).
  for (int64_t i = 0; i < T * C; ++i)
    DS_CHECK(ids[i] >= 0 && ids[i] < rows, "internal: Engram row {} outside the table of {}", ids[i], rows);
  // A table stays on disk: its rows' pages are read ahead together before
  // the gather faults on them one by one.
  if (T * C > 1) {
    const size_t row_bytes = static_cast<size_t>(Dh) * dtype_size(p.table.dtype);
    std::vector<std::pair<const void*, size_t>> rows_read;
    rows_read.reserve(static_cast<size_t>(T * C));
    for (int64_t i = 0; i < T * C; ++i)
      rows_read.emplace_back(static_cast<const char*>(p.table.data) + static_cast<size_t>(ids[i]) * row_bytes,
                             row_bytes);
    prefetch_pages(std::move(rows_read));
  }
  parallel_ranges(T, T * E >= (1 << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < C; ++c) {
        const int64_t id = ids[t * C + c];
        ops::widen_rows(A.e.data() + t * E + c * Dh, p.table, id, id + 1);
      }
  });
  ops::linear_forward(A.kappa.data(), A.e.data(), p.key, T);
  ops::linear_forward(A.v.data(), A.e.data(), p.value, T);
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  parallel_ranges(T, T * W >= (1 << 14), [&](int64_t t0, int64_t t1) {
    std::vector<float> qh(D);
    for (int64_t t = t0; t < t1; ++t) {
      float* v = A.v.data() + t * D;
      for (int64_t j = 0; j < D; ++j) v[j] += bv[j];
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = t * G + g, o = r * D;
        const float* xr = x + o;
        float* xn = A.xn.data() + o;
        const float rx = A.x_rstd[r] = rstd_of(xr, D, d.eps);
        for (int64_t j = 0; j < D; ++j) xn[j] = xr[j] * rx * g_in[j];
        const float rq = A.q_rstd[r] = rstd_of(xn, D, d.eps);
        for (int64_t j = 0; j < D; ++j) qh[j] = xn[j] * rq * gq[g * D + j];
        float* kap = A.kappa.data() + o;
        for (int64_t j = 0; j < D; ++j) kap[j] += bk[g * D + j];
        const float rk = A.k_rstd[r] = rstd_of(kap, D, d.eps);
        double dot = 0;
        for (int64_t j = 0; j < D; ++j) dot += static_cast<double>(qh[j]) * (kap[j] * rk * gk[g * D + j]);
        const float a = A.a[r] = static_cast<float>(dot) * inv_sqrt_d;
        const float s = a > 0 ? 1.0f : a < 0 ? -1.0f : 0.0f;
        const float alpha = A.alpha[r] = sigmoid(s * std::sqrt(std::max(std::fabs(a), 1e-6f)));
        float* u = A.u.data() + o;
        for (int64_t j = 0; j < D; ++j) u[j] = alpha * v[j];
        const float rn = A.n_rstd[r] = rstd_of(u, D, d.eps);
        float* n = A.n.data() + o;
        for (int64_t j = 0; j < D; ++j) n[j] = u[j] * rn * gc[g * D + j];
      }
    }
  });
  // The causal depthwise conv, within each sequence; then x += u + silu(y).
  for (const auto& sg : segs) {
    parallel_ranges(sg.count, sg.count * W >= (1 << 14), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        float* y = A.y.data() + (sg.row0 + i) * W;
        std::fill(y, y + W, 0.0f);
        for (int64_t r = 0; r < d.kernel; ++r) {
          const float* n = conv_row(A.n.data(), sg, i, (d.kernel - 1 - r) * d.dilation, d);
          if (!n) continue;
          const float* wr = w.data() + r * W;
          for (int64_t ch = 0; ch < W; ++ch) y[ch] += wr[ch] * n[ch];
        }
      }
    });
  }
  parallel_ranges(T, T * W >= (1 << 14), [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0 * W; i < t1 * W; ++i) x[i] += A.u[i] + silu(A.y[i]);
  });
}

void engram_backward(float* dx, EngramParams<float*>& g, const float* dy, const float* x_in, const int32_t* ids,
                     const EngramActs& A, const EngramParams<ops::WeightView>& p, const EngramDims& d,
                     const std::vector<EngramSegment>& segs, int64_t T) {
  check_segments(segs, T);
  if (T == 0) return;
  const int64_t G = d.streams, D = d.dim, W = d.width(), C = d.columns, Dh = d.head_dim, E = C * Dh;
  const float* g_in = vector_data(p.norm);
  const float* gq = vector_data(p.q_norm);
  const float* gk = vector_data(p.k_norm);
  const float* gc = vector_data(p.conv_norm);
  const std::vector<float> w = widened(p.conv);
  // dy_conv = dy silu'(y); the conv's transpose gives dn.
  Buffer<float> dyc(T * W), dn(T * W);
  for (int64_t i = 0; i < T * W; ++i) {
    const float s = sigmoid(A.y[i]);
    dyc[i] = dy[i] * s * (1.0f + A.y[i] * (1.0f - s));
  }
  std::fill(dn.begin(), dn.end(), 0.0f);
  for (const auto& sg : segs) {
    for (int64_t i = 0; i < sg.count; ++i) {
      const float* gy = dyc.data() + (sg.row0 + i) * W;
      for (int64_t r = 0; r < d.kernel; ++r) {
        const int64_t back = (d.kernel - 1 - r) * d.dilation;
        if (i - back < 0) continue;  // the history (generation only) takes no gradient
        float* dnr = dn.data() + (sg.row0 + i - back) * W;
        const float* wr = w.data() + r * W;
        for (int64_t ch = 0; ch < W; ++ch) dnr[ch] += wr[ch] * gy[ch];
      }
    }
    if (g.conv)
      for (int64_t r = 0; r < d.kernel; ++r) {
        const int64_t back = (d.kernel - 1 - r) * d.dilation;
        float* gw = g.conv + r * W;
        for (int64_t i = 0; i < sg.count; ++i) {
          const float* n = conv_row(A.n.data(), sg, i, back, d);
          if (!n) continue;
          const float* gy = dyc.data() + (sg.row0 + i) * W;
          for (int64_t ch = 0; ch < W; ++ch) gw[ch] += gy[ch] * n[ch];
        }
      }
  }
  // Per (token, stream): back through the conv's norm, the gate, the query
  // and key norms. dkappa [T, W], dv [T, D], dxi = the input norm's share of
  // dx; with scale gradients wanted, each row's terms of them [T, W] (input
  // norm, q_norm, k_norm, conv norm), summed below in token order.
  Buffer<float> dkappa(T * W), dv(T * D), dxi(T * W);
  const bool scales = g.norm || g.q_norm || g.k_norm || g.conv_norm;
  Buffer<float> t_in, t_q, t_k, t_c;
  if (scales) {
    t_in.resize(T * W);
    t_q.resize(T * W);
    t_k.resize(T * W);
    t_c.resize(T * W);
  }
  const float inv_sqrt_d = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  parallel_ranges(T, T * W >= (1 << 12), [&](int64_t t0, int64_t t1) {
    std::vector<float> du(D), qh(D), kh(D), dqh(D), dkh(D), dxn(D);
    for (int64_t t = t0; t < t1; ++t) {
      const float* v = A.v.data() + t * D;
      float* dvt = dv.data() + t * D;
      std::fill(dvt, dvt + D, 0.0f);
      for (int64_t gi = 0; gi < G; ++gi) {
        const int64_t r = t * G + gi, o = r * D;
        rms_backward_row(du.data(), dn.data() + o, A.u.data() + o, gc + gi * D, A.n_rstd[r], D);
        for (int64_t j = 0; j < D; ++j) du[j] += dy[o + j];
        const float alpha = A.alpha[r];
        double dalpha = 0;
        for (int64_t j = 0; j < D; ++j) {
          dalpha += static_cast<double>(du[j]) * v[j];
          dvt[j] += alpha * du[j];
        }
        const float a = A.a[r], fa = std::fabs(a);
        const float da =
            fa > 1e-6f ? static_cast<float>(dalpha) * alpha * (1.0f - alpha) / (2.0f * std::sqrt(fa)) : 0.0f;
        const float* xn = A.xn.data() + o;
        const float* kap = A.kappa.data() + o;
        const float rq = A.q_rstd[r], rk = A.k_rstd[r];
        for (int64_t j = 0; j < D; ++j) {
          qh[j] = xn[j] * rq * gq[gi * D + j];
          kh[j] = kap[j] * rk * gk[gi * D + j];
          dqh[j] = da * kh[j] * inv_sqrt_d;
          dkh[j] = da * qh[j] * inv_sqrt_d;
        }
        rms_backward_row(dxn.data(), dqh.data(), xn, gq + gi * D, rq, D);
        rms_backward_row(dkappa.data() + o, dkh.data(), kap, gk + gi * D, rk, D);
        rms_backward_row(dxi.data() + o, dxn.data(), x_in + o, g_in, A.x_rstd[r], D);
        if (scales)
          for (int64_t j = 0; j < D; ++j) {
            t_in[o + j] = dxn[j] * x_in[o + j] * A.x_rstd[r];
            t_q[o + j] = dqh[j] * xn[j] * rq;
            t_k[o + j] = dkh[j] * kap[j] * rk;
            t_c[o + j] = dn[o + j] * A.u[o + j] * A.n_rstd[r];
          }
      }
    }
  });
  if (scales)
    for (int64_t r = 0; r < T * G; ++r) {
      const int64_t o = r * D, s0 = (r % G) * D;  // the stream's scales
      for (int64_t j = 0; j < D; ++j) {
        if (g.norm) g.norm[j] += t_in[o + j];
        if (g.q_norm) g.q_norm[s0 + j] += t_q[o + j];
        if (g.k_norm) g.k_norm[s0 + j] += t_k[o + j];
        if (g.conv_norm) g.conv_norm[s0 + j] += t_c[o + j];
      }
    }
  // Biases, projections, and the table's rows.
  for (int64_t t = 0; t < T; ++t) {
    if (g.key_bias)
      for (int64_t i = 0; i < W; ++i) g.key_bias[i] += dkappa[t * W + i];
    if (g.value_bias)
      for (int64_t j = 0; j < D; ++j) g.value_bias[j] += dv[t * D + j];
  }
  Buffer<float> de(T * E);
  ops::linear_backward(de.data(), g.key, dkappa.data(), A.e.data(), p.key, T);
  ops::linear_backward(de.data(), g.value, dv.data(), A.e.data(), p.value, T, true);
  if (g.table)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t c = 0; c < C; ++c) {
        float* row = g.table + static_cast<int64_t>(ids[t * C + c]) * Dh;
        const float* src = de.data() + t * E + c * Dh;
        for (int64_t j = 0; j < Dh; ++j) row[j] += src[j];
      }
  for (int64_t i = 0; i < T * W; ++i) dx[i] += dxi[i];
}

}  // namespace ds::model
