#include "dist/fsdp.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace ds::dist {

FsdpParams::FsdpParams(const model::ModelConfig& cfg, int64_t mtp_layers, Communicator& fsdp)
    : cfg_(cfg), mtp_(mtp_layers), comm_(fsdp), F_(fsdp.size()), rank_(fsdp.rank()), L_(cfg.num_hidden_layers) {
  const int64_t U = L_ + mtp_;
  units_.assign(static_cast<size_t>(U + 2), Unit{});
  std::vector<bool> seen(units_.size(), false);
  int64_t off = 0, last_unit = 0;
  model::for_each_param(cfg_, mtp_, [&](const model::ParamInfo& i) {
    const int64_t u = i.layer >= 0 ? 1 + i.layer : (i.role == model::ParamRole::Embedding ? 0 : U + 1);
    DS_CHECK(u >= last_unit && (u == last_unit || !seen[u]), "internal: FSDP unit {} is not contiguous ({})", u,
             i.name);
    if (!seen[u]) units_[u].lo = off;
    seen[u] = true;
    last_unit = u;
    unit_of_.push_back(u);
    offset_of_.push_back(off);
    off += i.numel();
    units_[u].hi = off;
  });
  int64_t at = 0, c_max = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& x = units_[u];
    if (!seen[u]) x.lo = x.hi = off;  // no tensors (a tied head leaves the tail with the final norm only)
    x.c = (x.hi - x.lo + F_ - 1) / F_;
    x.at = at;
    at += x.c;
    const int64_t a = x.lo + rank_ * x.c, b = std::min(x.hi, a + x.c);
    if (a < b) owned_.push_back({a, b, x.at});
    if (u != 0 && u != units_.size() - 1) c_max = std::max(c_max, x.c);
  }
  shard.assign(static_cast<size_t>(at), 0.0f);
  grad_shard.assign(static_cast<size_t>(at), 0.0f);
  for (int r = 0; r < 2; ++r) {
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    resident_[r].assign(static_cast<size_t>(F_ * x.c), 0.0f);
    resident_grad_[r].assign(static_cast<size_t>(F_ * x.c), 0.0f);
    pbuf_[r].assign(static_cast<size_t>(F_ * c_max), 0.0f);
    gbuf_[r].assign(static_cast<size_t>(F_ * c_max), 0.0f);
    grecv_[r].assign(static_cast<size_t>(c_max), 0.0f);
  }
  view = model::make_params<ops::WeightView>(cfg_, mtp_);
  grads = model::make_params<float*>(cfg_, mtp_);
  point_unit(0, resident_[0].data(), resident_grad_[0].data());
  point_unit(U + 1, resident_[1].data(), resident_grad_[1].data());
}

void FsdpParams::point_unit(int64_t u, float* params, float* gr) {
  const int64_t lo = units_[u].lo;
  size_t idx = 0;
  model::for_each_param(
      cfg_, mtp_,
      [&](const model::ParamInfo& i, ops::WeightView& wv, float*& g) {
        const size_t k = idx++;
        if (unit_of_[k] != u) return;
        const int64_t o = offset_of_[k] - lo;
        wv = model::f32_view(params + o, i.shape[0], i.shape.size() > 1 ? i.shape[1] : 1);
        g = gr ? gr + o : nullptr;
      },
      view, grads);
  if (cfg_.tie_word_embeddings && u == 0) {
    view.lm_head = view.embed;
    grads.lm_head = grads.embed;
  }
}

void FsdpParams::take_shard(const float* full, float* out) const {
  for (const Unit& x : units_) {
    const int64_t a = std::min(x.hi, x.lo + rank_ * x.c), b = std::min(x.hi, a + x.c);
    std::fill(out + x.at, out + x.at + x.c, 0.0f);
    if (a < b) std::memcpy(out + x.at, full + a, static_cast<size_t>(b - a) * sizeof(float));
  }
}

void FsdpParams::gather_full(const float* shard_layout, float* full) {
  std::vector<float> tmp;
  for (const Unit& x : units_) {
    if (x.c == 0) continue;
    tmp.resize(static_cast<size_t>(F_ * x.c));
    comm_.all_gather(shard_layout + x.at, x.c, tmp.data()).wait();
    std::memcpy(full + x.lo, tmp.data(), static_cast<size_t>(x.hi - x.lo) * sizeof(float));
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
    if (x.c > 0) h[r] = comm_.all_gather(shard.data() + x.at, x.c, resident_[r].data());
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
  gbuf_h_[g].wait();
  const Unit& x = units_[1 + u];
  float* dst = grad_shard.data() + x.at;
  for (int64_t i = 0; i < x.c; ++i) dst[i] += grecv_[g][i];
  gbuf_unit_[g] = -1;
}

void FsdpParams::finish_grads() {
  for (int g = 0; g < 2; ++g) drain_grad_slot(g);
  std::vector<float> recv[2];
  Handle h[2];
  for (int r = 0; r < 2; ++r) {
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    recv[r].assign(static_cast<size_t>(x.c), 0.0f);
    if (x.c > 0) h[r] = comm_.reduce_scatter(resident_grad_[r].data(), x.c, recv[r].data());
  }
  for (int r = 0; r < 2; ++r) {
    h[r].wait();
    const Unit& x = units_[r == 0 ? 0 : units_.size() - 1];
    for (int64_t i = 0; i < x.c; ++i) grad_shard[x.at + i] += recv[r][i];
  }
}

int64_t FsdpParams::floats_held() const {
  size_t n = shard.size() + grad_shard.size();
  for (int r = 0; r < 2; ++r)
    n += resident_[r].size() + resident_grad_[r].size() + pbuf_[r].size() + gbuf_[r].size() + grecv_[r].size();
  return static_cast<int64_t>(n);
}

void FsdpParams::begin(int64_t units, bool backward) {
  DS_CHECK(units >= 0 && units <= L_ + mtp_, "internal: FSDP pass over {} units of {}", units, L_ + mtp_);
  for (int s = 0; s < 2; ++s) {
    pbuf_h_[s].wait();
    pbuf_unit_[s] = -1;  // the shards may have changed since: gather again
  }
  seq_.clear();
  for (int64_t u = 0; u < units; ++u) seq_.push_back(u);
  if (backward)
    for (int64_t u = units - 1; u >= 0; --u) seq_.push_back(u);
  pos_ = 0;
  if (seq_.empty()) return;
  const Unit& x = units_[1 + seq_[0]];
  pbuf_h_[0] = comm_.all_gather(shard.data() + x.at, x.c, pbuf_[0].data());
  pbuf_unit_[0] = seq_[0];
}

void FsdpParams::acquire(int64_t u, bool backward) {
  DS_CHECK(pos_ < seq_.size() && seq_[pos_] == u, "internal: FSDP unit {} used out of order (expected {})", u,
           pos_ < seq_.size() ? seq_[pos_] : -1);
  const int s = pbuf_unit_[0] == u ? 0 : 1;
  DS_CHECK(pbuf_unit_[s] == u, "internal: FSDP unit {} was not gathered", u);
  pbuf_h_[s].wait();
  // Prefetch: the next unit's gather runs while this one computes.
  if (pos_ + 1 < seq_.size() && seq_[pos_ + 1] != u) {
    const int o = 1 - s;
    pbuf_h_[o].wait();
    const int64_t v = seq_[pos_ + 1];
    const Unit& y = units_[1 + v];
    pbuf_h_[o] = comm_.all_gather(shard.data() + y.at, y.c, pbuf_[o].data());
    pbuf_unit_[o] = v;
  }
  float* g = nullptr;
  if (backward) {
    const int gs = next_gslot_;
    drain_grad_slot(gs);
    const Unit& x = units_[1 + u];
    std::fill(gbuf_[gs].begin(), gbuf_[gs].begin() + F_ * x.c, 0.0f);
    gbuf_unit_[gs] = u;
    g = gbuf_[gs].data();
  }
  point_unit(1 + u, pbuf_[s].data(), g);
  ++pos_;
}

void FsdpParams::release(int64_t u, bool backward) {
  if (!backward) return;
  const int gs = next_gslot_;
  DS_CHECK(gbuf_unit_[gs] == u, "internal: FSDP gradient of unit {} released out of order", u);
  const Unit& x = units_[1 + u];
  gbuf_h_[gs] = comm_.reduce_scatter(gbuf_[gs].data(), x.c, grecv_[gs].data());
  next_gslot_ = 1 - gs;
}

}  // namespace ds::dist
