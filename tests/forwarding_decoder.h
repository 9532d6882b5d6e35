// A generation Decoder that passes every call on to another; tests derive
// from it and override step() to make steps fail, wait or take time.
#pragma once

#include <cstdint>
#include <vector>

#include "infer/generate.h"

namespace ds::test {

class ForwardingDecoder : public infer::Decoder {
 public:
  explicit ForwardingDecoder(infer::Decoder& d) : d_(d) {}
  int64_t vocab_size() const override { return d_.vocab_size(); }
  int64_t max_positions() const override { return d_.max_positions(); }
  void start(int64_t sequences) override { d_.start(sequences); }
  void reset(int64_t sequence) override { d_.reset(sequence); }
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override { return d_.step(tokens); }
  std::vector<float> step_all(const std::vector<std::vector<int32_t>>& tokens) override { return d_.step_all(tokens); }
  int64_t length(int64_t sequence) const override { return d_.length(sequence); }
  size_t cache_bytes() const override { return d_.cache_bytes(); }
  void copy(int64_t from, int64_t to) override { d_.copy(from, to); }
  bool can_draft() const override { return d_.can_draft(); }
  std::vector<float> step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) override {
    return d_.step_keep(tokens, all_logits);
  }
  std::vector<float> draft(const std::vector<std::vector<int32_t>>& next) override { return d_.draft(next); }
  std::vector<float> draft_more(const std::vector<int32_t>& tokens) override { return d_.draft_more(tokens); }
  void drop_links() override { d_.drop_links(); }
  void truncate(int64_t sequence, int64_t length) override { d_.truncate(sequence, length); }
  size_t sequence_bytes(int64_t s) const override { return d_.sequence_bytes(s); }
  size_t bytes_after(int64_t s, int64_t n) const override { return d_.bytes_after(s, n); }
  size_t bytes_for(int64_t tokens) const override { return d_.bytes_for(tokens); }
  void limit_length(int64_t tokens) override { d_.limit_length(tokens); }
  std::shared_ptr<const infer::CacheSnapshot> take_snapshot(int64_t s) override { return d_.take_snapshot(s); }
  int64_t restorable(const infer::CacheSnapshot& snap, int64_t want) const override {
    return d_.restorable(snap, want);
  }
  void restore(int64_t s, const infer::CacheSnapshot& snap, int64_t length) override { d_.restore(s, snap, length); }
  int64_t drafted(int64_t s) const override { return d_.drafted(s); }

 private:
  infer::Decoder& d_;
};

}  // namespace ds::test
