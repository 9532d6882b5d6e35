// The training loop: one Trainer per run, whose named steps train() calls in
// order (set-up, then per step the micro-batches, the reduction, the update,
// the metrics, eval and checkpoints). It talks to the model through the
// family seam (model/family.h) alone.
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
#include "model/family.h"
#include "ops/adamw.h"
#include "ops/expert_selection.h"
#include "ops/fp8_quant.h"
#include "ops/linear.h"
#include "ops/matmul.h"
#include "train/checkpoint.h"
#include "train/data.h"
#include "train/loop_util.h"
#include "train/optimizer.h"
#include "train/run_identity.h"
#include "train/run_lock.h"
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

double sum_squares(const std::vector<ops::GradSpan>& spans) {
  const double n = ops::global_grad_norm(spans);
  return n * n;
}

// One step's loss terms (weighted sums over its micro-batches) and, per MoE
// layer, the expert loads and the routing-bias change they ask for.
struct StepTerms {
  model::LossTerms terms;
  std::vector<std::vector<int64_t>> load;
  std::vector<std::vector<float>> bias_delta;
};

struct StepUpdate {
  double raw_norm = 0, grad_norm = 0;
  bool finite = true;
};

class Trainer {
 public:
  explicit Trainer(const RunConfig& rc) : tc_(rc.train), family_(model_family(rc)), world_(dist::world()) {
    sum_.run_dir = tc_.run_dir();
    run_ = sum_.run_dir;
    ckdir_ = run_ / "checkpoints";
  }

  TrainSummary run() {
    set_up_mesh();
    open_run_folder();
    set_up_parameters();
    open_data();
    restore();
    open_metrics();
    set_up_loss();
    StopSignals signals;
    // MaxText's dtype: the arithmetic of every matmul of the step (ops/matmul.h).
    const ops::ScopedGemmDtype arithmetic(ops::parse_gemm_dtype(tc_.dtype));
    const ops::ScopedQuantization quantization(ops::parse_quantization(tc_.quantization));
    run_start_ = std::chrono::steady_clock::now();
    int64_t s = start_;
    for (; s < tc_.steps; ++s)
      if (!step(s)) {
        ++s;
        break;
      }
    finish(std::min<int64_t>(s, tc_.steps));
    return sum_;
  }

 private:
  void set_up_mesh();
  void open_run_folder();
  void set_up_parameters();
  void open_data();
  void restore();
  void restore_moments(bool have, std::vector<float>& m_full, std::vector<float>& v_full);
  void open_metrics();
  void set_up_loss();
  bool step(int64_t s);
  StepTerms micro_batches(int64_t s);
  void add_micro_batch(StepTerms& st, model::LossTerms& t, double wi);
  void reduce(model::LossTerms& terms);
  StepUpdate update(const StepTerms& st, double lr);
  nlohmann::json metrics_line(int64_t s, const StepTerms& st, const StepUpdate& u, double lr, double dt,
                              const std::array<double, 3>& busy0) const;
  void progress(int64_t s, const nlohmann::json& m, bool finite, double dt);
  double evaluate();
  void save(int64_t step);
  void finish(int64_t done);

  // Seconds each modeled link has been busy so far: expert exchange, shard
  // group, fsdp axis.
  std::array<double, 3> link_busy() const {
    std::array<double, 3> t{};
    const dist::LinkModel* links[3] = {link_expert_.get(), link_group_.get(), link_fsdp_.get()};
    for (int i = 0; i < 3; ++i) t[i] = links[i] ? links[i]->busy_seconds() : 0.0;
    return t;
  }
  // A norm over the whole tree from this rank's shard (sums of squares added
  // over the shard group; one shard: the plain norm).
  double tree_norm(const std::vector<ops::GradSpan>& spans) const {
    if (!fsdp_) return ops::global_grad_norm(spans);
    double ss = sum_squares(spans);
    mesh_->shard_group().all_reduce(&ss, 1).wait();
    return std::sqrt(ss);
  }

  const TrainConfig& tc_;
  const std::unique_ptr<model::Family> family_;
  dist::Communicator& world_;
  TrainSummary sum_;
  fs::path run_, ckdir_;
  std::unique_ptr<RunLock> lock_;  // rank 0, for the whole run

  // The mesh and its communicators, a modeled link under each when asked.
  std::unique_ptr<dist::Mesh> mesh_;
  bool lead_ = true, multi_ = false;
  int64_t F_ = 1, X_ = 1, G_ = 1, shards_ = 1, shard_ = 0, rows_ = 0;
  std::unique_ptr<dist::LinkModel> link_expert_, link_group_, link_fsdp_;
  std::unique_ptr<dist::ExpertExchange> exchange_;
  std::vector<int64_t> existing_;  // checkpoints in the run folder (rank 0)

  // Parameters: whole flat buffers, or (FSDP, expert parallelism) this
  // rank's shards, streamed in per layer. full_: rank 0's whole buffer while
  // the shards are made or gathered.
  std::vector<model::ParamInfo> layout_;
  int64_t P_ = 0;
  std::vector<float> params_, grads_, full_;
  std::unique_ptr<model::StreamedModel> streamed_;  // the family's trees for FSDP (null: it has none)
  std::unique_ptr<dist::FsdpParams> fsdp_;
  std::unique_ptr<model::BoundModel> bound_;
  std::unique_ptr<AdamW> opt_;

  std::unique_ptr<Dataset> data_, eval_data_;
  nlohmann::json model_json_, resumed_;
  int64_t start_ = 0, consecutive_skipped_ = 0, last_saved_ = -1;

  fs::path metrics_path_;
  std::ofstream metrics_;
  std::vector<std::pair<int64_t, double>> train_curve_, eval_curve_;

  // MoE layers in the order the loss reports their loads, with the place of
  // their routing bias in the flat order ({-1, 0}: none, e.g. hash-routed
  // layers).
  std::vector<int64_t> moe_layers_;
  std::vector<std::pair<int64_t, int64_t>> biases_;
  double bias_rate_ = 0;
  model::LossOptions lo_;
  double flops_ = 0, step_tokens_ = 0;
  bool tty_ = false;
  std::vector<ops::GradSpan> grad_spans_, param_spans_;
  std::chrono::steady_clock::time_point run_start_;
};

// The mesh. Every rank holds per_device_batch_size rows of each global
// batch; rank 0 alone touches the run folder (metrics, checkpoints), reads
// the initial parameters or the checkpoint, and broadcasts them.
void Trainer::set_up_mesh() {
  dist::set_collective_timeout(tc_.collective_timeout_seconds);
  check_same_run(world_, run_identity(tc_, *family_));
  mesh_ = std::make_unique<dist::Mesh>(world_, tc_.mesh, dist::ranks_per_node_from_env(world_.size()));
  dist::Mesh& mesh = *mesh_;
  lead_ = world_.rank() == 0;
  multi_ = world_.size() > 1;
  F_ = mesh.size(dist::kFsdp), X_ = mesh.size(dist::kExpert), G_ = mesh.shard_group_size();
  // A family without streamed trees: every rank holds the whole model and
  // the batch is split over the data and fsdp axes alike.
  streamed_ = family_->bind_streamed();
  if (!streamed_ && multi_ && lead_)
    fmt::print(stderr, "{} on {}: every rank holds the whole model; the batch is split over {} ranks{}\n",
               family_->name(), mesh.describe(), world_.size(),
               X_ > 1 ? ", each routed row computed on its expert's rank" : "");
  // A modeled link under the per-layer collectives: the expert exchange, the
  // dense weights' gathers (shard group) and the experts' (fsdp axis).
  if (tc_.link_model_gbps > 0) {
    const double lat = tc_.link_model_latency_us * 1e-6, bw = tc_.link_model_gbps * 1e9;
    if (X_ > 1) link_expert_ = std::make_unique<dist::LinkModel>(mesh.axis(dist::kExpert), lat, bw);
    if (G_ > 1) link_group_ = std::make_unique<dist::LinkModel>(mesh.shard_group(), lat, bw);
    if (X_ > 1 && F_ > 1) link_fsdp_ = std::make_unique<dist::LinkModel>(mesh.axis(dist::kFsdp), lat, bw);
  }
  // Expert parallelism: each rank of the expert axis computes its share of
  // the routed experts for the tokens of every rank on that axis.
  DS_CHECK(!tc_.expert_grad_comm_fp8 || X_ > 1,
           "expert_grad_comm_fp8 needs expert parallelism (ici_ or dcn_expert_parallelism > 1)");
  if (X_ > 1) {
    DS_CHECK(family_->routed_experts() > 0, "expert parallelism ({}) needs a model with routed experts",
             mesh.describe());
    dist::Communicator& expert_comm = link_expert_ ? *link_expert_ : mesh.axis(dist::kExpert);
    exchange_ = std::make_unique<dist::ExpertExchange>(expert_comm, family_->routed_experts(),
                                                       tc_.expert_dispatch == "allgather"
                                                           ? dist::ExpertExchange::Mode::AllGather
                                                           : dist::ExpertExchange::Mode::AllToAll,
                                                       tc_.expert_grad_comm_fp8);
  }
  shards_ = mesh.batch_shards(), shard_ = mesh.batch_index();
  rows_ = tc_.per_device_batch_size;
}

// The run folder: one trainer at a time (RunLock), every output a plain file
// or folder (a FIFO would hang the run), and no mixing with another run's
// checkpoints.
void Trainer::open_run_folder() {
  if (!lead_) return;
  io::check_output_folder(tc_.base_output_directory);
  std::error_code ec;
  fs::create_directories(run_, ec);
  DS_CHECK(!ec && fs::is_directory(run_), "cannot create the run folder '{}': {}", run_.string(), ec.message());
  lock_ = std::make_unique<RunLock>(run_.string());
  for (const char* out : {"metrics.jsonl", "config.json", "loss.svg"}) io::resolve_output_path((run_ / out).string());
  if (tc_.timeline_step >= 0) io::resolve_output_path((run_ / "timeline.svg").string());
  io::check_output_folder(ckdir_.string());
  existing_ = list_checkpoints(ckdir_.string());
  DS_CHECK(tc_.resume || existing_.empty(),
           "run folder '{}' already holds checkpoints (newest step_{}): pass resume=true to continue it, or "
           "choose another run_name",
           run_.string(), existing_.empty() ? 0 : existing_.back());
}

// Parameters, gradients and optimizer. A shard group of one rank (no fsdp,
// no expert axis), or a family without the stage functions: whole flat
// buffers. More: dist::FsdpParams keeps this rank's shards (dense weights
// over fsdp x expert, routed experts on their expert rank over fsdp) and
// streams the layers in (all-gather) and their gradients out
// (reduce-scatter); the whole buffer exists only for a moment at the start,
// at a resume and at a checkpoint.
void Trainer::set_up_parameters() {
  layout_ = family_->layout();
  P_ = family_->numel();
  if (G_ > 1 && streamed_) {
    dist::Mesh& mesh = *mesh_;
    fsdp_ = std::make_unique<dist::FsdpParams>(
        layout_, family_->routed_experts(), streamed_->leaves, link_group_ ? *link_group_ : mesh.shard_group(),
        link_fsdp_ ? *link_fsdp_ : mesh.axis(dist::kFsdp), X_ > 1 ? &mesh.axis(dist::kExpert) : nullptr);
    std::vector<OwnedRange> owned;
    for (const auto& pc : fsdp_->owned())
      owned.push_back({pc.lo, pc.hi, fsdp_->shard.data() + pc.at, fsdp_->grad_shard.data() + pc.at});
    opt_ = std::make_unique<AdamW>(layout_, tc_, std::move(owned));
    bound_ = std::move(streamed_->bound);
    full_.assign(static_cast<size_t>(P_), 0.0f);
  } else {
    params_.assign(static_cast<size_t>(P_), 0.0f);
    grads_.assign(static_cast<size_t>(P_), 0.0f);
    opt_ = std::make_unique<AdamW>(layout_, tc_, std::vector<OwnedRange>{{0, P_, params_.data(), grads_.data()}});
    bound_ = family_->bind(params_.data(), grads_.data());
  }
  if (multi_) {
    const int64_t held = fsdp_ ? fsdp_->floats_held() : 2 * P_;
    fmt::print(stderr, "rank {}: {}; shard {} of {}: {:.1f} MiB of parameters, gradients and AdamW moments\n",
               world_.rank(), mesh_->describe(), mesh_->shard_group().rank(), G_,
               static_cast<double>(held + static_cast<int64_t>(opt_->m.size() + opt_->v.size())) * 4 / (1 << 20));
  }
  // Rank 0's whole parameters.
  if (lead_) {
    float* full = fsdp_ ? full_.data() : params_.data();
    if (!tc_.load_parameters_path.empty())
      family_->load_hf(tc_.load_parameters_path, full);
    else
      family_->init(full, tc_.init_weights_seed, static_cast<float>(tc_.init_weights_std));
  }
}

void Trainer::open_data() {
  DataConfig data_cfg = tc_.data;
  data_cfg.batch = rows_ * shards_;  // the global batch: the same for any world size
  data_ = open_dataset(data_cfg, Split::Train);
  if (tc_.eval_interval > 0) {
    DataConfig ec_cfg = data_cfg;
    if (tc_.eval_per_device_batch_size > 0) ec_cfg.batch = tc_.eval_per_device_batch_size * shards_;
    eval_data_ = open_dataset(ec_cfg, Split::Eval);
  }
}

// Resume: rank 0 reads the checkpoint (whole tensors, so any world size
// resumes any other's); every rank takes the parameters and its shard of
// the moments.
void Trainer::restore() {
  model_json_ = family_->hf_config();
  resumed_ = {{"start", 0}, {"consecutive_skipped", 0}, {"newest", -1}};
  float* full = fsdp_ ? full_.data() : params_.data();
  std::vector<float> m_full, v_full;
  bool have_moments = false;
  if (lead_ && tc_.resume && !existing_.empty()) {
    const std::string dir = (ckdir_ / ("step_" + std::to_string(existing_.back()))).string();
    m_full.assign(static_cast<size_t>(P_), 0.0f);
    v_full.assign(static_cast<size_t>(P_), 0.0f);
    const CheckpointState st = load_checkpoint(dir, layout_, full, m_full.data(), v_full.data());
    DS_CHECK(st.model_config == model_json_,
             "checkpoint '{}' holds a different model than this config describes; resume with the same model keys",
             dir);
    resumed_ = {{"start", st.step},
                {"data", st.data_state},
                {"consecutive_skipped", st.consecutive_skipped},
                {"newest", existing_.back()},
                {"dir", dir}};
    have_moments = true;
    fmt::print(stderr, "resuming {} from {} ({} updates applied)\n", run_.string(), dir, st.step);
  } else if (lead_ && tc_.resume) {
    fmt::print(stderr, "resume=true but '{}' has no checkpoint yet: starting from step 0\n", ckdir_.string());
  }
  if (multi_) {
    resumed_ = nlohmann::json::parse(broadcast_string(world_, resumed_.dump()));
    world_.broadcast(full, P_, 0).wait();
    have_moments = resumed_["newest"].get<int64_t>() >= 0;
    if (have_moments) {
      m_full.resize(static_cast<size_t>(P_));
      v_full.resize(static_cast<size_t>(P_));
      world_.broadcast(m_full.data(), P_, 0).wait();
      world_.broadcast(v_full.data(), P_, 0).wait();
    }
  }
  if (fsdp_) {
    fsdp_->take_shard(full_.data(), fsdp_->shard.data());
    std::vector<float>().swap(full_);  // freed
  }
  bound_->params_changed();  // every rank, after the broadcast: a bad table stops all ranks alike
  restore_moments(have_moments, m_full, v_full);
  start_ = resumed_["start"].get<int64_t>();
  consecutive_skipped_ = resumed_["consecutive_skipped"].get<int64_t>();
  last_saved_ = resumed_["newest"].get<int64_t>();
  if (resumed_.contains("data")) {
    opt_->set_count(start_);
    try {
      data_->restore(resumed_["data"]);
    } catch (const Error& e) {
      DS_FAIL("checkpoint '{}': cannot restore the data position: {}", resumed_["dir"].get<std::string>(), e.what());
    }
  }
  DS_CHECK(start_ <= tc_.steps, "the newest checkpoint has {} updates, more than steps={}", start_, tc_.steps);
  sum_.start_step = sum_.end_step = start_;
}

void Trainer::restore_moments(bool have, std::vector<float>& m_full, std::vector<float>& v_full) {
  if (!have) return;
  if (fsdp_) {
    std::vector<float> sl(fsdp_->shard.size());
    fsdp_->take_shard(m_full.data(), sl.data());
    fsdp_->pack(sl, opt_->m);
    fsdp_->take_shard(v_full.data(), sl.data());
    fsdp_->pack(sl, opt_->v);
  } else {
    std::copy_n(m_full.begin(), P_, opt_->m.begin());
    std::copy_n(v_full.begin(), P_, opt_->v.begin());
  }
}

// Metrics: earlier steps kept (resume), the rest rewritten.
void Trainer::open_metrics() {
  metrics_path_ = run_ / "metrics.jsonl";
  if (!lead_) return;
  std::string kept;
  for (const auto& j : read_metrics_before(metrics_path_, start_)) {
    kept += j.dump() + "\n";
    if (j.contains("lm_loss") && j["lm_loss"].is_number())
      train_curve_.emplace_back(j["step"].get<int64_t>(), j["lm_loss"]);
    if (j.contains("eval_loss")) eval_curve_.emplace_back(j["step"].get<int64_t>(), j["eval_loss"]);
  }
  io::write_file_atomic(metrics_path_.string(), kept);
  io::write_file_atomic((run_ / "config.json").string(),
                        nlohmann::json{{"run", tc_.as_json}, {"model", model_json_}}.dump(2) + "\n");
  metrics_.open(metrics_path_, std::ios::app);
  DS_CHECK(metrics_.good(), "cannot append to '{}'", metrics_path_.string());
}

void Trainer::set_up_loss() {
  moe_layers_ = family_->moe_layers();
  biases_.assign(moe_layers_.size(), {-1, 0});
  int64_t off = 0;
  for (const auto& i : layout_) {
    if (i.role == model::ParamRole::RoutingBias) {
      const auto it = std::find(moe_layers_.begin(), moe_layers_.end(), i.layer);
      DS_CHECK(it != moe_layers_.end(), "internal: routing bias '{}' of a layer without experts", i.name);
      biases_[static_cast<size_t>(it - moe_layers_.begin())] = {off, i.numel()};
    }
    off += i.numel();
  }
  bias_rate_ = family_->routed_bias_update_rate();

  lo_.stream = fsdp_.get();
  lo_.exchange = exchange_.get();
  lo_.batch_split_factor = tc_.use_batch_split_schedule ? tc_.batch_split_factor : 1;
  lo_.z_loss_multiplier = tc_.z_loss_multiplier;
  lo_.load_balance_loss_weight = tc_.load_balance_loss_weight;
  lo_.mtp_num_layers = family_->mtp_layers();
  lo_.mtp_loss_scaling_factor = tc_.mtp_loss_scaling_factor;
  lo_.indexer_loss_scaling_factor = tc_.indexer_loss_scaling_factor;
  lo_.indexer_sparse_training = tc_.indexer_sparse_training;
  family_->check_loss_options(lo_);
  const std::string note = family_->training_note(lo_);
  if (lead_ && !note.empty())
    fmt::print(stderr, "{} model ({:.2f}M parameters): {}\n", family_->name(), static_cast<double>(P_) / 1e6, note);
  if (lead_ && tc_.dtype == "bfloat16")
    fmt::print(stderr,
               "dtype=bfloat16: matmul operands and activations rounded to bf16 (the residuals kept for the "
               "backward held in bf16), float32 sums, {}\n",
               ops::bf16_dot_products() ? "on the CPU's bf16 dot products (AVX512-BF16)"
                                        : "in float32 arithmetic (this CPU has no bf16 dot products, or "
                                          "DEEPSEEK_MAX_CPU_ISA forbids them): float32 speed");
  if (lead_ && !tc_.quantization.empty())
    fmt::print(stderr,
               "quantization={}: linear layers on fp8 operands (e4m3 forward, e5m2 gradients, a scale per channel), "
               "simulated with {} sums\n",
               tc_.quantization, tc_.dtype);

  const int64_t GA = tc_.gradient_accumulation_steps;
  flops_ = family_->step_flops(tc_.per_device_batch_size, tc_.max_target_length, GA);
  step_tokens_ = static_cast<double>(tc_.per_device_batch_size * tc_.max_target_length * GA);
  tty_ = lead_ && ::isatty(STDERR_FILENO) == 1;
  grad_spans_ = opt_->grad_spans();
  param_spans_ = opt_->param_spans();
}

// One step; false when the run stops after it (target eval loss, a signal).
bool Trainer::step(int64_t s) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto busy0 = link_busy();
  const double lr = learning_rate_at(tc_, s);
  StepTerms st = micro_batches(s);
  reduce(st.terms);
  const StepUpdate u = update(st, lr);
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  nlohmann::json m = metrics_line(s, st, u, lr, dt, busy0);
  const bool last = s + 1 == tc_.steps;
  if (eval_data_ && (s % tc_.eval_interval == 0 || last)) {
    const double ev = evaluate();
    m["eval_loss"] = ev;
    m["eval_perplexity"] = std::exp(std::min(ev, 700.0));
    eval_curve_.emplace_back(s, ev);
    sum_.last_eval_loss = ev;
  }
  if (lead_) {
    metrics_ << m.dump() << "\n";
    metrics_.flush();
    DS_CHECK(metrics_.good(), "writing '{}' failed", metrics_path_.string());
  }
  if (u.finite) train_curve_.emplace_back(s, st.terms.lm_loss);
  if (s == start_) sum_.first_loss = st.terms.loss;
  sum_.last_loss = st.terms.loss;
  sum_.end_step = s + 1;
  progress(s, m, u.finite, dt);
  DS_CHECK(consecutive_skipped_ < tc_.max_consecutive_skipped_steps,
           "stopping: {} steps in a row had a non-finite loss or gradient (max_consecutive_skipped_steps); "
           "the newest checkpoint is unchanged",
           consecutive_skipped_);

  if (tc_.enable_checkpointing && (s + 1) % tc_.checkpoint_period == 0) {
    save(s + 1);
    last_saved_ = s + 1;
  }
  if (tc_.target_eval_loss > 0 && m.contains("eval_loss") && m["eval_loss"].get<double>() < tc_.target_eval_loss) {
    if (lead_)
      fmt::print(stderr, "{}eval loss {:.4f} is below target_eval_loss {}: stopping\n", tty_ ? "\n" : "",
                 m["eval_loss"].get<double>(), tc_.target_eval_loss);
    return false;
  }
  // A signal seen by any rank stops every rank after the same step.
  int64_t stop = g_stop_signal.load();
  if (multi_) world_.all_reduce(&stop, 1, dist::ReduceOp::Max).wait();
  if (stop != 0) {
    if (lead_) fmt::print(stderr, "{}stopping on signal {} after step {}\n", tty_ ? "\n" : "", stop, s + 1);
    sum_.interrupted = true;
    return false;
  }
  return true;
}

// The step's gradient_accumulation_steps micro-batches, each weighed by its
// share of the step's counted targets.
StepTerms Trainer::micro_batches(int64_t s) {
  const int64_t GA = tc_.gradient_accumulation_steps;
  const bool draw = s == tc_.timeline_step && lead_;
  std::vector<model::TrainBatch> micro;
  std::vector<double> counted;
  double total_w = 0;
  for (int64_t i = 0; i < GA; ++i) {
    micro.push_back(data_->next());
    counted.push_back(counted_targets(micro.back()));
    total_w += counted.back();
  }
  if (fsdp_)
    fsdp_->start_step();
  else
    std::fill(grads_.begin(), grads_.end(), 0.0f);
  // In bf16, the weights are rounded once for the whole step (ops/matmul.h).
  const ops::ScopedBf16Weights bf16_weights(params_.data(), static_cast<int64_t>(params_.size()));
  StepTerms st;
  st.load.resize(moe_layers_.size());
  st.bias_delta.resize(moe_layers_.size());
  for (int64_t i = 0; i < GA; ++i) {
    model::LossOptions mo = lo_;
    const double wi = total_w > 0 ? counted[i] / total_w : 1.0 / static_cast<double>(GA);
    mo.grad_scale = wi;
    // This rank's rows, weighed as a share of the global micro-batch.
    if (multi_) mo.whole = family_->loss_weights(micro[i], true);
    if (draw && i == 0) model::timeline_record(true);
    model::TrainBatch part;  // one process: the whole micro-batch, not a copy
    auto t = bound_->loss_and_grad(multi_ ? (part = slice_rows(micro[i], shard_ * rows_, rows_)) : micro[i], mo,
                                   tc_.remat, true);
    if (draw && i == 0) {
      model::timeline_record(false);
      const int64_t first_moe = moe_layers_.empty() ? 0 : moe_layers_.front();
      write_timeline_svg((run_ / "timeline.svg").string(), model::timeline_spans(), first_moe,
                         fmt::format("{}: layer {} at step {}, {} micro-batches, {}", tc_.run_name, first_moe, s,
                                     lo_.batch_split_factor, mesh_->describe()));
    }
    add_micro_batch(st, t, wi);
  }
  return st;
}

void Trainer::add_micro_batch(StepTerms& st, model::LossTerms& t, double wi) {
  model::LossTerms& terms = st.terms;
  terms.loss += wi * t.loss;
  terms.lm_loss += wi * t.lm_loss;
  terms.z_loss += wi * t.z_loss;
  terms.mtp_loss += wi * t.mtp_loss;
  terms.moe_lb_loss += wi * t.moe_lb_loss;
  terms.indexer_loss += wi * t.indexer_loss;
  terms.tokens += t.tokens;
  if (multi_ && !t.expert_load.empty()) {
    // The global micro-batch's expert loads: every rank updates the biases alike.
    std::vector<int64_t> flat;
    for (const auto& c : t.expert_load) flat.insert(flat.end(), c.begin(), c.end());
    world_.all_reduce(flat.data(), static_cast<int64_t>(flat.size())).wait();
    size_t at = 0;
    for (auto& c : t.expert_load)
      for (auto& x : c) x = flat[at++];
  }
  for (size_t l = 0; l < moe_layers_.size() && l < t.expert_load.size(); ++l) {
    const auto& c = t.expert_load[l];
    if (st.load[l].empty()) st.load[l].assign(c.size(), 0);
    for (size_t e = 0; e < c.size(); ++e) st.load[l][e] += c[e];
    if (bias_rate_ > 0 && biases_[l].first >= 0) {
      if (st.bias_delta[l].empty()) st.bias_delta[l].assign(c.size(), 0.0f);
      ops::update_routing_bias(st.bias_delta[l].data(), c.data(), static_cast<int64_t>(c.size()),
                               static_cast<float>(bias_rate_));
    }
  }
}

// The global batch's loss terms and gradient: summed over the batch shards;
// with FSDP each rank keeps the sum of its own shard only.
void Trainer::reduce(model::LossTerms& terms) {
  if (!multi_) return;
  double t7[7] = {terms.loss,        terms.lm_loss, terms.z_loss,      terms.mtp_loss,
                  terms.moe_lb_loss, terms.tokens,  terms.indexer_loss};
  auto ht = world_.all_reduce(t7, 7);
  if (!fsdp_) {
    world_.all_reduce(grads_.data(), P_).wait();
  } else {
    fsdp_->finish_grads();
    // The replicas of this shard: the data axis.
    if (mesh_->size(dist::kData) > 1)
      mesh_->axis(dist::kData)
          .all_reduce(fsdp_->grad_shard.data(), static_cast<int64_t>(fsdp_->grad_shard.size()))
          .wait();
  }
  ht.wait();
  terms.loss = t7[0], terms.lm_loss = t7[1], terms.z_loss = t7[2], terms.mtp_loss = t7[3];
  terms.moe_lb_loss = t7[4], terms.tokens = t7[5], terms.indexer_loss = t7[6];
}

// Clipping, AdamW and the routing-bias rule; a non-finite loss or gradient
// norm skips the step.
StepUpdate Trainer::update(const StepTerms& st, double lr) {
  StepUpdate u;
  u.raw_norm = tree_norm(grad_spans_);
  u.finite = std::isfinite(st.terms.loss) && std::isfinite(u.raw_norm);
  u.grad_norm = u.raw_norm;
  if (!u.finite) {
    ++sum_.skipped_steps;
    ++consecutive_skipped_;
    return u;
  }
  consecutive_skipped_ = 0;
  if (tc_.gradient_clipping_threshold > 0) {
    // optax's clip_by_global_norm with the norm just taken (what ops::clip_grad_norm would compute again).
    if (u.raw_norm > tc_.gradient_clipping_threshold)
      ops::scale_grads(grad_spans_, static_cast<float>(tc_.gradient_clipping_threshold / u.raw_norm));
    u.grad_norm = std::min(u.raw_norm, tc_.gradient_clipping_threshold);
  }
  opt_->update(lr);
  if (bias_rate_ > 0)
    for (size_t l = 0; l < biases_.size(); ++l)
      if (biases_[l].first >= 0)
        opt_->for_owned(biases_[l].first, biases_[l].first + biases_[l].second,
                        [&](float* p, int64_t first, int64_t n) {
                          const float* d = st.bias_delta[l].data() + (first - biases_[l].first);
                          for (int64_t e = 0; e < n; ++e) p[e] += d[e];
                        });
  return u;
}

nlohmann::json Trainer::metrics_line(int64_t s, const StepTerms& st, const StepUpdate& u, double lr, double dt,
                                     const std::array<double, 3>& busy0) const {
  const model::LossTerms& terms = st.terms;
  nlohmann::json m = {{"step", s},
                      {"loss", terms.loss},
                      {"lm_loss", terms.lm_loss},
                      {"perplexity", std::exp(std::min(terms.lm_loss, 700.0))},
                      {"z_loss", terms.z_loss},
                      {"mtp_loss", terms.mtp_loss},
                      {"moe_lb_loss", terms.moe_lb_loss},
                      {"total_weights", terms.tokens},
                      {"lr", lr},
                      {"grad_norm", u.grad_norm},
                      {"raw_grad_norm", u.raw_norm},
                      {"param_norm", tree_norm(param_spans_)},
                      {"step_time_seconds", dt},
                      {"tokens_per_sec", step_tokens_ / dt},
                      {"tflops_per_sec", flops_ / dt / 1e12},
                      {"step_skipped", !u.finite},
                      {"dtype", tc_.dtype},
                      {"weight_dtype", tc_.weight_dtype},
                      {"quantization", tc_.quantization}};
  if (family_->reports_indexer_loss()) m["indexer_loss"] = terms.indexer_loss;
  if (link_expert_ || link_group_ || link_fsdp_) {
    // What this step's communication would have cost had nothing
    // overlapped, in all and per link.
    const auto busy = link_busy();
    const double by[3] = {busy[0] - busy0[0], busy[1] - busy0[1], busy[2] - busy0[2]};
    m["link_model_seconds"] = by[0] + by[1] + by[2];
    m["link_model_seconds_by_link"] = {
        {"expert_exchange", by[0]}, {"weights_shard_group", by[1]}, {"experts_fsdp", by[2]}};
  }
  if (!u.finite) {
    // JSON has no NaN: the raw values as text.
    m["loss"] = fmt::format("{}", terms.loss);
    m["raw_grad_norm"] = fmt::format("{}", u.raw_norm);
    m["grad_norm"] = fmt::format("{}", u.grad_norm);
  }
  const auto& load = st.load;
  bool any = false;
  for (const auto& l : load) any |= !l.empty();
  if (!any) return m;
  nlohmann::json el = nlohmann::json::array();
  for (size_t l = 0; l < load.size(); ++l) {
    if (load[l].empty()) continue;
    double mean = 0, var = 0;
    for (int64_t c : load[l]) mean += static_cast<double>(c);
    mean /= static_cast<double>(load[l].size());
    for (int64_t c : load[l]) var += (static_cast<double>(c) - mean) * (static_cast<double>(c) - mean);
    var /= static_cast<double>(load[l].size());
    el.push_back({{"layer", moe_layers_[l]},
                  {"min", *std::min_element(load[l].begin(), load[l].end())},
                  {"max", *std::max_element(load[l].begin(), load[l].end())},
                  {"cv", mean > 0 ? std::sqrt(var) / mean : 0.0}});
  }
  m["expert_load"] = el;
  if (exchange_) {
    // Rows each rank of the expert axis computed this step (all MoE
    // layers, averaged over the expert groups of the mesh).
    const int64_t per = exchange_->experts_per_rank();
    std::vector<double> rows_at(static_cast<size_t>(X_), 0.0);
    for (const auto& ld : load)
      for (size_t e = 0; e < ld.size(); ++e) rows_at[e / per] += static_cast<double>(ld[e]);
    for (auto& r : rows_at) r /= static_cast<double>(world_.size() / X_);
    m["expert_rows_per_rank"] = rows_at;
  }
  return m;
}

void Trainer::progress(int64_t s, const nlohmann::json& m, bool finite, double dt) {
  const bool last = s + 1 == tc_.steps;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start_).count();
  const double eta = elapsed / static_cast<double>(s + 1 - start_) * static_cast<double>(tc_.steps - s - 1);
  const double loss = sum_.last_loss;
  std::string line = fmt::format("step {}/{} loss {:.4f} lr {:.2e} | {} tok/s | ETA {}", s + 1, tc_.steps, loss,
                                 m["lr"].get<double>(), fmt_rate(step_tokens_ / dt), fmt_duration(eta));
  if (m.contains("eval_loss")) line += fmt::format(" | eval {:.4f}", m["eval_loss"].get<double>());
  if (!finite) line += " | non-finite: step skipped";
  if (tty_) {
    const int width = 24;
    const int done = static_cast<int>(width * (s + 1) / tc_.steps);
    fmt::print(stderr, "\r[{}{}] {}\033[K", std::string(done, '#'), std::string(width - done, '.'), line);
    if (!finite || m.contains("eval_loss")) fmt::print(stderr, "\n");
  } else if (lead_ && (s == start_ || last || (s + 1) % tc_.log_period == 0 || !finite || m.contains("eval_loss"))) {
    fmt::print(stderr, "{}\n", line);
  }
}

// The eval split's loss, MaxText's way: lm_loss alone (no MTP), forward only.
double Trainer::evaluate() {
  eval_data_->rewind();
  int64_t n = tc_.eval_steps;
  if (n < 0) n = eval_data_->batches_per_pass();
  DS_CHECK(n >= 1, "eval_steps=-1 needs an eval split of known length; set eval_steps");
  model::LossOptions el = lo_;
  el.mtp_num_layers = 0;      // MaxText's eval loss excludes MTP
  el.batch_split_factor = 1;  // forward only: nothing to overlap with a backward
  if (fsdp_) fsdp_->gather_resident();
  const ops::ScopedBf16Weights bf16_weights(params_.data(), static_cast<int64_t>(params_.size()));
  double xent = 0, weight = 0;
  for (int64_t i = 0; i < n; ++i) {
    const model::TrainBatch b = eval_data_->next();
    const int64_t r = b.batch / shards_;
    if (multi_) el.whole = family_->loss_weights(b, false);
    model::TrainBatch part;
    const auto t = bound_->loss_and_grad(multi_ ? (part = slice_rows(b, shard_ * r, r)) : b, el, tc_.remat, false);
    const double w = multi_ ? el.whole.targets : t.tokens;
    xent += t.lm_loss * w;
    weight += w;
  }
  if (multi_) world_.all_reduce(&xent, 1).wait();
  return xent / (weight + 1e-8);
}

// Collective: every rank calls it; rank 0 writes.
void Trainer::save(int64_t step) {
  std::vector<float> m_full, v_full;
  const float *p_src = params_.data(), *m_src = opt_->m.data(), *v_src = opt_->v.data();
  if (fsdp_) {
    full_.assign(static_cast<size_t>(P_), 0.0f);
    fsdp_->gather_full(fsdp_->shard.data(), full_.data());
    m_full.resize(static_cast<size_t>(P_));
    v_full.resize(static_cast<size_t>(P_));
    fsdp_->gather_full(fsdp_->expand(opt_->m).data(), m_full.data());
    fsdp_->gather_full(fsdp_->expand(opt_->v).data(), v_full.data());
    p_src = full_.data();
    m_src = m_full.data();
    v_src = v_full.data();
  }
  if (lead_) {
    CheckpointState st;
    st.step = step;
    st.data_state = data_->state();
    st.consecutive_skipped = consecutive_skipped_;
    st.model_config = model_json_;
    st.run_config = tc_.as_json;
    if (!tc_.tokenizer_path.empty()) st.tokenizer = fs::absolute(tc_.tokenizer_path).string();
    const std::string where = save_checkpoint(ckdir_.string(), layout_, p_src, m_src, v_src, st, family_->mtp_layers());
    prune_checkpoints(ckdir_.string(), tc_.max_num_checkpoints_to_keep);
    if (tty_) fmt::print(stderr, "\n");
    fmt::print(stderr, "saved checkpoint {}\n", where);
  }
  std::vector<float>().swap(full_);
}

void Trainer::finish(int64_t done) {
  if (tty_) fmt::print(stderr, "\n");
  if (tc_.enable_checkpointing && (tc_.save_checkpoint_on_completion || sum_.interrupted) && last_saved_ != done &&
      done > start_)
    save(done);
  if (lead_)
    write_loss_svg((run_ / "loss.svg").string(), train_curve_, eval_curve_,
                   fmt::format("{}: loss per step", tc_.run_name));
}

}  // namespace

TrainSummary train(const RunConfig& rc) {
  check_training_memory(rc);  // before anything is allocated
  return Trainer(rc).run();
}

}  // namespace ds::train
