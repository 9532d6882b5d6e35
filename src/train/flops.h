// The FLOP accounting moved to model/flops.h (a family's own); the training
// code keeps calling it by these names.
#pragma once

#include "model/flops.h"

namespace ds::train {
using model::forward_flops;
using model::step_flops;
}  // namespace ds::train
