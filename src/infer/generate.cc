#include "infer/generate.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <memory>

#include "core/error.h"
#include "core/system.h"
#include "infer/speculative.h"
#include "model/engram.h"
#include "ops/indexer.h"

namespace ds::infer {

double GenerateStats::decode_tokens_per_second() const {
  return decode_seconds > 0 ? decode_steps_tokens / decode_seconds : 0;
}

RowWidths cache_row_widths(const model::ModelConfig& c, CacheKind kind, bool indexer) {
  RowWidths w;
  if (kind == CacheKind::Latent) {
    w.c_kv = c.kv_lora_rank;
    w.k_pe = c.qk_rope_head_dim;
  } else {
    w.k = c.num_attention_heads * c.qk_head_dim();
    w.v = c.num_attention_heads * c.v_head_dim;
  }
  if (indexer && c.index_n_heads > 0) {  // DeepSeek-V3.2: the e4m3 key and its float32 block scales
    w.index_k = c.index_head_dim;
    w.index_scale = ops::indexer_scale_blocks(c.index_head_dim);
  }
  return w;
}

int64_t kv_cache_bytes_per_token(const model::ModelConfig& cfg, CacheKind kind) {
  return static_cast<int64_t>(cache_row_widths(cfg, kind, true).bytes(cfg.num_hidden_layers));
}

void check_generate_options(int64_t vocab_size, int64_t max_positions, const std::vector<int64_t>& prompt_lengths,
                            const GenerateOptions& opt) {
  DS_CHECK(!prompt_lengths.empty(), "generate: no prompts");
  DS_CHECK(static_cast<int64_t>(prompt_lengths.size()) <= kMaxSequences, "generate: {} prompts; at most {} at once",
           prompt_lengths.size(), kMaxSequences);
  DS_CHECK(opt.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got {}", opt.max_new_tokens);
  check_sampler(opt.sampler);
  DS_CHECK(opt.prefill_chunk >= 0, "generate: prefill_chunk must be >= 0, got {}", opt.prefill_chunk);
  DS_CHECK(opt.draft_tokens >= 0, "generate: draft tokens must be >= 0, got {}", opt.draft_tokens);
  DS_CHECK(opt.sample_vocab >= 0 && opt.sample_vocab <= vocab_size, "generate: sample_vocab {} outside [0, {}]",
           opt.sample_vocab, vocab_size);
  for (size_t s = 0; s < prompt_lengths.size(); ++s) {
    const int64_t n = prompt_lengths[s];
    DS_CHECK(n > 0, "sequence {} is empty", s);
    DS_CHECK(n <= max_positions, "sequence {} has {} tokens, beyond max_position_embeddings {}", s, n, max_positions);
  }
}

void check_generate_request(const model::ModelConfig& cfg, const std::vector<int64_t>& prompt_lengths,
                            const GenerateOptions& opt) {
  check_generate_options(cfg.vocab_size, cfg.max_position_embeddings, prompt_lengths, opt);
  int64_t tokens = 0;
  for (const int64_t n : prompt_lengths) {
    // Tokens that go through the model: the prompt and every new token but
    // the last (generation stops at max_position_embeddings).
    const int64_t fed = std::min(n + std::clamp<int64_t>(opt.max_new_tokens - 1, 0, cfg.max_position_embeddings),
                                 cfg.max_position_embeddings);
    tokens += fed;
  }
  check_fits_in_memory(tokens * kv_cache_bytes_per_token(cfg, opt.cache), "the KV cache of this request");
}

std::vector<float> Decoder::step_all(const std::vector<std::vector<int32_t>>&) {
  throw Error("this model's decoder gives no logits of prompt positions");
}

void Decoder::restore(int64_t, const CacheSnapshot&, int64_t) {
  throw Error("this model's decoder cannot restore a cached prefix");
}

void Decoder::copy(int64_t, int64_t) { throw Error("this model's decoder cannot copy a sequence"); }

std::vector<float> Decoder::step_keep(const std::vector<std::vector<int32_t>>&, bool) {
  throw Error("this model's decoder has no MTP layer to draft with");
}
std::vector<float> Decoder::draft(const std::vector<std::vector<int32_t>>&) {
  throw Error("this model's decoder has no MTP layer to draft with");
}
std::vector<float> Decoder::draft_more(const std::vector<int32_t>&) {
  throw Error("this model's decoder has no MTP layer to draft with");
}
void Decoder::drop_links() {}
void Decoder::truncate(int64_t, int64_t) { throw Error("this model's decoder cannot drop tokens"); }

namespace {

// The V2/V3 engine over its KV cache (with the MTP layer's, when loaded:
// one layer more, and each sequence's hidden states kept for draft()).
class KvDecoder : public Decoder {
 public:
  KvDecoder(Engine& e, CacheKind kind) : e_(e), kind_(kind) {}
  int64_t vocab_size() const override { return e_.config().vocab_size; }
  int64_t max_positions() const override { return e_.config().max_position_embeddings; }
  void start(int64_t sequences) override {
    cache_ = std::make_unique<KvCache>(kind_, sequences, layers());
    kept_.assign(static_cast<size_t>(sequences), {});
    link_.assign(static_cast<size_t>(sequences), {});
    links_.assign(static_cast<size_t>(sequences), 0);
  }
  void reset(int64_t s) override {
    DS_CHECK(cache_ && s >= 0 && s < static_cast<int64_t>(cache_->seqs.size()), "reset: no sequence {}", s);
    cache_->seqs[static_cast<size_t>(s)] = SequenceCache(layers());
    kept_[static_cast<size_t>(s)].clear();
    link_[static_cast<size_t>(s)].clear();
    links_[static_cast<size_t>(s)] = 0;
  }
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override {
    grow(tokens);
    return e_.step(*cache_, tokens, false);
  }
  std::vector<float> step_all(const std::vector<std::vector<int32_t>>& tokens) override {
    grow(tokens);
    return e_.step(*cache_, tokens, true);
  }
  int64_t length(int64_t s) const override { return cache_->seqs[static_cast<size_t>(s)].length; }
  size_t cache_bytes() const override { return cache_->bytes(); }
  size_t sequence_bytes(int64_t s) const override {
    const size_t i = static_cast<size_t>(s);
    return allocated_bytes(cache_->seqs[i]) + (kept_[i].capacity() + link_[i].capacity()) * sizeof(float);
  }
  size_t bytes_after(int64_t s, int64_t n) const override {
    const size_t i = static_cast<size_t>(s);
    const SequenceCache& sc = cache_->seqs[i];
    size_t b = sequence_bytes(s);
    // With the MTP layer a step also reads its drafts (at most
    // kMaxDraftTokens past the n planned tokens, never past the limit).
    const int64_t drafts = e_.has_mtp() ? kMaxDraftTokens : 0;
    const int64_t most = std::max(limit_, sc.length + n) + margin();
    for_each_buffer(const_cast<SequenceCache&>(sc), n + drafts, [&](const auto& r, int64_t width, int64_t need) {
      const int64_t rows = static_cast<int64_t>(r.capacity()) / width;
      b += static_cast<size_t>((grown_rows(rows, std::min(need, most), limit_ + margin()) - rows) * width) *
           sizeof(r[0]);
    });
    // The hidden states kept for the MTP layer.
    const size_t D = static_cast<size_t>(e_.config().hidden_size), nn = static_cast<size_t>(n + drafts);
    if (e_.has_mtp() && kept_[i].size() + nn * D > kept_[i].capacity())
      b += (std::max(2 * kept_[i].capacity(), kept_[i].size() + nn * D) - kept_[i].capacity()) * sizeof(float);
    return b;
  }
  size_t bytes_for(int64_t tokens) const override {
    const size_t rows = static_cast<size_t>(grown_rows(0, tokens + margin(), tokens + margin()));
    size_t b = widths().bytes(layers()) * rows;
    if (!e_.config().engram_layers.empty())  // the conv's rows (at most every position) and the tokens
      b += rows * (static_cast<size_t>(model::engram_dims(e_.config()).width()) * sizeof(float) *
                       e_.config().engram_layers.size() +
                   sizeof(int32_t));
    if (e_.has_mtp()) b += static_cast<size_t>((tokens + 1) * e_.config().hidden_size) * sizeof(float);
    return b;
  }
  void limit_length(int64_t tokens) override { limit_ = tokens; }

  // With the MTP layer, a snapshot also holds the hidden states it has not
  // read yet (positions draft_length .. length - 1).
  std::shared_ptr<const CacheSnapshot> take_snapshot(int64_t s) override {
    const size_t i = static_cast<size_t>(s);
    if (links_[i] != 0) return nullptr;  // chained drafts in the MTP layer's cache
    auto snap = std::make_shared<Snapshot>(std::move(cache_->seqs[i]));
    snap->kept = std::move(kept_[i]);
    reset(s);
    for_each_row_list(snap->cache, [](auto& rows) {
      for (auto& r : rows) r.shrink_to_fit();
    });
    for (auto& r : snap->cache.engram) r.shrink_to_fit();
    snap->cache.tokens.shrink_to_fit();
    snap->kept.shrink_to_fit();
    return snap;
  }
  int64_t restorable(const CacheSnapshot& snap, int64_t want) const override {
    const auto* k = dynamic_cast<const Snapshot*>(&snap);
    if (!k || k->cache.c_kv.size() != static_cast<size_t>(layers())) return 0;
    const SequenceCache& c = k->cache;
    const int64_t m = std::min(want, c.length);
    // Engram's conv rows before engram_first were dropped.
    const bool engram = std::any_of(c.engram.begin(), c.engram.end(), [](auto& r) { return !r.empty(); });
    if (engram && m < c.engram_first) return 0;
    // The MTP layer's row at position p read token p + 1, which the new
    // prompt may not share at m - 1; the hidden states it read are gone, so
    // its rows are kept whole and m must be past them.
    if (e_.has_mtp() && m < c.draft_length + 1) return 0;
    return std::max<int64_t>(m, 0);
  }
  void restore(int64_t s, const CacheSnapshot& snap, int64_t length) override {
    DS_CHECK(restorable(snap, length) == length && length > 0, "restore: the snapshot cannot give {} positions",
             length);
    SequenceCache& dst = cache_->seqs[static_cast<size_t>(s)];
    DS_CHECK(dst.length == 0, "restore: sequence {} is not empty", s);
    const auto& k = dynamic_cast<const Snapshot&>(snap);
    const SequenceCache& src = k.cache;
    for_each_buffer(dst, length, [&](auto& r, int64_t width, int64_t need) {
      r.reserve(static_cast<size_t>(grown_rows(0, need, limit_ + margin()) * width));
    });
    const size_t mtp = static_cast<size_t>(e_.config().num_hidden_layers);  // the MTP layer, if any
    auto copy_rows = [&](auto& to, const auto& from) {
      for (size_t l = 0; l < from.size(); ++l) {
        if (from[l].empty()) continue;
        const int64_t held = l == mtp ? src.draft_length : src.length, keep = l == mtp ? src.draft_length : length;
        const size_t width = from[l].size() / static_cast<size_t>(held);
        to[l].assign(from[l].begin(), from[l].begin() + static_cast<std::ptrdiff_t>(width * keep));
      }
    };
    copy_rows(dst.c_kv, src.c_kv);
    copy_rows(dst.k_pe, src.k_pe);
    copy_rows(dst.k, src.k);
    copy_rows(dst.v, src.v);
    copy_rows(dst.index_k, src.index_k);
    copy_rows(dst.index_scale, src.index_scale);
    for (size_t l = 0; l < src.engram.size(); ++l) {
      if (src.engram[l].empty()) continue;
      const size_t width = src.engram[l].size() / static_cast<size_t>(src.length - src.engram_first);
      dst.engram[l].assign(src.engram[l].begin(),
                           src.engram[l].begin() + static_cast<std::ptrdiff_t>(width * (length - src.engram_first)));
    }
    dst.engram_first = src.engram_first;
    dst.tokens.assign(src.tokens.begin(), src.tokens.begin() + std::min<std::ptrdiff_t>(src.tokens.size(), length));
    dst.length = length;
    dst.draft_length = src.draft_length;
    if (e_.has_mtp()) {  // the hidden states of positions draft_length .. length - 1
      const size_t D = static_cast<size_t>(e_.config().hidden_size);
      kept_[static_cast<size_t>(s)].assign(
          k.kept.begin(),
          k.kept.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(length - src.draft_length) * D));
    }
  }
  int64_t drafted(int64_t s) const override { return cache_->seqs[static_cast<size_t>(s)].draft_length; }

  void copy(int64_t from, int64_t to) override {
    const int64_t S = cache_ ? static_cast<int64_t>(cache_->seqs.size()) : 0;
    DS_CHECK(from >= 0 && from < S && to >= 0 && to < S, "copy: no sequence {} or {}", from, to);
    if (from == to) return;
    cache_->seqs[static_cast<size_t>(to)] = cache_->seqs[static_cast<size_t>(from)];
    kept_[static_cast<size_t>(to)] = kept_[static_cast<size_t>(from)];
    link_[static_cast<size_t>(to)] = link_[static_cast<size_t>(from)];
    links_[static_cast<size_t>(to)] = links_[static_cast<size_t>(from)];
  }

  bool can_draft() const override { return e_.has_mtp(); }
  std::vector<float> step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) override {
    DS_CHECK(can_draft(), "this model's MTP layer is not loaded");
    grow(tokens);
    std::vector<float> hidden;
    auto logits = e_.step(*cache_, tokens, all_logits, &hidden);
    const size_t D = static_cast<size_t>(e_.config().hidden_size);
    size_t row = 0;
    for (size_t s = 0; s < tokens.size(); ++s) {
      const size_t n = tokens[s].size();
      kept_[s].insert(kept_[s].end(), hidden.begin() + row * D, hidden.begin() + (row + n) * D);
      row += n;
    }
    return logits;
  }
  std::vector<float> draft(const std::vector<std::vector<int32_t>>& next) override {
    const size_t D = static_cast<size_t>(e_.config().hidden_size);
    std::vector<const float*> hidden(next.size(), nullptr);
    for (size_t s = 0; s < next.size(); ++s) {
      DS_CHECK(next[s].size() * D <= kept_[s].size(), "draft: sequence {} keeps {} positions, {} tokens given", s,
               kept_[s].size() / D, next[s].size());
      hidden[s] = kept_[s].data();
    }
    drop_links();
    std::vector<float> last;
    auto logits = e_.mtp_step(*cache_, next, hidden, 0, &last);
    size_t r = 0;
    for (size_t s = 0; s < next.size(); ++s) {
      kept_[s].erase(kept_[s].begin(), kept_[s].begin() + static_cast<std::ptrdiff_t>(next[s].size() * D));
      if (next[s].empty()) continue;
      link_[s].assign(last.begin() + r * D, last.begin() + (r + 1) * D);
      ++r;
    }
    return logits;
  }
  std::vector<float> draft_more(const std::vector<int32_t>& tokens) override {
    const size_t D = static_cast<size_t>(e_.config().hidden_size);
    DS_CHECK(tokens.size() == link_.size(), "draft_more: {} tokens for {} sequences", tokens.size(), link_.size());
    std::vector<std::vector<int32_t>> next(tokens.size());
    std::vector<const float*> hidden(tokens.size(), nullptr);
    int64_t ahead = 0;
    for (size_t s = 0; s < tokens.size(); ++s) {
      if (tokens[s] < 0) continue;
      DS_CHECK(link_[s].size() == D, "draft_more: sequence {} has no draft to chain from", s);
      next[s] = {tokens[s]};
      hidden[s] = link_[s].data();
      ahead = std::max(ahead, links_[s] + 1);
    }
    std::vector<float> last;
    auto logits = e_.mtp_step(*cache_, next, hidden, ahead, &last);
    size_t r = 0;
    for (size_t s = 0; s < tokens.size(); ++s) {
      if (tokens[s] < 0) continue;
      link_[s].assign(last.begin() + r * D, last.begin() + (r + 1) * D);
      ++links_[s];
      ++r;
    }
    return logits;
  }
  void drop_links() override {
    const int64_t L = e_.config().num_hidden_layers;
    for (size_t s = 0; s < links_.size(); ++s) {
      if (links_[s] == 0) continue;
      SequenceCache& sc = cache_->seqs[s];
      truncate_layer(sc, L, sc.draft_length, sc.draft_length - links_[s]);
      sc.draft_length -= links_[s];
      links_[s] = 0;
    }
  }
  void truncate(int64_t s, int64_t length) override {
    SequenceCache& sc = cache_->seqs[static_cast<size_t>(s)];
    auto& kept = kept_[static_cast<size_t>(s)];
    const size_t D = static_cast<size_t>(e_.config().hidden_size), drop = static_cast<size_t>(sc.length - length);
    DS_CHECK(length >= sc.draft_length && length <= sc.length && drop * D <= kept.size(),
             "truncate: sequence {} of {} tokens ({} drafted from, {} kept) to {}", s, sc.length, sc.draft_length,
             kept.size() / D, length);
    infer::truncate(sc, length, e_.config().num_hidden_layers);
    kept.resize(kept.size() - drop * D);
  }

 private:
  struct Snapshot final : CacheSnapshot {
    explicit Snapshot(SequenceCache c) : cache(std::move(c)) {}
    int64_t length() const override { return cache.length; }
    size_t bytes() const override { return allocated_bytes(cache) + kept.capacity() * sizeof(float); }
    SequenceCache cache;
    std::vector<float> kept;  // with the MTP layer: hidden states [length - draft_length, hidden_size]
  };
  int64_t layers() const { return e_.config().num_hidden_layers + (e_.has_mtp() ? 1 : 0); }
  // Positions past a sequence's length its buffers make room for: a step's
  // drafts and the MTP layer's chained links.
  int64_t margin() const { return e_.has_mtp() ? kMaxDraftTokens + 1 : 0; }
  RowWidths widths() const { return cache_row_widths(e_.config(), kind_, !e_.dense_attention()); }
  // f(buffer, elements per position, positions it must hold) for each
  // buffer of sc that n more tokens grow: the row lists of every layer,
  // Engram's conv rows and its tokens.
  template <class F>
  void for_each_buffer(SequenceCache& sc, int64_t n, F f) const {
    const RowWidths w = widths();
    const int64_t per[] = {w.c_kv, w.k_pe, w.k, w.v, w.index_k, w.index_scale};
    const int64_t need = sc.length + n + margin();
    int j = 0;
    for_each_row_list(sc, [&](auto& lists) {
      const int64_t width = per[j++];
      if (width == 0) return;
      for (int64_t l = 0; l < layers(); ++l) f(lists[static_cast<size_t>(l)], width, need);
    });
    if (e_.config().engram_layers.empty()) return;
    const int64_t W = model::engram_dims(e_.config()).width();
    for (const int64_t l : e_.config().engram_layers) f(sc.engram[static_cast<size_t>(l)], W, need - sc.engram_first);
    f(sc.tokens, 1, need);
  }
  // Room in every buffer of the sequences that take tokens, before a step.
  void grow(const std::vector<std::vector<int32_t>>& tokens) {
    for (size_t s = 0; s < tokens.size() && s < cache_->seqs.size(); ++s)
      if (!tokens[s].empty())
        for_each_buffer(cache_->seqs[s], static_cast<int64_t>(tokens[s].size()),
                        [&](auto& r, int64_t width, int64_t need) {
                          const int64_t rows = static_cast<int64_t>(r.capacity()) / width;
                          const int64_t to = grown_rows(rows, need, limit_ + margin());
                          if (to > rows) r.reserve(static_cast<size_t>(to * width));
                        });
  }

  Engine& e_;
  CacheKind kind_;
  std::unique_ptr<KvCache> cache_;
  std::vector<std::vector<float>> kept_;  // per sequence: hidden states [positions, hidden_size] draft() has not read
  // Per sequence: the MTP layer's last hidden state (what the next link
  // reads) and the links in its cache since the last draft().
  std::vector<std::vector<float>> link_;
  std::vector<int64_t> links_;
  int64_t limit_ = std::numeric_limits<int32_t>::max();  // limit_length()
};

}  // namespace

std::unique_ptr<Decoder> kv_decoder(Engine& engine, CacheKind kind) {
  return std::make_unique<KvDecoder>(engine, kind);
}

std::vector<std::vector<int32_t>> generate(infer::Engine& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& opt, GenerateStats* stats) {
  std::vector<int64_t> lengths;
  for (const auto& p : prompts) lengths.push_back(static_cast<int64_t>(p.size()));
  check_generate_request(model.config(), lengths, opt);
  KvDecoder d(model, opt.cache);
  return generate(d, prompts, opt, stats);
}

std::vector<std::vector<int32_t>> prefill_part(const std::vector<std::vector<int32_t>>& prompts,
                                               const std::vector<size_t>& fed, int64_t lead, int64_t chunk) {
  const int64_t S = static_cast<int64_t>(prompts.size());
  std::vector<std::vector<int32_t>> part(static_cast<size_t>(S));
  int64_t budget = chunk > 0 ? chunk : std::numeric_limits<int64_t>::max();
  for (int64_t s = lead; s < S && budget > 0; ++s) {
    const auto& p = prompts[s];
    const size_t n = std::min<size_t>(p.size() - fed[s], static_cast<size_t>(budget));
    part[s].assign(p.begin() + static_cast<std::ptrdiff_t>(fed[s]),
                   p.begin() + static_cast<std::ptrdiff_t>(fed[s] + n));
    budget -= static_cast<int64_t>(n);
  }
  return part;
}

std::vector<std::vector<int32_t>> generate(Decoder& model, const std::vector<std::vector<int32_t>>& prompts,
                                           const GenerateOptions& opt, GenerateStats* stats) {
  std::vector<int64_t> lengths;
  for (const auto& p : prompts) lengths.push_back(static_cast<int64_t>(p.size()));
  check_generate_options(model.vocab_size(), model.max_positions(), lengths, opt);
  if (opt.draft_tokens > 0) return generate_speculative(model, prompts, opt, stats);
  const int64_t V = model.vocab_size(), S = static_cast<int64_t>(prompts.size());
  const int64_t draw_vocab = opt.sample_vocab > 0 ? opt.sample_vocab : V;
  model.start(S);
  std::vector<std::vector<int32_t>> out(S);
  std::vector<bool> done(S, opt.max_new_tokens == 0);
  GenerateStats st;
  for (const auto& p : prompts) st.prompt_tokens += static_cast<int64_t>(p.size());
  using clock = std::chrono::steady_clock;

  auto emit = [&](const std::vector<float>& logits, const std::vector<int64_t>& rows_for) {
    for (size_t r = 0; r < rows_for.size(); ++r) {
      const int64_t s = rows_for[r];
      const int32_t tok =
          sample_token(&logits[r * V], draw_vocab, opt.sampler, static_cast<uint64_t>(s), out[s].size());
      out[s].push_back(tok);
      ++st.generated_tokens;
      if (opt.on_token) opt.on_token(s, tok);
      if ((opt.eos_token_id >= 0 && tok == opt.eos_token_id) ||
          static_cast<int64_t>(out[s].size()) >= opt.max_new_tokens || model.length(s) >= model.max_positions())
        done[s] = true;
    }
  };

  if (opt.max_new_tokens > 0) {
    auto t0 = clock::now();
    // Prefill in steps of at most prefill_chunk tokens, taken from the
    // prompts in order; a sequence's first logits come from the step that
    // reaches the end of its prompt.
    std::vector<float> logits(static_cast<size_t>(S * V));
    std::vector<size_t> fed(S, 0);
    for (int64_t next = 0; next < S;) {
      const auto part = prefill_part(prompts, fed, next, opt.prefill_chunk);
      for (int64_t s = next; s < S; ++s) fed[s] += part[s].size();
      const auto lg = model.step(part);
      // step returns one row per sequence that received tokens, in order.
      int64_t row = 0;
      for (int64_t s = next; s < S; ++s) {
        if (part[s].empty()) continue;
        if (fed[s] == prompts[s].size())
          std::copy(lg.begin() + row * V, lg.begin() + (row + 1) * V, logits.begin() + s * V);
        ++row;
      }
      while (next < S && fed[next] == prompts[next].size()) ++next;
    }
    st.prefill_seconds = std::chrono::duration<double>(clock::now() - t0).count();
    std::vector<int64_t> all(S);
    for (int64_t s = 0; s < S; ++s) all[s] = s;
    emit(logits, all);
    auto t1 = clock::now();
    for (;;) {
      std::vector<std::vector<int32_t>> step(S);
      std::vector<int64_t> rows;
      for (int64_t s = 0; s < S; ++s)
        if (!done[s]) {
          step[s] = {out[s].back()};
          rows.push_back(s);
        }
      if (rows.empty()) break;
      auto lg = model.step(step);
      st.decode_steps_tokens += static_cast<int64_t>(rows.size());
      emit(lg, rows);
    }
    st.decode_seconds = std::chrono::duration<double>(clock::now() - t1).count();
  }
  st.cache_bytes = model.cache_bytes();
  if (stats) *stats = st;
  return out;
}

}  // namespace ds::infer
