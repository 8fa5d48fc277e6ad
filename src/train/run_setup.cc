#include "train/run_setup.h"

#include <omp.h>

#include <filesystem>
#include <initializer_list>

#include "data/loader.h"
#include "io/checksum.h"
#include "io/files.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "nn/init.h"
#include "nn/llmc_layout.h"
#include "train/memory_trace.h"

namespace tally::train {

namespace fs = std::filesystem;

dist::EngineConfig engine_config(const TrainConfig& c, const nn::TransformerConfig& model) {
  dist::EngineConfig e;
  e.model = model;
  e.microbatches = c.batch.grad_accum;
  e.on_microbatch_loss = c.on_microbatch_loss;
  e.zero = c.parallel.zero;
  e.bucket_bytes = static_cast<int64_t>(c.parallel.bucket_mb * (1 << 20));
  e.sequence_parallel = c.parallel.sequence_parallel;
  e.pp_schedule = c.parallel.pp_schedule;
  e.virtual_stages = c.parallel.virtual_stages;
  e.pp_last_stage_layers = c.parallel.pp_last_stage_layers;
  e.recompute = c.compute.recompute;
  e.expert_capacity_factor = c.compute.moe_capacity_factor;
  e.router_losses = {c.compute.moe_balance_loss_coef, c.compute.moe_z_loss_coef};
  e.matmul_dtype = c.compute.dtype;
  e.chunked_loss = c.compute.chunked_loss;
  e.device = c.compute.device;
  e.adamw.beta1 = c.optimizer.beta1;
  e.adamw.beta2 = c.optimizer.beta2;
  e.adamw.eps = c.optimizer.eps;
  e.adamw.weight_decay = c.optimizer.weight_decay;
  return e;
}

void check_ranks_agree(const dist::World& world, const Settings& settings) {
  if (world.size() == 1) return;
  dist::Communicator& comm = world.world();
  for (const auto& [name, value] : settings) {
    io::Crc32 crc;
    crc.update(value.data(), value.size());
    const std::vector<double> all = comm.all_gather_scalar(static_cast<double>(crc.value()));
    std::string differ;
    for (size_t r = 1; r < all.size(); ++r)
      if (all[r] != all[0]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    if (differ.empty()) continue;
    TALLY_FAIL("the ranks were started with different settings: ", name, " on rank(s) ", differ,
               " differs from rank 0's (this is rank ", world.rank(), ", with ", value.empty() ? "none" : value,
               "); every rank must run the same command on the same data");
  }
}

namespace {
// Whether the checkpoint directory `checkpoint` is one of `out_dir`'s (a run continuing
// where it saves).
bool continues_in(const std::string& checkpoint, const std::string& out_dir) {
  std::error_code ec;
  const fs::path parent = fs::weakly_canonical(fs::path(checkpoint), ec).parent_path();
  const fs::path dir = fs::weakly_canonical(fs::path(out_dir), ec);
  return !ec && parent == dir;
}
}  // namespace

RunSetup::RunSetup(const TrainConfig& c, const dist::World& world) : c_(c), world_(world) {
  c.validate();
  check_layout(c, world.size());  // the layout flags' checks, as tally plan makes them
  TALLY_CHECK(c.parallel.dp == 0 || c.parallel.dp == world.dp(), "--dp ", c.parallel.dp,
              " but the world is laid out as ", world.describe());
  check_device_visible(c.compute.device);  // one process a GPU run: check_layout, above
  if (c.compute.threads > 0) omp_set_num_threads(c.compute.threads);
  check_paths();
  take_out_dir();
  check_outputs();
  find_earlier_checkpoints();
  // A resume that names no model builds the checkpoint's (the --model default would be
  // another shape).
  source_ = c.model;
  if (!resume_dir_.empty() && !c.model.preset_given && c.model.file.empty() && c.model.init_from.empty())
    source_.file = (fs::path(resume_dir_) / "model.bin").string();
  model_ = model_config(source_);
  TALLY_CHECK(c.batch.seq_len <= model_.max_seq_len, "--seq-len ", c.batch.seq_len,
              " exceeds the model's maximum sequence length ", model_.max_seq_len);
}

// Paths are checked before anything runs, so a bad one fails now, not after every step.
void RunSetup::check_paths() const {
  const std::string& out_dir = c_.checkpoint.out_dir;
  TALLY_CHECK(!fs::exists(out_dir) || fs::is_directory(out_dir), "--out-dir '", out_dir, "' is a file, expected a directory");
  const std::string& trace = c_.memory.trace;
  if (trace.empty()) return;
  TALLY_CHECK(trace.back() != '/', "--mem-trace '", trace,
              "' ends in '/', which names a directory: expected a file path ending in .json or .html");
  const std::string ext = fs::path(trace).extension().string();
  TALLY_CHECK(ext == ".json" || ext == ".html", "--mem-trace '", trace, "': expected a path ending in .json (a "
              "Perfetto/Chrome trace) or .html (a report), which say what is written");
  // (What the path names on disk, a directory or a device, is io::check_output_file's,
  // with the other outputs.)
}

// A run that saves holds its --out-dir's lock until it returns; one that saves nothing
// takes it only to repair the directory, and repairs nothing while another run holds it
// (its unfinished save is in progress, not left behind).
void RunSetup::take_out_dir() {
  const CheckpointConfig& k = c_.checkpoint;
  if (world_.is_root()) {
    io::create_directories_for("--out-dir", k.out_dir, k.out_dir);
    const bool saves = k.save_every > 0 || k.overwrite;
    lock_ = io::OutDirLock::try_take(k.out_dir);
    TALLY_CHECK(lock_.held() || !saves, "--out-dir '", k.out_dir, "' is in use by another tally run (pid ",
                lock_.holder(), ") that saves its checkpoints there: this run's ",
                k.overwrite ? "--overwrite would remove them" : "saves would mix with them",
                "; choose another --out-dir, or wait for that run to end");
    if (lock_.held()) io::recover_out_dir(k.out_dir);  // what a killed save left behind
    if (!saves) lock_ = io::OutDirLock();
  }
  world_.world().barrier();
  resume_dir_ = k.resume.empty() ? "" : io::resolve_checkpoint(k.resume);
  continues_ = !resume_dir_.empty() && continues_in(resume_dir_, k.out_dir);
  TALLY_CHECK(!(continues_ && k.overwrite), "--overwrite with --resume '", k.resume,
              "': it would remove the checkpoints the run continues from");
}

// The files the run writes besides its checkpoints, checked now (not when the run has
// trained): none may be an input (a log written over a training shard would destroy it
// while the loader maps it).
void RunSetup::check_outputs() const {
  const std::string& log = c_.metrics.log_json;
  const bool log_is_stream = !log.empty() && io::is_stream(log);
  std::vector<std::pair<std::string, std::string>> inputs;
  for (const std::string& shard : data::expand_glob(c_.data.train, "--train-data")) inputs.emplace_back("--train-data", shard);
  if (!c_.data.val.empty())
    for (const std::string& shard : data::expand_glob(c_.data.val, "--val-data")) inputs.emplace_back("--val-data", shard);
  if (!c_.model.file.empty()) inputs.emplace_back("--model-file", c_.model.file);
  // The files the run reads out of a directory (a log written beside them is no input).
  auto files_of = [&](const char* flag, const std::string& dir, std::initializer_list<const char*> names) {
    if (dir.empty()) return;
    std::error_code ec;
    if (!fs::is_directory(dir, ec)) return inputs.emplace_back(flag, dir), void();
    for (const char* name : names) inputs.emplace_back(flag, (fs::path(dir) / name).string());
  };
  if (!c_.model.init_from.empty())
    for (const std::string& file : io::hf_files_read(c_.model.init_from)) inputs.emplace_back("--init-from", file);
  files_of("--resume", resume_dir_, {"model.bin", "state.bin", "recipe.json", "history.json"});
  files_of("--tokenizer", c_.data.tokenizer, {"encoder.json", "vocab.bpe", "tokenizer.json"});
  // Two outputs of one name: the trace, written last, would replace the log.
  const std::string& trace = c_.memory.trace;
  std::error_code ec;
  TALLY_CHECK(log.empty() || trace.empty() || fs::weakly_canonical(log, ec) != fs::weakly_canonical(trace, ec),
              "--log-json and --mem-trace are both '", trace, "': the trace would replace the log");
  // The run's own files in --out-dir: its plot and `latest` would replace a log of that name.
  for (const char* own : {"loss.svg", "latest"})
    TALLY_CHECK(log.empty() || log_is_stream ||
                    fs::weakly_canonical(log, ec) != fs::weakly_canonical(fs::path(c_.checkpoint.out_dir) / own, ec),
                "--log-json '", log, "' is the run's own ", own, " in --out-dir '", c_.checkpoint.out_dir,
                "', which the run writes: give the log another name");
  const std::string rank_suffix = ".rank" + std::to_string(world_.rank());
  if (!log.empty() && world_.is_root()) io::check_output_file("--log-json", log, inputs, io::OutputKind::FileOrStream);
  TALLY_CHECK(!c_.metrics.log_json_all_ranks || !log_is_stream, "--log-json-all-ranks writes <--log-json>.rank<R> "
              "beside --log-json, and '", log, "' is a stream: give --log-json a file path");
  if (!log.empty() && c_.metrics.log_json_all_ranks) io::check_output_file("--log-json-all-ranks", log + rank_suffix, inputs);
  if (!trace.empty()) io::check_output_file("--mem-trace", trace_path_of(trace, world_.rank()), inputs);
}

// A fresh run that saves into an --out-dir holding an earlier run's checkpoints would
// replace them one step at a time and leave two runs' checkpoints mixed under one
// `latest`: refused unless --resume continues that run or --overwrite starts afresh (the
// earlier checkpoints are removed just before the first step, once every other check has
// passed and the model is loaded, which may come from one of them). Rank 0 decides, since
// out-dirs may be node-local, and every rank learns the answer. (A run that saves nothing
// leaves them, unless --overwrite says to start afresh.)
void RunSetup::find_earlier_checkpoints() {
  const CheckpointConfig& k = c_.checkpoint;
  if (world_.is_root() && (k.save_every > 0 || k.overwrite) && !continues_) earlier_ = io::checkpoints_in(k.out_dir);
  const bool has_earlier = world_.world().all_reduce_scalar(earlier_.empty() ? 0.0 : 1.0, dist::ReduceOp::Max) > 0;
  TALLY_CHECK(!has_earlier || k.overwrite, "--out-dir '", k.out_dir, "' holds an earlier run's checkpoints",
              earlier_.empty() ? "" : " (" + earlier_.front() + (earlier_.size() > 2 ? " ... " + earlier_[earlier_.size() - 2] : "") + ")",
              ": --resume ", k.out_dir, " continues that run, --overwrite starts afresh and removes them; or choose "
              "another --out-dir");
}

void RunSetup::remove_earlier_checkpoints(bool quiet) const {
  if (earlier_.empty()) return;  // --overwrite (rank 0 found them): every check has passed
  io::remove_checkpoints(c_.checkpoint.out_dir);
  if (!quiet) std::printf("--overwrite: removed the earlier run's checkpoints from %s\n", c_.checkpoint.out_dir.c_str());
}

std::string RunSetup::weights_source() const {
  if (!resume_dir_.empty()) return "the checkpoint";
  if (!c_.model.file.empty()) return "--model-file";
  if (!c_.model.init_from.empty()) return "--init-from";
  return "--model " + c_.model.preset + " drawn from --seed";
}

// Before anything whose sizes depend on them is exchanged.
void RunSetup::check_ranks_agree_on(const Settings& recipe) const {
  const TrainConfig& c = c_;
  const ParallelismConfig& p = c.parallel;
  Settings settings = recipe;
  const std::pair<std::string, std::string> more[] = {
      {"the model", model_.describe()},
      {"--tp x --pp x --cp x data-parallel ranks", std::to_string(world_.tp()) + " x " + std::to_string(world_.pp()) +
                                                        " x " + std::to_string(world_.cp()) + " x " +
                                                        std::to_string(world_.dp())},
      {"--ep", std::to_string(world_.ep())},  // the all-to-alls' groups and every shard's experts
      {"--grad-accum", std::to_string(c.batch.grad_accum)},
      {"--zero", std::to_string(p.zero)},
      {"--sp", p.sequence_parallel ? "on" : "off"},
      {"--pp-schedule", dist::pipeline_schedule_name(p.pp_schedule)},
      {"--virtual-stages", std::to_string(p.virtual_stages)},
      {"--pp-last-stage-layers", std::to_string(p.pp_last_stage_layers)},
      {"--recompute", nn::recompute_name(c.compute.recompute)},
      {"--chunked-loss", c.compute.chunked_loss ? "on" : "off"},
      {"--val-every", std::to_string(c.validation.every)},
      {"--val-batches", std::to_string(c.validation.batches)},
      {"--val-data", c.data.val.empty() ? "none" : "given"},
      {"--save-every", std::to_string(c.checkpoint.save_every)},
      {"--bucket-mb", std::to_string(p.bucket_mb)},  // the data-parallel all-reduces' sizes and count
      // Every rank samples (ZeRO-3 gathers in each forward): the same tokens, the same draws.
      {"--sample-every", std::to_string(c.sampling.every)},
      {"--sample-tokens", std::to_string(c.sampling.tokens)},
      {"--temperature", std::to_string(c.sampling.temperature)},
      {"--top-k", std::to_string(c.sampling.top_k)},
      {"--resume", resume_dir_.empty() ? "none" : fs::path(resume_dir_).filename().string()},
      // Where the weights come from: the comparison of their bytes runs only where a file
      // is read, so every rank must take that branch or none.
      {"the weights' source", weights_source()}};
  settings.insert(settings.end(), std::begin(more), std::end(more));
  check_ranks_agree(world_, settings);
}

dist::StepEngine::FillWeights RunSetup::fill_weights() {
  return [this](nn::Transformer& model) { fill(model); };
}

// A shard (tensor/pipeline parallel) reads or draws the whole model's parameters one at a
// time and keeps its part, as does ZeRO-3's optimizer, the model's residency by then
// (nn::fill_whole_parameters). A resume's weights are the checkpoint's: a model
// flag beside it only names the model.
void RunSetup::fill(nn::Transformer& model) {
  if (resume_dir_.empty()) {
    if (!source_.file.empty()) weights_crc_ = io::load_llmc(source_.file, model);
    else if (!source_.init_from.empty())
      io::load_hf(source_.init_from, model, world_.size() > 1 ? &hf_crcs_ : nullptr);
    else nn::init_weights(model, c_.seed);
    return;
  }
  try {
    weights_crc_ = io::load_checkpoint_model(resume_dir_, model);  // before ZeRO-1/2 shard it
  } catch (const Error& e) {
    // A shape mismatch here is the run's model flag against the checkpoint's model: say
    // which flag. Any other failure (a corrupt file) is the file's, as it was.
    std::string what = e.what();
    if (what.find("but the model is") == std::string::npos) throw;
    if (what.rfind("tally: ", 0) == 0) what = what.substr(7);
    TALLY_FAIL("--resume '", c_.checkpoint.resume, "': ", what, " (",
               c_.model.preset_given ? "--model " + c_.model.preset
               : !c_.model.file.empty() ? "--model-file " + c_.model.file
                                        : "--init-from " + c_.model.init_from,
               " names another model than the checkpoint's; without a model flag a resume builds the checkpoint's)");
  }
}

// --init-from's weights are compared parameter by parameter: each rank filled the
// parameters its stage holds (-1 for the others), and every rank that filled one must
// have read the same values. (A whole-file CRC, as for --model-file, would read every
// stage's tensors on every rank.)
void RunSetup::check_weights_agree() const {
  if (!resume_dir_.empty() || !source_.file.empty())
    check_ranks_agree(world_, {{resume_dir_.empty() ? "--model-file's contents (CRC-32 of its weights)"
                                                    : "--resume's model.bin (CRC-32 of its weights)",
                                std::to_string(weights_crc_)}});
  if (world_.size() == 1 || hf_crcs_.empty()) return;
  const nn::Transformer whole = nn::Transformer::layout_only(model_);
  for (size_t i = 0; i < hf_crcs_.size(); ++i) {
    const std::vector<double> all = world_.world().all_gather_scalar(static_cast<double>(hf_crcs_[i]));
    int first = -1;
    std::string differ;
    for (size_t r = 0; r < all.size(); ++r) {
      if (all[r] < 0) continue;
      if (first < 0) first = static_cast<int>(r);
      else if (all[r] != all[static_cast<size_t>(first)]) differ += (differ.empty() ? "" : ", ") + std::to_string(r);
    }
    if (differ.empty()) continue;
    TALLY_FAIL("the ranks were started with different settings: --init-from's weights (CRC-32 of ",
               whole.params().spec(i).name, ") on rank(s) ", differ, " differs from rank ", first,
               "'s (this is rank ", world_.rank(), "); every rank must run the same command on the same data");
  }
}

}  // namespace tally::train
