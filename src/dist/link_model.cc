#include "dist/link_model.h"

#include <algorithm>

#include "core/error.h"

namespace ds::dist {

LinkModel::LinkModel(Communicator& inner, double latency_seconds, double bytes_per_second)
    : inner_(inner), latency_(latency_seconds), bandwidth_(bytes_per_second) {
  DS_CHECK(latency_seconds >= 0 && bytes_per_second > 0,
           "link model: latency {} s must be >= 0 and bandwidth {} B/s > 0", latency_seconds, bytes_per_second);
  thread_ = std::thread([this] { loop(); });
}

LinkModel::~LinkModel() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::unique_ptr<Communicator> LinkModel::split(int, int) {
  DS_FAIL("internal: split the inner communicator, then model its link");
}

Handle LinkModel::delay(Handle inner, double bytes) {
  auto outer = detail::new_op("collective over the modeled link");
  {
    std::lock_guard<std::mutex> lk(mu_);
    const auto now = clock::now();
    const auto start = std::max(now, link_free_);
    const auto transfer =
        std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(bytes / bandwidth_));
    const auto lat = std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(latency_));
    link_free_ = start + transfer;
    busy_ += latency_ + bytes / bandwidth_;
    bytes_ += bytes;
    queue_.push_back({start + transfer + lat, std::move(inner), outer});
  }
  cv_.notify_all();
  return Handle(outer);
}

void LinkModel::loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping with nothing in flight
    Item it = std::move(queue_.front());
    queue_.pop_front();
    lk.unlock();
    std::this_thread::sleep_until(it.due);
    it.inner.wait();
    detail::complete(*it.outer);
    lk.lock();
  }
}

double LinkModel::busy_seconds() const {
  std::lock_guard<std::mutex> lk(mu_);
  return busy_;
}

double LinkModel::bytes_received() const {
  std::lock_guard<std::mutex> lk(mu_);
  return bytes_;
}

Handle LinkModel::all_reduce_raw(void* buf, int64_t n, Elem e, ReduceOp op) {
  const double S = size();
  return delay(inner_.all_reduce_raw(buf, n, e, op), 2.0 * (S - 1) / S * double(n) * double(elem_size(e)));
}
Handle LinkModel::all_gather_raw(const void* send, int64_t n, void* recv, Elem e) {
  return delay(inner_.all_gather_raw(send, n, recv, e), double(size() - 1) * double(n) * double(elem_size(e)));
}
Handle LinkModel::reduce_scatter_raw(const void* send, int64_t n, void* recv, Elem e) {
  return delay(inner_.reduce_scatter_raw(send, n, recv, e), double(size() - 1) * double(n) * double(elem_size(e)));
}
Handle LinkModel::all_to_all_raw(const void* send, const int64_t* sc, void* recv, const int64_t* rc, Elem e) {
  double got = 0;
  for (int r = 0; r < size(); ++r)
    if (r != rank()) got += double(rc[r]);
  return delay(inner_.all_to_all_raw(send, sc, recv, rc, e), got * double(elem_size(e)));
}
Handle LinkModel::broadcast_raw(void* buf, int64_t n, Elem e, int root) {
  return delay(inner_.broadcast_raw(buf, n, e, root), rank() == root ? 0.0 : double(n) * double(elem_size(e)));
}
Handle LinkModel::barrier() { return delay(inner_.barrier(), 0.0); }

}  // namespace ds::dist
