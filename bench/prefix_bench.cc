// Prefix caching inside the engine: the first-token work of a 2,000-token
// prompt read whole (in chunks of 512, as the server reads it) against the
// same prompt whose first 1,900 positions are restored from a kept cache
// (Decoder::restore) and whose last 100 are read; and 100 tokens read alone,
// what the restored case costs at least. A random `small` checkpoint
// (configs/small.yml). bench/prefix_cache_bench.py times the same through
// `deepseek serve`.
//
//   build/bench/prefix_bench --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "bench_main.h"
#include "infer/engine.h"
#include "infer/generate.h"
#include "model/config.h"
#include "model/init.h"

namespace ds::bench {
namespace {

struct Fixture {
  std::string dir;
  std::unique_ptr<infer::LoadedModel> model;
  std::vector<int32_t> prompt;
  std::shared_ptr<const infer::CacheSnapshot> kept;  // the prompt's cache

  Fixture() {
    dir = (std::filesystem::temp_directory_path() / "ds_prefix_bench").string();
    std::filesystem::remove_all(dir);
    const auto cfg = model::ModelConfig::from_yaml_file(std::string(DEEPSEEK_SOURCE_DIR) + "/configs/small.yml");
    model::InitOptions opt;
    opt.seed = 1;
    model::write_random_checkpoint(cfg, dir, opt);
    model = infer::load_model(dir);
    for (int i = 0; i < 2000; ++i) prompt.push_back((i * 7919 + 13) % static_cast<int32_t>(cfg.vocab_size));
    auto d = decoder();
    read(*d, 0, 2000);
    kept = d->take_snapshot(0);
  }
  ~Fixture() { std::filesystem::remove_all(dir); }
  std::unique_ptr<infer::Decoder> decoder() const {
    auto d = infer::kv_decoder(*model->engine, infer::CacheKind::Latent);
    d->start(1);
    return d;
  }
  // Prompt tokens [a, b) into sequence 0, 512 a step.
  void read(infer::Decoder& d, int64_t a, int64_t b) const {
    for (int64_t c = a; c < b; c += 512)
      benchmark::DoNotOptimize(d.step({{prompt.begin() + c, prompt.begin() + std::min<int64_t>(b, c + 512)}}));
  }
};

const Fixture& fixture() {
  static const Fixture f;
  return f;
}

void Uncached2000(benchmark::State& state) {
  const Fixture& f = fixture();
  auto d = f.decoder();
  for (auto _ : state) {
    d->reset(0);
    f.read(*d, 0, 2000);
  }
}

void Kept1900Read100(benchmark::State& state) {
  const Fixture& f = fixture();
  auto d = f.decoder();
  for (auto _ : state) {
    d->reset(0);
    d->restore(0, *f.kept, 1900);
    f.read(*d, 1900, 2000);
  }
}

void Alone100(benchmark::State& state) {
  const Fixture& f = fixture();
  auto d = f.decoder();
  for (auto _ : state) {
    d->reset(0);
    f.read(*d, 0, 100);
  }
}

void register_all() {
  benchmark::RegisterBenchmark("prefix/uncached_2000", Uncached2000)->Unit(benchmark::kMillisecond)->UseRealTime();
  benchmark::RegisterBenchmark("prefix/kept_1900_read_100", Kept1900Read100)
      ->Unit(benchmark::kMillisecond)
      ->UseRealTime();
  benchmark::RegisterBenchmark("prefix/alone_100", Alone100)->Unit(benchmark::kMillisecond)->UseRealTime();
}

}  // namespace
}  // namespace ds::bench

int main(int argc, char** argv) { return ds::bench::bench_main(argc, argv, ds::bench::register_all); }
