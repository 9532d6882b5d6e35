// DeepSeek-V4's part in speculative decoding with its MTP block
// (infer/speculative.h): a forward that keeps the last layer's streams, the
// MTP block over kept streams at a sequence's own positions, and undoing
// the last tokens of a step (a rejected draft).
//
// A step changes a layer's state in four ways: the window ring's slots of
// the new positions are overwritten; the compressors' carries take the new
// rows and drop those no open window reads any more; whole windows become
// entries (and indexer keys), appended; V4.1's Engram history and its last
// published index source move on. mark() notes what undoing needs before
// the step: the overwritten slots, the entry and key counts, and it makes
// the carries keep the rows they drop. rewind() puts back the slots of the
// dropped positions, cuts the entries back to the windows the kept tokens
// close, and rebuilds each carry from the kept rows, which is what a step
// of only the kept tokens would have left: a state's contents depend on its
// tokens alone, not on how they were split into steps.
#include <algorithm>

#include "core/error.h"
#include "model/v4_model.h"

namespace ds::model {

namespace {

// f(list) for each entry and key list of a layer, in V4LayerMark::sizes' order.
template <class F>
void for_each_entry_list(V4LayerState& s, F f) {
  f(s.entries);
  f(s.index_keys);
  f(s.entry_codes);
  f(s.entry_scales);
  f(s.entry_rope);
  f(s.key_codes);
  f(s.key_scales);
  f(s.entry_fp4);
  f(s.entry_fp4_scales);
}

void start_holding(V4CompressorCarry& c) {
  c.hold = true;
  c.held_start = c.start;
  c.held_P.clear();
  c.held_Z.clear();
}

void stop_holding(V4CompressorCarry& c) {
  c.hold = false;
  c.held_P = {};
  c.held_Z = {};
}

// The carry a compressor of ratio m holds after `length` tokens, from the
// rows [held_start, now) it held and dropped since the mark.
void rewind_carry(V4CompressorCarry& c, int64_t now, int64_t length, int64_t m) {
  DS_CHECK(c.hold, "internal: rewind of a compressor carry that was not marked");
  const size_t total = c.held_P.size() + c.P.size();
  const int64_t rows = now - c.held_start;
  if (total == 0 || rows <= 0) {  // a compressor this layer does not run
    stop_holding(c);
    return;
  }
  DS_CHECK(total % static_cast<size_t>(rows) == 0, "internal: compressor carry of {} values over {} positions", total,
           rows);
  const int64_t width = static_cast<int64_t>(total) / rows, from = v4_carry_start(length, m);
  DS_CHECK(from >= c.held_start, "internal: the carry after {} tokens starts at {}, before the mark's {}", length, from,
           c.held_start);
  auto cut = [&](std::vector<float>& held, std::vector<float>& now_rows) {
    held.insert(held.end(), now_rows.begin(), now_rows.end());
    now_rows.assign(held.begin() + (from - c.held_start) * width, held.begin() + (length - c.held_start) * width);
  };
  cut(c.held_P, c.P);
  cut(c.held_Z, c.Z);
  c.start = from;
  stop_holding(c);
}

}  // namespace

void v4_settle(V4State& st) {
  for (V4LayerState& l : st.layers) {
    stop_holding(l.carry);
    stop_holding(l.index_carry);
  }
}

std::vector<float> V4Model::forward_keep(const std::vector<V4Request>& batch, bool all_logits,
                                         std::vector<float>* hidden) {
  std::vector<Pass> passes;
  passes.push_back(begin_pass(batch, nullptr, false));
  auto out = run_passes(passes, all_logits, {nullptr}, nullptr, true);
  if (hidden) hidden->assign(passes[0].X.begin(), passes[0].X.end());
  return std::move(out[0]);
}

std::vector<float> V4Model::draft(const std::vector<V4DraftRequest>& batch, std::vector<float>* last) {
  const int64_t d = cfg_.hidden_size, hc = cfg_.hc_mult, V = cfg_.vocab_size, L = cfg_.num_hidden_layers;
  DS_CHECK(cfg_.num_nextn_predict_layers == 1 && w_.mtp.size() == 1, "V4 draft: the model has {} MTP layers, not one",
           w_.mtp.size());
  std::vector<Segment> msegs;
  std::vector<int32_t> next, pos;
  int64_t R = 0;
  for (const V4DraftRequest& r : batch) {
    if (r.n == 0) continue;
    DS_CHECK(r.state != nullptr && r.hidden != nullptr && r.next != nullptr && r.n > 0 && r.start >= 0,
             "V4 draft: a request without a state, rows or tokens");
    DS_CHECK(static_cast<int64_t>(r.state->layers.size()) == L + 1, "V4 draft: state of another model");
    DS_CHECK(r.start + r.n <= cfg_.max_position_embeddings, "V4 draft: {} positions exceed max_position_embeddings {}",
             r.start + r.n, cfg_.max_position_embeddings);
    for (const Segment& g : msegs) DS_CHECK(g.state != r.state, "V4 draft: one sequence twice in a batch");
    msegs.push_back({r.state, r.next, r.start, r.n, R});
    for (int64_t t = 0; t < r.n; ++t) {
      DS_CHECK(r.next[t] >= 0 && r.next[t] < V, "token id {} is outside the vocabulary of {}", r.next[t], V);
      next.push_back(r.next[t]);
      pos.push_back(static_cast<int32_t>(r.start + t));
    }
    R += r.n;
  }
  if (last) last->clear();
  if (R == 0) return {};
  Buffer<float> h(static_cast<size_t>(R * hc * d)), Xm;
  size_t k = 0;
  for (const V4DraftRequest& r : batch)
    if (r.n > 0) std::copy(r.hidden, r.hidden + r.n * hc * d, h.begin() + msegs[k++].row * hc * d);
  std::vector<Staged> tasks;
  tasks.push_back(mtp_layer(Xm, h, next, pos, msegs, nullptr, nullptr));
  run_interleaved(tasks, L, false);
  // Each request's last row.
  const int64_t S = static_cast<int64_t>(msegs.size());
  Buffer<float> Xr(static_cast<size_t>(S * hc * d));
  for (int64_t s = 0; s < S; ++s) {
    const Segment& g = msegs[static_cast<size_t>(s)];
    std::copy(Xm.begin() + (g.row + g.n - 1) * hc * d, Xm.begin() + (g.row + g.n) * hc * d, Xr.begin() + s * hc * d);
  }
  if (last) last->assign(Xr.begin(), Xr.end());
  const auto& M = w_.mtp[0];
  return head_forward(Xr.data(), S, M.hc_head_fn, M.hc_head_base, M.hc_head_scale, M.norm, nullptr, true);
}

V4StateMark V4Model::mark(V4State& st, int64_t l0, int64_t l1, int64_t start, int64_t n) const {
  const int64_t W = cfg_.sliding_window;
  DS_CHECK(0 <= l0 && l0 < l1 && l1 <= static_cast<int64_t>(st.layers.size()), "V4 mark: layers [{}, {}) of {}", l0, l1,
           st.layers.size());
  DS_CHECK(n >= 0 && n <= W, "V4 mark: a step that may be undone appends at most sliding_window {} tokens, not {}", W,
           n);
  // DeepSeek's released decode (late_index_keys): which keys a token's
  // index source scores depends on what its step published, so a step cut
  // short is not the shorter step.
  DS_CHECK(!(opt_.late_index_keys && cfg_.v41()),
           "V4 mark: with late index keys a step's tokens depend on how the tokens are split into steps, so a step "
           "cannot be undone");
  V4StateMark mk;
  mk.l0 = l0, mk.l1 = l1, mk.start = start, mk.n = n;
  mk.engram_history = st.engram_history;
  mk.published_keys = st.published_keys;
  for (int64_t l = l0; l < l1; ++l) {
    V4LayerState& ls = st.layers[static_cast<size_t>(l)];
    V4LayerMark lm;
    lm.count = ls.count;
    for_each_entry_list(ls, [&](const auto& v) { lm.sizes.push_back(v.size()); });
    if (!ls.window.empty()) {
      const size_t D = ls.window.size() / static_cast<size_t>(W);
      lm.slots.resize(static_cast<size_t>(n) * D);
      for (int64_t i = 0; i < n; ++i) {
        const auto row = ls.window.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>((start + i) % W) * D);
        std::copy(row, row + static_cast<std::ptrdiff_t>(D), lm.slots.begin() + static_cast<std::ptrdiff_t>(i * D));
      }
    }
    start_holding(ls.carry);
    start_holding(ls.index_carry);
    mk.layers.push_back(std::move(lm));
  }
  return mk;
}

void V4Model::rewind(V4State& st, const V4StateMark& mk, int64_t now, int64_t length, const int32_t* ids) const {
  DS_CHECK(mk.start <= length && length <= now && now <= mk.start + mk.n,
           "V4 rewind: to {} from {}, the marked step appended positions [{}, {})", length, now, mk.start,
           mk.start + mk.n);
  DS_CHECK(static_cast<int64_t>(mk.layers.size()) == mk.l1 - mk.l0 && mk.l1 <= static_cast<int64_t>(st.layers.size()),
           "V4 rewind: a mark of another state");
  const bool main = mk.l0 == 0;
  if (main) DS_CHECK(st.length == now, "V4 rewind: the state is at {}, not {}", st.length, now);
  const int64_t W = cfg_.sliding_window;
  for (int64_t l = mk.l0; l < mk.l1; ++l) {
    V4LayerState& ls = st.layers[static_cast<size_t>(l)];
    const V4LayerMark& lm = mk.layers[static_cast<size_t>(l - mk.l0)];
    if (!lm.slots.empty()) {  // the window's slots the dropped positions overwrote
      const size_t D = ls.window.size() / static_cast<size_t>(W);
      for (int64_t p = length; p < now; ++p)
        std::copy(lm.slots.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(p - mk.start) * D),
                  lm.slots.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(p - mk.start + 1) * D),
                  ls.window.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(p % W) * D));
    }
    const int64_t m = cfg_.compress_ratio(l);
    if (m > 0) {
      // Entry b pools window b, which closes once (b + 1) m tokens are in.
      const int64_t c0 = lm.count, c1 = ls.count;
      int64_t keep = c0;
      while (keep < c1 && (keep + 1) * m <= length) ++keep;
      if (keep < c1) {
        size_t j = 0;
        for_each_entry_list(ls, [&](auto& v) {
          const size_t s0 = lm.sizes[j++], grown = v.size() - s0, added = static_cast<size_t>(c1 - c0);
          DS_CHECK(v.size() >= s0 && grown % added == 0, "internal: an entry list grew by {} for {} entries", grown,
                   added);
          v.resize(s0 + grown / added * static_cast<size_t>(keep - c0));
        });
        ls.count = keep;
      }
      rewind_carry(ls.carry, now, length, m);
      rewind_carry(ls.index_carry, now, length, m);
    } else {
      stop_holding(ls.carry);
      stop_holding(ls.index_carry);
    }
  }
  if (!main) return;
  st.length = length;
  if (!cfg_.engram_layers.empty()) {
    st.engram_history = mk.engram_history;
    advance_engram_history({Segment{&st, ids, mk.start, length - mk.start, 0}});
  }
  if (cfg_.v41()) {  // the last layer, in layer order, whose kept tokens published index keys
    st.published_keys = mk.published_keys;
    for (int64_t l = mk.l0; l < mk.l1 && l < cfg_.num_hidden_layers; ++l)
      if (cfg_.owns_indexer(l) && st.layers[static_cast<size_t>(l)].count > mk.layers[static_cast<size_t>(l)].count)
        st.published_keys = l;
  }
}

}  // namespace ds::model
