#include "train/trainer.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/expert_exchange.h"
#include "dist/fsdp.h"
#include "dist/link_model.h"
#include "dist/mesh.h"
#include "io/atomic_file.h"
#include "model/init.h"
#include "model/model.h"
#include "ops/adamw.h"
#include "ops/expert_selection.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/flops.h"
#include "train/optimizer.h"
#include "train/schedule.h"

namespace ds::train {

namespace fs = std::filesystem;

namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }

// Installs SIGINT/SIGTERM handlers for the run and restores the old ones after.
class StopSignals {
 public:
  StopSignals() {
    g_stop_signal.store(0);
    old_int_ = std::signal(SIGINT, on_stop_signal);
    old_term_ = std::signal(SIGTERM, on_stop_signal);
  }
  ~StopSignals() {
    std::signal(SIGINT, old_int_);
    std::signal(SIGTERM, old_term_);
  }

 private:
  void (*old_int_)(int);
  void (*old_term_)(int);
};

double counted_targets(const model::TrainBatch& b) {
  double n = 0;
  for (int32_t s : b.target_segment_ids) n += s != 0;
  return n;
}

std::string fmt_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(seconds + 0.5);
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, (s / 60) % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

std::string fmt_rate(double x) { return x >= 1e4 ? fmt::format("{:.1f}k", x / 1e3) : fmt::format("{:.0f}", x); }

// The metrics of steps before `step` from an earlier run's metrics.jsonl
// (a resumed run rewrites the file without the steps it repeats).
std::vector<nlohmann::json> read_metrics_before(const fs::path& file, int64_t step) {
  std::vector<nlohmann::json> kept;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    try {
      auto j = nlohmann::json::parse(line);
      if (j.contains("step") && j["step"].get<int64_t>() < step) kept.push_back(std::move(j));
    } catch (const nlohmann::json::exception&) {
      // A line cut short by a crash: dropped.
    }
  }
  return kept;
}

// Rows [first, first + rows) of a batch.
model::TrainBatch slice_rows(const model::TrainBatch& b, int64_t first, int64_t rows) {
  model::TrainBatch out;
  out.batch = rows;
  out.seq = b.seq;
  const auto a = static_cast<std::ptrdiff_t>(first * b.seq), e = static_cast<std::ptrdiff_t>((first + rows) * b.seq);
  for (auto [dst, src] : {std::pair{&out.inputs, &b.inputs},
                          {&out.targets, &b.targets},
                          {&out.positions, &b.positions},
                          {&out.segment_ids, &b.segment_ids},
                          {&out.target_segment_ids, &b.target_segment_ids}})
    dst->assign(src->begin() + a, src->begin() + e);
  return out;
}

// A string from rank 0 to every rank of `c`.
std::string broadcast_string(dist::Communicator& c, std::string s) {
  int64_t n = static_cast<int64_t>(s.size());
  c.broadcast(&n, 1, 0).wait();
  s.resize(static_cast<size_t>(n));
  c.broadcast(s.data(), n, 0).wait();
  return s;
}

double sum_squares(const std::vector<ops::GradSpan>& spans) {
  const double n = ops::global_grad_norm(spans);
  return n * n;
}

}  // namespace

void write_loss_svg(const std::string& path, const std::vector<std::pair<int64_t, double>>& train_loss,
                    const std::vector<std::pair<int64_t, double>>& eval_loss, const std::string& title) {
  const double W = 720, H = 420, L = 64, R = 20, T = 40, B = 48;
  double x0 = 0, x1 = 1, y0 = 1e300, y1 = -1e300;
  for (const auto* v : {&train_loss, &eval_loss})
    for (const auto& [s, l] : *v) {
      if (!std::isfinite(l)) continue;
      x1 = std::max(x1, static_cast<double>(s));
      y0 = std::min(y0, l);
      y1 = std::max(y1, l);
    }
  if (y0 > y1) y0 = 0, y1 = 1;
  if (y1 - y0 < 1e-9) y0 -= 0.5, y1 += 0.5;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad;
  y1 += pad;
  auto px = [&](double s) { return L + (s - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double l) { return T + (y1 - l) / (y1 - y0) * (H - T - B); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"22\" font-size=\"15\">{3}</text>\n",
      W, H, L, title);
  // Axes, ticks and grid.
  svg += fmt::format("<path d=\"M{0} {1} V{2} H{3}\" stroke=\"black\" fill=\"none\"/>\n", L, T, H - B, W - R);
  for (int i = 0; i <= 5; ++i) {
    const double l = y0 + (y1 - y0) * i / 5, y = py(l);
    svg += fmt::format("<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" stroke=\"#ddd\"/>\n", L, y, W - R, y);
    svg += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3g}</text>\n", L - 6, y + 4, l);
    const double s = x0 + (x1 - x0) * i / 5;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{:.0f}</text>\n", px(s), H - B + 18, s);
  }
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (L + W - R) / 2, H - 10);
  std::string d;
  for (const auto& [s, l] : train_loss)
    if (std::isfinite(l)) d += fmt::format("{}{:.1f} {:.1f}", d.empty() ? "M" : " L", px(double(s)), py(l));
  if (!d.empty()) svg += "<path d=\"" + d + "\" stroke=\"#1f77b4\" stroke-width=\"1.5\" fill=\"none\"/>\n";
  for (const auto& [s, l] : eval_loss)
    if (std::isfinite(l))
      svg += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"#d62728\"/>\n", px(double(s)), py(l));
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"#1f77b4\" stroke-width=\"2\"/>"
      "<text x=\"{3}\" y=\"{4}\">train loss</text>\n",
      W - 200, T + 6, W - 180, W - 174, T + 10);
  if (!eval_loss.empty())
    svg += fmt::format(
        "<circle cx=\"{}\" cy=\"{}\" r=\"3.5\" fill=\"#d62728\"/><text x=\"{}\" y=\"{}\">eval loss</text>\n", W - 110,
        T + 6, W - 100, T + 10);
  svg += "</svg>\n";
  io::write_file_atomic(path, svg);
}

void write_timeline_svg(const std::string& path, const std::vector<model::TimelineSpan>& spans, int64_t layer,
                        const std::string& title) {
  int parts = 0;
  double t_begin[2] = {1e300, 1e300}, t_end[2] = {0, 0};
  for (const auto& x : spans) {
    if (x.layer != layer) continue;
    parts = std::max(parts, x.part + 1);
    t_begin[x.backward] = std::min(t_begin[x.backward], x.t0);
    t_end[x.backward] = std::max(t_end[x.backward], x.t1);
  }
  const double W = 900, L = 150, R = 20, row = 34, panel_gap = 50, T = 50;
  const double span_ms = std::max({1e-6, (t_end[0] - t_begin[0]) * 1e3, (t_end[1] - t_begin[1]) * 1e3});
  const double H = T + 2 * (parts * row + panel_gap) + 30;
  auto px = [&](double ms) { return L + ms / span_ms * (W - L - R); };
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"10\" y=\"22\" font-size=\"15\">{2}</text>\n"
      "<rect x=\"{3}\" y=\"30\" width=\"14\" height=\"10\" fill=\"#1f77b4\"/><text x=\"{4}\" y=\"39\">compute</text>"
      "<rect x=\"{5}\" y=\"33\" width=\"14\" height=\"5\" fill=\"#ff7f0e\"/>"
      "<text x=\"{6}\" y=\"39\">expert exchange in flight</text>\n",
      W, H, title, W - 330, W - 312, W - 240, W - 222);
  for (int b = 0; b < 2; ++b) {
    const double y0 = T + b * (parts * row + panel_gap) + 20;
    svg +=
        fmt::format("<text x=\"10\" y=\"{:.0f}\" font-weight=\"bold\">{}</text>\n", y0 - 6, b ? "backward" : "forward");
    for (int p = 0; p < parts; ++p)
      svg += fmt::format("<text x=\"10\" y=\"{:.0f}\">micro-batch {}</text>\n", y0 + p * row + 18, p);
    for (int i = 0; i <= 4; ++i) {
      const double ms = span_ms * i / 4, x = px(ms);
      svg += fmt::format(
          "<line x1=\"{0:.1f}\" y1=\"{1:.0f}\" x2=\"{0:.1f}\" y2=\"{2:.0f}\" stroke=\"#ddd\"/>"
          "<text x=\"{0:.1f}\" y=\"{3:.0f}\" text-anchor=\"middle\">{4:.2f} ms</text>\n",
          x, y0, y0 + parts * row, y0 + parts * row + 14, ms);
    }
    for (const auto& x : spans) {
      if (x.layer != layer || x.backward != (b == 1)) continue;
      const double a = px((x.t0 - t_begin[b]) * 1e3), e = px((x.t1 - t_begin[b]) * 1e3);
      const double y = y0 + x.part * row + (x.computing ? 4 : 24);
      svg += fmt::format("<rect x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"{}\" fill=\"{}\"/>\n", a, y,
                         std::max(0.5, e - a), x.computing ? 18 : 6, x.computing ? "#1f77b4" : "#ff7f0e");
    }
  }
  svg += "</svg>\n";
  io::write_file_atomic(path, svg);
}

TrainSummary train(const RunConfig& rc) {
  const model::ModelConfig& cfg = rc.model;
  const TrainConfig& tc = rc.train;
  // DeepSeek-V4 shares the loop: its own parameter layout, loss and
  // checkpoint tensors; data parallelism only.
  const model::V4Config* v4 = rc.v4 ? &*rc.v4 : nullptr;
  const int64_t mtp = v4 ? 0 : cfg.num_nextn_predict_layers;
  TrainSummary sum;
  sum.run_dir = tc.run_dir();
  const fs::path run(sum.run_dir), ckdir = run / "checkpoints";

  // The mesh. Every rank holds per_device_batch_size rows of each global
  // batch; rank 0 alone touches the run folder (metrics, checkpoints), reads
  // the initial parameters or the checkpoint, and broadcasts them.
  dist::Communicator& world = dist::world();
  dist::set_collective_timeout(tc.collective_timeout_seconds);
  dist::Mesh mesh(world, tc.mesh, dist::ranks_per_node_from_env(world.size()));
  const bool lead = world.rank() == 0, multi = world.size() > 1;
  // A modeled link under the per-layer collectives: the expert exchange, the
  // dense weights' gathers (shard group) and the experts' (fsdp axis).
  const int64_t F = mesh.size(dist::kFsdp), X = mesh.size(dist::kExpert), G = mesh.shard_group_size();
  // DeepSeek-V4: data parallelism only. Every rank holds the whole model; the
  // batch is split over the data and fsdp axes alike (fsdp then shards the
  // batch, not the parameters).
  DS_CHECK(!v4 || X == 1,
           "{}: expert parallelism is not implemented for DeepSeek-V4 models (ici_/dcn_data_parallelism and "
           "fsdp split the batch)",
           mesh.describe());
  if (v4 && multi && lead)
    fmt::print(stderr, "DeepSeek-V4 on {}: every rank holds the whole model; the batch is split over {} ranks\n",
               mesh.describe(), world.size());
  std::unique_ptr<dist::LinkModel> link_expert, link_group, link_fsdp;
  if (tc.link_model_gbps > 0) {
    const double lat = tc.link_model_latency_us * 1e-6, bw = tc.link_model_gbps * 1e9;
    if (X > 1) link_expert = std::make_unique<dist::LinkModel>(mesh.axis(dist::kExpert), lat, bw);
    if (G > 1) link_group = std::make_unique<dist::LinkModel>(mesh.shard_group(), lat, bw);
    if (X > 1 && F > 1) link_fsdp = std::make_unique<dist::LinkModel>(mesh.axis(dist::kFsdp), lat, bw);
  }
  dist::Communicator& expert_comm = link_expert ? *link_expert : mesh.axis(dist::kExpert);
  dist::Communicator& group_comm = link_group ? *link_group : mesh.shard_group();
  dist::Communicator& fsdp_comm = link_fsdp ? *link_fsdp : mesh.axis(dist::kFsdp);
  // Seconds each modeled link has been busy so far: expert exchange, shard
  // group, fsdp axis.
  auto link_busy = [&] {
    std::array<double, 3> t{};
    const dist::LinkModel* links[3] = {link_expert.get(), link_group.get(), link_fsdp.get()};
    for (int i = 0; i < 3; ++i) t[i] = links[i] ? links[i]->busy_seconds() : 0.0;
    return t;
  };

  // Expert parallelism: each rank of the expert axis computes its share of
  // the routed experts for the tokens of every rank on that axis.
  std::unique_ptr<dist::ExpertExchange> exchange;
  DS_CHECK(!tc.expert_grad_comm_fp8 || mesh.size(dist::kExpert) > 1,
           "expert_grad_comm_fp8 needs expert parallelism (ici_ or dcn_expert_parallelism > 1)");
  if (X > 1) {
    DS_CHECK(cfg.n_routed_experts > 0, "expert parallelism ({}) needs a model with routed experts", mesh.describe());
    exchange =
        std::make_unique<dist::ExpertExchange>(expert_comm, cfg.n_routed_experts,
                                               tc.expert_dispatch == "allgather" ? dist::ExpertExchange::Mode::AllGather
                                                                                 : dist::ExpertExchange::Mode::AllToAll,
                                               tc.expert_grad_comm_fp8);
  }
  const int64_t shards = mesh.batch_shards(), shard = mesh.batch_index();
  const int64_t rows = tc.per_device_batch_size;
  DataConfig data_cfg = tc.data;
  data_cfg.batch = rows * shards;  // the global batch: the same for any world size

  // The run folder: refuse to mix with another run's checkpoints.
  std::vector<int64_t> existing;
  if (lead) {
    io::check_output_folder(tc.base_output_directory);
    std::error_code ec;
    fs::create_directories(run, ec);
    DS_CHECK(!ec && fs::is_directory(run), "cannot create the run folder '{}': {}", run.string(), ec.message());
    existing = list_checkpoints(ckdir.string());
    DS_CHECK(tc.resume || existing.empty(),
             "run folder '{}' already holds checkpoints (newest step_{}): pass resume=true to continue it, or "
             "choose another run_name",
             run.string(), existing.empty() ? 0 : existing.back());
  }

  // Parameters, gradients and optimizer. A shard group of one rank (no fsdp,
  // no expert axis): whole flat buffers. More: dist::FsdpParams keeps this
  // rank's shards (dense weights over fsdp x expert, routed experts on their
  // expert rank over fsdp) and streams the layers in (all-gather) and their
  // gradients out (reduce-scatter); the whole buffer exists only for a moment
  // at the start, at a resume and at a checkpoint.
  const std::vector<model::ParamInfo> layout = v4 ? model::v4_param_infos(*v4) : model::param_infos(cfg, mtp);
  const int64_t P = v4 ? model::V4FlatParams::numel(*v4) : model::FlatParams::numel(cfg, mtp);
  model::FlatParams params, grads;
  model::V4FlatParams v4_params;
  std::vector<float> v4_grad_data;
  model::V4Params<float*> v4_grads;
  std::unique_ptr<dist::FsdpParams> fsdp;
  std::unique_ptr<AdamW> opt_box;
  if (v4) {
    v4_params = model::V4FlatParams::zeros(*v4);
    v4_grad_data.assign(static_cast<size_t>(P), 0.0f);
    v4_grads = model::V4FlatParams::wrap(*v4, v4_grad_data.data()).ptr;
    opt_box = std::make_unique<AdamW>(layout, tc,
                                      std::vector<OwnedRange>{{0, P, v4_params.data.data(), v4_grad_data.data()}});
  } else if (G == 1) {
    params = model::FlatParams::zeros(cfg, mtp);
    grads = model::FlatParams::zeros(cfg, mtp);
    opt_box = std::make_unique<AdamW>(cfg, mtp, tc, params, grads);
  } else {
    fsdp = std::make_unique<dist::FsdpParams>(cfg, mtp, group_comm, fsdp_comm,
                                              X > 1 ? &mesh.axis(dist::kExpert) : nullptr);
    std::vector<OwnedRange> owned;
    for (const auto& pc : fsdp->owned())
      owned.push_back({pc.lo, pc.hi, fsdp->shard.data() + pc.at, fsdp->grad_shard.data() + pc.at});
    opt_box = std::make_unique<AdamW>(cfg, mtp, tc, std::move(owned));
  }
  AdamW& opt = *opt_box;
  const model::ParamsView& pview = fsdp ? fsdp->view : params.view;
  model::ModelParams<float*>& gtree = fsdp ? fsdp->grads : grads.ptr;
  if (multi) {
    const int64_t held = fsdp ? fsdp->floats_held()
                         : v4 ? 2 * P
                              : static_cast<int64_t>(params.data.size() + grads.data.size());
    fmt::print(stderr, "rank {}: {}; shard {} of {}: {:.1f} MiB of parameters, gradients and AdamW moments\n",
               world.rank(), mesh.describe(), mesh.shard_group().rank(), G,
               static_cast<double>(held + static_cast<int64_t>(opt.m.size() + opt.v.size())) * 4 / (1 << 20));
  }
  // Rank 0's whole parameters (FSDP: a temporary buffer until the shards are taken).
  model::FlatParams full_box;
  if (fsdp) full_box = model::FlatParams::zeros(cfg, mtp);
  model::FlatParams& full = fsdp ? full_box : params;
  if (lead && v4) {
    if (!tc.load_parameters_path.empty())
      load_v4_hf_params(tc.load_parameters_path, *v4, v4_params);
    else
      init_v4_params(*v4, v4_params, tc.init_weights_seed, static_cast<float>(tc.init_weights_std));
  } else if (lead) {
    if (!tc.load_parameters_path.empty())
      load_hf_params(tc.load_parameters_path, cfg, mtp, full);
    else
      init_params(cfg, mtp, full, tc.init_weights_seed, static_cast<float>(tc.init_weights_std));
  }

  // Data.
  auto data = open_dataset(data_cfg, Split::Train);
  std::unique_ptr<Dataset> eval_data;
  if (tc.eval_interval > 0) {
    DataConfig ec_cfg = data_cfg;
    if (tc.eval_per_device_batch_size > 0) ec_cfg.batch = tc.eval_per_device_batch_size * shards;
    eval_data = open_dataset(ec_cfg, Split::Eval);
  }

  // Resume: rank 0 reads the checkpoint (whole tensors, so any world size
  // resumes any other's); every rank takes the parameters and its shard of
  // the moments.
  const nlohmann::json model_json = v4 ? v4->to_hf_json() : model::to_hf_json(cfg, mtp);
  int64_t start = 0, consecutive_skipped = 0;
  nlohmann::json resumed = {{"start", 0}, {"consecutive_skipped", 0}, {"newest", -1}};
  {
    std::vector<float> m_full, v_full;
    bool have_moments = false;
    if (lead && tc.resume && !existing.empty()) {
      const std::string dir = (ckdir / ("step_" + std::to_string(existing.back()))).string();
      m_full.assign(static_cast<size_t>(P), 0.0f);
      v_full.assign(static_cast<size_t>(P), 0.0f);
      CheckpointState st;
      if (v4) {
        st = load_checkpoint(dir, layout, v4_params.data.data(), m_full.data(), v_full.data());
        v4_params.sync_tables(*v4);
      } else {
        auto mf = model::FlatParams::wrap(cfg, mtp, m_full.data()),
             vf = model::FlatParams::wrap(cfg, mtp, v_full.data());
        st = load_checkpoint(dir, cfg, mtp, full, &mf, &vf);
      }
      DS_CHECK(st.model_config == model_json,
               "checkpoint '{}' holds a different model than this config describes; resume with the same model keys",
               dir);
      resumed = {{"start", st.step},
                 {"data", st.data_state},
                 {"consecutive_skipped", st.consecutive_skipped},
                 {"newest", existing.back()},
                 {"dir", dir}};
      have_moments = true;
      fmt::print(stderr, "resuming {} from {} ({} updates applied)\n", run.string(), dir, st.step);
    } else if (lead && tc.resume) {
      fmt::print(stderr, "resume=true but '{}' has no checkpoint yet: starting from step 0\n", ckdir.string());
    }
    if (multi) {
      resumed = nlohmann::json::parse(broadcast_string(world, resumed.dump()));
      if (v4) {
        world.broadcast(v4_params.data.data(), P, 0).wait();
        v4_params.sync_tables(*v4);
      } else {
        world.broadcast(full.data.data(), P, 0).wait();
      }
      have_moments = resumed["newest"].get<int64_t>() >= 0;
      if (have_moments) {
        m_full.resize(static_cast<size_t>(P));
        v_full.resize(static_cast<size_t>(P));
        world.broadcast(m_full.data(), P, 0).wait();
        world.broadcast(v_full.data(), P, 0).wait();
      }
    }
    if (fsdp) {
      fsdp->take_shard(full.data.data(), fsdp->shard.data());
      full_box = model::FlatParams();  // freed
    }
    if (have_moments && fsdp) {
      std::vector<float> sl(fsdp->shard.size());
      fsdp->take_shard(m_full.data(), sl.data());
      fsdp->pack(sl, opt.m);
      fsdp->take_shard(v_full.data(), sl.data());
      fsdp->pack(sl, opt.v);
    } else if (have_moments) {
      std::copy_n(m_full.begin(), P, opt.m.begin());
      std::copy_n(v_full.begin(), P, opt.v.begin());
    }
    start = resumed["start"].get<int64_t>();
    consecutive_skipped = resumed["consecutive_skipped"].get<int64_t>();
    if (resumed.contains("data")) {
      opt.set_count(start);
      try {
        data->restore(resumed["data"]);
      } catch (const Error& e) {
        DS_FAIL("checkpoint '{}': cannot restore the data position: {}", resumed["dir"].get<std::string>(), e.what());
      }
    }
  }
  DS_CHECK(start <= tc.steps, "the newest checkpoint has {} updates, more than steps={}", start, tc.steps);
  sum.start_step = sum.end_step = start;

  // Metrics: earlier steps kept (resume), the rest rewritten.
  const fs::path metrics_path = run / "metrics.jsonl";
  std::vector<std::pair<int64_t, double>> train_curve, eval_curve;
  std::ofstream metrics;
  if (lead) {
    std::string kept;
    for (const auto& j : read_metrics_before(metrics_path, start)) {
      kept += j.dump() + "\n";
      if (j.contains("loss") && j["loss"].is_number()) train_curve.emplace_back(j["step"].get<int64_t>(), j["loss"]);
      if (j.contains("eval_loss")) eval_curve.emplace_back(j["step"].get<int64_t>(), j["eval_loss"]);
    }
    io::write_file_atomic(metrics_path.string(), kept);
    io::write_file_atomic((run / "config.json").string(),
                          nlohmann::json{{"run", tc.as_json}, {"model", model_json}}.dump(2) + "\n");
    metrics.open(metrics_path, std::ios::app);
    DS_CHECK(metrics.good(), "cannot append to '{}'", metrics_path.string());
  }

  // MoE layers in the order the loss reports their loads (V4: every layer),
  // with the place of their routing bias in the flat order ({-1, 0}: none,
  // e.g. V4's hash-routed layers); this rank updates the elements it owns.
  std::vector<int64_t> moe_layers;
  for (int64_t l = 0; l < (v4 ? v4->num_hidden_layers + v4->num_nextn_predict_layers : cfg.num_hidden_layers + mtp);
       ++l)
    if (v4 || cfg.is_moe_layer(l)) moe_layers.push_back(l);
  std::vector<std::pair<int64_t, int64_t>> biases(moe_layers.size(), {-1, 0});
  {
    int64_t off = 0;
    for (const auto& i : layout) {
      if (i.role == model::ParamRole::RoutingBias) {
        const auto it = std::find(moe_layers.begin(), moe_layers.end(), i.layer);
        DS_CHECK(it != moe_layers.end(), "internal: routing bias '{}' of a layer without experts", i.name);
        biases[static_cast<size_t>(it - moe_layers.begin())] = {off, i.numel()};
      }
      off += i.numel();
    }
  }
  const double bias_rate = v4 ? rc.v4_routed_bias_update_rate : cfg.routed_bias_update_rate;
  const bool bias_update = bias_rate > 0;
  if (lead && v4)
    fmt::print(stderr,
               "DeepSeek-V4 model ({:.2f}M parameters): each document piece its own sequence; the lightning indexer "
               "and the hash table stay as they are; every activation is kept (remat_policy does not apply)\n",
               static_cast<double>(P) / 1e6);

  model::LossOptions lo;
  lo.stream = fsdp.get();
  lo.exchange = exchange.get();
  lo.batch_split_factor = tc.use_batch_split_schedule ? tc.batch_split_factor : 1;
  lo.z_loss_multiplier = tc.z_loss_multiplier;
  lo.load_balance_loss_weight = tc.load_balance_loss_weight;
  lo.mtp_num_layers = mtp;
  lo.mtp_loss_scaling_factor = tc.mtp_loss_scaling_factor;
  lo.indexer_loss_scaling_factor = tc.indexer_loss_scaling_factor;
  lo.indexer_sparse_training = tc.indexer_sparse_training;
  if (lead && cfg.index_n_heads > 0)
    fmt::print(stderr, "DSA model: {}; the indexer {}\n",
               tc.indexer_sparse_training
                   ? fmt::format("the sparse stage, attention over the indexer's top {} keys", cfg.index_topk)
                   : std::string("the dense warm-up, attention dense"),
               tc.indexer_loss_scaling_factor > 0
                   ? fmt::format("learns from its KL loss (x {})", tc.indexer_loss_scaling_factor)
                   : std::string("is not trained (indexer_loss_scaling_factor is 0)"));
  const int64_t GA = tc.gradient_accumulation_steps;
  const double flops = v4 ? v4_step_flops(*v4, tc.per_device_batch_size, tc.max_target_length, GA)
                          : step_flops(cfg, tc.per_device_batch_size, tc.max_target_length, mtp, GA);
  const double step_tokens = static_cast<double>(tc.per_device_batch_size * tc.max_target_length * GA);
  const bool tty = lead && ::isatty(STDERR_FILENO) == 1;
  const auto grad_spans = opt.grad_spans();
  const auto param_spans = opt.param_spans();
  // A norm over the whole tree from this rank's shard (sums of squares added
  // over the shard group; one shard: the plain norm).
  auto tree_norm = [&](const std::vector<ops::GradSpan>& spans) {
    if (!fsdp) return ops::global_grad_norm(spans);
    double ss = sum_squares(spans);
    mesh.shard_group().all_reduce(&ss, 1).wait();
    return std::sqrt(ss);
  };

  // Collective: every rank calls it; rank 0 writes.
  auto save = [&](int64_t step) {
    std::vector<float> m_full, v_full;
    float *m_src = opt.m.data(), *v_src = opt.v.data();
    if (fsdp) {
      full_box = model::FlatParams::zeros(cfg, mtp);
      fsdp->gather_full(fsdp->shard.data(), full_box.data.data());
      m_full.resize(static_cast<size_t>(P));
      v_full.resize(static_cast<size_t>(P));
      fsdp->gather_full(fsdp->expand(opt.m).data(), m_full.data());
      fsdp->gather_full(fsdp->expand(opt.v).data(), v_full.data());
      m_src = m_full.data();
      v_src = v_full.data();
    }
    if (!lead) {
      full_box = model::FlatParams();
      return;
    }
    CheckpointState st;
    st.step = step;
    st.data_state = data->state();
    st.consecutive_skipped = consecutive_skipped;
    st.model_config = model_json;
    st.run_config = tc.as_json;
    if (!tc.tokenizer_path.empty()) st.tokenizer = fs::absolute(tc.tokenizer_path).string();
    std::string where;
    if (v4) {
      where = save_checkpoint(ckdir.string(), layout, v4_params.data.data(), m_src, v_src, st, 0);
    } else {
      auto mf = model::FlatParams::wrap(cfg, mtp, m_src);
      auto vf = model::FlatParams::wrap(cfg, mtp, v_src);
      where = save_checkpoint(ckdir.string(), cfg, mtp, fsdp ? full_box : params, &mf, &vf, st);
    }
    full_box = model::FlatParams();
    prune_checkpoints(ckdir.string(), tc.max_num_checkpoints_to_keep);
    if (tty) fmt::print(stderr, "\n");
    fmt::print(stderr, "saved checkpoint {}\n", where);
  };

  auto evaluate = [&]() {
    eval_data->rewind();
    int64_t n = tc.eval_steps;
    if (n < 0) n = eval_data->batches_per_pass();
    DS_CHECK(n >= 1, "eval_steps=-1 needs an eval split of known length; set eval_steps");
    model::LossOptions el = lo;
    el.mtp_num_layers = 0;      // MaxText's eval loss excludes MTP
    el.batch_split_factor = 1;  // forward only: nothing to overlap with a backward
    if (fsdp) fsdp->gather_resident();
    double xent = 0, weight = 0;
    for (int64_t i = 0; i < n; ++i) {
      const model::TrainBatch b = eval_data->next();
      const int64_t r = b.batch / shards;
      if (v4) {
        // This rank's rows' share of the whole batch's mean.
        model::V4LossOptions o{tc.z_loss_multiplier, 1.0, false, false};
        o.whole_targets = counted_targets(b);
        const auto t = model::v4_loss_and_grad(
            *v4, v4_params.view, nullptr, model::V4TrainBatch::from_packed(multi ? slice_rows(b, shard * r, r) : b), o);
        xent += t.lm_loss * o.whole_targets;
        weight += o.whole_targets;
        continue;
      }
      if (multi) el.whole = model::loss_weights(b, 0);
      model::TrainBatch part;
      const auto t =
          model::loss_and_grad(cfg, pview, nullptr, multi ? (part = slice_rows(b, shard * r, r)) : b, el, tc.remat);
      const double w = multi ? el.whole.targets : t.tokens;
      xent += t.lm_loss * w;
      weight += w;
    }
    if (multi) world.all_reduce(&xent, 1).wait();
    return xent / (weight + 1e-8);
  };

  StopSignals signals;
  const auto run_start = std::chrono::steady_clock::now();
  int64_t last_saved = resumed["newest"].get<int64_t>();
  int64_t s = start;
  for (; s < tc.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto busy0 = link_busy();
    const bool draw = s == tc.timeline_step && lead;
    const double lr = learning_rate_at(tc, s);
    std::vector<model::TrainBatch> micro;
    std::vector<double> counted;
    double total_w = 0;
    for (int64_t i = 0; i < GA; ++i) {
      micro.push_back(data->next());
      counted.push_back(counted_targets(micro.back()));
      total_w += counted.back();
    }
    if (fsdp)
      fsdp->start_step();
    else if (v4)
      std::fill(v4_grad_data.begin(), v4_grad_data.end(), 0.0f);
    else
      std::fill(grads.data.begin(), grads.data.end(), 0.0f);
    model::LossTerms terms;
    std::vector<std::vector<float>> bias_delta(moe_layers.size());
    std::vector<std::vector<int64_t>> load(moe_layers.size());
    for (int64_t i = 0; i < GA; ++i) {
      model::LossOptions mo = lo;
      const double wi = total_w > 0 ? counted[i] / total_w : 1.0 / static_cast<double>(GA);
      mo.grad_scale = wi;
      // This rank's rows, weighed as a share of the global micro-batch.
      if (multi) mo.whole = model::loss_weights(micro[i], mtp);
      if (draw && i == 0) model::timeline_record(true);
      model::TrainBatch part;  // one process: the whole micro-batch, not a copy
      model::LossTerms t;
      if (v4) {
        model::V4LossOptions o{tc.z_loss_multiplier, wi, true, true, tc.mtp_loss_scaling_factor};
        if (multi) {
          const auto whole = model::v4_loss_weights(model::V4TrainBatch::from_packed(micro[i]));
          o.whole_targets = whole.targets;
          o.whole_mtp_targets = whole.mtp_targets;
        }
        auto t4 = model::v4_loss_and_grad(
            *v4, v4_params.view, &v4_grads,
            model::V4TrainBatch::from_packed(multi ? slice_rows(micro[i], shard * rows, rows) : micro[i]), o);
        t.loss = t4.loss;
        t.lm_loss = t4.lm_loss;
        t.z_loss = t4.z_loss;
        t.mtp_loss = t4.mtp_loss;
        t.tokens = static_cast<double>(t4.tokens);
        t.expert_load = std::move(t4.expert_load);
      } else {
        t = model::loss_and_grad(cfg, pview, &gtree,
                                 multi ? (part = slice_rows(micro[i], shard * rows, rows)) : micro[i], mo, tc.remat);
      }
      if (draw && i == 0) {
        model::timeline_record(false);
        const int64_t first_moe = moe_layers.empty() ? 0 : moe_layers.front();
        write_timeline_svg((run / "timeline.svg").string(), model::timeline_spans(), first_moe,
                           fmt::format("{}: layer {} at step {}, {} micro-batches, {}", tc.run_name, first_moe, s,
                                       lo.batch_split_factor, mesh.describe()));
      }
      terms.loss += wi * t.loss;
      terms.lm_loss += wi * t.lm_loss;
      terms.z_loss += wi * t.z_loss;
      terms.mtp_loss += wi * t.mtp_loss;
      terms.moe_lb_loss += wi * t.moe_lb_loss;
      terms.indexer_loss += wi * t.indexer_loss;
      terms.tokens += t.tokens;
      if (multi && !t.expert_load.empty()) {
        // The global micro-batch's expert loads: every rank updates the biases alike.
        std::vector<int64_t> flat;
        for (const auto& c : t.expert_load) flat.insert(flat.end(), c.begin(), c.end());
        world.all_reduce(flat.data(), static_cast<int64_t>(flat.size())).wait();
        size_t at = 0;
        for (auto& c : t.expert_load)
          for (auto& x : c) x = flat[at++];
      }
      for (size_t l = 0; l < moe_layers.size() && l < t.expert_load.size(); ++l) {
        const auto& c = t.expert_load[l];
        if (load[l].empty()) load[l].assign(c.size(), 0);
        for (size_t e = 0; e < c.size(); ++e) load[l][e] += c[e];
        if (bias_update && biases[l].first >= 0) {
          if (bias_delta[l].empty()) bias_delta[l].assign(c.size(), 0.0f);
          ops::update_routing_bias(bias_delta[l].data(), c.data(), static_cast<int64_t>(c.size()),
                                   static_cast<float>(bias_rate));
        }
      }
    }
    if (multi) {
      // The global batch's loss terms and gradient: summed over the batch
      // shards; with FSDP each rank keeps the sum of its own shard only.
      double t6[7] = {terms.loss,        terms.lm_loss, terms.z_loss,      terms.mtp_loss,
                      terms.moe_lb_loss, terms.tokens,  terms.indexer_loss};
      auto ht = world.all_reduce(t6, 7);
      if (v4) {
        world.all_reduce(v4_grad_data.data(), P).wait();
      } else if (!fsdp) {
        world.all_reduce(grads.data.data(), P).wait();
      } else {
        fsdp->finish_grads();
        // The replicas of this shard: the data axis.
        if (mesh.size(dist::kData) > 1)
          mesh.axis(dist::kData)
              .all_reduce(fsdp->grad_shard.data(), static_cast<int64_t>(fsdp->grad_shard.size()))
              .wait();
      }
      ht.wait();
      terms.loss = t6[0], terms.lm_loss = t6[1], terms.z_loss = t6[2], terms.mtp_loss = t6[3];
      terms.moe_lb_loss = t6[4], terms.tokens = t6[5], terms.indexer_loss = t6[6];
    }
    const double raw_norm = tree_norm(grad_spans);
    const bool finite = std::isfinite(terms.loss) && std::isfinite(raw_norm);
    double grad_norm = raw_norm;
    if (finite) {
      consecutive_skipped = 0;
      if (tc.gradient_clipping_threshold > 0) {
        // optax's clip_by_global_norm with the norm just taken (what ops::clip_grad_norm would compute again).
        if (raw_norm > tc.gradient_clipping_threshold)
          ops::scale_grads(grad_spans, static_cast<float>(tc.gradient_clipping_threshold / raw_norm));
        grad_norm = std::min(raw_norm, tc.gradient_clipping_threshold);
      }
      opt.update(lr);
      if (bias_update)
        for (size_t l = 0; l < biases.size(); ++l)
          if (biases[l].first >= 0)
            opt.for_owned(biases[l].first, biases[l].first + biases[l].second, [&](float* p, int64_t first, int64_t n) {
              const float* d = bias_delta[l].data() + (first - biases[l].first);
              for (int64_t e = 0; e < n; ++e) p[e] += d[e];
            });
    } else {
      ++sum.skipped_steps;
      ++consecutive_skipped;
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    nlohmann::json m = {{"step", s},
                        {"loss", terms.loss},
                        {"lm_loss", terms.lm_loss},
                        {"perplexity", std::exp(std::min(terms.lm_loss, 700.0))},
                        {"z_loss", terms.z_loss},
                        {"mtp_loss", terms.mtp_loss},
                        {"moe_lb_loss", terms.moe_lb_loss},
                        {"total_weights", terms.tokens},
                        {"lr", lr},
                        {"grad_norm", grad_norm},
                        {"raw_grad_norm", raw_norm},
                        {"param_norm", tree_norm(param_spans)},
                        {"step_time_seconds", dt},
                        {"tokens_per_sec", step_tokens / dt},
                        {"tflops_per_sec", flops / dt / 1e12},
                        {"step_skipped", !finite}};
    if (cfg.index_n_heads > 0) m["indexer_loss"] = terms.indexer_loss;
    if (link_expert || link_group || link_fsdp) {
      // What this step's communication would have cost had nothing
      // overlapped, in all and per link.
      const auto busy = link_busy();
      const double by[3] = {busy[0] - busy0[0], busy[1] - busy0[1], busy[2] - busy0[2]};
      m["link_model_seconds"] = by[0] + by[1] + by[2];
      m["link_model_seconds_by_link"] = {
          {"expert_exchange", by[0]}, {"weights_shard_group", by[1]}, {"experts_fsdp", by[2]}};
    }
    if (!finite) {
      // JSON has no NaN: the raw values as text.
      m["loss"] = fmt::format("{}", terms.loss);
      m["raw_grad_norm"] = fmt::format("{}", raw_norm);
      m["grad_norm"] = fmt::format("{}", grad_norm);
    }
    if (!load.empty()) {
      nlohmann::json el = nlohmann::json::array();
      for (size_t l = 0; l < load.size(); ++l) {
        if (load[l].empty()) continue;
        double mean = 0, var = 0;
        for (int64_t c : load[l]) mean += static_cast<double>(c);
        mean /= static_cast<double>(load[l].size());
        for (int64_t c : load[l]) var += (static_cast<double>(c) - mean) * (static_cast<double>(c) - mean);
        var /= static_cast<double>(load[l].size());
        el.push_back({{"layer", moe_layers[l]},
                      {"min", *std::min_element(load[l].begin(), load[l].end())},
                      {"max", *std::max_element(load[l].begin(), load[l].end())},
                      {"cv", mean > 0 ? std::sqrt(var) / mean : 0.0}});
      }
      m["expert_load"] = el;
      if (exchange) {
        // Rows each rank of the expert axis computed this step (all MoE
        // layers, averaged over the expert groups of the mesh).
        const int64_t per = exchange->experts_per_rank();
        std::vector<double> rows_at(static_cast<size_t>(X), 0.0);
        for (const auto& ld : load)
          for (size_t e = 0; e < ld.size(); ++e) rows_at[e / per] += static_cast<double>(ld[e]);
        for (auto& r : rows_at) r /= static_cast<double>(world.size() / X);
        m["expert_rows_per_rank"] = rows_at;
      }
    }
    const bool last = s + 1 == tc.steps;
    if (eval_data && (s % tc.eval_interval == 0 || last)) {
      const double ev = evaluate();
      m["eval_loss"] = ev;
      m["eval_perplexity"] = std::exp(std::min(ev, 700.0));
      eval_curve.emplace_back(s, ev);
      sum.last_eval_loss = ev;
    }
    if (lead) {
      metrics << m.dump() << "\n";
      metrics.flush();
      DS_CHECK(metrics.good(), "writing '{}' failed", metrics_path.string());
    }
    if (finite) train_curve.emplace_back(s, terms.loss);
    if (s == start) sum.first_loss = terms.loss;
    sum.last_loss = terms.loss;
    sum.end_step = s + 1;

    // Progress.
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const double eta = elapsed / static_cast<double>(s + 1 - start) * static_cast<double>(tc.steps - s - 1);
    std::string line = fmt::format("step {}/{} loss {:.4f} lr {:.2e} | {} tok/s | ETA {}", s + 1, tc.steps, terms.loss,
                                   lr, fmt_rate(step_tokens / dt), fmt_duration(eta));
    if (m.contains("eval_loss")) line += fmt::format(" | eval {:.4f}", m["eval_loss"].get<double>());
    if (!finite) line += " | non-finite: step skipped";
    if (tty) {
      const int width = 24;
      const int done = static_cast<int>(width * (s + 1) / tc.steps);
      fmt::print(stderr, "\r[{}{}] {}\033[K", std::string(done, '#'), std::string(width - done, '.'), line);
      if (!finite || m.contains("eval_loss")) fmt::print(stderr, "\n");
    } else if (lead && (s == start || last || (s + 1) % tc.log_period == 0 || !finite || m.contains("eval_loss"))) {
      fmt::print(stderr, "{}\n", line);
    }
    DS_CHECK(consecutive_skipped < tc.max_consecutive_skipped_steps,
             "stopping: {} steps in a row had a non-finite loss or gradient (max_consecutive_skipped_steps); "
             "the newest checkpoint is unchanged",
             consecutive_skipped);

    if (tc.enable_checkpointing && (s + 1) % tc.checkpoint_period == 0) {
      save(s + 1);
      last_saved = s + 1;
    }
    if (tc.target_eval_loss > 0 && m.contains("eval_loss") && m["eval_loss"].get<double>() < tc.target_eval_loss) {
      if (lead)
        fmt::print(stderr, "{}eval loss {:.4f} is below target_eval_loss {}: stopping\n", tty ? "\n" : "",
                   m["eval_loss"].get<double>(), tc.target_eval_loss);
      ++s;
      break;
    }
    // A signal seen by any rank stops every rank after the same step.
    int64_t stop = g_stop_signal.load();
    if (multi) world.all_reduce(&stop, 1, dist::ReduceOp::Max).wait();
    if (stop != 0) {
      if (lead) fmt::print(stderr, "{}stopping on signal {} after step {}\n", tty ? "\n" : "", stop, s + 1);
      sum.interrupted = true;
      ++s;
      break;
    }
  }
  if (tty) fmt::print(stderr, "\n");
  const int64_t done = std::min<int64_t>(s, tc.steps);
  if (tc.enable_checkpointing && (tc.save_checkpoint_on_completion || sum.interrupted) && last_saved != done &&
      done > start)
    save(done);
  if (lead)
    write_loss_svg((run / "loss.svg").string(), train_curve, eval_curve, fmt::format("{}: loss per step", tc.run_name));
  return sum;
}

}  // namespace ds::train
