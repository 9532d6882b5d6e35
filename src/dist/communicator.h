// Collective communication between the processes of a run.
//
// A Communicator is a group of ranks 0..size()-1. Every collective is
// asynchronous: it starts the operation and returns a Handle; the buffers
// belong to the operation until Handle::wait() returns. Collectives on one
// communicator must be started in the same order on every rank (MPI's rule);
// any number may be in flight at once.
//
//   all_reduce(buf, n)               buf[i] = sum (or max) over ranks, in place
//   all_gather(send, n, recv)        recv[r*n + i] = send_r[i]
//   reduce_scatter(send, n, recv)    recv[i] = sum over ranks of send_r[rank*n + i]
//   all_to_all(send, sc, recv, rc)   rank r's block for rank q (sc[q] elements,
//                                    blocks in rank order) lands in q's recv at
//                                    block r; rc[r] must equal r's sc[q]
//   broadcast(buf, n, root)          buf = root's buf
//   barrier()
//
// Backends: single-process (size 1; no MPI needed to build or run) and MPI
// (processes started by mpirun; one progress thread owns every MPI call, so
// non-blocking collectives advance while the caller computes). split() makes
// the sub-communicators of the mesh axes; an NCCL backend implements the same
// interface.
//
// A wait that does not finish within the timeout (set_collective_timeout;
// a peer that died or stopped) raises ds::Error; the caller then ends the
// process with exit_after_error(), which under MPI skips the collective
// shutdown so mpirun stops the other ranks instead of everyone hanging.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>

namespace ds::dist {

enum class Elem { F32, F64, I32, I64, U8 };
enum class ReduceOp { Sum, Max };

template <typename T>
constexpr Elem elem_of() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
                    std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t> || std::is_same_v<T, char>,
                "collectives move float, double, int32, int64 or bytes");
  if constexpr (std::is_same_v<T, float>) return Elem::F32;
  if constexpr (std::is_same_v<T, double>) return Elem::F64;
  if constexpr (std::is_same_v<T, int32_t>) return Elem::I32;
  if constexpr (std::is_same_v<T, int64_t>) return Elem::I64;
  return Elem::U8;
}
size_t elem_size(Elem e);

// The completion state of one collective, shared by the backend and the caller.
struct OpState;

class Handle {
 public:
  Handle() = default;  // already complete
  explicit Handle(std::shared_ptr<OpState> s) : s_(std::move(s)) {}
  // Blocks until the operation is complete; ds::Error after the timeout.
  void wait();
  bool done() const;

 private:
  std::shared_ptr<OpState> s_;
};

// Seconds a wait may take before it is an error (default 300; 0: forever).
void set_collective_timeout(double seconds);

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ranks with the same color form a new communicator, ordered by key (then
  // by rank here). Collective: every rank calls it.
  virtual std::unique_ptr<Communicator> split(int color, int key) = 0;
  virtual std::string backend() const = 0;

  virtual Handle all_reduce_raw(void* buf, int64_t n, Elem e, ReduceOp op) = 0;
  virtual Handle all_gather_raw(const void* send, int64_t n, void* recv, Elem e) = 0;
  virtual Handle reduce_scatter_raw(const void* send, int64_t n, void* recv, Elem e) = 0;
  virtual Handle all_to_all_raw(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                                Elem e) = 0;
  virtual Handle broadcast_raw(void* buf, int64_t n, Elem e, int root) = 0;
  virtual Handle barrier() = 0;

  template <typename T>
  Handle all_reduce(T* buf, int64_t n, ReduceOp op = ReduceOp::Sum) {
    return all_reduce_raw(buf, n, elem_of<T>(), op);
  }
  template <typename T>
  Handle all_gather(const T* send, int64_t n, T* recv) {
    return all_gather_raw(send, n, recv, elem_of<T>());
  }
  template <typename T>
  Handle reduce_scatter(const T* send, int64_t n, T* recv) {
    return reduce_scatter_raw(send, n, recv, elem_of<T>());
  }
  template <typename T>
  Handle all_to_all(const T* send, const int64_t* send_counts, T* recv, const int64_t* recv_counts) {
    return all_to_all_raw(send, send_counts, recv, recv_counts, elem_of<T>());
  }
  template <typename T>
  Handle broadcast(T* buf, int64_t n, int root) {
    return broadcast_raw(buf, n, elem_of<T>(), root);
  }
};

// A communicator of one rank: every collective is a copy, complete at once.
std::unique_ptr<Communicator> make_single();

// The process's world: MPI when this process was started by mpirun (and the
// build has MPI), else single-process. Created on first use, shut down at exit.
Communicator& world();
// True when world() is an MPI communicator of more than one rank.
bool is_distributed();
// Ends the process after an error has been printed: under MPI with more than
// one rank without the collective shutdown (mpirun then stops the others), else
// a normal exit.
[[noreturn]] void exit_after_error(int code);

namespace detail {
// Backend interface to OpState.
std::shared_ptr<OpState> new_op(std::string what);
void complete(OpState& s);
std::unique_ptr<Communicator> make_mpi_world();  // nullptr: no MPI in this build or not launched by mpirun
}  // namespace detail

}  // namespace ds::dist
