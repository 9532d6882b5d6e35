// MLA attention over the latent cache; see ops/latent_attention.h.
//
// A call runs in four passes over all of its sequences' rows:
//   1. queries into the latent space: qc [R, H, Dq] with Dq = kvlp + rope,
//      per head [q_nope W_UK_h | q_pe] (the padding columns of q_lat are 0);
//   2. tasks of up to kTileQ query rows of one sequence (row j * H + h:
//      query j, head h) over its keys, a tile at a time: the keys transposed
//      ([c_kv | 0 | k_pe], the score kernel's layout), then scores, mask,
//      online softmax and P V, the values read from a copy at a padded
//      stride when several blocks of rows read them. They write lat [R, H,
//      kvlp] = softmax(s) c_kv. A decode step's long cache is split into
//      chunks of keys instead, each task writing a partial max, sum and
//      output;
//   3. the chunks' partials merged in chunk order;
//   4. out [R, H, vp] = lat W_UV_h^T per head, then copied to ctx.
// Passes 1 and 4 are the score kernel's product of rows by a row-major
// matrix, so each row's result is the same whatever rows share the call.
// Without the absorbed copy (LatentAttentionDims::kv_b), pass 1 widens
// W_UK_h from kv_b into that same layout (the same bits), and pass 4 is a
// linear layer over W_UV_h's rows in kv_b's dtype: the decode kernels
// stream them, a row of lat at a time in the same order for any rows.
// Key chunks depend on the sizes alone, never on the thread count; tiles of
// rows may (a row's result is the same bits in any tile).
#include "ops/latent_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/parallel.h"
#include "ops/backend.h"
#include "ops/block_quant.h"
#include "ops/cpu/attention_tiles.h"

namespace ds::ops {

namespace {

using tiles::kKeyLd;
using tiles::kTileK;
using tiles::round_up16;

constexpr int64_t kTileQ = 128;             // query rows per score tile
constexpr int64_t kChunkKeys = 4 * kTileK;  // keys per chunk, at least
constexpr int64_t kMaxChunks = 16;          // chunks per sequence, at most
constexpr int64_t kMinTileRows = 16;        // query rows per task, at least (unless fewer)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// Multiply-adds below which a pass runs on the calling thread: waking the
// others costs about as much.
constexpr int64_t kParallelWork = int64_t{1} << 18;
// The absorbed products (q_nope W_UK_h, lat W_UV_h^T) read a float32
// matrix per head for every row, so at decode, where few rows share them,
// they are bound by reading it: worth two threads from this many
// multiply-adds (a 64 KiB weight per row) on.
constexpr int64_t kParallelReadWork = int64_t{1} << 14;

// Sizes derived from the dimensions.
struct Shape {
  int64_t H, nope, rope, vd, kvl, kvlp, vp, Dq, ldv;
  explicit Shape(const LatentAttentionDims& d)
      : H(d.heads),
        nope(d.nope),
        rope(d.rope),
        vd(d.v_dim),
        kvl(d.kv_lora),
        kvlp(round_up16(d.kv_lora)),
        vp(round_up16(d.v_dim)),
        Dq(kvlp + d.rope),
        // Value rows 16 floats longer than the row: at a power-of-two stride
        // the rows the P V kernel walks down would share a few L1 sets.
        ldv(kvlp + 16) {}
  const float* w_uk(const float* absorbed, int64_t h) const { return absorbed + h * nope * kvlp; }
  const float* w_uv_t(const float* absorbed, int64_t h) const { return absorbed + H * nope * kvlp + h * kvl * vp; }
};

// W_UK_h [nope, kvlp] widened from kv_b into the calling thread's buffer,
// as absorb_kv_b lays it out (zero columns kvl..kvlp).
const float* widen_uk(const WeightView& kv_b, const Shape& g, int64_t h) {
  thread_local Buffer<float> rows, padded;
  const int64_t r0 = h * (g.nope + g.vd);
  if (rows.size() < static_cast<size_t>(g.nope * g.kvl)) rows.resize(static_cast<size_t>(g.nope * g.kvl));
  widen_rows(rows.data(), kv_b, r0, r0 + g.nope);
  if (g.kvl == g.kvlp) return rows.data();
  if (padded.size() < static_cast<size_t>(g.nope * g.kvlp)) padded.resize(static_cast<size_t>(g.nope * g.kvlp));
  for (int64_t i = 0; i < g.nope; ++i) {
    std::copy_n(rows.data() + i * g.kvl, g.kvl, padded.data() + i * g.kvlp);
    std::fill(padded.data() + i * g.kvlp + g.kvl, padded.data() + (i + 1) * g.kvlp, 0.0f);
  }
  return padded.data();
}

// out [R, vd] (rows ldo apart) = lat [R, kvl] (rows ldl apart) W_UV_h^T, W_UV_h
// the rows of kv_b after head h's W_UK_h, read in kv_b's dtype (reads_kv_b)
// by the decode kernels, at most kGemvRows rows of lat a call: each row's
// sums then run in the same order whatever rows share the call.
void uv_product(float* out, int64_t ldo, const float* lat, int64_t ldl, int64_t R, const WeightView& kv_b,
                const Shape& g, int64_t h) {
  constexpr int64_t kGemvRows = 8;
  const int64_t r0 = h * (g.nope + g.vd) + g.nope;
  const WeightView w = row_slice(kv_b, r0, r0 + g.vd);
  for (int64_t r = 0; r < R; r += kGemvRows)
    cpu::linear_forward(out + r * ldo, lat + r * ldl, w, std::min(kGemvRows, R - r), ldl, ldo, false);
}

void check_dims(const LatentAttentionDims& d, const char* what) {
  DS_CHECK(d.heads >= 1 && d.nope >= 0 && d.rope >= 0 && d.v_dim >= 1 && d.kv_lora >= 1,
           "{}: bad sizes heads={} nope={} rope={} v={} kv_lora={}", what, d.heads, d.nope, d.rope, d.v_dim, d.kv_lora);
  DS_CHECK(std::isfinite(d.scale), "{}: softmax scale must be finite, got {}", what, d.scale);
}

// One task: rows [r0, r1) of sequence sq (its queries at qc, Dq apart)
// against its keys [k0, k1), into m, l [r1 - r0] and o [r1 - r0, kvlp]
// (fresh: max -inf, sum 0, output 0 at the start). r1 - r0 <= kTileQ.
void attend(float* m, float* l, float* o, const float* qc, const LatentQueries& sq, int64_t r0, int64_t r1, int64_t k0,
            int64_t k1, const Shape& g, float scale) {
  const int64_t rows = r1 - r0;
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(o, o + rows * g.kvlp, 0.0f);
  // A transposed key tile, its values and a tile of scores.
  Buffer<float> scratch(static_cast<size_t>(g.Dq * kKeyLd + kTileK * g.ldv + kTileQ * kTileK));
  float* kt = scratch.data();
  float* vb = kt + g.Dq * kKeyLd;
  float* s = vb + kTileK * g.ldv;
  const float* ck[kTileK];
  const float* pk[kTileK];
  // One block of query rows reads each value once: it may read them where
  // they are when they are a whole number of vectors. More rows read them
  // again for each block, from a copy at the padded stride.
  const bool direct = !sq.keys && g.kvl == g.kvlp && rows <= tiles::block_rows();
  for (int64_t j0 = k0; j0 < k1; j0 += kTileK) {
    const int64_t nk = std::min(kTileK, k1 - j0), width = round_up16(nk);
    // Row j H + h sees tokens [0, past + j + 1): the rows before query
    // j0 - past see none of this tile.
    const int64_t first = sq.keys ? r0 : std::clamp<int64_t>((j0 - sq.past) * g.H, r0, r1);
    if (first == r1) break;
    for (int64_t t = 0; t < nk; ++t) {
      const int64_t token = sq.keys ? sq.keys[j0 + t] : j0 + t;
      ck[t] = sq.c_kv + token * g.kvl;
      pk[t] = sq.k_pe + token * g.rope;
      if (direct) continue;
      float* v = vb + t * g.ldv;
      std::memcpy(v, ck[t], static_cast<size_t>(g.kvl) * sizeof(float));
      std::fill(v + g.kvl, v + g.kvlp, 0.0f);
    }
    const float* values = direct ? ck[0] : vb;
    const int64_t ldv = direct ? g.kvl : g.ldv;
    tiles::gather_keys(kt, kKeyLd, width, ck, nk, g.kvl);
    for (int64_t c = g.kvl; c < g.kvlp; ++c) std::fill(kt + c * kKeyLd, kt + c * kKeyLd + width, 0.0f);
    if (g.rope > 0) tiles::gather_keys(kt + g.kvlp * kKeyLd, kKeyLd, width, pk, nk, g.rope);
    const int64_t n = r1 - first, i = first - r0;
    tiles::score_tile(s, kTileK, qc + first * g.Dq, g.Dq, kt, kKeyLd, n, nk, nk, g.Dq, scale);
    for (int64_t r = 0; r < n; ++r) {
      const int64_t allowed = sq.keys ? nk : std::clamp<int64_t>(sq.past + (first + r) / g.H + 1 - j0, 0, nk);
      std::fill(s + r * kTileK + allowed, s + r * kTileK + width, kNegInf);
    }
    tiles::fold_rows(s, kTileK, n, width, m + i, l + i, o + i * g.kvlp, g.kvlp);
    tiles::value_tile(o + i * g.kvlp, g.kvlp, s, kTileK, values, ldv, n, nk, nk, g.kvlp);
  }
}

// A task of pass 2: rows [r0, r1) of sequence seq against keys [k0, k1);
// part: where its partial results go, when the sequence has several.
struct Task {
  int64_t seq, r0, r1, k0, k1, part;
};

}  // namespace

bool reads_kv_b(const WeightView& kv_b, const LatentAttentionDims& d) {
  if (kv_b.dtype == DType::BF16 || is_block_format(kv_b.dtype)) return true;
  if (kv_b.dtype != DType::F8E4M3) return false;
  // Each head's W_UV_h rows start at h (nope + v) + nope: a row slice must
  // start on a scale block.
  return kv_b.scale_inv && kv_b.block_rows > 0 && d.nope % kv_b.block_rows == 0 &&
         (d.nope + d.v_dim) % kv_b.block_rows == 0;
}

size_t absorbed_kv_b_bytes(const LatentAttentionDims& d) {
  check_dims(d, "absorbed_kv_b_bytes");
  const Shape g(d);
  return static_cast<size_t>(g.H * (g.nope * g.kvlp + g.kvl * g.vp)) * sizeof(float);
}

std::vector<float> absorb_kv_b(const WeightView& kv_b, const LatentAttentionDims& d) {
  check_dims(d, "absorb_kv_b");
  const Shape g(d);
  DS_CHECK(kv_b.rows == g.H * (g.nope + g.vd) && kv_b.cols == g.kvl, "absorb_kv_b: kv_b is [{}, {}], expected [{}, {}]",
           kv_b.rows, kv_b.cols, g.H * (g.nope + g.vd), g.kvl);
  std::vector<float> out(static_cast<size_t>(g.H * (g.nope * g.kvlp + g.kvl * g.vp)), 0.0f);
  // A head at a time on each thread (DeepSeek-V3: 128 heads, 64 MiB a
  // layer, made at the first decode step).
  parallel_tasks(g.H, g.H * (g.nope + g.vd) * g.kvl >= kParallelWork, [&](int64_t h) {
    Buffer<float> rows(static_cast<size_t>((g.nope + g.vd) * g.kvl));
    widen_rows(rows.data(), kv_b, h * (g.nope + g.vd), (h + 1) * (g.nope + g.vd));
    float* uk = out.data() + h * g.nope * g.kvlp;
    for (int64_t i = 0; i < g.nope; ++i) std::copy_n(rows.data() + i * g.kvl, g.kvl, uk + i * g.kvlp);
    float* uv = out.data() + g.H * g.nope * g.kvlp + h * g.kvl * g.vp;
    for (int64_t i = 0; i < g.vd; ++i)
      for (int64_t c = 0; c < g.kvl; ++c) uv[c * g.vp + i] = rows[(g.nope + i) * g.kvl + c];
  });
  return out;
}

void cpu::latent_attention_forward(const LatentQueries* seqs, int64_t count, int64_t ldq, int64_t ldc,
                                   const float* absorbed, const LatentAttentionDims& d) {
  check_dims(d, "latent_attention");
  const Shape g(d);
  const int64_t H = g.H, qk = g.nope + g.rope;
  DS_CHECK(count >= 0 && ldq >= H * qk && ldc >= H * g.vd, "latent_attention: row strides ldq={} ldc={} too small", ldq,
           ldc);
  DS_CHECK(
      absorbed || (d.kv_b && d.kv_b->rows == H * (g.nope + g.vd) && d.kv_b->cols == g.kvl && reads_kv_b(*d.kv_b, d)),
      "latent_attention: no absorbed projections, and kv_b is {} (expected a [{}, {}] weight reads_kv_b takes)",
      d.kv_b ? fmt::format("{} [{}, {}]", dtype_name(d.kv_b->dtype), d.kv_b->rows, d.kv_b->cols)
             : std::string("missing"),
      H * (g.nope + g.vd), g.kvl);
  if (count == 0) return;
  // Token rows before each sequence, and the tasks of pass 2. A dense
  // sequence of at most one tile of rows (a decode step) over a long cache
  // has its keys split into chunks, at least kChunkKeys keys and at most
  // kMaxChunks chunks, whose partial results are merged: their size depends
  // on the sizes, never on the threads. Sparse queries (at most index_topk
  // keys each, and a prefill's many) and sequences of more rows go in tiles
  // of rows over all of their keys, smaller tiles when there are too few to
  // share among the threads: a row's result is the same bits in any tile.
  std::vector<int64_t> base(static_cast<size_t>(count) + 1, 0);
  int64_t work = 0, whole_rows = 0;
  for (int64_t i = 0; i < count; ++i) {
    const LatentQueries& sq = seqs[i];
    DS_CHECK(sq.n >= 1 && sq.past >= 0 && (!sq.keys || sq.n == 1),
             "latent_attention: sequence {}: bad sizes n={} past={}{}", i, sq.n, sq.past,
             sq.keys ? " (sparse queries come one at a time)" : "");
    DS_CHECK(sq.q && sq.ctx && sq.c_kv && (sq.k_pe || g.rope == 0), "latent_attention: sequence {}: null pointer", i);
    base[i + 1] = base[i] + sq.n;
    work += sq.n * H * (sq.past + (sq.keys ? 1 : sq.n)) * (g.Dq + g.kvlp);
  }
  auto chunked = [&](const LatentQueries& sq) { return !sq.keys && sq.n * H <= kTileQ && sq.past + sq.n > kChunkKeys; };
  for (int64_t i = 0; i < count; ++i)
    if (!chunked(seqs[i])) whole_rows += seqs[i].n * H;
  int64_t tile_rows = kTileQ;
  while (tile_rows > kMinTileRows && whole_rows > 0 && whole_rows / tile_rows < 2 * num_threads()) tile_rows /= 2;
  std::vector<Task> tasks;
  int64_t part_size = 0;
  for (int64_t i = 0; i < count; ++i) {
    const LatentQueries& sq = seqs[i];
    const int64_t Rs = sq.n * H, T = sq.past + (sq.keys ? 1 : sq.n);
    if (!chunked(sq)) {
      for (int64_t r0 = 0; r0 < Rs; r0 += tile_rows) tasks.push_back({i, r0, std::min(Rs, r0 + tile_rows), 0, T, -1});
      continue;
    }
    const int64_t chunk = std::max(kChunkKeys, (T + kMaxChunks * kTileK - 1) / (kMaxChunks * kTileK) * kTileK);
    for (int64_t k0 = 0; k0 < T; k0 += chunk) {
      tasks.push_back({i, 0, Rs, k0, std::min(T, k0 + chunk), part_size});
      part_size += Rs * (g.kvlp + 2);
    }
  }
  const int64_t R = base[count], RH = R * H;
  // qin [R, H qk], qc [RH, Dq], lat [RH, kvlp], out [RH, vp].
  Buffer<float> qin(static_cast<size_t>(R * H * qk)), qc(static_cast<size_t>(RH * g.Dq)),
      lat(static_cast<size_t>(RH * g.kvlp)), out(static_cast<size_t>(RH * g.vp)), part(static_cast<size_t>(part_size));

  // 1. qc = [q_nope W_UK_h | q_pe] per head. (The score kernel is a plain
  // product of rows by a row-major matrix: here q_nope and W_UK_h.)
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < seqs[i].n; ++j)
      std::memcpy(qin.data() + (base[i] + j) * H * qk, seqs[i].q + j * ldq,
                  static_cast<size_t>(H * qk) * sizeof(float));
  parallel_tasks(H, RH * g.nope * g.kvl >= kParallelReadWork, [&](int64_t h) {
    const float* uk = absorbed ? g.w_uk(absorbed, h) : widen_uk(*d.kv_b, g, h);
    tiles::score_tile(qc.data() + h * g.Dq, H * g.Dq, qin.data() + h * qk, H * qk, uk, g.kvlp, R, g.kvlp, g.kvlp,
                      g.nope, 1.0f);
  });
  if (g.rope > 0)
    for (int64_t r = 0; r < RH; ++r)
      std::memcpy(qc.data() + r * g.Dq + g.kvlp, qin.data() + r * qk + g.nope,
                  static_cast<size_t>(g.rope) * sizeof(float));

  // 2. The tasks: lat of the rows of a task over all of its sequence's
  // keys, or a chunk's partial max, sum and output.
  parallel_tasks(static_cast<int64_t>(tasks.size()), work >= kParallelWork, [&](int64_t t) {
    const Task& k = tasks[static_cast<size_t>(t)];
    const LatentQueries& sq = seqs[k.seq];
    const int64_t rows = k.r1 - k.r0;
    const float* q = qc.data() + base[k.seq] * H * g.Dq;
    if (k.part >= 0) {
      float* m = part.data() + k.part;
      attend(m, m + rows, m + 2 * rows, q, sq, k.r0, k.r1, k.k0, k.k1, g, d.scale);
      return;
    }
    float m[kTileQ], l[kTileQ];
    float* o = lat.data() + (base[k.seq] * H + k.r0) * g.kvlp;
    attend(m, l, o, q, sq, k.r0, k.r1, k.k0, k.k1, g, d.scale);
    for (int64_t r = 0; r < rows; ++r) {  // every row sees a key: l >= 1
      const float w = 1.0f / l[r];
      for (int64_t c = 0; c < g.kvlp; ++c) o[r * g.kvlp + c] *= w;
    }
  });

  // 3. The chunks of a sequence merged in order: lat = sum_c w_c o_c with
  // w_c = exp(m_c - M) / sum_c l_c exp(m_c - M).
  for (size_t t0 = 0; t0 < tasks.size();) {
    size_t t1 = t0 + 1;
    while (t1 < tasks.size() && tasks[t1].seq == tasks[t0].seq) ++t1;
    if (tasks[t0].part < 0) {
      t0 = t1;
      continue;
    }
    const int64_t i = tasks[t0].seq, Rs = seqs[i].n * H;
    parallel_ranges(Rs, Rs * g.kvlp * static_cast<int64_t>(t1 - t0) >= kParallelWork, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float M = kNegInf;
        for (size_t t = t0; t < t1; ++t) M = std::max(M, part[static_cast<size_t>(tasks[t].part + r)]);
        float L = 0.0f;
        for (size_t t = t0; t < t1; ++t) {
          const float* pm = part.data() + tasks[t].part;
          if (pm[r] != kNegInf) L += pm[Rs + r] * std::exp(pm[r] - M);
        }
        float* dst = lat.data() + (base[i] * H + r) * g.kvlp;
        std::fill(dst, dst + g.kvlp, 0.0f);
        for (size_t t = t0; t < t1; ++t) {
          const float* pm = part.data() + tasks[t].part;
          if (pm[r] == kNegInf) continue;
          const float w = std::exp(pm[r] - M) / L;
          const float* o = pm + 2 * Rs + r * g.kvlp;
          for (int64_t c = 0; c < g.kvlp; ++c) dst[c] += w * o[c];
        }
      }
    });
    t0 = t1;
  }

  // 4. out = lat W_UV_h^T per head, then ctx.
  parallel_tasks(H, RH * g.kvl * g.vd >= kParallelReadWork, [&](int64_t h) {
    if (!absorbed)
      return uv_product(out.data() + h * g.vp, H * g.vp, lat.data() + h * g.kvlp, H * g.kvlp, R, *d.kv_b, g, h);
    tiles::score_tile(out.data() + h * g.vp, H * g.vp, lat.data() + h * g.kvlp, H * g.kvlp, g.w_uv_t(absorbed, h), g.vp,
                      R, g.vp, g.vp, g.kvl, 1.0f);
  });
  for (int64_t i = 0; i < count; ++i)
    for (int64_t j = 0; j < seqs[i].n; ++j)
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(seqs[i].ctx + j * ldc + h * g.vd, out.data() + ((base[i] + j) * H + h) * g.vp,
                    static_cast<size_t>(g.vd) * sizeof(float));
}

void latent_attention_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                              const float* k_pe, const float* absorbed, int64_t n, int64_t past,
                              const LatentAttentionDims& d) {
  LatentQueries sq;
  sq.q = q;
  sq.ctx = ctx;
  sq.c_kv = c_kv;
  sq.k_pe = k_pe;
  sq.n = n;
  sq.past = past;
  latent_attention_forward(&sq, 1, ldq, ldc, absorbed, d);
}

void latent_attention_sparse_forward(float* ctx, int64_t ldc, const float* q, int64_t ldq, const float* c_kv,
                                     const float* k_pe, const float* absorbed, int64_t n, const int32_t* idx, int64_t k,
                                     const LatentAttentionDims& d) {
  DS_CHECK(n >= 1 && k >= 1, "latent_attention_sparse: bad sizes n={} k={}", n, k);
  std::vector<LatentQueries> seqs(static_cast<size_t>(n));
  for (int64_t j = 0; j < n; ++j) {
    LatentQueries& sq = seqs[static_cast<size_t>(j)];
    sq.q = q + j * ldq;
    sq.ctx = ctx + j * ldc;
    sq.c_kv = c_kv;
    sq.k_pe = k_pe;
    sq.past = k - 1;
    sq.keys = idx + j * k;
  }
  latent_attention_forward(seqs.data(), n, ldq, ldc, absorbed, d);
}

void causal_softmax_rows(float* S, int64_t rows, int64_t n, int64_t past, int64_t T) {
  for (int64_t r = 0; r < rows; ++r) {
    float* row = S + r * T;
    const int64_t visible = past + r % n + 1;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < visible; ++t) mx = std::max(mx, row[t]);
    double z = 0;
    for (int64_t t = 0; t < visible; ++t) {
      row[t] = std::exp(row[t] - mx);
      z += row[t];
    }
    const float inv = static_cast<float>(1.0 / z);
    for (int64_t t = 0; t < visible; ++t) row[t] *= inv;
    for (int64_t t = visible; t < T; ++t) row[t] = 0.0f;
  }
}

}  // namespace ds::ops
