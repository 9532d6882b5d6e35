// Every rank of a run must train the same thing: the run's keys as resolved,
// the model (its Hugging Face config) and the data's identity (dataset_type,
// dataset_path and the sizes of its files). At the start each rank compares
// its identity with rank 0's; a difference stops every rank with one line
// naming the first differing key and both values.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "dist/communicator.h"
#include "model/family.h"
#include "train/config.h"

namespace ds::train {

nlohmann::json run_identity(const TrainConfig& tc, const model::Family& family);

// The first key (as a/b/c, in sorted order) where the two differ, with rank
// 0's value and `who`'s; "" when equal.
std::string first_difference(const nlohmann::json& lead, const nlohmann::json& mine, const std::string& who,
                             const std::string& path = "");

// Collective: ds::Error on every rank when any rank's identity differs from rank 0's.
void check_same_run(dist::Communicator& world, const nlohmann::json& identity);

}  // namespace ds::train
