// FSDP with expert sharding: the model's float32 parameters and gradients
// split between the ranks of a shard group (the fsdp x expert ranks of one
// data coordinate, as the seed shards its weights), each decoder layer (and
// MTP depth) all-gathered just before use and its gradient reduce-scattered
// just after.
//
// A family's flat parameter order (its layout: model::ParamInfo in order)
// is cut into units by the tensors' layers: the embedding, each decoder
// layer, each MTP depth, and the tail (final norm and LM head). A unit holds
// dense elements (everything but routed experts, the tensors named
// `.experts.`) and,
// in an MoE layer under expert parallelism (X = expert.size() > 1), the
// routed experts' block, which is contiguous in the flat order:
//   dense    the unit's dense elements in order (the part before the
//            experts, then the part after) are split into G = group.size()
//            chunks of cd = ceil(n / G); group rank g owns chunk g;
//   experts  expert rank x keeps experts [x E/X, (x + 1) E/X) alone (the
//            block the expert exchange sends it rows for), split over the
//            fsdp axis into F chunks of ce; no other rank stores them.
// `shard` holds this rank's chunks unit by unit (dense chunk, then expert
// chunk; the missing end of a short last chunk as zeros), `grad_shard` their
// gradient. Acquiring a unit gathers its dense chunks over the group and its
// expert chunks over fsdp, so the tree's views cover the dense tensors and
// this rank's experts; other ranks' experts stay null (the exchange gives
// them no rows here, so nothing reads them). Gradients go back by the
// matching reduce-scatters: dense ones summed over the group, expert ones
// over fsdp (the exchange already brought every expert-axis rank's rows).
//
// The embedding and the tail are resident: gathered whole by
// gather_resident() and kept for the step, their gradients accumulated whole
// and reduce-scattered by finish_grads(). The layers stream through two
// gathered buffers as a model::LayerStream: acquiring unit u waits for its
// all-gathers and starts the next unit's (the prefetch: forward 0..U-1, then
// backward U-1..0), and in a backward releasing u starts the reduce-scatters
// of its gradient, which the next-but-one acquire (or finish_grads) adds
// into grad_shard. So a rank holds its shards, the resident units, and four
// layer-sized buffers instead of the whole model twice.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "dist/communicator.h"
#include "model/config.h"
#include "model/family.h"
#include "model/model.h"
#include "model/weights.h"

namespace ds::dist {

class FsdpParams final : public model::LayerStream {
 public:
  // Where the tensors of a unit go once it is gathered: per tensor of the
  // layout, a view leaf and a gradient leaf (either may be null), which
  // pointing sets to the gathered memory, or to nothing for another expert
  // rank's expert; then after_point(u) when given.
  using Leaves = model::TreeLeaves;
  // layout: a family's tensors in flat order; routed_experts per MoE layer
  // (0: none); group: the shard group (rank f X + x); fsdp, expert: this
  // rank's axes (no expert: one expert rank, and group and fsdp are the
  // same ranks).
  FsdpParams(std::vector<model::ParamInfo> layout, int64_t routed_experts, Leaves leaves, Communicator& group,
             Communicator& fsdp, Communicator* expert);
  // A V2/V3 model: its layout, with `view` and `grads` as the trees.
  FsdpParams(const model::ModelConfig& cfg, int64_t mtp_layers, Communicator& group, Communicator& fsdp,
             Communicator* expert);
  // FSDP alone: comm is the group and the fsdp axis.
  FsdpParams(const model::ModelConfig& cfg, int64_t mtp_layers, Communicator& comm)
      : FsdpParams(cfg, mtp_layers, comm, comm, nullptr) {}
  FsdpParams(const FsdpParams&) = delete;
  FsdpParams& operator=(const FsdpParams&) = delete;

  // The V2/V3 constructor's trees to give loss_and_grad (with this object
  // as its stream).
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
  // Collective over the group and the expert axis: the whole flat buffer
  // from every rank's `shard_layout` chunks.
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
    int64_t lo = 0, hi = 0;        // flat range
    int64_t elo = 0, ehi = 0;      // the routed experts' block (elo == ehi: none, or no expert parallelism)
    int64_t mine = 0, mine_n = 0;  // this expert rank's experts: flat [mine, mine + mine_n)
    int64_t cd = 0, ce = 0;        // chunk per rank: dense (over the group), experts (over fsdp)
    int64_t at = 0;                // this rank's dense chunk in shard; the expert chunk follows
    int64_t dense() const { return hi - lo - (ehi - elo); }
    // Flat index of dense element v (the part after the experts skips them).
    int64_t flat(int64_t v) const { return lo + v < elo ? lo + v : lo + v + (ehi - elo); }
  };
  // f(flat, n, v) for the runs of dense elements [a, b) (at most two).
  template <typename Fn>
  static void dense_runs(const Unit& x, int64_t a, int64_t b, Fn&& f);
  void point_unit(int64_t u, float* dense, float* experts, float* dense_grad, float* expert_grad);
  void start_gather(int slot, int64_t u);
  void drain_grad_slot(int slot);

  // The communicators (the constructors' common part).
  FsdpParams(std::vector<model::ParamInfo> layout, Communicator& group, Communicator& fsdp, Communicator* expert);
  void cut_units(int64_t routed_experts);

  std::vector<model::ParamInfo> layout_;
  Leaves leaves_;
  std::unique_ptr<Communicator> single_;  // the expert axis of a one-axis FsdpParams
  Communicator &group_, &fsdp_, &expert_;
  int64_t G_, F_, X_, g_, f_, x_;
  int64_t layer_units_ = 0;       // decoder layers and MTP depths
  std::vector<Unit> units_;       // 0: embedding, 1..L+K: layers and MTP depths, last: tail
  std::vector<Piece> owned_;      // in flat order
  std::vector<int64_t> unit_of_;  // per tensor in walk order
  std::vector<int64_t> offset_of_;
  std::vector<float> resident_[2], resident_grad_[2];  // embedding, tail
  // Streamed layers: two parameter and two gradient buffers, each G cd_max
  // dense elements then F ce_max expert elements (at eoff_).
  int64_t eoff_ = 0, roff_ = 0;  // expert part in pbuf/gbuf; in grecv
  std::vector<float> pbuf_[2], gbuf_[2], grecv_[2];
  int64_t pbuf_unit_[2] = {-1, -1}, gbuf_unit_[2] = {-1, -1};
  Handle pbuf_h_[2][2], gbuf_h_[2][2];  // [slot][dense, experts]
  // The pass: the sequence of units and the position in it.
  std::vector<int64_t> seq_;
  size_t pos_ = 0;
  int next_gslot_ = 0;
};

}  // namespace ds::dist
