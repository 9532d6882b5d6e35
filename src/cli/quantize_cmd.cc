// deepseek quantize --model IN --out OUT [--type q4_k_m|q4_k|q8_0] [--override REGEX=FORMAT]...
// A model folder with its matrices in q8_0 / q4_k blocks (model/quantize.h).
#include <fmt/format.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "infer/model.h"
#include "model/quantize.h"

namespace ds::cli {

namespace {

struct QuantizeArgs {
  std::string model, out, type = "q4_k_m";
  std::vector<std::string> overrides;
};

std::string mebibytes(uint64_t b) { return fmt::format("{:.1f} MiB", static_cast<double>(b) / (1 << 20)); }

int run_quantize(const QuantizeArgs& a) {
  model::QuantizeOptions opt;
  opt.recipe = a.type;
  for (const auto& o : a.overrides) opt.overrides.push_back(model::parse_quantize_override(o));
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = model::quantize_model(infer::model_folder(a.model), a.out, opt);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& [f, n] : r.fallbacks)
    fmt::print(stderr, "quantize: {} tensor{}: {} (rows not whole blocks)\n", n, n == 1 ? "" : "s", f);
  std::string parts;
  for (const auto& [f, n] : r.tensors)
    parts += fmt::format("{}{} {} ({})", parts.empty() ? "" : ", ", n, f, mebibytes(r.bytes.at(f)));
  fmt::print("quantize: {} -> {} ({}): {} of weights -> {} in {:.1f} s; tensors: {}\n", a.model, a.out, a.type,
             mebibytes(r.bytes_in), mebibytes(r.bytes_out), s, parts);
  return 0;
}

}  // namespace

void add_quantize_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<QuantizeArgs>();
  auto* cmd = app.add_subcommand("quantize", "write a model folder with its matrices in q8_0 or q4_k blocks");
  cmd->add_option("--model", args->model, "model folder of any DeepSeek family (or a GGUF file) to read")->required();
  cmd->add_option("--out", args->out, "the folder to write (new or empty)")->required();
  cmd->add_option("--type", args->type,
                  "q4_k_m (default: routed experts q4_k, the rest q8_0), q4_k (every matrix q4_k but the LM head), "
                  "or q8_0")
      ->check(CLI::IsMember({"q4_k_m", "q4_k", "q8_0"}));
  cmd->add_option(
      "--override", args->overrides,
      "REGEX=FORMAT (q4_k, q4_1, q6_k, q8_0, bf16, f32): tensors whose whole name matches, before the recipe; the "
      "first match wins (repeatable)");
  commands.emplace_back(cmd, [args] { return run_quantize(*args); });
}

}  // namespace ds::cli
