#include "infer/metrics.h"

#include <fmt/format.h>

#include <algorithm>

#include "core/error.h"

namespace ds::infer::metrics {

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)), counts_(std::make_unique<std::atomic<uint64_t>[]>(bounds_.size() + 1)) {
  DS_CHECK(std::is_sorted(bounds_.begin(), bounds_.end()), "histogram bounds must ascend");
}

void Histogram::observe(double v) {
  const size_t b = static_cast<size_t>(std::lower_bound(bounds_.begin(), bounds_.end(), v) - bounds_.begin());
  counts_[b].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(v, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
}

// A number as Prometheus reads it: integers without a fraction, others in
// the shortest form that reads back the same.
static std::string number(double v) {
  if (v == static_cast<double>(static_cast<int64_t>(v)) && std::abs(v) < 1e15)
    return fmt::format("{}", static_cast<int64_t>(v));
  return fmt::format("{}", v);
}

void Histogram::render(std::string& out, std::string_view name, std::string_view help) const {
  header(out, name, "histogram", help);
  // A scrape while observations land can see a bucket ahead of _count; the
  // cumulative counts stay monotone, and _count is their total.
  uint64_t cum = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    cum += counts_[i].load(std::memory_order_relaxed);
    const std::string le = i < bounds_.size() ? number(bounds_[i]) : "+Inf";
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, le, cum);
  }
  out += fmt::format("{}_sum {}\n", name, number(sum_.load(std::memory_order_relaxed)));
  out += fmt::format("{}_count {}\n", name, cum);
}

std::vector<double> latency_bounds() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}

void header(std::string& out, std::string_view name, std::string_view type, std::string_view help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

void sample(std::string& out, std::string_view name, std::string_view labels, double value) {
  if (labels.empty())
    out += fmt::format("{} {}\n", name, number(value));
  else
    out += fmt::format("{}{{{}}} {}\n", name, labels, number(value));
}

void scalar(std::string& out, std::string_view name, std::string_view type, std::string_view help, double value) {
  header(out, name, type, help);
  sample(out, name, "", value);
}

}  // namespace ds::infer::metrics
