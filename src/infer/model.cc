#include "infer/model.h"

#include "infer/engine.h"
#include "infer/v4_engine.h"

namespace ds::infer {

std::unique_ptr<Model> open_model(const std::string& dir, const ModelOptions& opt) {
  if (is_v4_folder(dir)) return open_v4_model(dir, opt);
  return open_v3_model(dir, opt);
}

}  // namespace ds::infer
