// Shared by the DeepSeek-V4 and V4.1 training tests: a training fixture
// folder, gradient buffers by name, and central differences of the
// engine's own float32 loss against its gradient on sampled entries.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "infer/v4_engine.h"
#include "io/safetensors.h"
#include "model/v4_train.h"

namespace ds::test {

// A folder of make_v4_train_fixtures.py or make_v41_train_fixtures.py: the
// config (with a V4.1 tokenizer's token classes), the weights and the
// batch of batch.json (rows of equal length, each its own sequence).
struct V4TrainFixture {
  model::V4Config cfg;
  io::SafetensorsSet files;
  model::V4Weights weights;
  model::V4TrainBatch batch;
};

inline std::unique_ptr<V4TrainFixture> load_v4_train_fixture(const std::string& dir) {
  auto f = std::make_unique<V4TrainFixture>();
  f->cfg = infer::load_v4_config(dir);
  f->files = io::SafetensorsSet::open_dir(dir);
  f->weights = model::V4Weights::load(f->files, f->cfg);
  std::ifstream in(dir + "/batch.json");
  const auto j = nlohmann::json::parse(in);
  const auto inputs = j["inputs"].get<std::vector<std::vector<int32_t>>>();
  const auto targets = j["targets"].get<std::vector<std::vector<int32_t>>>();
  std::vector<int32_t> ins, tg;
  for (size_t r = 0; r < inputs.size(); ++r) {
    ins.insert(ins.end(), inputs[r].begin(), inputs[r].end());
    tg.insert(tg.end(), targets[r].begin(), targets[r].end());
  }
  f->batch = model::V4TrainBatch::rows(static_cast<int64_t>(inputs.size()), static_cast<int64_t>(inputs[0].size()),
                                       std::move(ins), std::move(tg));
  return f;
}

// Zeroed gradient buffers for every float parameter (not tid2eid), by name.
struct V4Grads {
  std::map<std::string, std::vector<float>> by_name;
  model::V4Params<float*> tree;
  explicit V4Grads(const model::V4Config& c) : tree(model::make_v4_params<float*>(c)) {
    model::for_each_v4_param(
        c,
        [&](const model::V4ParamInfo& i, float*& leaf) {
          if (i.role == model::V4Role::HashTable) return;
          auto& v = by_name[i.name];
          v.assign(static_cast<size_t>(shape_numel(i.shape)), 0.0f);
          leaf = v.data();
        },
        tree);
  }
};

// For each (tensor name, count): `count` entries, the largest gradient of
// each of `count` equal stretches of the tensor, perturbed by +-1e-3
// (relative above 1); the loss's central difference must match the
// gradient to 5e-3 of it plus 2e-4. The weights are views into the mapped
// file, so each probed tensor is copied and its view redirected.
inline void expect_central_differences(const model::V4Config& cfg, const model::V4View& weights,
                                       const std::map<std::string, std::vector<float>>& grads,
                                       const model::V4TrainBatch& batch,
                                       const std::vector<std::pair<std::string, int64_t>>& probes) {
  model::V4View view = weights;
  for (const auto& [name, count] : probes) {
    ops::WeightView* leaf = nullptr;
    model::for_each_v4_param(
        cfg,
        [&](const model::V4ParamInfo& i, ops::WeightView& v) {
          if (i.name == name) leaf = &v;
        },
        view);
    ASSERT_NE(leaf, nullptr) << name;
    const ops::WeightView orig = *leaf;
    std::vector<float> copy(static_cast<const float*>(orig.data),
                            static_cast<const float*>(orig.data) + orig.rows * orig.cols);
    leaf->data = copy.data();
    const auto& grad = grads.at(name);
    for (int64_t k = 0; k < count; ++k) {
      const size_t stride = copy.size() / static_cast<size_t>(count);
      size_t at = static_cast<size_t>(k) * stride;
      for (size_t i = at; i < std::min(copy.size(), at + stride); ++i)
        if (std::fabs(grad[i]) > std::fabs(grad[at])) at = i;
      const float x0 = copy[at], h = 1e-3f * std::max(1.0f, std::fabs(x0));
      copy[at] = x0 + h;
      const double lp = model::v4_loss_and_grad(cfg, view, nullptr, batch).loss;
      copy[at] = x0 - h;
      const double lm = model::v4_loss_and_grad(cfg, view, nullptr, batch).loss;
      copy[at] = x0;
      const double fd = (lp - lm) / (2.0 * h);
      EXPECT_NEAR(grad[at], fd, 5e-3 * std::fabs(fd) + 2e-4) << name << "[" << at << "]";
    }
    *leaf = orig;
  }
}

}  // namespace ds::test
