// Prometheus' text exposition format (version 0.0.4) for the server's
// GET /metrics: counters, gauges and histograms that threads update without
// a lock and a scrape reads at any time.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace ds::infer::metrics {

// Observations counted into buckets by upper bound (`le`), with their sum.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double v);
  uint64_t count() const { return count_.load(std::memory_order_relaxed); }
  // # HELP, # TYPE, the cumulative _bucket lines (+Inf last), _sum, _count.
  void render(std::string& out, std::string_view name, std::string_view help) const;

 private:
  std::vector<double> bounds_;
  std::unique_ptr<std::atomic<uint64_t>[]> counts_;  // per bucket, not cumulative; +Inf last
  std::atomic<double> sum_{0.0};
  std::atomic<uint64_t> count_{0};
};

// Bounds in seconds for a latency from 1 ms to 60 s.
std::vector<double> latency_bounds();

// # HELP and # TYPE lines, then the one sample `name value`.
void scalar(std::string& out, std::string_view name, std::string_view type, std::string_view help, double value);
// # HELP and # TYPE lines.
void header(std::string& out, std::string_view name, std::string_view type, std::string_view help);
// A sample line: name{labels} value (labels: `k="v",...`, may be empty).
void sample(std::string& out, std::string_view name, std::string_view labels, double value);

}  // namespace ds::infer::metrics
