#include "dist/communicator.h"

#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

#include "core/error.h"

namespace ds::dist {

struct OpState {
  std::string what;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
};

namespace {
std::atomic<double> g_timeout{300.0};
}  // namespace

size_t elem_size(Elem e) {
  switch (e) {
    case Elem::F32:
    case Elem::I32:
      return 4;
    case Elem::F64:
    case Elem::I64:
      return 8;
    case Elem::U8:
      return 1;
  }
  return 1;
}

void set_collective_timeout(double seconds) { g_timeout.store(seconds); }

void Handle::wait() {
  if (!s_) return;
  std::unique_lock<std::mutex> lk(s_->mu);
  const double t = g_timeout.load();
  if (t <= 0) {
    s_->cv.wait(lk, [&] { return s_->done; });
    return;
  }
  const bool ok = s_->cv.wait_for(lk, std::chrono::duration<double>(t), [&] { return s_->done; });
  DS_CHECK(ok, "{} did not complete within {} s: another rank has stopped or is stuck (collective_timeout_seconds)",
           s_->what, t);
}

bool Handle::done() const {
  if (!s_) return true;
  std::lock_guard<std::mutex> lk(s_->mu);
  return s_->done;
}

namespace detail {

std::shared_ptr<OpState> new_op(std::string what) {
  auto s = std::make_shared<OpState>();
  s->what = std::move(what);
  return s;
}

void complete(OpState& s) {
  {
    std::lock_guard<std::mutex> lk(s.mu);
    s.done = true;
  }
  s.cv.notify_all();
}

#ifndef DEEPSEEK_HAVE_MPI
std::unique_ptr<Communicator> make_mpi_world() { return nullptr; }
#endif

}  // namespace detail

namespace {

class Single final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "single"; }
  std::unique_ptr<Communicator> split(int, int) override { return std::make_unique<Single>(); }

  Handle all_reduce_raw(void*, int64_t, Elem, ReduceOp) override { return {}; }
  Handle all_gather_raw(const void* send, int64_t n, void* recv, Elem e) override {
    copy(recv, send, n, e);
    return {};
  }
  Handle reduce_scatter_raw(const void* send, int64_t n, void* recv, Elem e) override {
    copy(recv, send, n, e);
    return {};
  }
  Handle all_to_all_raw(const void* send, const int64_t* sc, void* recv, const int64_t* rc, Elem e) override {
    DS_CHECK(sc[0] == rc[0], "all_to_all: sends {} elements to itself but expects {}", sc[0], rc[0]);
    copy(recv, send, sc[0], e);
    return {};
  }
  Handle broadcast_raw(void*, int64_t, Elem, int root) override {
    DS_CHECK(root == 0, "broadcast from rank {} in a communicator of one rank", root);
    return {};
  }
  Handle barrier() override { return {}; }

 private:
  static void copy(void* dst, const void* src, int64_t n, Elem e) {
    if (dst != src && n > 0) std::memmove(dst, src, static_cast<size_t>(n) * elem_size(e));
  }
};

std::once_flag g_world_once;
std::unique_ptr<Communicator> g_world;

}  // namespace

std::unique_ptr<Communicator> make_single() { return std::make_unique<Single>(); }

Communicator& world() {
  std::call_once(g_world_once, [] {
    g_world = detail::make_mpi_world();
    if (!g_world) g_world = make_single();
  });
  return *g_world;
}

bool is_distributed() { return world().size() > 1; }

void exit_after_error(int code) {
  std::fflush(stdout);
  std::fflush(stderr);
  // Only look at the world if it exists: an error before any communication
  // (a bad command line) must not start MPI just to exit.
  if (g_world && g_world->size() > 1) std::_Exit(code);
  std::exit(code);
}

}  // namespace ds::dist
