// DeepSeek-V4 generation: a loaded V4 folder, and the per-sequence states
// (model/v4_model.h) behind the common generation loop (infer/generate.h).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "infer/generate.h"
#include "io/safetensors.h"
#include "model/v4_model.h"

namespace ds::infer {

class Model;
struct ModelOptions;
// DeepSeek-V4's face to generation (infer/model.h's open_model picks it).
std::unique_ptr<Model> open_v4_model(const std::string& dir, const ModelOptions& opt);

struct LoadedV4Model {
  model::V4Config config;
  io::SafetensorsSet files;
  model::V4Weights weights;
  std::unique_ptr<model::V4Model> model;  // refers to config and weights above
};

// Whether DIR/config.json says model_type deepseek_v4.
bool is_v4_folder(const std::string& dir);
// DIR/config.json alone (checked).
model::V4Config load_v4_config(const std::string& dir);
std::unique_ptr<LoadedV4Model> load_v4_model(const std::string& dir, model::V4Options opt = {});

// check_generate_options, then the states of every sequence at its longest
// (prompt plus new tokens) against this machine's memory.
// `codes`: the state's layout (model::v4_state_bytes); `mtp`: speculative
// decoding, whose MTP block keeps a layer's state of its own as long.
void check_v4_request(const model::V4Config& cfg, const std::vector<int64_t>& prompt_lengths,
                      const GenerateOptions& opt, bool codes = true, bool mtp = false);

// With mtp, speculative decoding with the model's MTP block
// (infer/speculative.h): each sequence keeps the last-layer streams of the
// positions its MTP layer has not read, and a step that checks drafts is
// marked (model::V4Model::mark) so that truncate() can drop its rejected
// positions from every layer's state.
class V4Decoder : public Decoder {
 public:
  explicit V4Decoder(model::V4Model& m, bool mtp = false);
  int64_t vocab_size() const override { return m_.config().vocab_size; }
  int64_t max_positions() const override { return m_.config().max_position_embeddings; }
  void start(int64_t sequences) override;
  void reset(int64_t sequence) override;
  std::vector<float> step(const std::vector<std::vector<int32_t>>& tokens) override;
  std::vector<float> step_all(const std::vector<std::vector<int32_t>>& tokens) override;
  int64_t length(int64_t s) const override { return states_[static_cast<size_t>(s)].length; }
  size_t cache_bytes() const override;
  void copy(int64_t from, int64_t to) override;
  // The cache pool counts a V4 state by its contents (model::v4_state_bytes),
  // not by the spare capacity of its buffers.
  size_t sequence_bytes(int64_t s) const override;
  size_t bytes_after(int64_t s, int64_t n) const override;
  size_t bytes_for(int64_t tokens) const override;
  // A V4 state cannot be cut (its compressors pool the positions before):
  // a snapshot is restored whole, when the prompt extends all of it.
  std::shared_ptr<const CacheSnapshot> take_snapshot(int64_t s) override;
  int64_t restorable(const CacheSnapshot& snap, int64_t want) const override;
  void restore(int64_t s, const CacheSnapshot& snap, int64_t length) override;
  int64_t drafted(int64_t s) const override { return extra_[static_cast<size_t>(s)].drafted; }

  bool can_draft() const override { return mtp_; }
  std::vector<float> step_keep(const std::vector<std::vector<int32_t>>& tokens, bool all_logits) override;
  std::vector<float> draft(const std::vector<std::vector<int32_t>>& next) override;
  std::vector<float> draft_more(const std::vector<int32_t>& tokens) override;
  void drop_links() override;
  void truncate(int64_t sequence, int64_t length) override;

 private:
  // What speculative decoding keeps of a sequence besides its state.
  struct Drafting {
    std::vector<float> kept;  // last-layer streams [length - drafted, hc, d] the MTP layer has not read
    int64_t drafted = 0;      // positions the MTP layer has read
    std::vector<float> link;  // the MTP layer's last output streams [hc, d] (what a chained draft reads)
    int64_t links = 0;        // chained drafts in the MTP layer's state since the last draft()
    bool marked = false;      // step holds the last step (truncate can drop its positions)
    model::V4StateMark step, chain;
    std::vector<int32_t> step_ids;
    size_t bytes() const;
  };
  std::vector<float> run(const std::vector<std::vector<int32_t>>& tokens, bool all_logits);
  void check_sequence(int64_t s, const char* what) const;
  int64_t row_width() const;  // floats of one position's streams
  size_t mark_bytes() const;  // the most a sequence's marks hold

  model::V4Model& m_;
  const bool mtp_;
  std::vector<model::V4State> states_;
  std::vector<Drafting> extra_;
};

}  // namespace ds::infer
