#include "model/staged.h"

namespace ds::model {

void run_interleaved(std::vector<Staged>& tasks) {
  const size_t n = tasks.size();
  std::vector<Staged::Chain> chains(n);
  std::vector<bool> done(n, false);
  for (size_t i = 0; i < n; ++i) {
    tasks[i].get().promise().chain = &chains[i];
    chains[i].leaf = tasks[i].get();
  }
  for (size_t left = n; left > 0;) {
    for (size_t i = 0; i < n; ++i) {
      if (done[i]) continue;
      Staged::Chain& c = chains[i];
      if (c.finish) {
        auto f = std::move(c.finish);
        c.finish = nullptr;
        f();
      }
      c.leaf.resume();
      if (tasks[i].get().done()) {
        done[i] = true;
        --left;
        if (auto e = tasks[i].get().promise().error) std::rethrow_exception(e);
      }
    }
  }
}

void run_staged(Staged task) {
  std::vector<Staged> one;
  one.push_back(std::move(task));
  run_interleaved(one);
}

}  // namespace ds::model
