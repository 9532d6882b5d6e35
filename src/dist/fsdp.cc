#include "dist/fsdp.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace ds::dist {

FsdpParams::FsdpParams(std::vector<model::ParamInfo> layout, Communicator& group, Communicator& fsdp,
                       Communicator* expert)
    : layout_(std::move(layout)),
      single_(expert ? nullptr : make_single()),
      group_(group),
      fsdp_(fsdp),
      expert_(expert ? *expert : *single_),
      G_(group.size()),
      F_(fsdp.size()),
      X_(expert_.size()),
      g_(group.rank()),
      f_(fsdp.rank()),
      x_(expert_.rank()) {}

FsdpParams::FsdpParams(std::vector<model::ParamInfo> layout, int64_t routed_experts, Leaves leaves, Communicator& group,
                       Communicator& fsdp, Communicator* expert)
    : FsdpParams(std::move(layout), group, fsdp, expert) {
  leaves_ = std::move(leaves);
  DS_CHECK(leaves_.views.size() == layout_.size() && leaves_.grads.size() == layout_.size(),
           "internal: FSDP leaves for {} and {} of {} tensors", leaves_.views.size(), leaves_.grads.size(),
           layout_.size());
  cut_units(routed_experts);
}

FsdpParams::FsdpParams(const model::ModelConfig& cfg, int64_t mtp_layers, Communicator& group, Communicator& fsdp,
                       Communicator* expert)
    : FsdpParams(model::param_infos(cfg, mtp_layers), group, fsdp, expert) {
  view = model::make_params<ops::WeightView>(cfg, mtp_layers);
  grads = model::make_params<float*>(cfg, mtp_layers);
  leaves_ = model::tree_leaves(cfg, mtp_layers, view, grads);
  cut_units(cfg.n_routed_experts);
}

void FsdpParams::cut_units(int64_t E) {
  DS_CHECK(G_ == F_ * X_ && g_ == f_ * X_ + x_, "internal: shard group of {} ranks (rank {}) for fsdp={} x expert={}",
           G_, g_, F_, X_);
  DS_CHECK(X_ == 1 || (E > 0 && E % X_ == 0), "{} routed experts do not split over {} expert ranks", E, X_);
  for (const model::ParamInfo& i : layout_) layer_units_ = std::max(layer_units_, i.layer + 1);
  const int64_t U = layer_units_;
  units_.assign(static_cast<size_t>(U + 2), Unit{});
  std::vector<bool> seen(units_.size(), false), has_experts(units_.size(), false);
  int64_t off = 0, last_unit = 0;
  for (const model::ParamInfo& i : layout_) {
    const int64_t u = i.layer >= 0 ? 1 + i.layer : (i.role == model::ParamRole::Embedding ? 0 : U + 1);
    DS_CHECK(u == last_unit || !seen[u], "internal: FSDP unit {} is not contiguous ({})", u, i.name);
    Unit& x = units_[u];
    if (!seen[u]) x.lo = off;
    seen[u] = true;
    last_unit = u;
    unit_of_.push_back(u);
    offset_of_.push_back(off);
    if (X_ > 1 && i.name.find(".experts.") != std::string::npos) {
      if (!has_experts[u]) x.elo = off;
      DS_CHECK(!has_experts[u] || x.ehi == off, "internal: the experts of unit {} are not contiguous ({})", u, i.name);
      has_experts[u] = true;
      x.ehi = off + i.numel();
    }
    off += i.numel();
    x.hi = off;
  }
  int64_t at = 0, cd_max = 0, ce_max = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& x = units_[u];
    if (!seen[u]) x.lo = x.hi = off;  // no tensors (a tied head leaves the tail with the final norm only)
    if (!has_experts[u]) x.elo = x.ehi = x.hi;
    x.cd = (x.dense() + G_ - 1) / G_;
    const int64_t block = x.ehi - x.elo;
    DS_CHECK(block % X_ == 0, "internal: unit {}'s experts ({} elements) do not split over {} ranks", u, block, X_);
    x.mine_n = block / X_;
    x.mine = x.elo + x_ * x.mine_n;
    x.ce = (x.mine_n + F_ - 1) / F_;
    x.at = at;
    at += x.cd + x.ce;
    dense_runs(x, g_ * x.cd, std::min(x.dense(), (g_ + 1) * x.cd), [&](int64_t flat, int64_t n, int64_t v) {
      owned_.push_back({flat, flat + n, x.at + v - g_ * x.cd});
    });
    const int64_t a = std::min(x.mine_n, f_ * x.ce), b = std::min(x.mine_n, a + x.ce);
    if (a < b) owned_.push_back({x.mine + a, x.mine + b, x.at + x.cd});
    if (u != 0 && u != units_.size() - 1) {
      cd_max = std::max(cd_max, x.cd);
      ce_max = std::max(ce_max, x.ce);
    }
  }
  std::sort(owned_.begin(), owned_.end(), [](const Piece& p, const Piece& q) { return p.lo < q.lo; });
  shard.assign(static_cast<size_t>(at), 0.0f);
  grad_shard.assign(static_cast<size_t>(at), 0.0f);
  eoff_ = G_ * cd_max;
  roff_ = cd_max;
  for (int r = 0; r < 2; ++r) {
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    resident_[r].assign(static_cast<size_t>(G_ * x.cd), 0.0f);
    resident_grad_[r].assign(static_cast<size_t>(G_ * x.cd), 0.0f);
    pbuf_[r].assign(static_cast<size_t>(eoff_ + F_ * ce_max), 0.0f);
    gbuf_[r].assign(static_cast<size_t>(eoff_ + F_ * ce_max), 0.0f);
    grecv_[r].assign(static_cast<size_t>(roff_ + ce_max), 0.0f);
  }
  point_unit(0, resident_[0].data(), nullptr, resident_grad_[0].data(), nullptr);
  point_unit(U + 1, resident_[1].data(), nullptr, resident_grad_[1].data(), nullptr);
}

template <typename Fn>
void FsdpParams::dense_runs(const Unit& x, int64_t a, int64_t b, Fn&& f) {
  const int64_t before = x.elo - x.lo;  // dense elements before the experts
  if (a < std::min(b, before)) f(x.lo + a, std::min(b, before) - a, a);
  const int64_t c = std::max(a, before);
  if (c < b) f(x.flat(c), b - c, c);
}

void FsdpParams::point_unit(int64_t u, float* dense, float* experts, float* dense_grad, float* expert_grad) {
  const Unit& x = units_[u];
  for (size_t k = 0; k < layout_.size(); ++k) {
    if (unit_of_[k] != u) continue;
    const model::ParamInfo& i = layout_[k];
    const int64_t off = offset_of_[k];
    float *p = nullptr, *pg = nullptr;
    if (off >= x.elo && off < x.ehi) {
      if (off >= x.mine && off < x.mine + x.mine_n) {  // this rank's expert
        p = experts + (off - x.mine);
        pg = expert_grad ? expert_grad + (off - x.mine) : nullptr;
      }
    } else {
      const int64_t v = off < x.elo ? off - x.lo : off - x.lo - (x.ehi - x.elo);
      p = dense + v;
      pg = dense_grad ? dense_grad + v : nullptr;
    }
    if (ops::WeightView* wv = leaves_.views[k])
      *wv = p ? model::f32_view(p, i.shape[0], i.shape.size() > 1 ? i.shape[1] : 1) : ops::WeightView{};
    if (float** g = leaves_.grads[k]) *g = pg;
  }
  if (leaves_.after_point) leaves_.after_point(u);
}

void FsdpParams::take_shard(const float* full, float* out) const {
  for (const Unit& x : units_) std::fill(out + x.at, out + x.at + x.cd + x.ce, 0.0f);
  for (const Piece& p : owned_) std::memcpy(out + p.at, full + p.lo, static_cast<size_t>(p.hi - p.lo) * sizeof(float));
}

void FsdpParams::gather_full(const float* shard_layout, float* full) {
  std::vector<float> tmp, mine;
  for (const Unit& x : units_) {
    if (x.cd > 0) {
      tmp.resize(static_cast<size_t>(G_ * x.cd));
      group_.all_gather(shard_layout + x.at, x.cd, tmp.data()).wait();
      dense_runs(x, 0, x.dense(), [&](int64_t flat, int64_t n, int64_t v) {
        std::memcpy(full + flat, tmp.data() + v, static_cast<size_t>(n) * sizeof(float));
      });
    }
    if (x.ce > 0) {
      mine.resize(static_cast<size_t>(F_ * x.ce));
      fsdp_.all_gather(shard_layout + x.at + x.cd, x.ce, mine.data()).wait();
      expert_.all_gather(mine.data(), x.mine_n, full + x.elo).wait();
    }
  }
}

std::vector<float> FsdpParams::expand(const std::vector<float>& packed) const {
  std::vector<float> out(shard.size(), 0.0f);
  size_t i = 0;
  for (const Piece& p : owned_) {
    const auto n = static_cast<size_t>(p.hi - p.lo);
    DS_CHECK(i + n <= packed.size(), "internal: FSDP expand of {} packed values", packed.size());
    std::memcpy(out.data() + p.at, packed.data() + i, n * sizeof(float));
    i += n;
  }
  return out;
}

void FsdpParams::pack(const std::vector<float>& shard_layout, std::vector<float>& packed) const {
  size_t i = 0;
  for (const Piece& p : owned_) {
    const auto n = static_cast<size_t>(p.hi - p.lo);
    DS_CHECK(i + n <= packed.size(), "internal: FSDP pack into {} values", packed.size());
    std::memcpy(packed.data() + i, shard_layout.data() + p.at, n * sizeof(float));
    i += n;
  }
}

void FsdpParams::gather_resident() {
  Handle h[2];
  for (int r = 0; r < 2; ++r) {
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    if (x.cd > 0) h[r] = group_.all_gather(shard.data() + x.at, x.cd, resident_[r].data());
  }
  h[0].wait();
  h[1].wait();
}

void FsdpParams::start_step() {
  for (int g = 0; g < 2; ++g) drain_grad_slot(g);
  gather_resident();
  std::fill(grad_shard.begin(), grad_shard.end(), 0.0f);
  for (auto& b : resident_grad_) std::fill(b.begin(), b.end(), 0.0f);
}

void FsdpParams::drain_grad_slot(int g) {
  const int64_t u = gbuf_unit_[g];
  if (u < 0) return;
  gbuf_h_[g][0].wait();
  gbuf_h_[g][1].wait();
  const Unit& x = units_[1 + u];
  float* dst = grad_shard.data() + x.at;
  for (int64_t i = 0; i < x.cd; ++i) dst[i] += grecv_[g][i];
  for (int64_t i = 0; i < x.ce; ++i) dst[x.cd + i] += grecv_[g][roff_ + i];
  gbuf_unit_[g] = -1;
}

void FsdpParams::finish_grads() {
  for (int g = 0; g < 2; ++g) drain_grad_slot(g);
  std::vector<float> recv[2];
  Handle h[2];
  for (int r = 0; r < 2; ++r) {
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    recv[r].assign(static_cast<size_t>(x.cd), 0.0f);
    if (x.cd > 0) h[r] = group_.reduce_scatter(resident_grad_[r].data(), x.cd, recv[r].data());
  }
  for (int r = 0; r < 2; ++r) {
    h[r].wait();
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    for (int64_t i = 0; i < x.cd; ++i) grad_shard[x.at + i] += recv[r][i];
  }
}

int64_t FsdpParams::floats_held() const {
  size_t n = shard.size() + grad_shard.size();
  for (int r = 0; r < 2; ++r)
    n += resident_[r].size() + resident_grad_[r].size() + pbuf_[r].size() + gbuf_[r].size() + grecv_[r].size();
  return static_cast<int64_t>(n);
}

void FsdpParams::start_gather(int s, int64_t u) {
  const Unit& x = units_[1 + u];
  pbuf_h_[s][0] = group_.all_gather(shard.data() + x.at, x.cd, pbuf_[s].data());
  if (x.ce > 0) pbuf_h_[s][1] = fsdp_.all_gather(shard.data() + x.at + x.cd, x.ce, pbuf_[s].data() + eoff_);
  pbuf_unit_[s] = u;
}

void FsdpParams::begin(int64_t units, bool backward) {
  DS_CHECK(units >= 0 && units <= layer_units_, "internal: FSDP pass over {} units of {}", units, layer_units_);
  for (int s = 0; s < 2; ++s) {
    pbuf_h_[s][0].wait();
    pbuf_h_[s][1].wait();
    pbuf_unit_[s] = -1;  // the shards may have changed since: gather again
  }
  seq_.clear();
  for (int64_t u = 0; u < units; ++u) seq_.push_back(u);
  if (backward)
    for (int64_t u = units - 1; u >= 0; --u) seq_.push_back(u);
  pos_ = 0;
  if (!seq_.empty()) start_gather(0, seq_[0]);
}

void FsdpParams::acquire(int64_t u, bool backward) {
  DS_CHECK(pos_ < seq_.size() && seq_[pos_] == u, "internal: FSDP unit {} used out of order (expected {})", u,
           pos_ < seq_.size() ? seq_[pos_] : -1);
  const int s = pbuf_unit_[0] == u ? 0 : 1;
  DS_CHECK(pbuf_unit_[s] == u, "internal: FSDP unit {} was not gathered", u);
  pbuf_h_[s][0].wait();
  pbuf_h_[s][1].wait();
  // Prefetch: the next unit's gathers run while this one computes.
  if (pos_ + 1 < seq_.size() && seq_[pos_ + 1] != u) {
    const int o = 1 - s;
    pbuf_h_[o][0].wait();
    pbuf_h_[o][1].wait();
    start_gather(o, seq_[pos_ + 1]);
  }
  float *g = nullptr, *ge = nullptr;
  if (backward) {
    const int gs = next_gslot_;
    drain_grad_slot(gs);
    const Unit& x = units_[1 + u];
    std::fill(gbuf_[gs].begin(), gbuf_[gs].begin() + G_ * x.cd, 0.0f);
    std::fill(gbuf_[gs].begin() + eoff_, gbuf_[gs].begin() + eoff_ + F_ * x.ce, 0.0f);
    gbuf_unit_[gs] = u;
    g = gbuf_[gs].data();
    ge = g + eoff_;
  }
  point_unit(1 + u, pbuf_[s].data(), pbuf_[s].data() + eoff_, g, ge);
  ++pos_;
}

void FsdpParams::release(int64_t u, bool backward) {
  if (!backward) return;
  const int gs = next_gslot_;
  DS_CHECK(gbuf_unit_[gs] == u, "internal: FSDP gradient of unit {} released out of order", u);
  const Unit& x = units_[1 + u];
  gbuf_h_[gs][0] = group_.reduce_scatter(gbuf_[gs].data(), x.cd, grecv_[gs].data());
  if (x.ce > 0) gbuf_h_[gs][1] = fsdp_.reduce_scatter(gbuf_[gs].data() + eoff_, x.ce, grecv_[gs].data() + roff_);
  next_gslot_ = 1 - gs;
}

}  // namespace ds::dist
