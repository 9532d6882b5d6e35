// FSDP: the model's float32 parameters and gradients sharded over the fsdp
// axis, each decoder layer (and MTP depth) all-gathered just before use and
// its gradient reduce-scattered just after.
//
// The flat parameter order (model::for_each_param) is cut into units: the
// embedding, each decoder layer, each MTP depth, and the tail (final norm and
// LM head). Unit u of n elements is split into F chunks of c = ceil(n / F);
// rank f owns elements [f c, min((f + 1) c, n)) of it and stores them in
// `shard` (every unit's chunk in unit order, the missing end of a short last
// chunk as zeros), their gradient in `grad_shard`.
//
// The embedding and the tail are resident: gathered whole by
// gather_resident() and kept for the step, their gradients accumulated whole
// and reduce-scattered by finish_grads(). The layers stream through two
// gathered buffers as a model::LayerStream: acquiring unit u waits for its
// all-gather and starts the next unit's (the prefetch: forward 0..U-1, then
// backward U-1..0), and in a backward releasing u starts the reduce-scatter
// of its gradient, which the next-but-one acquire (or finish_grads) adds
// into grad_shard. So a rank holds its shards, the resident units, and four
// layer-sized buffers instead of the whole model twice.
#pragma once

#include <cstdint>
#include <vector>

#include "dist/communicator.h"
#include "model/config.h"
#include "model/model.h"
#include "model/weights.h"

namespace ds::dist {

class FsdpParams final : public model::LayerStream {
 public:
  FsdpParams(const model::ModelConfig& cfg, int64_t mtp_layers, Communicator& fsdp);

  // The trees to give loss_and_grad (with this object as its stream).
  model::ParamsView view;
  model::ModelParams<float*> grads;

  std::vector<float> shard, grad_shard;  // this rank's chunks, in unit order
  struct Piece {
    int64_t lo, hi;  // flat elements owned
    int64_t at;      // index of lo in shard
  };
  const std::vector<Piece>& owned() const { return owned_; }

  // This rank's chunks of a whole flat buffer (`full`: numel floats) into
  // out (shard layout).
  void take_shard(const float* full, float* out) const;
  // Collective: the whole flat buffer from every rank's `shard_layout` chunks.
  void gather_full(const float* shard_layout, float* full);
  // Packed (the owned elements only, in order: AdamW's moments) <-> shard layout.
  std::vector<float> expand(const std::vector<float>& packed) const;
  void pack(const std::vector<float>& shard_layout, std::vector<float>& packed) const;

  // Before a step: the resident units gathered from the shards, every
  // gradient zeroed. gather_resident() alone before an eval.
  void start_step();
  void gather_resident();
  // After the last backward of a step: every gradient reduce-scattered into
  // grad_shard.
  void finish_grads();
  // Floats held: shards, resident units, layer buffers (parameters and
  // gradients), for the memory report.
  int64_t floats_held() const;

  void begin(int64_t units, bool backward) override;
  void acquire(int64_t unit, bool backward) override;
  void release(int64_t unit, bool backward) override;

 private:
  struct Unit {
    int64_t lo = 0, hi = 0;  // flat range
    int64_t c = 0;           // chunk per rank
    int64_t at = 0;          // this rank's chunk in shard
  };
  void point_unit(int64_t u, float* params, float* grads);
  void drain_grad_slot(int slot);

  const model::ModelConfig cfg_;
  const int64_t mtp_;
  Communicator& comm_;
  int64_t F_, rank_, L_;
  std::vector<Unit> units_;  // 0: embedding, 1..L+K: layers and MTP depths, last: tail
  std::vector<Piece> owned_;
  std::vector<int64_t> unit_of_;  // per tensor in walk order
  std::vector<int64_t> offset_of_;
  std::vector<float> resident_[2], resident_grad_[2];  // embedding, tail
  // Streamed layers: two parameter and two gradient buffers of F x c_max.
  std::vector<float> pbuf_[2], gbuf_[2], grecv_[2];
  int64_t pbuf_unit_[2] = {-1, -1}, gbuf_unit_[2] = {-1, -1};
  Handle pbuf_h_[2], gbuf_h_[2];
  // The pass: the sequence of units and the position in it.
  std::vector<int64_t> seq_;
  size_t pos_ = 0;
  int next_gslot_ = 0;
};

}  // namespace ds::dist
