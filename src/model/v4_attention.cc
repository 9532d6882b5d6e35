// DeepSeek-V4's attention (model/v4_model.h) as stages: the query (q-LoRA,
// its norm, the per-head norm, RoPE), the shared K=V latent, the
// compressors that pool closed windows into entries (CSA m = 4 with the
// indexer's keys, HCA m > 4), the indexer's choice of entries, the attention
// over the sliding window and the entries with the per-head sink, and the
// grouped low-rank output projection. Generation, a training forward and a
// remat rerun run the same stages; each fills only the residuals it finds
// missing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/v4_model.h"
#include "model/weights.h"
#include "ops/compressor.h"
#include "ops/fp8_quant.h"
#include "ops/indexer.h"
#include "ops/matmul.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sparse_attention.h"

namespace ds::model {

namespace {

// The first `rows` indexer keys of a state kept as codes, as a packed-fp4
// weight [rows, dim].
ops::WeightView key_codes(const V4LayerState& st, int64_t rows, int64_t dim) {
  ops::WeightView w;
  w.data = st.key_codes.data();
  w.dtype = DType::F4E2M1;
  w.rows = rows;
  w.cols = dim;
  w.scale_e8m0 = st.key_scales.data();
  return w;
}

// Unit weights for the per-head query norm, which has none.
const float* ones(int64_t n) {
  thread_local std::vector<float> v;
  if (static_cast<int64_t>(v.size()) < n) v.assign(static_cast<size_t>(n), 1.0f);
  return v.data();
}

// y = rmsnorm(lin) with its rstd: training keeps lin apart, inference
// normalises in place (lin's storage becomes y).
void normed(Buffer<float>& y, Buffer<float>& lin, Buffer<float>& rstd, const float* w, int64_t rows, int64_t dim,
            float eps, bool keep) {
  rstd.resize(static_cast<size_t>(rows));
  if (keep) {
    y.resize(lin.size());
    ops::rmsnorm_forward(y.data(), rstd.data(), lin.data(), w, rows, dim, eps);
  } else {
    ops::rmsnorm_forward(lin.data(), rstd.data(), lin.data(), w, rows, dim, eps);
    y = std::move(lin);
  }
}

}  // namespace

int64_t v4_carry_start(int64_t tokens, int64_t ratio) {
  const int64_t open = tokens / ratio;  // the window being filled
  return (ratio == 4 ? std::max<int64_t>(open - 1, 0) : open) * ratio;
}

void V4Model::compress(V4LayerState& st, const float* a, const V4CompressorParams<ops::WeightView>& p, int64_t dim,
                       int64_t ratio, bool index_keys, int64_t p0, int64_t n, V4CompressorSaved* sv,
                       const std::pair<const float*, const float*>& proj,
                       const V4AttentionParams<ops::WeightView>* v41) {
  V4CompressorCarry& carry = index_keys ? st.index_carry : st.carry;
  const int64_t R = cfg_.qk_rope_head_dim, m = ratio;
  const bool overlap = m == 4;
  const int64_t width = (overlap ? 2 : 1) * dim;
  const int64_t old = static_cast<int64_t>(carry.P.size()) / width, start = carry.start;
  DS_CHECK(start + old == p0, "internal: compressor carry ends at {}, the new tokens start at {}", start + old, p0);
  const int64_t total = old + n;
  Buffer<float> P(static_cast<size_t>(total * width)), Z(static_cast<size_t>(total * width));
  std::copy(carry.P.begin(), carry.P.end(), P.begin());
  std::copy(carry.Z.begin(), carry.Z.end(), Z.begin());
  // V4.1's ratio-1 compressor has no gate: one token's softmax weight is 1.
  const bool gated = p.wgate.data != nullptr;
  if (proj.first) {
    std::copy(proj.first, proj.first + n * width, P.begin() + old * width);
    if (gated) std::copy(proj.second, proj.second + n * width, Z.begin() + old * width);
  } else {
    ops::linear_forward(P.data() + old * width, a, p.wkv, n);
    if (gated) ops::linear_forward(Z.data() + old * width, a, p.wgate, n);
  }
  if (!gated) std::fill(Z.begin() + old * width, Z.end(), 0.0f);
  if (const float* ape = vector_data(p.ape))  // V4's position embedding (V4.1 has none)
    for (int64_t i = 0; i < n; ++i) {
      float* z = Z.data() + (old + i) * width;
      const float* e = ape + ((p0 + i) % m) * width;
      for (int64_t c = 0; c < width; ++c) z[c] += e[c];
    }
  // The buffer's first window was emitted before when it is complete (the
  // previous window an overlapping entry still reads).
  const int64_t skip = start / m < p0 / m ? 1 : 0;
  const ops::CompressorDims dims{total, dim, m, overlap};
  const int64_t windows = dims.entries();
  if (windows > skip) {
    Buffer<float> pooled(static_cast<size_t>(windows * dim));
    ops::compressor_pool_forward(pooled.data(), P.data(), Z.data(), dims);
    const int64_t k = windows - skip, b0 = start / m + skip;
    float* E = pooled.data() + skip * dim;
    Buffer<float> rstd(static_cast<size_t>(k));
    if (sv) sv->pooled.assign(E, E + k * dim);
    ops::rmsnorm_forward(E, rstd.data(), E, vector_data(p.norm), k, dim, static_cast<float>(cfg_.rms_norm_eps));
    if (sv) sv->rstd.assign(rstd.begin(), rstd.end());
    std::vector<int32_t> pos(static_cast<size_t>(k));
    for (int64_t b = 0; b < k; ++b) pos[static_cast<size_t>(b)] = static_cast<int32_t>((b0 + b) * m);
    if (v41) v41_index_keys(st, E, *v41, pos.data(), k);  // from the entries before their RoPE
    ops::rope_forward(E + dim - R, E + dim - R, pos.data(), freqs_compressed_.data(), k, 1, R, dim, dim,
                      ops::RopeLayout::Interleaved);
    if (index_keys) ops::hadamard_rows(E, k, dim);
    if (v41 && opt_.qat) {  // V4.1: fp4 in groups of 16 with e4m3 scales, kept as codes
      const size_t c0 = st.entry_fp4.size(), s0 = st.entry_fp4_scales.size();
      st.entry_fp4.resize(c0 + static_cast<size_t>(k * dim / 2));
      st.entry_fp4_scales.resize(s0 + static_cast<size_t>(k * dim / kV41EntryFp4Block));
      ops::fp4_encode_blocks_e4m3(st.entry_fp4.data() + c0, st.entry_fp4_scales.data() + s0, E, k * dim,
                                  kV41EntryFp4Block);
    } else if (!opt_.qat) {  // float32 rows (V4.1's entries too)
      auto& rows = index_keys ? st.index_keys : st.entries;
      rows.insert(rows.end(), E, E + k * dim);
    } else if (index_keys) {  // fp4 in blocks of 32, kept as codes
      store_key_codes(st, E, k * dim);
    } else {  // the non-rope dims to fp8 in blocks of 64, kept as codes; the rope dims as they are
      const int64_t N = dim - R;
      for (int64_t b = 0; b < k; ++b) {
        const size_t c0 = st.entry_codes.size(), s0 = st.entry_scales.size();
        st.entry_codes.resize(c0 + static_cast<size_t>(N));
        st.entry_scales.resize(s0 + static_cast<size_t>(N / kV4LatentFp8Block));
        ops::fp8_encode_blocks(st.entry_codes.data() + c0, st.entry_scales.data() + s0, E + b * dim, N,
                               kV4LatentFp8Block);
        st.entry_rope.insert(st.entry_rope.end(), E + b * dim + N, E + (b + 1) * dim);
      }
    }
    if (!index_keys) st.count += k;
  }
  const int64_t keep = v4_carry_start(p0 + n, m);
  if (carry.hold) {  // a step that may be undone: the rows it drops are kept
    carry.held_P.insert(carry.held_P.end(), P.begin(), P.begin() + (keep - start) * width);
    carry.held_Z.insert(carry.held_Z.end(), Z.begin(), Z.begin() + (keep - start) * width);
  }
  carry.P.assign(P.begin() + (keep - start) * width, P.end());
  carry.Z.assign(Z.begin() + (keep - start) * width, Z.end());
  carry.start = keep;
  if (sv) {
    DS_CHECK(old == 0 && start == 0, "internal: a training forward starts every sequence afresh");
    sv->P = std::move(P);
    sv->Z = std::move(Z);
  }
}

void V4Model::store_key_codes(V4LayerState& st, const float* keys, int64_t count) const {
  const size_t c0 = st.key_codes.size(), s0 = st.key_scales.size();
  st.key_codes.resize(c0 + static_cast<size_t>(count / 2));
  st.key_scales.resize(s0 + static_cast<size_t>(count / kV4IndexFp4Block));
  ops::fp4_encode_blocks(st.key_codes.data() + c0, st.key_scales.data() + s0, keys, count, kV4IndexFp4Block);
}

void V4Model::v41_index_keys(V4LayerState& st, const float* E, const V4AttentionParams<ops::WeightView>& p,
                             const int32_t* pos, int64_t k) const {
  const int64_t Di = cfg_.index_head_dim, R = cfg_.qk_rope_head_dim;
  const ops::ScopedFloat32Products f32;
  Buffer<float> K(static_cast<size_t>(k * Di)), rstd(static_cast<size_t>(k));
  ops::linear_forward(K.data(), E, p.index_wk, k);
  ops::rmsnorm_forward(K.data(), rstd.data(), K.data(), vector_data(p.index_k_norm), k, Di,
                       static_cast<float>(cfg_.rms_norm_eps));
  ops::rope_forward(K.data() + Di - R, K.data() + Di - R, pos, freqs_compressed_.data(), k, 1, R, Di, Di,
                    ops::RopeLayout::Interleaved);
  if (opt_.qat)
    store_key_codes(st, K.data(), k * Di);
  else
    st.index_keys.insert(st.index_keys.end(), K.begin(), K.end());
}

void V4Model::attention(float* out, const float* a, int64_t layer, const std::vector<Segment>& segs,
                        const int32_t* positions, int64_t n, V4AttentionSaved* sv, V4PassContext* cx) {
  DS_CHECK(!sv || !opt_.qat, "internal: a training forward runs without the fp8/fp4 roundings");
  V4AttentionSaved own;
  V4AttentionSaved& S = sv ? *sv : own;
  const bool keep = sv != nullptr;
  query_stage(S, a, layer, positions, n, keep);
  kv_stage(S, a, layer, positions, n, keep);
  compress_stage(S, a, layer, segs, n, keep);
  std::vector<int32_t> seg_of(static_cast<size_t>(n));
  for (size_t k = 0; k < segs.size(); ++k)
    std::fill(seg_of.begin() + segs[k].row, seg_of.begin() + segs[k].row + segs[k].n, static_cast<int32_t>(k));
  const auto picked = index_stage(S.qr.data(), a, layer, segs, seg_of, positions, n, cx);
  attend_stage(S, layer, segs, seg_of, picked, positions, n, keep, cx);
  output_stage(out, S, layer, positions, n, keep);
}

void V4Model::query_stage(V4AttentionSaved& S, const float* a, int64_t layer, const int32_t* pos, int64_t n,
                          bool keep) const {
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t H = cfg_.num_attention_heads, D = cfg_.head_dim, R = cfg_.qk_rope_head_dim, Lq = cfg_.q_lora_rank;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  // q-LoRA (query_wa_proj), its norm (mla_q); per-head RMS normalisation and
  // RoPE on the tail (query_proj).
  if (S.qr_lin.empty() && (keep || S.qr.empty())) {
    S.qr_lin.resize(static_cast<size_t>(n * Lq));
    ops::linear_forward(S.qr_lin.data(), a, p.wq_a, n);
    to_activation_dtype(S.qr_lin.data(), n * Lq);
  }
  if (S.qr.empty()) {
    normed(S.qr, S.qr_lin, S.rstd_qr, vector_data(p.q_norm), n, Lq, eps, keep);
    to_activation_dtype(S.qr.data(), n * Lq);
  }
  if (!S.q.empty()) return;
  S.q_lin.resize(static_cast<size_t>(n * H * D));
  ops::linear_forward(S.q_lin.data(), S.qr.data(), p.wq_b, n);
  to_activation_dtype(S.q_lin.data(), n * H * D);
  if (cfg_.q_head_norm()) {
    normed(S.q, S.q_lin, S.rstd_q, ones(D), n * H, D, eps, keep);
  } else if (keep) {  // V4.1 has no per-head norm
    S.q = S.q_lin;
  } else {
    S.q = std::move(S.q_lin);
  }
  ops::rope_forward(S.q.data() + D - R, S.q.data() + D - R, pos, rope_frequencies(layer), n, H, R, H * D, D,
                    ops::RopeLayout::Interleaved);
  to_activation_dtype(S.q.data(), n * H * D);
}

void V4Model::kv_stage(V4AttentionSaved& S, const float* a, int64_t layer, const int32_t* pos, int64_t n,
                       bool keep) const {
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t D = cfg_.head_dim, R = cfg_.qk_rope_head_dim, N = D - R;
  // wkv (kv_wa_proj), kv_norm and RoPE (kv_proj); inference rounds the
  // non-rope dims to fp8 as DeepSeek's code does.
  if (S.kv_lin.empty() && (keep || S.kv.empty())) {
    S.kv_lin.resize(static_cast<size_t>(n * D));
    ops::linear_forward(S.kv_lin.data(), a, p.wkv, n);
    to_activation_dtype(S.kv_lin.data(), n * D);
  }
  if (!S.kv.empty()) return;
  normed(S.kv, S.kv_lin, S.rstd_kv, vector_data(p.kv_norm), n, D, static_cast<float>(cfg_.rms_norm_eps), keep);
  float* kv = S.kv.data();
  ops::rope_forward(kv + N, kv + N, pos, rope_frequencies(layer), n, 1, R, D, D, ops::RopeLayout::Interleaved);
  // V4 rounds the non-rope dims in blocks of 64, V4.1 the whole vector in blocks of 32.
  const int64_t rounded = cfg_.v41() ? D : N;
  if (opt_.qat)
    for (int64_t i = 0; i < n; ++i)
      ops::fp8_round_blocks(kv + i * D, kv + i * D, rounded, cfg_.window_fp8_block(), /*ue8m0=*/true);
  to_activation_dtype(kv, n * D);
}

void V4Model::compress_stage(V4AttentionSaved& S, const float* a, int64_t layer, const std::vector<Segment>& segs,
                             int64_t n, bool keep) {
  const int64_t m = cfg_.compress_ratio(layer);
  if (!cfg_.owns_compressor(layer)) return;
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t D = cfg_.head_dim, Di = cfg_.index_head_dim, d = cfg_.hidden_size;
  DS_CHECK(S.comp.empty(), "internal: layer {}'s compressors ran twice for one forward", layer);
  // With several sequences, the compressors' projections of every new row
  // in one product each (one small product per sequence costs more in
  // overhead than in arithmetic).
  const int64_t cw = (m == 4 ? 2 : 1) * D, iw = 2 * Di;
  Buffer<float> cP, cZ, iP, iZ;
  const bool batched = segs.size() > 1;
  if (batched) {
    cP.resize(static_cast<size_t>(n * cw));
    cZ.resize(cP.size());
    ops::linear_forward(cP.data(), a, p.compressor.wkv, n);
    if (p.compressor.wgate.data) ops::linear_forward(cZ.data(), a, p.compressor.wgate, n);
    if (m == 4) {
      iP.resize(static_cast<size_t>(n * iw));
      iZ.resize(iP.size());
      ops::linear_forward(iP.data(), a, p.index_compressor.wkv, n);
      ops::linear_forward(iZ.data(), a, p.index_compressor.wgate, n);
    }
  }
  for (const Segment& g : segs) {
    V4LayerState& st = g.state->layers[static_cast<size_t>(layer)];
    V4CompressorSaved* cs = keep ? &S.comp.emplace_back() : nullptr;
    auto rows_of = [&](const Buffer<float>& P, const Buffer<float>& Z, int64_t width) {
      return batched ? std::pair<const float*, const float*>{P.data() + g.row * width, Z.data() + g.row * width}
                     : std::pair<const float*, const float*>{nullptr, nullptr};
    };
    const int64_t before = st.count;
    compress(st, a + g.row * d, p.compressor, D, m, false, g.start, g.n, cs, rows_of(cP, cZ, cw),
             cfg_.v41() ? &p : nullptr);
    // The released code publishes an index source's keys when it made one.
    if (cfg_.v41() && cfg_.owns_indexer(layer) && st.count > before) g.state->published_keys = layer;
    if (m == 4)
      compress(st, a + g.row * d, p.index_compressor, Di, 4, true, g.start, g.n, nullptr, rows_of(iP, iZ, iw));
  }
}

std::vector<std::vector<int32_t>> V4Model::index_stage(const float* qr, const float* a, int64_t layer,
                                                       const std::vector<Segment>& segs,
                                                       const std::vector<int32_t>& seg_of, const int32_t* pos,
                                                       int64_t n, V4PassContext* cx) const {
  const int64_t m = cfg_.compress_ratio(layer);
  std::vector<std::vector<int32_t>> picked(static_cast<size_t>(n));
  if (m == 0) return picked;
  // The indexers stay float32 whatever the run's dtype and quantization (layer.cc).
  const ops::ScopedFloat32Products f32;
  if (cfg_.v41() && !cfg_.owns_indexer(layer)) {  // V4.1's readers reuse their index source's choice
    DS_CHECK(cx && cx->picked_layer == cfg_.index_source_of(layer),
             "internal: layer {} reads layer {}'s top-k, which this pass has not chosen", layer,
             cfg_.index_source_of(layer));
    return cx->picked;
  }
  if (!cfg_.sparse_entries(layer)) {  // HCA: every entry whose window is complete
    for (int64_t i = 0; i < n; ++i) {
      auto& pk = picked[static_cast<size_t>(i)];
      pk.resize(static_cast<size_t>((pos[i] + 1) / m));
      std::iota(pk.begin(), pk.end(), 0);
    }
    return picked;
  }
  // CSA: the lightning indexer's top index_topk (sum_h w_h relu(q_h . k_b)).
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t Hi = cfg_.index_n_heads, Di = cfg_.index_head_dim, R = cfg_.qk_rope_head_dim;
  // The keys scored: the KV source's, or with late_index_keys the ones
  // published last.
  auto state = [&](const Segment& g) -> const V4LayerState& {
    if (!opt_.late_index_keys || !cfg_.v41()) return entries_state(*g.state, layer);
    const int64_t src = g.state->published_keys;
    DS_CHECK(src >= 0, "internal: layer {} scores index keys nobody has published", layer);
    return g.state->layers[static_cast<size_t>(src)];
  };
  for (const Segment& g : segs) {
    const int64_t need = (pos[g.row + g.n - 1] + 1) / m;
    DS_CHECK(need == 0 || state(g).count >= need, "layer {} scores {} index keys, the ones published last hold {}",
             layer, need, state(g).count);
  }
  Buffer<float> qi(static_cast<size_t>(n * Hi * Di)), wts(static_cast<size_t>(n * Hi));
  ops::linear_forward(qi.data(), qr, p.index_wq_b, n);
  ops::rope_forward(qi.data() + Di - R, qi.data() + Di - R, pos, rope_frequencies(layer), n, Hi, R, Hi * Di, Di,
                    ops::RopeLayout::Interleaved);
  if (!cfg_.v41()) ops::hadamard_rows(qi.data(), n * Hi, Di);  // V4.1 rotates nothing
  if (opt_.qat) ops::fp4_round_blocks(qi.data(), qi.data(), n * Hi * Di, kV4IndexFp4Block);
  // V4.1's candidate source publishes each query's blocks; the index
  // sources after it choose among them.
  const bool candidate_source = cfg_.v41() && layer == cfg_.candidate_source_layer;
  const bool restricted = cfg_.v41() && cfg_.candidate_source_layer >= 0 && layer > cfg_.candidate_source_layer;
  DS_CHECK(!restricted || (cx && cx->have_candidates), "internal: layer {} needs the candidate blocks of layer {}",
           layer, cfg_.candidate_source_layer);
  std::vector<std::vector<int32_t>> cands(candidate_source ? static_cast<size_t>(n) : 0);
  ops::linear_forward(wts.data(), a, p.index_weights_proj, n);
  const float ws = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Di) * static_cast<double>(Hi)));
  for (auto& v : wts) v *= ws;
  // Keys kept as codes: a few thousand are widened once for the call and
  // scored by sgemm; beyond that each query scores them straight from the
  // codes (the fp4 linear kernel widens them in registers).
  std::vector<std::vector<float>> wide_keys(segs.size());
  if (opt_.qat)
    for (size_t k = 0; k < segs.size(); ++k) {
      const V4LayerState& st = state(segs[k]);
      if (st.count == 0 || st.count > opt_.widen_index_keys_up_to) continue;
      wide_keys[k].resize(static_cast<size_t>(st.count * Di));
      ops::widen_rows(wide_keys[k].data(), key_codes(st, st.count, Di), 0, st.count);
    }
  // Queries in blocks of consecutive rows of one sequence: with the keys as
  // floats, a block's scores against the keys its last query sees are one
  // product. Blocks depend on the positions only, never on the thread count.
  struct Block {
    int64_t i0, i1;
  };
  std::vector<Block> blocks;
  for (const Segment& g : segs) {
    const int64_t vis = std::max<int64_t>(1, (pos[g.row + g.n - 1] + 1) / m);
    const int64_t rows = std::clamp<int64_t>((int64_t{1} << 16) / (Hi * vis), 1, 64);
    for (int64_t i0 = g.row; i0 < g.row + g.n;) {
      const int64_t i1 = std::min(g.row + g.n, i0 + rows);
      blocks.push_back({i0, i1});
      i0 = i1;
    }
  }
  parallel_ranges(static_cast<int64_t>(blocks.size()), blocks.size() > 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> isc, score, own;
    for (int64_t bi = b0; bi < b1; ++bi) {
      const Block& blk = blocks[static_cast<size_t>(bi)];
      const size_t seg = static_cast<size_t>(seg_of[static_cast<size_t>(blk.i0)]);
      const V4LayerState& st = state(segs[seg]);
      // Scores of the block's queries: [rows, Hi, ld], row i's first
      // visible(i) columns used.
      const bool codes = opt_.qat && wide_keys[seg].empty();
      const int64_t ld = (pos[blk.i1 - 1] + 1) / m;
      if (ld == 0) continue;
      if (!codes) {
        const float* keys = opt_.qat ? wide_keys[seg].data() : st.index_keys.data();
        isc.resize(static_cast<size_t>((blk.i1 - blk.i0) * Hi * ld));
        ops::gemm(false, true, (blk.i1 - blk.i0) * Hi, ld, Di, 1.0f, qi.data() + blk.i0 * Hi * Di, Di, keys, Di, 0.0f,
                  isc.data(), ld);
      }
      for (int64_t i = blk.i0; i < blk.i1; ++i) {
        const int64_t visible = (pos[i] + 1) / m;
        if (visible == 0) continue;
        const float* rows = isc.data() + (i - blk.i0) * Hi * ld;
        int64_t stride = ld;
        if (codes) {  // the keys' fp4 codes, widened inside the linear kernel
          own.resize(static_cast<size_t>(Hi * visible));
          ops::linear_forward(own.data(), qi.data() + i * Hi * Di, key_codes(st, visible, Di), Hi);
          rows = own.data();
          stride = visible;
        }
        score.assign(static_cast<size_t>(visible), 0.0f);
        for (int64_t h = 0; h < Hi; ++h) {
          const float wh = wts[static_cast<size_t>(i * Hi + h)];
          const float* row = rows + h * stride;
          for (int64_t b = 0; b < visible; ++b) score[static_cast<size_t>(b)] += wh * std::max(row[b], 0.0f);
        }
        auto& pk = picked[static_cast<size_t>(i)];
        if (cfg_.v41()) {
          v41_choose(pk, score, candidate_source ? &cands[static_cast<size_t>(i)] : nullptr,
                     restricted ? &cx->candidates[static_cast<size_t>(i)] : nullptr);
          continue;
        }
        pk.resize(static_cast<size_t>(std::min(visible, cfg_.index_topk)));
        pk.resize(static_cast<size_t>(ops::topk_indices(pk.data(), score.data(), visible, cfg_.index_topk)));
      }
    }
  });
  if (cfg_.v41()) {
    if (candidate_source) {
      cx->candidates = std::move(cands);
      cx->have_candidates = true;
    }
    cx->picked = picked;
    cx->picked_layer = layer;
  }
  return picked;
}

void V4Model::v41_choose(std::vector<int32_t>& pk, std::vector<float>& score, std::vector<int32_t>* cand,
                         const std::vector<int32_t>* allowed) const {
  const int64_t visible = static_cast<int64_t>(score.size()), B = cfg_.candidate_block_size;
  const float ninf = -std::numeric_limits<float>::infinity();
  if (cand) {
    // Blocks of B entries scored by their best entry; the block holding the
    // newest visible entry always kept; the best candidate_topk_blocks kept.
    const int64_t blocks = (visible + B - 1) / B;
    cand->clear();
    if (blocks > cfg_.candidate_topk_blocks) {
      std::vector<float> bs(static_cast<size_t>(blocks), ninf);
      for (int64_t j = 0; j < visible; ++j)
        bs[static_cast<size_t>(j / B)] = std::max(bs[static_cast<size_t>(j / B)], score[static_cast<size_t>(j)]);
      bs.back() = std::numeric_limits<float>::infinity();
      cand->resize(static_cast<size_t>(cfg_.candidate_topk_blocks));
      cand->resize(static_cast<size_t>(ops::topk_indices(cand->data(), bs.data(), blocks, cfg_.candidate_topk_blocks)));
    }
  }
  if (allowed && !allowed->empty()) {
    std::vector<uint8_t> keep(static_cast<size_t>(visible), 0);
    for (int32_t b : *allowed)
      for (int64_t j = b * B; j < std::min(visible, (b + 1) * B); ++j) keep[static_cast<size_t>(j)] = 1;
    for (int64_t j = 0; j < visible; ++j)
      if (!keep[static_cast<size_t>(j)]) score[static_cast<size_t>(j)] = ninf;
  }
  pk.resize(static_cast<size_t>(std::min(visible, cfg_.index_topk)));
  pk.resize(static_cast<size_t>(ops::topk_indices(pk.data(), score.data(), visible, cfg_.index_topk)));
  // Entries outside the candidates are never picked, even when fewer than index_topk remain.
  if (allowed && !allowed->empty())
    pk.erase(std::remove_if(pk.begin(), pk.end(), [&](int32_t j) { return score[static_cast<size_t>(j)] == ninf; }),
             pk.end());
}

void V4Model::attend_stage(V4AttentionSaved& S, int64_t layer, const std::vector<Segment>& segs,
                           const std::vector<int32_t>& seg_of, const std::vector<std::vector<int32_t>>& picked,
                           const int32_t* pos, int64_t n, bool keep, V4PassContext* cx) {
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t H = cfg_.num_attention_heads, D = cfg_.head_dim, R = cfg_.qk_rope_head_dim, N = D - R;
  const int64_t W = cfg_.sliding_window, m = cfg_.compress_ratio(layer);
  auto state = [&](const Segment& g) -> V4LayerState& { return g.state->layers[static_cast<size_t>(layer)]; };
  for (const Segment& g : segs)
    if (state(g).window.empty()) state(g).window.assign(static_cast<size_t>(W * D), 0.0f);
  // The compressed entries (V4.1: its KV source's). Kept as codes: the
  // picked ones decoded once for this call, or with V4.1 once for every
  // layer that reads the same source with the same choice (the pass keeps
  // them).
  auto source = [&](const Segment& g) -> const V4LayerState& { return entries_state(*g.state, layer); };
  std::vector<std::vector<int64_t>> own_slot(segs.size());
  std::vector<std::vector<float>> own_decoded(segs.size());
  const std::pair<int64_t, int64_t> key{cfg_.kv_source_of(layer), cfg_.index_source_of(layer)};
  const bool shared = cx && cfg_.v41();
  const bool reuse = shared && cx->decoded_for == key;
  if (shared && !reuse) {
    cx->decoded_for = key;
    cx->slot.assign(segs.size(), {});
    cx->decoded.assign(segs.size(), {});
  }
  std::vector<std::vector<int64_t>>& slot = shared ? cx->slot : own_slot;
  std::vector<std::vector<float>>& decoded = shared ? cx->decoded : own_decoded;
  if (m > 0 && entry_codes() && !reuse) {
    for (size_t k = 0; k < segs.size(); ++k) slot[k].assign(static_cast<size_t>(source(segs[k]).count), -1);
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(seg_of[static_cast<size_t>(i)]);
      for (int32_t b : picked[static_cast<size_t>(i)])
        if (slot[k][static_cast<size_t>(b)] < 0) {
          const V4LayerState& st = source(segs[k]);
          slot[k][static_cast<size_t>(b)] = static_cast<int64_t>(decoded[k].size()) / D;
          decoded[k].resize(decoded[k].size() + static_cast<size_t>(D));
          float* row = decoded[k].data() + decoded[k].size() - static_cast<size_t>(D);
          if (cfg_.v41()) {
            ops::fp4_decode_blocks_e4m3(row, st.entry_fp4.data() + b * (D / 2),
                                        st.entry_fp4_scales.data() + b * (D / kV41EntryFp4Block), D, kV41EntryFp4Block);
            continue;
          }
          ops::fp8_decode_blocks(row, st.entry_codes.data() + b * N,
                                 st.entry_scales.data() + b * (N / kV4LatentFp8Block), N, kV4LatentFp8Block);
          std::copy(st.entry_rope.begin() + b * R, st.entry_rope.begin() + (b + 1) * R, row + N);
        }
    }
  }
  // The key lists: the window (new tokens' latents, older ones from the
  // ring), then the picked entries. Training keeps them by index.
  const float* kv = S.kv.data();
  std::vector<int64_t> offsets(static_cast<size_t>(n + 1), 0);
  std::vector<const float*> rows;
  for (int64_t i = 0; i < n; ++i) {
    const int32_t k = seg_of[static_cast<size_t>(i)];
    const Segment& g = segs[static_cast<size_t>(k)];
    const V4LayerState& st = state(g);
    const int64_t t = pos[i];
    for (int64_t src = std::max<int64_t>(0, t - W + 1); src <= t; ++src) {
      rows.push_back(src >= g.start ? kv + (g.row + src - g.start) * D : st.window.data() + (src % W) * D);
      if (keep) {
        DS_CHECK(src >= g.start, "internal: a training forward starts every sequence afresh");
        S.key_seg.push_back(-1);
        S.key_idx.push_back(g.row + src - g.start);
      }
    }
    for (int32_t b : picked[static_cast<size_t>(i)]) {
      rows.push_back(entry_codes() ? decoded[static_cast<size_t>(k)].data() +
                                         slot[static_cast<size_t>(k)][static_cast<size_t>(b)] * D
                                   : source(g).entries.data() + b * D);
      if (keep) {
        S.key_seg.push_back(k);
        S.key_idx.push_back(b);
      }
    }
    offsets[static_cast<size_t>(i + 1)] = static_cast<int64_t>(rows.size());
  }
  // The attention with the sink (context), unless kept.
  if (S.o.empty()) {
    S.o.resize(static_cast<size_t>(n * H * D));
    S.lse.resize(static_cast<size_t>(n * H));
    ops::sparse_mqa_forward(S.o.data(), S.lse.data(), S.q.data(), rows.data(), offsets.data(), vector_data(p.sink),
                            v4_attention_dims(cfg_, n));
    to_activation_dtype(S.o.data(), n * H * D);
  }
  for (const Segment& g : segs)
    for (int64_t src = std::max(g.start, g.start + g.n - W); src < g.start + g.n; ++src)
      std::memcpy(state(g).window.data() + (src % W) * D, kv + (g.row + src - g.start) * D,
                  static_cast<size_t>(D) * sizeof(float));
  if (keep) S.offsets = std::move(offsets);
}

void V4Model::output_stage(float* out, V4AttentionSaved& S, int64_t layer, const int32_t* pos, int64_t n,
                           bool keep) const {
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t H = cfg_.num_attention_heads, D = cfg_.head_dim, R = cfg_.qk_rope_head_dim, N = D - R;
  // The values carry RoPE: the output's tail rotated back by -t
  // (attention_out; training keeps the kernel's output as it was too).
  bool rotate = !keep;
  if (keep && S.o2.empty()) {
    S.o2 = S.o;
    rotate = true;
  }
  Buffer<float>& ob = keep ? S.o2 : S.o;
  if (rotate) {
    ops::rope_backward(ob.data() + N, ob.data() + N, pos, rope_frequencies(layer), n, H, R, H * D, D,
                       ops::RopeLayout::Interleaved);
    to_activation_dtype(ob.data(), n * H * D);
  }
  // Grouped low-rank output: group g's heads through wo_a's rows of group g
  // (z), then wo_b (out_proj).
  const int64_t G = cfg_.o_groups, r = cfg_.o_lora_rank, gw = H * D / G;
  if (S.z.empty()) {
    S.z.resize(static_cast<size_t>(n * G * r));
    for (int64_t g = 0; g < G; ++g)
      ops::linear_forward(S.z.data() + g * r, ob.data() + g * gw, ops::row_slice(p.wo_a, g * r, (g + 1) * r), n, H * D,
                          G * r);
    to_activation_dtype(S.z.data(), n * G * r);
  }
  if (out) {
    ops::linear_forward(out, S.z.data(), p.wo_b, n);
    to_activation_dtype(out, n * cfg_.hidden_size);
  }
}

}  // namespace ds::model
