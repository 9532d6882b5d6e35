// The MPI backend of Communicator.
//
// One progress thread per process initializes MPI (MPI_THREAD_FUNNELED is
// enough: no other thread ever calls MPI), starts every non-blocking
// collective the callers queue, polls the requests in flight (MPI_Testsome,
// which is also what advances them: Open MPI's non-blocking collectives move
// only inside MPI calls) and marks each operation complete. Between polls it
// sleeps a few microseconds, so it costs the compute threads next to nothing;
// with nothing in flight it sleeps on a condition variable. MPI_Finalize runs
// on the same thread at exit.
#include <fmt/format.h>
#include <mpi.h>

#include <climits>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "core/error.h"
#include "dist/communicator.h"

namespace ds::dist {

namespace {

MPI_Datatype mpi_type(Elem e) {
  switch (e) {
    case Elem::F32:
      return MPI_FLOAT;
    case Elem::F64:
      return MPI_DOUBLE;
    case Elem::I32:
      return MPI_INT32_T;
    case Elem::I64:
      return MPI_INT64_T;
    case Elem::U8:
      return MPI_UINT8_T;
  }
  return MPI_BYTE;
}

int as_int(int64_t n, const char* what) {
  DS_CHECK(n >= 0 && n <= INT_MAX, "{}: {} elements is more than one MPI call moves ({})", what, n, INT_MAX);
  return static_cast<int>(n);
}

// What one collective holds while in flight.
struct Flight {
  std::shared_ptr<OpState> state;
  std::vector<MPI_Request> requests;
  std::vector<int> ints;  // all_to_all counts and displacements
  size_t open = 0;
};

class Engine {
 public:
  Engine() {
    thread_ = std::thread([this] { loop(); });
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return started_; });
  }
  ~Engine() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }

  int world_rank() const { return rank_; }
  int world_size() const { return size_; }
  bool initialized() const { return init_ok_; }

  // Runs fn on the progress thread; it may start requests into the flight.
  Handle start(std::string what, std::function<void(Flight&)> fn) {
    auto st = detail::new_op(std::move(what));
    {
      std::lock_guard<std::mutex> lk(mu_);
      queue_.push_back({st, std::move(fn)});
    }
    cv_.notify_all();
    return Handle(st);
  }
  // Runs fn on the progress thread and waits for it (setup calls).
  void run(std::function<void()> fn) {
    start("MPI setup call", [fn = std::move(fn)](Flight&) { fn(); }).wait();
  }

 private:
  struct Queued {
    std::shared_ptr<OpState> state;
    std::function<void(Flight&)> fn;
  };

  void loop() {
    int provided = 0;
    const int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (rc == MPI_SUCCESS) {
      MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
      MPI_Comm_size(MPI_COMM_WORLD, &size_);
      init_ok_ = provided >= MPI_THREAD_FUNNELED;
    }
    {
      std::lock_guard<std::mutex> lk(mu_);
      started_ = true;
    }
    cv_.notify_all();
    std::vector<Flight> flights;
    std::vector<MPI_Request> reqs;
    std::vector<int> idx;
    for (;;) {
      std::deque<Queued> todo;
      {
        std::unique_lock<std::mutex> lk(mu_);
        if (queue_.empty() && flights.empty()) cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
        todo.swap(queue_);
        if (stop_ && todo.empty() && flights.empty()) break;
      }
      for (auto& q : todo) {
        Flight f;
        f.state = q.state;
        q.fn(f);
        f.open = f.requests.size();
        if (f.open == 0)
          detail::complete(*f.state);
        else
          flights.push_back(std::move(f));
      }
      if (flights.empty()) continue;
      // Poll every request in flight once.
      reqs.clear();
      std::vector<std::pair<size_t, size_t>> where;
      for (size_t i = 0; i < flights.size(); ++i)
        for (size_t j = 0; j < flights[i].requests.size(); ++j)
          if (flights[i].requests[j] != MPI_REQUEST_NULL) {
            reqs.push_back(flights[i].requests[j]);
            where.emplace_back(i, j);
          }
      idx.resize(reqs.size());
      int outcount = 0;
      MPI_Testsome(static_cast<int>(reqs.size()), reqs.data(), &outcount, idx.data(), MPI_STATUSES_IGNORE);
      if (outcount == MPI_UNDEFINED) outcount = 0;
      for (int k = 0; k < outcount; ++k) {
        auto [i, j] = where[static_cast<size_t>(idx[k])];
        flights[i].requests[j] = MPI_REQUEST_NULL;
        --flights[i].open;
      }
      bool any = false;
      for (size_t i = 0; i < flights.size();) {
        if (flights[i].open == 0) {
          detail::complete(*flights[i].state);
          flights.erase(flights.begin() + static_cast<std::ptrdiff_t>(i));
          any = true;
        } else {
          ++i;
        }
      }
      if (!any && outcount == 0) std::this_thread::sleep_for(std::chrono::microseconds(20));
    }
    if (init_ok_ || rc == MPI_SUCCESS) MPI_Finalize();
  }

  std::thread thread_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> queue_;
  bool started_ = false, stop_ = false, init_ok_ = false;
  int rank_ = 0, size_ = 1;
};

class MpiComm final : public Communicator {
 public:
  MpiComm(std::shared_ptr<Engine> eng, MPI_Comm comm, bool owned) : eng_(std::move(eng)), comm_(comm), owned_(owned) {
    eng_->run([&] {
      MPI_Comm_rank(comm_, &rank_);
      MPI_Comm_size(comm_, &size_);
    });
  }
  ~MpiComm() override {
    if (owned_) eng_->run([c = comm_]() mutable { MPI_Comm_free(&c); });
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "mpi"; }

  std::unique_ptr<Communicator> split(int color, int key) override {
    MPI_Comm out = MPI_COMM_NULL;
    eng_->run([&] { MPI_Comm_split(comm_, color, key, &out); });
    return std::make_unique<MpiComm>(eng_, out, true);
  }

  Handle all_reduce_raw(void* buf, int64_t n, Elem e, ReduceOp op) override {
    // Large buffers go in pieces of at most INT_MAX elements.
    return eng_->start(fmt::format("all_reduce of {} elements", n), [=, this](Flight& f) {
      auto* p = static_cast<char*>(buf);
      for (int64_t off = 0; off < n; off += INT_MAX) {
        const int c = static_cast<int>(std::min<int64_t>(INT_MAX, n - off));
        f.requests.emplace_back();
        MPI_Iallreduce(MPI_IN_PLACE, p + off * static_cast<int64_t>(elem_size(e)), c, mpi_type(e),
                       op == ReduceOp::Sum ? MPI_SUM : MPI_MAX, comm_, &f.requests.back());
      }
    });
  }
  Handle all_gather_raw(const void* send, int64_t n, void* recv, Elem e) override {
    const int c = as_int(n * size_, "all_gather") / std::max(1, size_);
    const bool in_place = send == static_cast<const char*>(recv) + static_cast<int64_t>(rank_) * n * elem_size(e);
    return eng_->start(fmt::format("all_gather of {} elements", n), [=, this](Flight& f) {
      f.requests.emplace_back();
      MPI_Iallgather(in_place ? MPI_IN_PLACE : send, c, mpi_type(e), recv, c, mpi_type(e), comm_, &f.requests.back());
    });
  }
  Handle reduce_scatter_raw(const void* send, int64_t n, void* recv, Elem e) override {
    const int c = as_int(n * size_, "reduce_scatter") / std::max(1, size_);
    return eng_->start(fmt::format("reduce_scatter of {} elements", n), [=, this](Flight& f) {
      f.requests.emplace_back();
      MPI_Ireduce_scatter_block(send, recv, c, mpi_type(e), MPI_SUM, comm_, &f.requests.back());
    });
  }
  Handle all_to_all_raw(const void* send, const int64_t* sc, void* recv, const int64_t* rc, Elem e) override {
    std::vector<int> ints(static_cast<size_t>(4 * size_));
    int64_t so = 0, ro = 0;
    for (int r = 0; r < size_; ++r) {
      ints[r] = as_int(sc[r], "all_to_all");
      ints[size_ + r] = as_int(so, "all_to_all");
      ints[2 * size_ + r] = as_int(rc[r], "all_to_all");
      ints[3 * size_ + r] = as_int(ro, "all_to_all");
      so += sc[r];
      ro += rc[r];
    }
    return eng_->start("all_to_all", [=, this, ints = std::move(ints)](Flight& f) mutable {
      f.ints = std::move(ints);
      const int* v = f.ints.data();
      f.requests.emplace_back();
      MPI_Ialltoallv(send, v, v + size_, mpi_type(e), recv, v + 2 * size_, v + 3 * size_, mpi_type(e), comm_,
                     &f.requests.back());
    });
  }
  Handle broadcast_raw(void* buf, int64_t n, Elem e, int root) override {
    DS_CHECK(root >= 0 && root < size_, "broadcast from rank {} of {}", root, size_);
    return eng_->start(fmt::format("broadcast of {} elements", n), [=, this](Flight& f) {
      auto* p = static_cast<char*>(buf);
      for (int64_t off = 0; off < n; off += INT_MAX) {
        const int c = static_cast<int>(std::min<int64_t>(INT_MAX, n - off));
        f.requests.emplace_back();
        MPI_Ibcast(p + off * static_cast<int64_t>(elem_size(e)), c, mpi_type(e), root, comm_, &f.requests.back());
      }
    });
  }
  Handle barrier() override {
    return eng_->start("barrier", [this](Flight& f) {
      f.requests.emplace_back();
      MPI_Ibarrier(comm_, &f.requests.back());
    });
  }

 private:
  std::shared_ptr<Engine> eng_;
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

bool launched_by_mpirun() {
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(v) != nullptr) return true;
  return false;
}

}  // namespace

namespace detail {

std::unique_ptr<Communicator> make_mpi_world() {
  if (!launched_by_mpirun()) return nullptr;
  auto eng = std::make_shared<Engine>();
  DS_CHECK(eng->initialized(), "MPI_Init_thread failed or lacks MPI_THREAD_FUNNELED");
  return std::make_unique<MpiComm>(eng, MPI_COMM_WORLD, false);
}

}  // namespace detail

}  // namespace ds::dist
