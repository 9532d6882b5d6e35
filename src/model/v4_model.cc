#include "model/v4_model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <utility>

#include "core/buffer.h"
#include "core/error.h"
#include "core/parallel.h"
#include "model/model.h"
#include "model/weights.h"
#include "ops/activations.h"
#include "ops/compressor.h"
#include "ops/expert_selection.h"
#include "ops/indexer.h"
#include "ops/matmul.h"
#include "ops/mhc.h"
#include "ops/rmsnorm.h"
#include "ops/rope.h"
#include "ops/sparse_attention.h"

namespace ds::model {

namespace {

constexpr int64_t kLatentFp8Block = 64;  // the K=V latent's fp8 simulation blocks
constexpr int64_t kIndexFp4Block = 32;   // the indexer's fp4 simulation blocks

std::vector<float> frequencies(const V4Config& c, double theta, bool yarn) {
  ops::RopeConfig rc;
  rc.dim = c.qk_rope_head_dim;
  rc.theta = theta;
  if (yarn && c.rope_scaling.enabled) {
    rc.factor = c.rope_scaling.factor;
    rc.original_max_position = c.rope_scaling.original_max_position_embeddings;
    rc.beta_fast = c.rope_scaling.beta_fast;
    rc.beta_slow = c.rope_scaling.beta_slow;
  }
  std::vector<float> f(static_cast<size_t>(c.qk_rope_head_dim / 2));
  ops::rope_frequencies(f.data(), rc);
  return f;
}

// Rows a compressor's carry holds after `tokens` tokens.
int64_t carry_start(int64_t tokens, int64_t ratio) {
  const int64_t open = tokens / ratio;  // the window being filled
  return (ratio == 4 ? std::max<int64_t>(open - 1, 0) : open) * ratio;
}

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

}  // namespace

ops::MhcDims v4_mhc_dims(const V4Config& c, int64_t tokens) {
  ops::MhcDims md;
  md.tokens = tokens;
  md.streams = c.hc_mult;
  md.dim = c.hidden_size;
  md.sinkhorn_iters = c.hc_sinkhorn_iters;
  md.eps = static_cast<float>(c.hc_eps);
  md.norm_eps = static_cast<float>(c.rms_norm_eps);
  return md;
}

ops::SparseMqaDims v4_attention_dims(const V4Config& c, int64_t queries) {
  ops::SparseMqaDims sd;
  sd.queries = queries;
  sd.heads = c.num_attention_heads;
  sd.dim = c.head_dim;
  sd.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(c.head_dim)));
  return sd;
}

ops::ExpertSelectionConfig v4_selection_config(const V4Config& c) {
  ops::ExpertSelectionConfig sc;
  sc.num_experts = c.n_routed_experts;
  sc.k = c.num_experts_per_tok;
  sc.group_score = ops::GroupScore::None;
  sc.scoring = c.scoring_func == V4Scoring::SqrtSoftplus ? ops::ExpertScoring::SqrtSoftplus
               : c.scoring_func == V4Scoring::Sigmoid    ? ops::ExpertScoring::Sigmoid
                                                         : ops::ExpertScoring::Softmax;
  sc.norm_topk_prob = c.scoring_func != V4Scoring::Softmax;
  sc.routed_scaling_factor = static_cast<float>(c.routed_scaling_factor);
  return sc;
}

size_t V4LayerState::bytes() const {
  return (window.size() + carry.P.size() + carry.Z.size() + entries.size() + index_carry.P.size() +
          index_carry.Z.size() + index_keys.size() + entry_rope.size()) *
             sizeof(float) +
         entry_codes.size() + entry_scales.size() + key_codes.size() + key_scales.size();
}

size_t V4State::bytes() const {
  size_t b = 0;
  for (const auto& l : layers) b += l.bytes();
  return b;
}

size_t v4_state_bytes(const V4Config& c, int64_t tokens, bool codes) {
  if (tokens <= 0) return 0;
  size_t bytes = 0;
  const int64_t R = c.qk_rope_head_dim, N = c.nope_dim(), Di = c.index_head_dim;
  auto carry = [&](int64_t ratio, int64_t dim) {
    const int64_t width = (ratio == 4 ? 2 : 1) * dim;
    bytes += static_cast<size_t>(2 * (tokens - carry_start(tokens, ratio)) * width) * sizeof(float);
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    bytes += static_cast<size_t>(c.sliding_window * c.head_dim) * sizeof(float);
    const int64_t m = c.compress_ratio(l);
    if (m == 0) continue;
    const int64_t count = tokens / m;
    carry(m, c.head_dim);
    bytes += static_cast<size_t>(count * (codes ? N + N / kLatentFp8Block + R * 4 : c.head_dim * 4));
    if (m != 4) continue;
    carry(4, Di);
    bytes += static_cast<size_t>(count * (codes ? Di / 2 + Di / kIndexFp4Block : Di * 4));
  }
  return bytes;
}

V4Model::V4Model(const V4Config& cfg, const V4View& w, V4Options opt)
    : cfg_(cfg),
      w_(w),
      opt_(opt),
      freqs_window_(frequencies(cfg, cfg.rope_theta, false)),
      freqs_compressed_(
          frequencies(cfg, cfg.compress_rope_theta > 1 ? cfg.compress_rope_theta : cfg.rope_theta, true)) {
  cfg_.validate();
  DS_CHECK(static_cast<int64_t>(w.layers.size()) == cfg.num_hidden_layers + cfg.num_nextn_predict_layers &&
               static_cast<int64_t>(w.mtp.size()) == cfg.num_nextn_predict_layers,
           "V4 weights do not match the config");
}

V4State V4Model::new_state() const {
  V4State s;
  s.layers.resize(static_cast<size_t>(cfg_.num_hidden_layers + cfg_.num_nextn_predict_layers));
  return s;
}

void V4Model::compress(V4LayerState& st, const float* a, const V4CompressorParams<ops::WeightView>& p, int64_t dim,
                       int64_t ratio, bool index_keys, int64_t p0, int64_t n, V4CompressorSaved* sv,
                       const std::pair<const float*, const float*>& proj) {
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
  if (proj.first) {
    std::copy(proj.first, proj.first + n * width, P.begin() + old * width);
    std::copy(proj.second, proj.second + n * width, Z.begin() + old * width);
  } else {
    ops::linear_forward(P.data() + old * width, a, p.wkv, n);
    ops::linear_forward(Z.data() + old * width, a, p.wgate, n);
  }
  const float* ape = vector_data(p.ape);
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
    ops::rope_forward(E + dim - R, E + dim - R, pos.data(), freqs_compressed_.data(), k, 1, R, dim, dim,
                      ops::RopeLayout::Interleaved);
    if (index_keys) ops::hadamard_rows(E, k, dim);
    if (!opt_.qat) {
      auto& rows = index_keys ? st.index_keys : st.entries;
      rows.insert(rows.end(), E, E + k * dim);
    } else if (index_keys) {  // fp4 in blocks of 32, kept as codes
      const size_t c0 = st.key_codes.size(), s0 = st.key_scales.size();
      st.key_codes.resize(c0 + static_cast<size_t>(k * dim / 2));
      st.key_scales.resize(s0 + static_cast<size_t>(k * dim / kIndexFp4Block));
      ops::fp4_encode_blocks(st.key_codes.data() + c0, st.key_scales.data() + s0, E, k * dim, kIndexFp4Block);
    } else {  // the non-rope dims to fp8 in blocks of 64, kept as codes; the rope dims as they are
      const int64_t N = dim - R;
      for (int64_t b = 0; b < k; ++b) {
        const size_t c0 = st.entry_codes.size(), s0 = st.entry_scales.size();
        st.entry_codes.resize(c0 + static_cast<size_t>(N));
        st.entry_scales.resize(s0 + static_cast<size_t>(N / kLatentFp8Block));
        ops::fp8_encode_blocks(st.entry_codes.data() + c0, st.entry_scales.data() + s0, E + b * dim, N,
                               kLatentFp8Block);
        st.entry_rope.insert(st.entry_rope.end(), E + b * dim + N, E + (b + 1) * dim);
      }
    }
    if (!index_keys) st.count += k;
  }
  const int64_t keep = carry_start(p0 + n, m);
  carry.P.assign(P.begin() + (keep - start) * width, P.end());
  carry.Z.assign(Z.begin() + (keep - start) * width, Z.end());
  carry.start = keep;
  if (sv) {
    DS_CHECK(old == 0 && start == 0, "internal: a training forward starts every sequence afresh");
    sv->P = std::move(P);
    sv->Z = std::move(Z);
  }
}

void V4Model::attention(float* out, const float* a, int64_t layer, const std::vector<Segment>& segs,
                        const int32_t* positions, int64_t n, V4AttentionSaved* sv) {
  const auto& p = w_.layers[static_cast<size_t>(layer)].attn;
  const int64_t H = cfg_.num_attention_heads, D = cfg_.head_dim, R = cfg_.qk_rope_head_dim, N = D - R;
  const int64_t Lq = cfg_.q_lora_rank, W = cfg_.sliding_window, m = cfg_.compress_ratio(layer), d = cfg_.hidden_size;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const float* freqs = rope_frequencies(layer);
  const int32_t* pos = positions;
  auto state = [&](const Segment& g) -> V4LayerState& { return g.state->layers[static_cast<size_t>(layer)]; };
  DS_CHECK(!sv || !opt_.qat, "internal: a training forward runs without the fp8/fp4 roundings");

  // Training keeps the values before each norm in buffers of their own (they
  // move into sv at the end, as does everything else it keeps); inference
  // normalises in place.
  auto normed = [&](Buffer<float>& y, Buffer<float>& lin, Buffer<float>& rstd, const float* w, int64_t rows,
                    int64_t dim) {
    rstd.resize(static_cast<size_t>(rows));
    if (sv) {
      y.resize(lin.size());
      ops::rmsnorm_forward(y.data(), rstd.data(), lin.data(), w, rows, dim, eps);
    } else {
      ops::rmsnorm_forward(lin.data(), rstd.data(), lin.data(), w, rows, dim, eps);
      y = std::move(lin);
    }
  };
  // Queries: q-LoRA, its norm, per-head RMS normalisation, RoPE on the tail.
  Buffer<float> qr_lin(static_cast<size_t>(n * Lq)), qr, rstd_qr;
  ops::linear_forward(qr_lin.data(), a, p.wq_a, n);
  normed(qr, qr_lin, rstd_qr, vector_data(p.q_norm), n, Lq);
  Buffer<float> q_lin(static_cast<size_t>(n * H * D)), q, rstd_q;
  ops::linear_forward(q_lin.data(), qr.data(), p.wq_b, n);
  normed(q, q_lin, rstd_q, ones(D), n * H, D);
  ops::rope_forward(q.data() + N, q.data() + N, pos, freqs, n, H, R, H * D, D, ops::RopeLayout::Interleaved);
  // The shared K=V latent.
  Buffer<float> kv_lin(static_cast<size_t>(n * D)), kv, rstd_kv;
  ops::linear_forward(kv_lin.data(), a, p.wkv, n);
  normed(kv, kv_lin, rstd_kv, vector_data(p.kv_norm), n, D);
  ops::rope_forward(kv.data() + N, kv.data() + N, pos, freqs, n, 1, R, D, D, ops::RopeLayout::Interleaved);
  if (opt_.qat)
    for (int64_t i = 0; i < n; ++i)
      ops::fp8_round_blocks(kv.data() + i * D, kv.data() + i * D, N, kLatentFp8Block, /*ue8m0=*/true);

  // Compressed entries (they become visible only once their window closes).
  const int64_t Hi = cfg_.index_n_heads, Di = cfg_.index_head_dim;
  // With several sequences, the compressors' projections of every new row
  // in one product each (one small product per sequence costs more in
  // overhead than in arithmetic).
  const int64_t cw = (m == 4 ? 2 : 1) * D, iw = 2 * Di;
  Buffer<float> cP, cZ, iP, iZ;
  const bool batched = m > 0 && segs.size() > 1;
  if (batched) {
    cP.resize(static_cast<size_t>(n * cw));
    cZ.resize(cP.size());
    ops::linear_forward(cP.data(), a, p.compressor.wkv, n);
    ops::linear_forward(cZ.data(), a, p.compressor.wgate, n);
    if (m == 4) {
      iP.resize(static_cast<size_t>(n * iw));
      iZ.resize(iP.size());
      ops::linear_forward(iP.data(), a, p.index_compressor.wkv, n);
      ops::linear_forward(iZ.data(), a, p.index_compressor.wgate, n);
    }
  }
  for (const Segment& g : segs) {
    V4LayerState& st = state(g);
    V4CompressorSaved* cs = nullptr;
    if (sv && m > 0) cs = &sv->comp.emplace_back();
    auto rows_of = [&](const Buffer<float>& P, const Buffer<float>& Z, int64_t width) {
      return batched ? std::pair<const float*, const float*>{P.data() + g.row * width, Z.data() + g.row * width}
                     : std::pair<const float*, const float*>{nullptr, nullptr};
    };
    if (m > 0) compress(st, a + g.row * d, p.compressor, D, m, false, g.start, g.n, cs, rows_of(cP, cZ, cw));
    if (m == 4)
      compress(st, a + g.row * d, p.index_compressor, Di, 4, true, g.start, g.n, nullptr, rows_of(iP, iZ, iw));
    if (st.window.empty()) st.window.assign(static_cast<size_t>(W * D), 0.0f);
  }
  Buffer<float> qi, wts;
  if (m == 4) {
    qi.resize(static_cast<size_t>(n * Hi * Di));
    ops::linear_forward(qi.data(), qr.data(), p.index_wq_b, n);
    ops::rope_forward(qi.data() + Di - R, qi.data() + Di - R, pos, freqs, n, Hi, R, Hi * Di, Di,
                      ops::RopeLayout::Interleaved);
    ops::hadamard_rows(qi.data(), n * Hi, Di);
    if (opt_.qat) ops::fp4_round_blocks(qi.data(), qi.data(), n * Hi * Di, kIndexFp4Block);
    wts.resize(static_cast<size_t>(n * Hi));
    ops::linear_forward(wts.data(), a, p.index_weights_proj, n);
    const float ws = static_cast<float>(1.0 / std::sqrt(static_cast<double>(Di) * static_cast<double>(Hi)));
    for (auto& v : wts) v *= ws;
  }

  // Every query over its window and its compressed entries.
  std::vector<int32_t> seg_of(static_cast<size_t>(n));
  for (size_t k = 0; k < segs.size(); ++k)
    std::fill(seg_of.begin() + segs[k].row, seg_of.begin() + segs[k].row + segs[k].n, static_cast<int32_t>(k));
  // Each query's compressed entries: HCA all visible ones, CSA the
  // indexer's top index_topk (sum_h w_h relu(q_h . k_b)).
  std::vector<std::vector<int32_t>> picked(static_cast<size_t>(n));
  // Keys kept as codes: a few thousand are widened once for the call and
  // scored by sgemm; beyond that each query scores them straight from the
  // codes (the fp4 linear kernel widens them in registers).
  std::vector<std::vector<float>> wide_keys(segs.size());
  if (m == 4 && opt_.qat)
    for (size_t k = 0; k < segs.size(); ++k) {
      const V4LayerState& st = state(segs[k]);
      if (st.count == 0 || st.count > opt_.widen_index_keys_up_to) continue;
      wide_keys[k].resize(static_cast<size_t>(st.count * Di));
      ops::widen_rows(wide_keys[k].data(), key_codes(st, st.count, Di), 0, st.count);
    }
  if (m > 0) {
    // CSA queries in blocks of consecutive rows of one sequence: with the keys
    // as floats, a block's scores against the keys its last query sees are
    // one product. Blocks depend on the positions only, never on the thread
    // count.
    struct Block {
      int64_t i0, i1;
    };
    std::vector<Block> blocks;
    for (const Segment& g : segs) {
      if (m != 4) {
        blocks.push_back({g.row, g.row + g.n});
        continue;
      }
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
        if (m != 4) {
          for (int64_t i = blk.i0; i < blk.i1; ++i) {
            auto& pk = picked[static_cast<size_t>(i)];
            pk.resize(static_cast<size_t>((pos[i] + 1) / m));
            std::iota(pk.begin(), pk.end(), 0);
          }
          continue;
        }
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
          pk.resize(static_cast<size_t>(std::min(visible, cfg_.index_topk)));
          pk.resize(static_cast<size_t>(ops::topk_indices(pk.data(), score.data(), visible, cfg_.index_topk)));
        }
      }
    });
  }
  // Entries kept as codes: the picked ones decoded once for this call.
  std::vector<std::vector<int64_t>> slot(segs.size());
  std::vector<std::vector<float>> decoded(segs.size());
  if (m > 0 && opt_.qat) {
    for (size_t k = 0; k < segs.size(); ++k) slot[k].assign(static_cast<size_t>(state(segs[k]).count), -1);
    for (int64_t i = 0; i < n; ++i) {
      const size_t k = static_cast<size_t>(seg_of[static_cast<size_t>(i)]);
      for (int32_t b : picked[static_cast<size_t>(i)])
        if (slot[k][static_cast<size_t>(b)] < 0) {
          const V4LayerState& st = state(segs[k]);
          slot[k][static_cast<size_t>(b)] = static_cast<int64_t>(decoded[k].size()) / D;
          decoded[k].resize(decoded[k].size() + static_cast<size_t>(D));
          float* row = decoded[k].data() + decoded[k].size() - static_cast<size_t>(D);
          ops::fp8_decode_blocks(row, st.entry_codes.data() + b * N, st.entry_scales.data() + b * (N / kLatentFp8Block),
                                 N, kLatentFp8Block);
          std::copy(st.entry_rope.begin() + b * R, st.entry_rope.begin() + (b + 1) * R, row + N);
        }
    }
  }
  // The key lists: the window (new tokens' latents, older ones from the
  // ring), then the picked entries.
  std::vector<int64_t> offsets(static_cast<size_t>(n + 1), 0);
  std::vector<const float*> rows;
  for (int64_t i = 0; i < n; ++i) {
    const Segment& g = segs[static_cast<size_t>(seg_of[static_cast<size_t>(i)])];
    const V4LayerState& st = state(g);
    const int64_t t = pos[i];
    for (int64_t src = std::max<int64_t>(0, t - W + 1); src <= t; ++src) {
      rows.push_back(src >= g.start ? kv.data() + (g.row + src - g.start) * D : st.window.data() + (src % W) * D);
      if (sv) {
        DS_CHECK(src >= g.start, "internal: a training forward starts every sequence afresh");
        sv->key_seg.push_back(-1);
        sv->key_idx.push_back(g.row + src - g.start);
      }
    }
    const size_t k = static_cast<size_t>(seg_of[static_cast<size_t>(i)]);
    for (int32_t b : picked[static_cast<size_t>(i)]) {
      rows.push_back(opt_.qat ? decoded[k].data() + slot[k][static_cast<size_t>(b)] * D : st.entries.data() + b * D);
      if (sv) {
        sv->key_seg.push_back(seg_of[static_cast<size_t>(i)]);
        sv->key_idx.push_back(b);
      }
    }
    offsets[static_cast<size_t>(i + 1)] = static_cast<int64_t>(rows.size());
  }
  const ops::SparseMqaDims sd = v4_attention_dims(cfg_, n);
  Buffer<float> o(static_cast<size_t>(n * H * D)), lse(static_cast<size_t>(n * H));
  ops::sparse_mqa_forward(o.data(), lse.data(), q.data(), rows.data(), offsets.data(), vector_data(p.sink), sd);
  for (const Segment& g : segs)
    for (int64_t src = std::max(g.start, g.start + g.n - W); src < g.start + g.n; ++src)
      std::memcpy(state(g).window.data() + (src % W) * D, kv.data() + (g.row + src - g.start) * D,
                  static_cast<size_t>(D) * sizeof(float));
  // The values carry RoPE: rotate the output's tail back by -t (training
  // keeps the output as it was too).
  Buffer<float> o2;
  if (sv) o2 = o;
  Buffer<float>& ob = sv ? o2 : o;
  ops::rope_backward(ob.data() + N, ob.data() + N, pos, freqs, n, H, R, H * D, D, ops::RopeLayout::Interleaved);

  // Grouped low-rank output: group g's heads through wo_a's rows of group g.
  const int64_t G = cfg_.o_groups, r = cfg_.o_lora_rank, gw = H * D / G;
  Buffer<float> z(static_cast<size_t>(n * G * r));
  for (int64_t g = 0; g < G; ++g)
    ops::linear_forward(z.data() + g * r, ob.data() + g * gw, ops::row_slice(p.wo_a, g * r, (g + 1) * r), n, H * D,
                        G * r);
  ops::linear_forward(out, z.data(), p.wo_b, n);
  if (sv) {
    sv->qr_lin = std::move(qr_lin);
    sv->qr = std::move(qr);
    sv->rstd_qr = std::move(rstd_qr);
    sv->q_lin = std::move(q_lin);
    sv->q = std::move(q);
    sv->rstd_q = std::move(rstd_q);
    sv->kv_lin = std::move(kv_lin);
    sv->kv = std::move(kv);
    sv->rstd_kv = std::move(rstd_kv);
    sv->o = std::move(o);
    sv->lse = std::move(lse);
    sv->o2 = std::move(o2);
    sv->z = std::move(z);
    sv->offsets = std::move(offsets);
  }
}

std::vector<float> V4Model::forward(V4State& st, const int32_t* ids, int64_t n, bool all_logits) {
  std::vector<V4Request> one = {{&st, ids, n}};
  return forward(one, all_logits);
}

std::vector<float> V4Model::forward(const std::vector<V4Request>& batch, bool all_logits) {
  return forward(batch, all_logits, nullptr);
}

Staged V4Model::layer_forward(Buffer<float>& X, Buffer<float>& X2, int64_t l, const std::vector<Segment>& segs,
                              const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls) {
  co_await sublayer(X, X2, l, false, segs, ids, pos, n, ls);
  co_await sublayer(X, X2, l, true, segs, ids, pos, n, ls);
}

Staged V4Model::sublayer(Buffer<float>& X, Buffer<float>& X2, int64_t l, bool ffn, const std::vector<Segment>& segs,
                         const int32_t* ids, const int32_t* pos, int64_t n, V4LayerSaved* ls) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const auto& L = w_.layers[static_cast<size_t>(l)];
  const ops::MhcDims md = v4_mhc_dims(cfg_, n);
  const size_t nd = static_cast<size_t>(n * d), nh = static_cast<size_t>(n * hc);
  // x0 = mhc_pre(X), x = rmsnorm(x0), y = f(x), X = mhc_post(y, X). Training
  // keeps x0 and x apart and moves every buffer into ls (the input streams
  // once mhc_post has read them); inference normalises in place.
  Buffer<float> x0(nd), x, y(nd), rstd(static_cast<size_t>(n)), post(nh), comb(nh * static_cast<size_t>(hc));
  const auto& fn = ffn ? L.hc_ffn_fn : L.hc_attn_fn;
  const auto& base = ffn ? L.hc_ffn_base : L.hc_attn_base;
  const auto& scale = ffn ? L.hc_ffn_scale : L.hc_attn_scale;
  const auto& norm = ffn ? L.ffn_norm : L.attn_norm;
  ops::mhc_pre_forward(x0.data(), post.data(), comb.data(), X.data(), vector_data(fn), vector_data(base),
                       vector_data(scale), md);
  if (ls) {
    x.resize(nd);
    ops::rmsnorm_forward(x.data(), rstd.data(), x0.data(), vector_data(norm), n, d, eps);
  } else {
    ops::rmsnorm_forward(x0.data(), rstd.data(), x0.data(), vector_data(norm), n, d, eps);
  }
  const float* a = ls ? x.data() : x0.data();
  if (ffn)
    co_await moe(y.data(), a, ids, l, n, ls ? &ls->moe : nullptr);
  else
    attention(y.data(), a, l, segs, pos, n, ls ? &ls->attn : nullptr);
  X2.resize(X.size());
  ops::mhc_post_forward(X2.data(), y.data(), X.data(), post.data(), comb.data(), md);
  std::swap(X, X2);
  if (!ls) co_return;
  if (ffn) {
    ls->X1 = std::move(X2), ls->f0 = std::move(x0), ls->rstd_f = std::move(rstd), ls->f = std::move(x);
    ls->fpost = std::move(post), ls->fcomb = std::move(comb), ls->fo = std::move(y);
  } else {
    ls->X = std::move(X2), ls->a0 = std::move(x0), ls->rstd_a = std::move(rstd), ls->a = std::move(x);
    ls->post = std::move(post), ls->comb = std::move(comb), ls->o = std::move(y);
  }
  X2 = Buffer<float>(X.size());
}

std::vector<float> V4Model::head_forward(const float* Xr, int64_t R, const ops::WeightView& fn,
                                         const ops::WeightView& base, const ops::WeightView& scale,
                                         const ops::WeightView& norm, V4HeadSaved* sv, bool logits) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, V = cfg_.vocab_size;
  Buffer<float> y(static_cast<size_t>(R * d)), rstd(static_cast<size_t>(R));
  ops::mhc_head_forward(y.data(), Xr, vector_data(fn), vector_data(base), vector_data(scale), v4_mhc_dims(cfg_, R));
  if (sv) {
    sv->X.assign(Xr, Xr + R * hc * d);
    sv->y.assign(y.begin(), y.end());
  }
  ops::rmsnorm_forward(y.data(), rstd.data(), y.data(), vector_data(norm), R, d, static_cast<float>(cfg_.rms_norm_eps));
  if (sv) sv->rstd_y.assign(rstd.begin(), rstd.end());
  if (!logits) return std::vector<float>(y.begin(), y.end());
  std::vector<float> out(static_cast<size_t>(R * V));
  ops::linear_forward(out.data(), y.data(), head_weight(), R);
  return out;
}

std::vector<float> V4Model::forward(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                                    std::vector<float>* mtp_logits) {
  return run(batch, all_logits, saved, mtp_logits, true);
}

std::vector<float> V4Model::forward_normed(const std::vector<V4Request>& batch, V4Saved* saved,
                                           std::vector<float>* mtp_normed) {
  return run(batch, true, saved, mtp_normed, false);
}

std::vector<float> V4Model::run(const std::vector<V4Request>& batch, bool all_logits, V4Saved* saved,
                                std::vector<float>* mtp_out, bool logits) {
  std::vector<Pass> passes;
  passes.push_back(begin_pass(batch, saved, mtp_out != nullptr));
  std::vector<std::vector<float>> mtp;
  auto out = run_passes(passes, all_logits, {saved}, mtp_out ? &mtp : nullptr, logits);
  if (mtp_out) *mtp_out = std::move(mtp[0]);
  return std::move(out[0]);
}

std::vector<std::vector<float>> V4Model::forward_normed_parts(const std::vector<std::vector<V4Request>>& parts,
                                                              const std::vector<V4Saved*>& saved,
                                                              std::vector<std::vector<float>>* mtp_normed) {
  DS_CHECK(!parts.empty() && saved.size() == parts.size(), "V4 forward: {} parts with {} saved records", parts.size(),
           saved.size());
  std::vector<Pass> passes;
  for (size_t i = 0; i < parts.size(); ++i) passes.push_back(begin_pass(parts[i], saved[i], mtp_normed != nullptr));
  return run_passes(passes, true, saved, mtp_normed, false);
}

V4Model::Pass V4Model::begin_pass(const std::vector<V4Request>& batch, V4Saved* saved, bool mtp) const {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  Pass p;
  int64_t& n = p.n;
  for (const V4Request& r : batch) {
    if (r.n == 0) continue;
    DS_CHECK(r.state != nullptr && r.n > 0, "V4 forward: a request without a state or with a negative count");
    DS_CHECK(static_cast<int64_t>(r.state->layers.size()) == L + cfg_.num_nextn_predict_layers,
             "V4 forward: state of another model");
    DS_CHECK(r.state->length + r.n <= cfg_.max_position_embeddings,
             "V4 forward: {} tokens exceed max_position_embeddings {}", r.state->length + r.n,
             cfg_.max_position_embeddings);
    DS_CHECK(!mtp || r.state->length == 0, "V4 forward: the MTP logits need whole sequences (fresh states)");
    for (const Segment& g : p.segs) DS_CHECK(g.state != r.state, "V4 forward: one sequence twice in a batch");
    for (int64_t i = 0; i < r.n; ++i)
      DS_CHECK(r.ids[i] >= 0 && r.ids[i] < V, "token id {} is outside the vocabulary of {}", r.ids[i], V);
    p.segs.push_back({r.state, r.ids, r.state->length, r.n, n});
    n += r.n;
  }
  DS_CHECK(n >= 1, "V4 forward: no tokens");
  DS_CHECK(!mtp || cfg_.num_nextn_predict_layers == 1, "V4 forward: the MTP logits need one MTP layer ({})",
           cfg_.num_nextn_predict_layers);
  p.ids.resize(static_cast<size_t>(n));
  p.pos.resize(static_cast<size_t>(n));
  for (const Segment& g : p.segs) {
    std::copy(g.ids, g.ids + g.n, p.ids.begin() + g.row);
    for (int64_t i = 0; i < g.n; ++i) p.pos[static_cast<size_t>(g.row + i)] = static_cast<int32_t>(g.start + i);
  }
  if (saved) {
    saved->ids = p.ids;
    saved->pos = p.pos;
    saved->layers.assign(static_cast<size_t>(L + (mtp ? 1 : 0)), {});
    saved->mtp.clear();
    saved->segs = p.segs;
  }
  // Embedding, copied into every stream.
  p.X = Buffer<float>(static_cast<size_t>(n * hc * d));
  p.X2 = Buffer<float>(static_cast<size_t>(n * hc * d));
  for (int64_t i = 0; i < n; ++i) {
    float* row = p.X.data() + i * hc * d;
    ops::widen_rows(row, w_.embed, p.ids[static_cast<size_t>(i)], p.ids[static_cast<size_t>(i)] + 1);
    for (int64_t j = 1; j < hc; ++j) std::copy(row, row + d, row + j * d);
  }
  return p;
}

std::vector<std::vector<float>> V4Model::run_passes(std::vector<Pass>& passes, bool all_logits,
                                                    const std::vector<V4Saved*>& saved,
                                                    std::vector<std::vector<float>>* mtp_out, bool logits) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, L = cfg_.num_hidden_layers;
  const size_t P = passes.size();
  for (int64_t l = 0; l < L; ++l) {
    if (opt_.stream) opt_.stream->acquire(l, false);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i) {
      Pass& p = passes[i];
      V4LayerSaved* ls = saved[i] ? &saved[i]->layers[static_cast<size_t>(l)] : nullptr;
      tasks.push_back(layer_forward(p.X, p.X2, l, p.segs, p.ids.data(), p.pos.data(), p.n, ls));
    }
    run_interleaved(tasks, l, false);
    if (opt_.stream) opt_.stream->release(l, false);
    for (size_t i = 0; i < P; ++i)
      if (saved[i]) drop(saved[i]->layers[static_cast<size_t>(l)], *saved[i]);
  }
  for (Pass& p : passes)
    for (const Segment& g : p.segs) g.state->length += g.n;

  if (mtp_out) {
    mtp_out->assign(P, {});
    if (opt_.stream) opt_.stream->acquire(L, false);
    std::vector<Staged> tasks;
    for (size_t i = 0; i < P; ++i)
      tasks.push_back(mtp_forward((*mtp_out)[i], passes[i].X.data(), passes[i].segs, passes[i].ids, saved[i], logits));
    run_interleaved(tasks, L, false);
    if (opt_.stream) opt_.stream->release(L, false);
  }

  // Logits: every row, or each sequence's last.
  std::vector<std::vector<float>> out;
  for (size_t i = 0; i < P; ++i) {
    const Pass& p = passes[i];
    std::vector<int64_t> rows;
    for (const Segment& g : p.segs)
      for (int64_t t = all_logits ? 0 : g.n - 1; t < g.n; ++t) rows.push_back(g.row + t);
    const int64_t R = static_cast<int64_t>(rows.size());
    Buffer<float> Xr(static_cast<size_t>(R * hc * d));
    for (int64_t r = 0; r < R; ++r)
      std::copy(p.X.begin() + rows[static_cast<size_t>(r)] * hc * d,
                p.X.begin() + (rows[static_cast<size_t>(r)] + 1) * hc * d, Xr.begin() + r * hc * d);
    if (saved[i]) saved[i]->logit_rows = rows;
    out.push_back(head_forward(Xr.data(), R, w_.hc_head_fn, w_.hc_head_base, w_.hc_head_scale, w_.norm,
                               saved[i] ? &saved[i]->head : nullptr, logits));
  }
  return out;
}

Staged V4Model::mtp_forward(std::vector<float>& out, const float* X, const std::vector<Segment>& segs,
                            const std::vector<int32_t>& ids, V4Saved* saved, bool logits) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, l = cfg_.num_hidden_layers;
  const float eps = static_cast<float>(cfg_.rms_norm_eps);
  const auto& M = w_.mtp[0];
  // Row t of a sequence: its main streams at token t and the embedding of token t + 1.
  std::vector<Segment> msegs;
  std::vector<int64_t> rows;
  std::vector<int32_t> next, pos;
  for (const Segment& g : segs) {
    if (g.n < 2) continue;
    msegs.push_back({g.state, g.ids + 1, 0, g.n - 1, static_cast<int64_t>(rows.size())});
    for (int64_t t = 0; t + 1 < g.n; ++t) {
      rows.push_back(g.row + t);
      next.push_back(ids[static_cast<size_t>(g.row + t + 1)]);
      pos.push_back(static_cast<int32_t>(t));
    }
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  V4MtpSaved* ms = nullptr;
  if (saved) {
    saved->mtp.emplace_back();
    ms = &saved->mtp.back();
    ms->segs = msegs;
    ms->rows = rows;
    ms->ids = next;
    ms->pos = pos;
  }
  if (R == 0) {
    out.clear();
    co_return;
  }
  Buffer<float> e(static_cast<size_t>(R * d)), re(static_cast<size_t>(R));
  Buffer<float> h(static_cast<size_t>(R * hc * d)), rh(static_cast<size_t>(R * hc));
  for (int64_t r = 0; r < R; ++r) {
    ops::widen_rows(e.data() + r * d, w_.embed, next[static_cast<size_t>(r)], next[static_cast<size_t>(r)] + 1);
    std::copy(X + rows[static_cast<size_t>(r)] * hc * d, X + (rows[static_cast<size_t>(r)] + 1) * hc * d,
              h.data() + r * hc * d);
  }
  if (ms) {
    ms->e0.assign(e.begin(), e.end());
    ms->h0.assign(h.begin(), h.end());
  }
  ops::rmsnorm_forward(e.data(), re.data(), e.data(), vector_data(M.enorm), R, d, eps);
  ops::rmsnorm_forward(h.data(), rh.data(), h.data(), vector_data(M.hnorm), R * hc, d, eps);
  if (ms) {
    ms->rstd_e.assign(re.begin(), re.end());
    ms->e.assign(e.begin(), e.end());
    ms->rstd_h.assign(rh.begin(), rh.end());
    ms->h.assign(h.begin(), h.end());
  }
  Buffer<float> Xm(static_cast<size_t>(R * hc * d)), Xm2(static_cast<size_t>(R * hc * d)),
      pe(static_cast<size_t>(R * d));
  ops::linear_forward(Xm.data(), h.data(), M.h_proj, R * hc);
  ops::linear_forward(pe.data(), e.data(), M.e_proj, R);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < hc; ++j)
      for (int64_t i = 0; i < d; ++i) Xm[(r * hc + j) * d + i] += pe[r * d + i];
  V4LayerSaved* ls = saved ? &saved->layers[static_cast<size_t>(l)] : nullptr;
  co_await layer_forward(Xm, Xm2, l, msegs, next.data(), pos.data(), R, ls);
  if (ls) drop(*ls, *saved);
  out = head_forward(Xm.data(), R, M.hc_head_fn, M.hc_head_base, M.hc_head_scale, M.norm, ms ? &ms->head : nullptr,
                     logits);
}

}  // namespace ds::model
