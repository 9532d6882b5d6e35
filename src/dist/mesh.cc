#include "dist/mesh.h"

#include <fmt/format.h>

#include <cstdlib>

#include "core/error.h"

namespace ds::dist {

namespace {

const char* kNames[kAxes] = {"data", "fsdp", "expert"};

// Fills the one -1 of `v` so that the product is `total`.
std::array<int64_t, kAxes> fill(std::array<int64_t, kAxes> v, int64_t total, const char* group, const char* what) {
  int64_t known = 1, holes = 0;
  for (int64_t x : v) {
    if (x == -1)
      ++holes;
    else
      known *= x;
  }
  DS_CHECK(holes <= 1, "more than one {}_*_parallelism is -1: only one axis can fill the rest", group);
  if (holes == 1) {
    DS_CHECK(total % known == 0,
             "{}_*_parallelism: the given axes multiply to {}, which does not divide the {} ({}): the -1 axis "
             "cannot fill the rest",
             group, known, what, total);
    for (auto& x : v)
      if (x == -1) x = total / known;
  } else {
    DS_CHECK(known == total,
             "{}_data/fsdp/expert_parallelism multiply to {} but the {} is {} (use -1 on one axis to fill the rest)",
             group, known, what, total);
  }
  return v;
}

}  // namespace

const char* axis_name(Axis a) { return kNames[a]; }

std::vector<std::string> MeshConfig::keys() {
  std::vector<std::string> k;
  for (const char* g : {"ici_", "dcn_"})
    for (const char* n : kNames) k.push_back(fmt::format("{}{}_parallelism", g, n));
  return k;
}

void MeshConfig::set(const std::string& key, int64_t value) {
  DS_CHECK(value == -1 || value >= 1, "{}={} must be -1 (fill the rest) or >= 1", key, value);
  for (int a = 0; a < kAxes; ++a) {
    if (key == fmt::format("ici_{}_parallelism", kNames[a])) ici[a] = value;
    if (key == fmt::format("dcn_{}_parallelism", kNames[a])) dcn[a] = value;
  }
}

namespace {

struct Factors {
  std::array<int64_t, kAxes> ici, dcn;
};

Factors resolve_factors(const MeshConfig& mc, int64_t world, int64_t ranks_per_node) {
  DS_CHECK(ranks_per_node >= 1 && world % ranks_per_node == 0,
           "{} ranks do not split into nodes of {} ranks each (every node must run the same number of ranks)", world,
           ranks_per_node);
  return {fill(mc.ici, ranks_per_node, "ici", "ranks per node"),
          fill(mc.dcn, world / ranks_per_node, "dcn", "number of nodes")};
}

}  // namespace

std::array<int64_t, kAxes> resolve_mesh(const MeshConfig& mc, int64_t world, int64_t ranks_per_node) {
  const Factors f = resolve_factors(mc, world, ranks_per_node);
  std::array<int64_t, kAxes> s{};
  for (int a = 0; a < kAxes; ++a) s[a] = f.ici[a] * f.dcn[a];
  return s;
}

Mesh::Mesh(Communicator& world, const MeshConfig& mc, int64_t ranks_per_node) : world_(world) {
  const int64_t W = world.size(), r = world.rank();
  const auto [ici, dcn] = resolve_factors(mc, W, ranks_per_node);
  for (int a = 0; a < kAxes; ++a) sizes_[a] = ici[a] * dcn[a];
  int64_t local = r % ranks_per_node, node = r / ranks_per_node;
  std::array<int64_t, kAxes> ic{}, dc{};
  for (int a = kAxes - 1; a >= 0; --a) {
    ic[a] = local % ici[a];
    local /= ici[a];
    dc[a] = node % dcn[a];
    node /= dcn[a];
  }
  for (int a = 0; a < kAxes; ++a) coords_[a] = dc[a] * ici[a] + ic[a];
  // The communicator along axis a: the ranks that share every other
  // coordinate, ordered by their coordinate on a.
  for (int a = 0; a < kAxes; ++a) {
    int64_t color = 0;
    for (int b = 0; b < kAxes; ++b)
      if (b != a) color = color * sizes_[b] + coords_[b];
    axis_comms_[a] = world.split(static_cast<int>(color), static_cast<int>(coords_[a]));
    DS_CHECK(axis_comms_[a]->size() == sizes_[a] && axis_comms_[a]->rank() == coords_[a],
             "internal: mesh axis {} has {} ranks (rank {}), expected {} (coordinate {})", kNames[a],
             axis_comms_[a]->size(), axis_comms_[a]->rank(), sizes_[a], coords_[a]);
  }
  const int64_t g = coords_[kFsdp] * sizes_[kExpert] + coords_[kExpert];
  shard_group_ = world.split(static_cast<int>(coords_[kData]), static_cast<int>(g));
  DS_CHECK(shard_group_->size() == shard_group_size() && shard_group_->rank() == g,
           "internal: the mesh's shard group has {} ranks (rank {}), expected {} ({})", shard_group_->size(),
           shard_group_->rank(), shard_group_size(), g);
}

std::string Mesh::describe() const {
  return fmt::format("{} ranks: data={} fsdp={} expert={}", world_.size(), sizes_[kData], sizes_[kFsdp],
                     sizes_[kExpert]);
}

int64_t ranks_per_node_from_env(int64_t world) {
  for (const char* v : {"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS"})
    if (const char* s = std::getenv(v)) {
      char* end = nullptr;
      const long long n = std::strtoll(s, &end, 10);
      if (end != s && *end == '\0' && n >= 1) return n;
    }
  return world;
}

}  // namespace ds::dist
