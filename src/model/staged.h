// Staged: a computation that pauses while its own communication is in
// flight, so that another one can compute meanwhile (the batch-split
// schedule's overlap; MaxText's staggered_call).
//
// A Staged is a C++20 coroutine. Where it has started a collective it
// writes `co_await Pending{&finish}`: it pauses, and `finish` (which waits for
// the collective and uses its result) runs just before it is resumed. A
// Staged may `co_await` another Staged, which then runs as part of it.
//
//   run_staged(task)        runs one to the end (each finish right away);
//   run_interleaved(tasks)  runs several in turn: task 0 until it pauses,
//                           task 1 until it pauses, ..., then task 0 again
//                           (its finish first), so each one's communication
//                           overlaps the others' computation. The order of
//                           everything, collectives included, is fixed by
//                           the tasks alone, the same on every rank.
#pragma once

#include <coroutine>
#include <exception>
#include <functional>
#include <utility>
#include <vector>

namespace ds::model {

class Staged {
 public:
  struct Chain {  // per top-level task
    std::coroutine_handle<> leaf;
    std::function<void()> finish;
  };
  struct promise_type {
    Chain* chain = nullptr;
    std::coroutine_handle<> continuation;
    std::exception_ptr error;
    Staged get_return_object() { return Staged(std::coroutine_handle<promise_type>::from_promise(*this)); }
    std::suspend_always initial_suspend() noexcept { return {}; }
    struct Final {
      bool await_ready() noexcept { return false; }
      std::coroutine_handle<> await_suspend(std::coroutine_handle<promise_type> h) noexcept {
        auto c = h.promise().continuation;
        if (c) {
          h.promise().chain->leaf = c;
          return c;
        }
        return std::noop_coroutine();
      }
      void await_resume() noexcept {}
    };
    Final final_suspend() noexcept { return {}; }
    void return_void() {}
    void unhandled_exception() { error = std::current_exception(); }
  };
  using handle = std::coroutine_handle<promise_type>;

  explicit Staged(handle h) : h_(h) {}
  Staged(Staged&& o) noexcept : h_(std::exchange(o.h_, {})) {}
  Staged& operator=(Staged&& o) noexcept {
    if (this != &o) {
      if (h_) h_.destroy();
      h_ = std::exchange(o.h_, {});
    }
    return *this;
  }
  Staged(const Staged&) = delete;
  ~Staged() {
    if (h_) h_.destroy();
  }

  // co_await of a sub-task: it runs within the awaiting one.
  bool await_ready() const noexcept { return false; }
  std::coroutine_handle<> await_suspend(handle outer) noexcept {
    h_.promise().chain = outer.promise().chain;
    h_.promise().continuation = outer;
    h_.promise().chain->leaf = h_;
    return h_;
  }
  void await_resume() {
    if (h_.promise().error) std::rethrow_exception(h_.promise().error);
  }

  handle get() const { return h_; }

 private:
  handle h_;
};

// co_await Pending{&finish}: pause until resumed; finish runs first. (A
// pointer to a named function, not a temporary holding one: GCC 12
// mishandles non-trivial temporaries inside a co_await expression.)
struct Pending {
  std::function<void()>* finish;
  bool await_ready() const noexcept { return !finish || !*finish; }
  void await_suspend(Staged::handle h) {
    h.promise().chain->leaf = h;
    h.promise().chain->finish = std::move(*finish);
  }
  void await_resume() const noexcept {}
};

// `layer` and `backward` label the spans of the timeline (below).
void run_interleaved(std::vector<Staged>& tasks, int64_t layer = -1, bool backward = false);
void run_staged(Staged task);

// The timeline of the schedule, for a picture of it: while recording,
// run_interleaved notes for each part when it computed (from a resume to
// its next pause) and when its communication was in flight (from that pause
// to the end of the finish that waited for it), in seconds since
// timeline_record(true). One process-wide record; not thread-safe.
struct TimelineSpan {
  int64_t layer;
  bool backward;
  int part;
  bool computing;  // else: communication in flight
  double t0, t1;
};
void timeline_record(bool on);
std::vector<TimelineSpan> timeline_spans();

}  // namespace ds::model
