// The weights of a DeepSeek model loaded from a checkpoint, found by the
// parameter tree's Hugging Face names and kept in the checkpoint's own dtype
// (mmapped; fp8 with its block scales). Only the small vectors (norm weights,
// routing bias) are widened to float32 here.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/params.h"
#include "ops/linear.h"

namespace ds::model {

// One loaded tensor: the checkpoint tensor (and, for fp8, its scale_inv),
// float32 copies of vectors, and the view the stage functions read.
struct Weight {
  Tensor tensor, scale_inv;
  std::vector<float> widened;
  ops::WeightView view;
};

// What every stage function reads: a weight's view (vectors as float32
// [n, 1] views).
using ParamsView = ModelParams<ops::WeightView>;
using LayerView = LayerParams<ops::WeightView>;

struct ModelWeights {
  ModelParams<Weight> tensors;
  ParamsView view;          // over `tensors` (moving ModelWeights keeps it valid; copying is not allowed)
  size_t weight_bytes = 0;  // bytes of all tensors in use (file sizes, not widened)

  ModelWeights() = default;
  ModelWeights(ModelWeights&&) = default;
  ModelWeights& operator=(ModelWeights&&) = default;
  ModelWeights(const ModelWeights&) = delete;
  ModelWeights& operator=(const ModelWeights&) = delete;

  // Finds every tensor the config needs, checks its shape, and rejects
  // checkpoints with unknown tensors (extra MTP layers are recognised).
  // Loads `mtp_layers` multi-token prediction depths too (training starts
  // from them; generation loads none).
  static ModelWeights load(const io::SafetensorsSet& st, const ModelConfig& cfg, int64_t mtp_layers = 0);
};

// st's float tensor `name` (present), checked to have `shape` and to hold no
// NaN or infinity: one error line otherwise.
Tensor checked_float_tensor(const io::SafetensorsSet& st, const std::string& name, const Shape& shape);

// st's U8 tensor `name`, a matrix [out, in] stored as rows of q8_0, q4_k,
// q4_1 or q6_k blocks (a `deepseek quantize` folder): its format from its
// bytes a row. One error line, naming each format's row size, otherwise.
ops::WeightView block_matrix_view(const io::SafetensorsSet& st, const std::string& name, int64_t out, int64_t in);

// A float32 view of n contiguous floats ([n, 1]); of [rows, cols] floats.
inline ops::WeightView f32_view(const float* p, int64_t rows, int64_t cols = 1) {
  return {p, DType::F32, rows, cols, nullptr, 128, 128};
}
// The float32 data of a vector view (norm weights, bias); null for an empty view.
const float* vector_data(const ops::WeightView& v);

}  // namespace ds::model
