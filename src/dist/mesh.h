// The device mesh of a run: MaxText's named axes over the ranks of the world.
//
// Axes (MaxText's names and order, outermost first): data, fsdp, expert.
// Each axis's size is ici_<axis>_parallelism x dcn_<axis>_parallelism: the
// ici factors span the ranks of one node, the dcn factors span nodes. One
// value per group may be -1, "fill the rest": the ici product must equal the
// ranks per node and the dcn product the number of nodes (world size / ranks
// per node). MaxText's defaults are ici_fsdp_parallelism=-1 and
// dcn_data_parallelism=-1: every rank of a node is an fsdp shard, and nodes
// replicate.
//
// Rank r is node r / ranks_per_node (mpirun's default placement fills a node
// before the next), local index r % ranks_per_node. Its coordinate on an axis
// is dcn_coord x ici_size + ici_coord, where ici_coord comes from the local
// index and dcn_coord from the node, the last axis (expert) varying fastest.
//
// Every rank holds a shard of the batch (data, fsdp and expert all split it,
// as MaxText's activation sharding does); batch_index() is its place there.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "dist/communicator.h"

namespace ds::dist {

enum Axis { kData = 0, kFsdp = 1, kExpert = 2, kAxes = 3 };
const char* axis_name(Axis a);

struct MeshConfig {
  std::array<int64_t, kAxes> ici{1, -1, 1};  // MaxText's defaults
  std::array<int64_t, kAxes> dcn{-1, 1, 1};
  // The keys this struct reads: ici_data_parallelism, ..., dcn_expert_parallelism.
  static std::vector<std::string> keys();
  void set(const std::string& key, int64_t value);
};

// Axis sizes from the config, the world size and the ranks per node;
// ds::Error (one line) when they cannot fit.
std::array<int64_t, kAxes> resolve_mesh(const MeshConfig& mc, int64_t world, int64_t ranks_per_node);

class Mesh {
 public:
  // Collective over `world` (it splits sub-communicators).
  Mesh(Communicator& world, const MeshConfig& mc, int64_t ranks_per_node);

  int64_t size(Axis a) const { return sizes_[a]; }
  int64_t coord(Axis a) const { return coords_[a]; }
  Communicator& axis(Axis a) { return *axis_comms_[a]; }
  // The ranks that share this rank's data coordinate (fsdp x expert), rank
  // fsdp_coord x expert_size + expert_coord: they hold one copy of the
  // parameters between them, the non-expert weights sharded over all of them.
  Communicator& shard_group() { return *shard_group_; }
  int64_t shard_group_size() const { return sizes_[kFsdp] * sizes_[kExpert]; }
  Communicator& world() { return world_; }
  int64_t batch_shards() const { return world_.size(); }
  int64_t batch_index() const { return world_.rank(); }
  std::string describe() const;

 private:
  Communicator& world_;
  std::array<int64_t, kAxes> sizes_{}, coords_{};
  std::array<std::unique_ptr<Communicator>, kAxes> axis_comms_;
  std::unique_ptr<Communicator> shard_group_;
};

// Ranks per node as the launcher reports it (Open MPI's, MPICH's), else the
// world size (one node).
int64_t ranks_per_node_from_env(int64_t world);

}  // namespace ds::dist
