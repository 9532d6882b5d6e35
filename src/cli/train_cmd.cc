// `deepseek train CONFIG.yml [key=value ...]`: MaxText's command form (bare
// key=value overrides, MaxText's key names; see train/config.h), everything
// written to base_output_directory/run_name.
// `deepseek export --checkpoint DIR --out HF_DIR [--dtype bf16|f16|f32]`: a
// training checkpoint as a Hugging Face folder (config.json, model.safetensors,
// and the run's tokenizer files when it had one; a tokenizer.json and
// tokenizer_config.json already in the folder are removed when it had none)
// that `deepseek generate` and Hugging Face's loaders read.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/dtype.h"
#include "core/error.h"
#include "dist/communicator.h"
#include "infer/model.h"
#include "io/atomic_file.h"
#include "io/text_input.h"
#include "io/tokenizer.h"
#include "model/gguf_export.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "train/trainer.h"

namespace ds::cli {

namespace {

namespace fs = std::filesystem;

struct TrainArgs {
  std::string config;
  std::vector<std::string> overrides;
};

struct ExportArgs {
  std::string checkpoint, model, out, dtype = "bf16", format = "hf";
  bool quiet = false;  // no line of its own (the folder is a step of --format gguf)
};

int run_train(const TrainArgs& a) {
  const auto rc = train::load_run_config(a.config, a.overrides);
  const auto s = train::train(rc);
  if (dist::world().rank() != 0) return s.interrupted ? 130 : 0;
  fmt::print("trained {}: steps {} -> {}, loss {:.4f} -> {:.4f}{}{}; metrics, loss.svg and checkpoints in {}\n",
             rc.train.run_name, s.start_step, s.end_step, s.first_loss, s.last_loss,
             s.last_eval_loss >= 0 ? fmt::format(", eval loss {:.4f}", s.last_eval_loss) : "",
             s.skipped_steps ? fmt::format(", {} steps skipped", s.skipped_steps) : "", s.run_dir);
  check_stdout();
  return s.interrupted ? 130 : 0;
}

// The BOS and EOS ids of the run's tokenizer in the exported config.json
// (its root, and text_config's when it has its own): the model was trained
// on documents that begin and end with them (`deepseek prepare`), and
// generation stops at the config's EOS. A tokenizer without them leaves the
// config's.
void set_special_ids(const fs::path& config, std::optional<int32_t> bos, std::optional<int32_t> eos, int64_t vocab) {
  if (!bos && !eos) return;
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(io::read_file(config.string(), "config"));
  for (auto* o : {&j, j.contains("text_config") ? &j["text_config"] : nullptr}) {
    if (!o) continue;
    for (const auto& [key, id] : {std::pair{"bos_token_id", bos}, {"eos_token_id", eos}})
      if (id && *id < vocab && (o == &j || o->contains(key))) (*o)[key] = *id;
  }
  io::write_file_atomic(config.string(), j.dump(2) + "\n");
}

int run_export_hf(const ExportArgs& a);

// --format gguf: the Hugging Face folder in float32 beside the output, then
// one GGUF file of it (model/gguf_export.h), the folder removed.
int run_export_gguf(const ExportArgs& a) {
  const std::string out = io::resolve_output_path(a.out);
  if (!a.model.empty()) {  // a model folder as it is
    const uint64_t bytes = model::export_gguf(infer::model_folder(a.model), out, a.dtype);
    fmt::print("exported {} to {} (GGUF, {}, {:.1f} MiB)\n", a.model, a.out, a.dtype,
               static_cast<double>(bytes) / (1 << 20));
    check_stdout();
    return 0;
  }
  const fs::path tmp = fs::path(out).parent_path() / (fs::path(out).filename().string() + ".hf-export");
  std::error_code ec;
  fs::remove_all(tmp, ec);
  ExportArgs hf = a;
  hf.out = tmp.string();
  hf.dtype = "f32";
  hf.format = "hf";
  hf.quiet = true;
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code e;
      fs::remove_all(p, e);
    }
  } cleanup{tmp};
  {
    // The folder's own line is not the user's output.
    const int rc = run_export_hf(hf);
    if (rc != 0) return rc;
  }
  const uint64_t bytes = model::export_gguf(tmp.string(), out, a.dtype);
  fmt::print("exported {} to {} (GGUF, {}, {:.1f} MiB)\n", a.checkpoint, a.out, a.dtype,
             static_cast<double>(bytes) / (1 << 20));
  check_stdout();
  return 0;
}

int run_export(const ExportArgs& a) {
  DS_CHECK(a.checkpoint.empty() != a.model.empty(), "export: give --checkpoint or --model (one of them)");
  DS_CHECK(a.model.empty() || a.format == "gguf",
           "export: --model is read by --format gguf (a model folder is a "
           "Hugging Face folder already)");
  if (a.format == "gguf") return run_export_gguf(a);
  DS_CHECK(a.format == "hf", "export: --format must be hf or gguf, got '{}'", a.format);
  return run_export_hf(a);
}

int run_export_hf(const ExportArgs& a) {
  DType dt;
  if (a.dtype == "bf16")
    dt = DType::BF16;
  else if (a.dtype == "f16")
    dt = DType::F16;
  else if (a.dtype == "f32")
    dt = DType::F32;
  else
    DS_FAIL("export: --dtype {} is not bf16, f16 or f32", a.dtype);
  const auto st = train::read_checkpoint_state(a.checkpoint);
  std::unique_ptr<model::Family> family;
  try {
    family = model::family_from_hf_config(st.model_config, a.checkpoint + "/state.json");
  } catch (const Error& e) {
    DS_FAIL("checkpoint '{}' is corrupt: {}", a.checkpoint, e.what());
  }
  // Every output path is checked, and the tokenizer read, before anything is written.
  io::check_output_folder(a.out);
  const fs::path out(a.out);
  const char* outputs[] = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"};
  std::error_code ec;
  if (fs::is_directory(out, ec))
    for (const char* o : outputs) io::resolve_output_path((out / o).string());
  std::string tok_note = "no tokenizer recorded", tok_text, tok_config;
  std::optional<int32_t> bos, eos;
  if (!st.tokenizer.empty()) {
    const fs::path t(st.tokenizer);
    if (fs::is_regular_file(t, ec)) {
      tok_text = io::read_file(t.string(), "tokenizer");
      const fs::path tc = t.parent_path() / "tokenizer_config.json";
      if (fs::is_regular_file(tc, ec)) tok_config = io::read_file(tc.string(), "tokenizer config");
      const io::Tokenizer tok = io::Tokenizer::from_json(tok_text, tok_config, t.string());
      bos = tok.bos_id();
      eos = tok.token_to_id("<｜end▁of▁sentence｜>");
      tok_note = "tokenizer from " + t.string();
    } else {
      tok_note = "tokenizer " + t.string() + " no longer exists";
    }
  }
  const int64_t mtp = family->mtp_layers();
  std::vector<float> params(static_cast<size_t>(family->numel()));
  train::load_checkpoint(a.checkpoint, family->layout(), params.data(), nullptr, nullptr);
  family->bind(params.data(), nullptr)->params_changed();  // checks what the family derives (hash tables)
  family->export_hf(a.out, params.data(), dt, "export");
  set_special_ids(out / "config.json", bos, eos, family->vocab_size());
  // The folder's tokenizer files are this run's or none: another model's
  // would silently mistranslate its ids.
  for (const auto& [name, text] : {std::pair{"tokenizer.json", &tok_text}, {"tokenizer_config.json", &tok_config}}) {
    if (!text->empty()) {
      io::write_file_atomic((out / name).string(), *text);
    } else if (fs::exists(fs::symlink_status(out / name, ec))) {
      fs::remove(out / name, ec);
      DS_CHECK(!ec, "export: cannot remove the stale '{}': {}", (out / name).string(), ec.message());
      tok_note += fmt::format("; removed the folder's old {}", name);
    }
  }
  if (a.quiet) return 0;
  fmt::print("exported {} (step {}, {} MTP layers, {}) to {}; {}\n", a.checkpoint, st.step, mtp, a.dtype, a.out,
             tok_note);
  check_stdout();
  return 0;
}

}  // namespace

void add_train_commands(CLI::App& app, CommandList& commands) {
  auto ta = std::make_shared<TrainArgs>();
  auto* t = app.add_subcommand("train", "train a model: deepseek train CONFIG.yml [key=value ...] (MaxText's keys)");
  t->add_option("config", ta->config, "YAML config (MaxText key names)")->required();
  t->add_option("overrides", ta->overrides, "key=value overrides");
  commands.emplace_back(t, [ta] { return run_train(*ta); });

  auto ea = std::make_shared<ExportArgs>();
  auto* e = app.add_subcommand("export", "write a training checkpoint as a Hugging Face model folder or a GGUF file");
  e->add_option("--checkpoint", ea->checkpoint, "checkpoint folder (RUN/checkpoints/step_N)");
  e->add_option("--model", ea->model,
                "with --format gguf: a DeepSeek-V2/V3 model folder (any float dtype, or `deepseek quantize` blocks) "
                "instead of a checkpoint");
  e->add_option("--out", ea->out, "output folder")->required();
  e->add_option("--dtype", ea->dtype,
                "weight dtype: bf16 (default), f16, f32; with --format gguf also q8_0, q4_k, q4_k_m and q6_k");
  e->add_option("--format", ea->format,
                "hf (default: a Hugging Face folder) or gguf (one file llama.cpp loads; DeepSeek-V2/V3 models)");
  commands.emplace_back(e, [ea] { return run_export(*ea); });
}

}  // namespace ds::cli
