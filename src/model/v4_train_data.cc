// DeepSeek-V4 training's flat parameters (V4FlatParams, the trainer's
// layout and roles) and its batches (V4TrainBatch from packed rows, their
// counted targets): model/v4_train.h.
#include <cmath>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "model/v4_train.h"

namespace ds::model {

int64_t V4FlatParams::numel(const V4Config& c) {
  int64_t n = 0;
  for_each_v4_param(c, [&](const V4ParamInfo& i) { n += shape_numel(i.shape); });
  return n;
}

V4FlatParams V4FlatParams::wrap(const V4Config& c, float* base) {
  V4FlatParams f;
  f.ptr = make_v4_params<float*>(c);
  int64_t off = 0;
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float*& p) {
        p = base + off;
        off += shape_numel(i.shape);
      },
      f.ptr);
  return f;
}

V4FlatParams V4FlatParams::zeros(const V4Config& c) {
  std::vector<float> data(static_cast<size_t>(numel(c)), 0.0f);
  V4FlatParams f = over(c, data.data());
  f.data = std::move(data);  // the heap block moves with it: the pointers and views stay valid
  return f;
}

V4FlatParams V4FlatParams::over(const V4Config& c, float* base) {
  V4FlatParams f = wrap(c, base);
  f.tables.resize(static_cast<size_t>(c.num_hidden_layers));
  f.view = make_v4_params<ops::WeightView>(c);
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float* const& p, ops::WeightView& v) {
        const int64_t rows = i.shape[0], cols = i.shape.size() > 1 ? i.shape[1] : 1;
        if (i.role == V4Role::HashTable) {
          auto& t = f.tables[static_cast<size_t>(i.layer)];
          t.assign(static_cast<size_t>(rows * cols), 0);
          v = {t.data(), DType::I32, rows, cols, nullptr, 128, 128};
        } else {
          v = {p, DType::F32, rows, cols, nullptr, 128, 128};
        }
      },
      f.ptr, f.view);
  if (c.tie_word_embeddings) f.view.head = f.view.embed;
  return f;
}

void v4_hash_table(const V4Config& c, const std::string& name, const float* f, int64_t cols,
                   std::vector<int32_t>& table) {
  for (size_t k = 0; k < table.size(); ++k) {
    const float e = f[k];
    DS_CHECK(e >= 0 && e < static_cast<float>(c.n_routed_experts) && e == std::floor(e),
             "'{}' routes token {} to {}, not an expert id in [0, {})", name, k / static_cast<size_t>(cols), e,
             c.n_routed_experts);
    table[k] = static_cast<int32_t>(e);
  }
}

void V4FlatParams::sync_tables(const V4Config& c) {
  for_each_v4_param(
      c,
      [&](const V4ParamInfo& i, float* const& p) {
        if (i.role == V4Role::HashTable)
          v4_hash_table(c, i.name, p, i.shape.back(), tables[static_cast<size_t>(i.layer)]);
      },
      ptr);
}

std::vector<ParamInfo> v4_param_infos(const V4Config& c) {
  std::vector<ParamInfo> out;
  for_each_v4_param(c, [&](const V4ParamInfo& i) {
    // Vectors (norms, the sink, mHC mixes, position embeddings) are Norm:
    // no weight decay when 1-D.
    static const std::map<V4Role, ParamRole> role_of = {
        {V4Role::Embedding, ParamRole::Embedding},    {V4Role::Projection, ParamRole::Projection},
        {V4Role::Router, ParamRole::Router},          {V4Role::LmHead, ParamRole::LmHead},
        {V4Role::HashTable, ParamRole::Untrained},    {V4Role::Vector, ParamRole::Norm},
        {V4Role::EngramTable, ParamRole::EngramTable}};
    ParamRole role = role_of.at(i.role);
    if (i.name.ends_with(".ffn.gate.bias")) role = ParamRole::RoutingBias;
    if (i.name.find(".attn.indexer.") != std::string::npos) role = ParamRole::Untrained;
    out.push_back(ParamInfo{i.name, i.shape, role, i.layer});
  });
  return out;
}

V4TrainBatch V4TrainBatch::rows(int64_t batch, int64_t seq, std::vector<int32_t> inputs, std::vector<int32_t> targets) {
  DS_CHECK(batch > 0 && seq > 0 && static_cast<int64_t>(inputs.size()) == batch * seq &&
               static_cast<int64_t>(targets.size()) == batch * seq,
           "V4 training batch: {} rows of {} tokens need {} inputs and targets (got {}, {})", batch, seq, batch * seq,
           inputs.size(), targets.size());
  V4TrainBatch b;
  b.inputs = std::move(inputs);
  b.targets = std::move(targets);
  b.lengths.assign(static_cast<size_t>(batch), seq);
  return b;
}

V4TrainBatch V4TrainBatch::from_packed(const TrainBatch& p) {
  const int64_t n = p.batch * p.seq;
  DS_CHECK(p.batch > 0 && p.seq > 0 && static_cast<int64_t>(p.inputs.size()) == n &&
               static_cast<int64_t>(p.targets.size()) == n && static_cast<int64_t>(p.positions.size()) == n &&
               static_cast<int64_t>(p.segment_ids.size()) == n &&
               static_cast<int64_t>(p.target_segment_ids.size()) == n,
           "training batch of {} x {} tokens has fields of the wrong length", p.batch, p.seq);
  V4TrainBatch b;
  b.packed_rows = p.batch;
  b.counted.reserve(static_cast<size_t>(n));
  for (int64_t r = 0; r < p.batch; ++r)
    for (int64_t t = r * p.seq; t < (r + 1) * p.seq;) {
      const int32_t seg = p.segment_ids[static_cast<size_t>(t)];
      int64_t e = t + 1;
      while (e < (r + 1) * p.seq && p.segment_ids[static_cast<size_t>(e)] == seg) ++e;
      if (seg != 0) {
        // A document piece: its own sequence, which must count from 0.
        for (int64_t k = t; k < e; ++k)
          DS_CHECK(p.positions[static_cast<size_t>(k)] == k - t,
                   "row {}: segment {} has position {} at its token {}; DeepSeek-V4 trains on whole document pieces "
                   "whose positions count from 0",
                   r, seg, p.positions[static_cast<size_t>(k)], k - t);
        b.inputs.insert(b.inputs.end(), p.inputs.begin() + t, p.inputs.begin() + e);
        b.targets.insert(b.targets.end(), p.targets.begin() + t, p.targets.begin() + e);
        for (int64_t k = t; k < e; ++k) b.counted.push_back(p.target_segment_ids[static_cast<size_t>(k)] != 0);
        b.lengths.push_back(e - t);
        b.row_of.push_back(r);
      }
      t = e;
    }
  return b;
}

V4LossWeights v4_loss_weights(const V4TrainBatch& b) {
  V4LossWeights w;
  size_t at = 0;
  for (const int64_t L : b.lengths) {
    for (int64_t t = 0; t < L; ++t) {
      const bool c = b.counted.empty() || b.counted[at + static_cast<size_t>(t)];
      w.targets += c;
      w.mtp_targets += c && t >= 1;  // MTP row t - 1 predicts target t
    }
    at += static_cast<size_t>(L);
  }
  return w;
}

}  // namespace ds::model
