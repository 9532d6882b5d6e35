// A communicator that delivers through a modeled link, to see on one machine
// how much communication a schedule hides. Each collective goes to the inner
// communicator as usual, but its handle completes no earlier than
//   start + latency + bytes / bandwidth,
// where bytes are what this rank receives (all_gather and reduce_scatter:
// (ranks - 1) x the block; all_reduce: 2 (ranks - 1) / ranks x the buffer;
// all_to_all: what others send it; broadcast: the buffer) and start is when
// the link is free: transfers share the bandwidth one after another in the
// order they were started, while latencies overlap. A timer thread completes
// the handles. busy_seconds() adds up latency + bytes / bandwidth of every
// collective: what the communication would cost if none of it were hidden.
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "dist/communicator.h"

namespace ds::dist {

class LinkModel final : public Communicator {
 public:
  LinkModel(Communicator& inner, double latency_seconds, double bytes_per_second);
  ~LinkModel() override;

  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  std::string backend() const override { return "link model over " + inner_.backend(); }
  std::unique_ptr<Communicator> split(int color, int key) override;

  Handle all_reduce_raw(void* buf, int64_t n, Elem e, ReduceOp op) override;
  Handle all_gather_raw(const void* send, int64_t n, void* recv, Elem e) override;
  Handle reduce_scatter_raw(const void* send, int64_t n, void* recv, Elem e) override;
  Handle all_to_all_raw(const void* send, const int64_t* send_counts, void* recv, const int64_t* recv_counts,
                        Elem e) override;
  Handle broadcast_raw(void* buf, int64_t n, Elem e, int root) override;
  Handle barrier() override;

  double busy_seconds() const;
  double bytes_received() const;

 private:
  using clock = std::chrono::steady_clock;
  Handle delay(Handle inner, double bytes);
  void loop();

  Communicator& inner_;
  const double latency_, bandwidth_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Item {
    clock::time_point due;
    Handle inner;
    std::shared_ptr<OpState> outer;
  };
  std::deque<Item> queue_;
  clock::time_point link_free_{};
  double busy_ = 0, bytes_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace ds::dist
