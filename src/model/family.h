// The model-family seam, as MaxText's decoders.py picks a layer class from
// `decoder_block`: a DeepSeek generation (V2/V3/V3.2, V4, ...) is one
// implementation of `Family`, and the trainer, checkpoints, export and
// `deepseek init` talk to this interface only.
//
// A family describes its parameters as one flat float32 order (`layout()`,
// the order of its parameter walker): master weights, gradients, AdamW's
// moments, checkpoints and data-parallel reductions are all buffers in that
// order. `bind` gives the training loss over such buffers; `bind_streamed`
// the loss over per-layer trees that FSDP streams in.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "model/model.h"
#include "model/params.h"
#include "model/remat.h"
#include "model/v4_config.h"

namespace ds::model {

// A family's loss over one set of parameter buffers.
class BoundModel {
 public:
  virtual ~BoundModel() = default;
  // The loss terms of `batch` (this rank's rows; opt.whole weighs them as a
  // share of the whole batch). With `grads`, opt.grad_scale x dloss/dparam is
  // added into the bound gradient buffer. opt.mtp_num_layers 0 leaves the
  // MTP loss out (eval), whatever the model has.
  virtual LossTerms loss_and_grad(const TrainBatch& batch, const LossOptions& opt, const RematPolicy& remat,
                                  bool grads) = 0;
  // The parameter buffer was written from outside (initialised, loaded, a
  // checkpoint, a broadcast): refresh what is derived from it. ds::Error
  // when it holds what the family cannot run (e.g. a hash table entry that
  // is not an expert id).
  virtual void params_changed() {}
};

// The leaves of a family's parameter trees that a LayerStream (FSDP)
// points unit by unit. Units: 0 the embedding, 1 + l decoder layer (or MTP
// depth) l, the last the tail (final norm, head).
struct TreeLeaves {
  std::vector<ops::WeightView*> views;       // per tensor of layout(), its view leaf (null: none)
  std::vector<float**> grads;                // and its gradient leaf
  std::function<void(int64_t)> after_point;  // after unit u's leaves are set (may be empty)
};
// A V2/V3 model's trees' leaves (the tied head follows the embedding).
TreeLeaves tree_leaves(const ModelConfig& cfg, int64_t mtp_layers, ParamsView& view, ModelParams<float*>& grads);

// Those trees and the family's loss over them.
struct StreamedModel {
  TreeLeaves leaves;
  std::unique_ptr<BoundModel> bound;  // owns the trees; its loss acquires units from opt.stream
};

class Family {
 public:
  virtual ~Family() = default;

  // "DeepSeek-V3", "DeepSeek-V4": for messages.
  virtual std::string name() const = 0;
  // The Hugging Face config.json this model is recorded as (checkpoints,
  // config.json of the run); equal jsons mean the same model.
  virtual nlohmann::json hf_config() const = 0;
  virtual int64_t vocab_size() const = 0;
  virtual int64_t max_positions() const = 0;
  // MTP depths the model has (its loss runs them unless told 0).
  virtual int64_t mtp_layers() const = 0;

  // The parameter tree in flat order, and its size in floats.
  virtual std::vector<ParamInfo> layout() const = 0;
  virtual int64_t numel() const = 0;
  // The layers whose expert loads LossTerms::expert_load reports, in its order.
  virtual std::vector<int64_t> moe_layers() const = 0;
  // Routed experts per MoE layer (0: none), which expert parallelism shares out.
  virtual int64_t routed_experts() const = 0;
  // The aux-loss-free balancing rate (routed_bias_update_rate; 0: off).
  virtual double routed_bias_update_rate() const = 0;

  // Parameters in the flat order: random (matrices normal(0, std), one Philox
  // stream each in tree order), from a Hugging Face folder, to one.
  virtual void init(float* params, uint64_t seed, float std) const = 0;
  virtual void load_hf(const std::string& dir, float* params) const = 0;
  virtual void export_hf(const std::string& out_dir, const float* params, DType dtype, const char* who) const = 0;
  // A randomly initialised model folder, as `deepseek init` writes one
  // (matrices normal(0, std) from `seed`), its weights in `dtype`: one of
  // init_dtypes(), ds::Error for another. By default init, then export_hf.
  // `tokenizer` (a tokenizer.json, or empty) is copied into the folder; a
  // model whose Engram layers hash token classes needs one.
  virtual std::vector<DType> init_dtypes() const { return {DType::BF16, DType::F16, DType::F32}; }
  virtual void write_random(const std::string& out_dir, uint64_t seed, float std, DType dtype,
                            const std::string& tokenizer = "") const;
  // Model FLOPs of one training step (MaxText's accounting, model/flops.h).
  virtual double step_flops(int64_t batch, int64_t seq, int64_t grad_accum) const = 0;

  // The normalizers of a whole batch (counted targets, counted MTP targets
  // with `mtp`, rows), for data parallelism's shares.
  virtual LossOptions::Whole loss_weights(const TrainBatch& whole, bool mtp) const = 0;
  // What the run asks of the loss that this family does not offer: one
  // clear ds::Error (nothing: all supported).
  virtual void check_loss_options(const LossOptions& opt) const { (void)opt; }
  // What a training run should be told of this model (one line; empty: nothing).
  virtual std::string training_note(const LossOptions& opt) const {
    (void)opt;
    return "";
  }
  // Whether LossTerms::indexer_loss means something (a DSA model).
  virtual bool reports_indexer_loss() const { return false; }
  // The bytes a training step's forward keeps for the backward per token of
  // sequences of `seq` tokens under `keep` (bf16: dtype=bfloat16, which
  // holds the streams and named residuals in 2 bytes): at or above the
  // step's LossTerms::saved_bytes over its tokens. train::training_memory_bytes'
  // activation estimate.
  virtual double saved_bytes_per_token(const RematPolicy& keep, bool bf16, int64_t seq) const = 0;

  // The loss over whole flat buffers (grads may be null: forward only).
  // The buffers must outlive the result.
  virtual std::unique_ptr<BoundModel> bind(float* params, float* grads) const = 0;
  // The trees FSDP streams the layers into, and the loss over them (null:
  // the family holds whole buffers only).
  virtual std::unique_ptr<StreamedModel> bind_streamed() const { return nullptr; }
};

// The family of a recorded Hugging Face config.json (a checkpoint's
// state.json, a model folder), by its model_type (model/family_kind.h);
// `source` names it in errors.
std::unique_ptr<Family> family_from_hf_config(const nlohmann::json& config, const std::string& source);

// DeepSeek-V2/V3/V3.2 (the stage functions), with `mtp_layers` MTP depths
// (model/v3/family.cc).
std::unique_ptr<Family> v3_family(const ModelConfig& cfg, int64_t mtp_layers);
// DeepSeek-V4 (model/v4/family.cc); its balancing rate is a training key.
std::unique_ptr<Family> v4_family(const V4Config& cfg, double routed_bias_update_rate);

// Copies a tokenizer.json (none when empty) into a model folder.
void copy_tokenizer(const std::string& tokenizer, const std::string& out_dir);

}  // namespace ds::model
