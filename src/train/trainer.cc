#include "train/trainer.h"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <optional>
#include <memory>

#include <nlohmann/json.hpp>

#include "autograd/grad_mode.h"
#include "core/checked.h"
#include "core/crash_point.h"
#include "data/loader.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "dist/data_parallel.h"
#include "dist/pipeline.h"
#include "dist/tensor_parallel.h"
#include "dist/world.h"
#include "dist/zero.h"
#include "io/files.h"
#include "io/checkpoint.h"
#include "io/checksum.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "memory/process.h"
#include "memory/report.h"
#include "nn/transformer.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"
#include "runtime/backend.h"
#include "sanitizer/sanitizer.h"
#include "train/plan.h"
#include "train/plot.h"
#include "train/step_log.h"
#include "train/sampler.h"

namespace tally::train {

namespace fs = std::filesystem;
using memory::format_bytes;

std::vector<Device> sanitized_devices(Device training) {
  if (training.is_cpu()) return {training};
  return {Device::cpu(), training};
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (c.warmup_steps > 0 && step < c.warmup_steps)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  if (c.lr_schedule == "constant") return c.lr;
  TALLY_CHECK(c.lr_schedule == "cosine", "--lr-schedule: expected constant or cosine, got '", c.lr_schedule, "'");
  // From the peak on the first step after the warm-up to min_lr on the last step that
  // trains (steps - 1); one step after the warm-up stays at the peak.
  const double min_lr = c.lr * c.min_lr_frac;
  const int64_t decay_steps = c.steps - 1 - c.warmup_steps;
  const double progress =
      decay_steps <= 0 ? 0.0 : std::min(1.0, static_cast<double>(step - c.warmup_steps) / static_cast<double>(decay_steps));
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (c.lr - min_lr);
}

namespace {

// More threads than any machine tally targets has cores; a typo (--threads 100000) would
// otherwise reach OpenMP's per-thread buffers.
constexpr int kMaxThreads = 1024;

// A double as the shortest decimal that reads back as it (a stream's six digits print
// 0.99999999 as 1).
std::string shortest_decimal(double x) {
  char text[32];
  return std::string(text, std::to_chars(text, text + sizeof(text), x).ptr);
}

void validate(const TrainConfig& c) {
  // Every real-valued flag must be a number: checked first, so NaN and infinity are named as such.
  for (auto [flag, value] : {std::pair{"--lr", c.lr}, {"--min-lr-frac", c.min_lr_frac}, {"--beta1", c.beta1},
                             {"--beta2", c.beta2}, {"--temperature", c.temperature}, {"--grad-clip", c.grad_clip},
                             {"--weight-decay", c.weight_decay}, {"--bucket-mb", c.bucket_mb}})
    TALLY_CHECK(std::isfinite(value), flag, " must be a finite number, got ", value);
  TALLY_CHECK(!c.train_data.empty(), "--train-data is required (a glob of llm.c token shards; make them with `tally tokenize`)");
  TALLY_CHECK(c.batch_size > 0, "--batch-size must be positive, got ", c.batch_size);
  TALLY_CHECK(c.seq_len > 0, "--seq-len must be positive, got ", c.seq_len);
  TALLY_CHECK(c.grad_accum > 0, "--grad-accum must be positive, got ", c.grad_accum);
  TALLY_CHECK(c.steps >= 0, "--steps must be >= 0, got ", c.steps);
  TALLY_CHECK(c.lr > 0, "--lr must be positive, got ", c.lr);
  TALLY_CHECK(c.min_lr_frac >= 0 && c.min_lr_frac <= 1, "--min-lr-frac must be in [0, 1], got ", c.min_lr_frac);
  TALLY_CHECK(c.beta1 >= 0 && c.beta1 < 1 && c.beta2 >= 0 && c.beta2 < 1, "--beta1/--beta2 must be in [0, 1)");
  TALLY_CHECK(c.eps > 0 && std::isfinite(c.eps), "--eps must be positive and finite, got ", c.eps);
  // AdamW keeps its moments and divides in fp32 (optim/adamw.h): these flags must survive the
  // rounding. A beta that rounds to 1 freezes its moment (beta2: every update is m/eps); an
  // eps below fp32's normal range rounds, or flushes, to 0, and a zero gradient's update is 0/0.
  for (auto [flag, beta] : {std::pair{"--beta1", c.beta1}, {"--beta2", c.beta2}})
    TALLY_CHECK(static_cast<float>(beta) < 1.0f, flag, " ", shortest_decimal(beta),
                " is 1 in fp32, where AdamW keeps its moments (the largest beta below 1 there is 1 - 2^-24 = 0.99999994)");
  TALLY_CHECK(static_cast<float>(c.eps) >= std::numeric_limits<float>::min(), "--eps ", c.eps,
              " is below fp32's smallest normal number (1.2e-38), where AdamW divides by it");
  TALLY_CHECK(c.warmup_steps >= 0, "--warmup-steps must be >= 0, got ", c.warmup_steps);
  TALLY_CHECK(c.val_batches > 0, "--val-batches must be positive, got ", c.val_batches);
  TALLY_CHECK(c.sample_tokens >= 0, "--sample-tokens must be >= 0, got ", c.sample_tokens);
  TALLY_CHECK(c.temperature >= 0, "--temperature must be >= 0, got ", c.temperature);
  TALLY_CHECK(c.grad_clip >= 0, "--grad-clip must be >= 0 (0 = off)");
  TALLY_CHECK(c.weight_decay >= 0, "--weight-decay must be >= 0");
  TALLY_CHECK(c.model_file.empty() || c.init_from.empty(), "--model-file and --init-from are exclusive");
  TALLY_CHECK(c.val_every >= 0, "--val-every must be >= 0 (0: only at the end), got ", c.val_every);
  // Flags that would do nothing without another: said, not ignored.
  TALLY_CHECK(c.lr_schedule != "constant" || c.min_lr_frac == 0, "--min-lr-frac ", c.min_lr_frac,
              " is where --lr-schedule cosine ends; --lr-schedule constant has no end to set");
  TALLY_CHECK(c.val_every == 0 || !c.val_data.empty(), "--val-every ", c.val_every,
              " validates on --val-data, which this run does not have");
  TALLY_CHECK(!c.val_batches_given || !c.val_data.empty(), "--val-batches ", c.val_batches,
              " sets the batches of a validation on --val-data, which this run does not have");
  TALLY_CHECK(!c.allow_recipe_change || !c.resume.empty(),
              "--allow-recipe-change lets --resume continue a run with another recipe; this run resumes none");
  TALLY_CHECK(!c.log_json_all_ranks || !c.log_json.empty(),
              "--log-json-all-ranks writes <--log-json>.rank<R> beside --log-json, which this run does not have");
  TALLY_CHECK(c.save_every >= 0, "--save-every must be >= 0 (0: never), got ", c.save_every);
  TALLY_CHECK(c.keep_last >= 0, "--keep-last must be >= 0 (0: keep every checkpoint), got ", c.keep_last);
  TALLY_CHECK(c.keep_last == 0 || c.save_every > 0, "--keep-last ", c.keep_last,
              " keeps the newest checkpoints --save-every writes, and this run saves none");
  TALLY_CHECK(c.sample_every >= -1, "--sample-every must be >= -1 (-1: never, 0: only at the end), got ", c.sample_every);
  TALLY_CHECK(c.sample_every <= 0 || c.sample_tokens > 0, "--sample-every ", c.sample_every, " prints a sample of "
              "--sample-tokens tokens every ", c.sample_every, " steps, and --sample-tokens is 0; give it a length, or "
              "--sample-every -1 for none");
  TALLY_CHECK(c.top_k >= 0, "--top-k must be >= 0 (0: no truncation), got ", c.top_k);
  TALLY_CHECK(c.threads >= 0 && c.threads <= kMaxThreads, "--threads must be in 0..", kMaxThreads,
              " (0: all cores), got ", c.threads);
  // Sizes derived from flags are checked before anything is allocated: B x T x N tokens per
  // step, and the loader reads B x T + 1 tokens per microbatch.
  checked_product({c.batch_size, c.seq_len, c.grad_accum, 8}, "--batch-size x --seq-len x --grad-accum");
  TALLY_CHECK(c.lr_schedule == "constant" || c.lr_schedule == "cosine", "--lr-schedule: expected constant or cosine, got '",
              c.lr_schedule, "'");
}

// What decides a run's trajectory after its checkpoint: the global batch's shape (the data
// position of every microbatch), the learning-rate schedule (cosine depends on --steps) and
// the optimizer. Saved with every checkpoint and compared on resume. Numbers are written
// exactly (%.17g), so "equal" means bit-equal. The data's path is not part of it: it may
// differ between machines of one job, or after the shards were moved.
std::vector<std::pair<std::string, std::string>> run_recipe(const TrainConfig& c, const dist::World& world) {
  auto num = [](double v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  return {{"--batch-size", std::to_string(c.batch_size)},
          {"--seq-len", std::to_string(c.seq_len)},
          {"microbatches per step (--grad-accum x --dp)", std::to_string(c.grad_accum * world.dp())},
          {"--steps", std::to_string(c.steps)},
          {"--lr", num(c.lr)},
          {"--warmup-steps", std::to_string(c.warmup_steps)},
          {"--lr-schedule", c.lr_schedule},
          {"--min-lr-frac", num(c.min_lr_frac)},
          {"--weight-decay", num(c.weight_decay)},
          {"--beta1", num(c.beta1)},
          {"--beta2", num(c.beta2)},
          {"--eps", num(c.eps)},
          {"--grad-clip", num(c.grad_clip)},
          {"--seed", std::to_string(c.seed)},
          {"--shuffle", c.shuffle ? "on" : "off"},
          {"--dtype", c.dtype}};
}

// Every rank must run the same job. A setting that differs between ranks (a wrapper
// script, another copy of the data on one machine) would make collectives of different
// sizes or counts, which MPI turns into corrupt memory or a hang, or would silently train
// the ranks on different data. Each setting's CRC-32 is gathered from every rank; one that
// differs from rank 0's stops every rank with the same error, which names it (and each
// rank says what it has). What is compared is what the settings say, not every byte: the
// data by its token count, the model by its shape, a resume by its step.
void check_ranks_agree(const dist::World& world, const std::vector<std::pair<std::string, std::string>>& settings) {
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

// --init-from's weights, compared parameter by parameter: each rank filled the parameters
// its stage holds (io::load_hf; -1 for the others), and every rank that filled one must have
// read the same values. (A whole-file CRC, as for --model-file, would read every stage's
// tensors on every rank.)
void check_ranks_read_the_same_weights(const dist::World& world, const std::vector<int64_t>& crcs,
                                       const nn::TransformerConfig& config) {
  if (world.size() == 1) return;
  const nn::Transformer whole = nn::Transformer::layout_only(config);
  for (size_t i = 0; i < crcs.size(); ++i) {
    const std::vector<double> all = world.world().all_gather_scalar(static_cast<double>(crcs[i]));
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
               "'s (this is rank ", world.rank(), "); every rank must run the same command on the same data");
  }
}

}  // namespace

// A recipe's number as one would type it: kept as %.17g (compared exactly), 3e-4 reads
// 0.00029999999999999997. Whole numbers and words are shown as they are.
std::string readable(const std::string& value) {
  if (value.find_first_of(".e") == std::string::npos) return value;
  double x = 0;
  const char* end = value.data() + value.size();
  const auto [stop, error] = std::from_chars(value.data(), end, x);
  return error == std::errc() && stop == end ? shortest_decimal(x) : value;
}

// "--lr 3e-4 -> 6e-4, --steps 100 -> 200", or "" when nothing differs. Checkpoints older
// than saved recipes have none and compare equal. A setting added to the recipe later is
// missing from the recipes saved before it, which ran with its old behaviour: it compares
// as that value (--shuffle: off).
std::string recipe_changes(const std::vector<std::pair<std::string, std::string>>& saved,
                           const std::vector<std::pair<std::string, std::string>>& now) {
  static const std::vector<std::pair<std::string, std::string>> added_later = {{"--shuffle", "off"}};
  std::string out;
  for (const auto& [name, value] : now) {
    const std::string* was = nullptr;
    for (const auto& [saved_name, saved_value] : saved)
      if (saved_name == name) was = &saved_value;
    if (!was && !saved.empty())
      for (const auto& [added, old_behaviour] : added_later)
        if (added == name) was = &old_behaviour;
    if (was && *was != value)
      out += (out.empty() ? "" : ", ") + name + " was " + readable(*was) + ", now " + readable(value);
  }
  return out;
}

Device parse_device(const std::string& text) {
  TALLY_CHECK(is_device_name(text), "--device: expected cpu, cuda or cuda:N, got '", text, "'");
  if (text == "cpu") return Device::cpu();
  const Device d = text == "cuda" ? Device::cuda(0) : Device::cuda(std::stoi(text.substr(5)));
  const int visible = runtime::device_count(DeviceType::CUDA);
  TALLY_CHECK(d.index < visible, "--device ", text, ": ",
              visible == 0 ? std::string("no CUDA device is visible to this process") +
#ifdef TALLY_CUDA
                                 " (tally is built with CUDA; is a GPU present and its driver loaded?)"
#else
                                 " (this tally is built without CUDA: /usr/local/cuda/bin/nvcc was not found at build time)"
#endif
                           : std::to_string(visible) + " CUDA device(s) are visible (cuda:0 .. cuda:" +
                                 std::to_string(visible - 1) + ")");
  return d;
}

namespace {

// The model's weights from the file the config names, or initialized from the seed. A
// shard (tensor/pipeline parallel) reads or draws the whole model's parameters one at a
// time and keeps its part, as does ZeRO-3's optimizer, the model's residency by then
// (Transformer::fill_whole_parameters).
// Returns the CRC-32 of an llm.c file's weight bytes (0 for the other sources); with
// `hf_crcs`, HuggingFace files' weights are checksummed parameter by parameter there.
uint32_t fill_weights(const TrainConfig& c, nn::Transformer& model, std::vector<int64_t>* hf_crcs = nullptr) {
  if (!c.model_file.empty()) return io::load_llmc(c.model_file, model);
  if (!c.init_from.empty()) io::load_hf(c.init_from, model, hf_crcs);
  else model.init_weights(c.seed);
  return 0;
}

// Decodes samples when a tokenizer is available; otherwise prints token ids.
struct Detokenizer {
  std::unique_ptr<data::Tokenizer> tok;
  explicit Detokenizer(const std::string& dir) {
    if (dir.empty()) return;
    tok = std::make_unique<data::Tokenizer>(data::Tokenizer::load_path(dir));
  }
  std::string text(const std::vector<int32_t>& ids) const {
    if (tok) return decode_known(*tok, ids);
    std::string s;
    for (int32_t i : ids) s += std::to_string(i) + " ";
    return s;
  }
  // Samples start where a document does: after the separator tally's tokenize writes.
  int32_t start_token(const nn::TransformerConfig& config) const { return document_bounds(config, tok.get()).start; }
};

double evaluate(const nn::Transformer& model, dist::PipelineStage* pipeline, data::TokenLoader& loader, int64_t batches) {
  autograd::InferenceModeGuard inference;
  OwnerScope scope("eval");
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const data::Batch& b = loader.batch_from(i * loader.tokens_per_batch());
    // to() is the tensor itself on the model's own device (the CPU's loader buffers on the CPU).
    total += pipeline ? pipeline->evaluate(b.inputs, b.targets)
                      : model.forward(b.inputs.to(model.device()), b.targets.to(model.device())).loss.item();
  }
  return total / static_cast<double>(std::max<int64_t>(batches, 1));
}

// Rank R's --mem-trace beside rank 0's: ".rankR" before the extension, so that another
// rank's report still ends in .html (run.rank1.html opens as a page; run.html.rank1 did not).
std::string rank_trace_path(const std::string& path, int rank) {
  const fs::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

// Runs `write` when the scope is left by an exception: a run that fails (out of memory, a
// loss gone non-finite, the sanitizer's strict mode) still writes its memory trace, up to
// the failure, which is when it is wanted most. A failure to write it is said, and the
// run's own error is the one that propagates.
class WriteOnFailure {
 public:
  explicit WriteOnFailure(std::function<void()> write) : write_(std::move(write)) {}
  WriteOnFailure(const WriteOnFailure&) = delete;
  WriteOnFailure& operator=(const WriteOnFailure&) = delete;
  ~WriteOnFailure() {
    if (std::uncaught_exceptions() <= exceptions_ || !write_) return;
    try {
      write_();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "tally: the failed run's memory trace could not be written: %s\n", e.what());
    }
  }

 private:
  std::function<void()> write_;
  int exceptions_ = std::uncaught_exceptions();
};

}  // namespace

namespace {

std::string fmt_fixed(double v, int digits) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, v);
  return buf;
}

// How much of the training data a number of tokens reads: "0.052% of one pass", "87.5% of
// one pass", "2.31 passes" (never an exponent: %g would print 99.7% as "1e+02%").
std::string passes_str(double passes) {
  char buf[48];
  const double percent = 100.0 * passes;
  if (passes >= 1.0) std::snprintf(buf, sizeof buf, "%.2f pass%s", passes, passes == 1.0 ? "" : "es");
  else if (percent >= 10) std::snprintf(buf, sizeof buf, "%.1f%% of one pass", percent);
  else if (percent >= 0.001) std::snprintf(buf, sizeof buf, "%.2g%% of one pass", percent);
  else std::snprintf(buf, sizeof buf, "under 0.001%% of one pass");
  return buf;
}

// "1h02m", "3m05s", "12s".
std::string duration_str(double seconds) {
  const auto s = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  char buf[32];
  if (s >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", static_cast<long long>(s / 3600), static_cast<long long>(s / 60 % 60));
  else if (s >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", static_cast<long long>(s / 60), static_cast<long long>(s % 60));
  else std::snprintf(buf, sizeof buf, "%llds", static_cast<long long>(s));
  return buf;
}

// The full parameter block in its order, on every rank (ZeRO-3 gathers each unit).
Tensor gather_parameters(const nn::Transformer& model) {
  const nn::ParameterStore& params = model.params();
  Tensor out = Tensor::empty({params.numel()}, DType::F32, Device::cpu(), make_owner(Category::Other, "final_parameters"));
  nn::ParameterResidency* residency = model.residency();
  for (size_t u = 0; u < params.num_units(); ++u) {
    if (residency) residency->acquire(u, false);
    const nn::ParameterUnit& unit = params.unit(u);
    for (size_t i = unit.first; i < unit.last; ++i)
      make_view(out, {params[i].numel()}, {1}, params.offset(i)).copy_(params[i].reshape({-1}).detach());
    if (residency) residency->release(u, false);
  }
  return out;
}

}  // namespace

TrainResult run_training(const TrainConfig& c, const std::function<void(const StepMetrics&)>& on_step) {
  std::unique_ptr<dist::World> world = dist::World::create({c.dp, c.tp, c.pp});
  return run_training(c, *world, on_step);
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

nn::TransformerConfig model_config(const std::string& preset, const std::string& model_file, const std::string& init_from) {
  if (!model_file.empty()) {
    // The directories a user may mean here are other flags' (a HuggingFace model, a checkpoint).
    const bool hf = io::is_hf_model_dir(model_file);
    const bool checkpoint = fs::exists(fs::path(model_file) / "state.bin") || fs::exists(fs::path(model_file) / "latest");
    TALLY_CHECK(!hf, "--model-file '", model_file, "' is a HuggingFace model directory: --init-from ", model_file,
                " starts from it (--model-file takes an llm.c model file, .bin)");
    TALLY_CHECK(!checkpoint, "--model-file '", model_file, "' is a checkpoint or training --out-dir: --resume ", model_file,
                " continues its run, and --model-file with its step directory's model.bin starts a new run from its "
                "weights (--model-file takes an llm.c model file, .bin)");
    return io::read_llmc_config(model_file);
  }
  if (!init_from.empty()) return io::read_hf_config(init_from);
  return nn::TransformerConfig::preset(preset);
}

TrainResult run_training(const TrainConfig& c, const dist::World& world, const std::function<void(const StepMetrics&)>& on_step) {
  validate(c);
  // The layout flags' checks, as tally plan makes them (train/plan.h).
  check_layout_flags({world.size(), world.tp(), world.pp(), c.sequence_parallel, c.seq_len, c.zero, c.dtype == "bf16",
                      c.chunked_loss, c.device});
  // (At least a byte: a smaller bucket truncated to 0 bytes. At most a TiB, so its size in
  // bytes is an int64: past any use for one all-reduce.)
  TALLY_CHECK(c.bucket_mb * (1 << 20) >= 1 && c.bucket_mb <= 1048576,
              "--bucket-mb must be from one byte (2^-20) to 1048576 MiB, got ", c.bucket_mb);
  TALLY_CHECK(c.dp == 0 || c.dp == world.dp(), "--dp ", c.dp, " but the world is laid out as ", world.describe());
  if (c.threads > 0) omp_set_num_threads(c.threads);
  const bool root = world.is_root();
  auto log = [&](const char* fmt, auto... args) {
    if (!c.quiet && root) std::printf(fmt, args...), std::fflush(stdout);
  };
  dist::Communicator& dp_group = world.dp_group();
  const int64_t D = world.dp(), dp_rank = world.dp_rank();
  // Where the model trains (one process a GPU run: check_layout_flags, above).
  const Device device = parse_device(c.device);
  // A batch's tokens on the training device (the loader fills host buffers).
  auto on_device = [&](const Tensor& t) {
    if (t.device() == device) return t;
    Tensor moved = Tensor::empty(t.shape(), t.dtype(), device, current_owner("microbatch_tokens"));
    moved.copy_(t);
    return moved;
  };

  // Paths are checked before anything runs, so a bad one fails now, not after every step.
  TALLY_CHECK(!fs::exists(c.out_dir) || fs::is_directory(c.out_dir), "--out-dir '", c.out_dir,
              "' is a file, expected a directory");
  if (!c.mem_trace.empty()) {
    TALLY_CHECK(c.mem_trace.back() != '/', "--mem-trace '", c.mem_trace,
                "' ends in '/', which names a directory: expected a file path ending in .json or .html");
    const std::string ext = fs::path(c.mem_trace).extension().string();
    TALLY_CHECK(ext == ".json" || ext == ".html", "--mem-trace '", c.mem_trace, "': expected a path ending in .json (a "
                "Perfetto/Chrome trace) or .html (a report), which say what is written");
    // (What the path names on disk, a directory or a device, is io::check_output_file's
    // below, with the other outputs.)
  }
  // A run that saves holds its --out-dir's lock until it returns; one that saves nothing
  // takes it only to repair the directory, and repairs nothing while another run holds it
  // (its unfinished save is in progress, not left behind).
  io::OutDirLock out_dir_lock;
  if (root) {
    io::create_directories_for("--out-dir", c.out_dir, c.out_dir);
    const bool saves = c.save_every > 0 || c.overwrite;
    out_dir_lock = io::OutDirLock::try_take(c.out_dir);
    TALLY_CHECK(out_dir_lock.held() || !saves, "--out-dir '", c.out_dir, "' is in use by another tally run (pid ",
                out_dir_lock.holder(), ") that saves its checkpoints there: this run's ",
                c.overwrite ? "--overwrite would remove them" : "saves would mix with them",
                "; choose another --out-dir, or wait for that run to end");
    if (out_dir_lock.held()) io::recover_out_dir(c.out_dir);  // what a killed save left behind
    if (!saves) out_dir_lock = io::OutDirLock();
  }
  world.world().barrier();
  // A fresh run that saves into an --out-dir holding an earlier run's checkpoints would
  // replace them one step at a time and leave two runs' checkpoints mixed under one
  // `latest`: refused unless --resume continues that run or --overwrite starts afresh (the
  // earlier checkpoints are removed just before the first step, once every other check has
  // passed and the model is loaded, which may come from one of them). Rank 0 decides, since
  // out-dirs may be node-local, and every rank learns the answer.
  const std::string resume_dir = c.resume.empty() ? "" : io::resolve_checkpoint(c.resume);
  const bool continues = !resume_dir.empty() && continues_in(resume_dir, c.out_dir);
  TALLY_CHECK(!(continues && c.overwrite), "--overwrite with --resume '", c.resume,
              "': it would remove the checkpoints the run continues from");
  // A log on a stream (/dev/stdout, /dev/null, a pipe) is written as it is: never read
  // back on resume, trimmed or replaced whole (io/files.h).
  const bool log_is_stream = !c.log_json.empty() && io::is_stream(c.log_json);
  {
    // The files the run writes besides its checkpoints, checked now (not when the run has
    // trained): none may be an input (a log written over the training shard destroyed it,
    // and the loader's mapping of it crashed the run).
    std::vector<std::pair<std::string, std::string>> inputs;
    for (const std::string& shard : data::expand_glob(c.train_data, "--train-data")) inputs.emplace_back("--train-data", shard);
    if (!c.val_data.empty())
      for (const std::string& shard : data::expand_glob(c.val_data, "--val-data")) inputs.emplace_back("--val-data", shard);
    if (!c.model_file.empty()) inputs.emplace_back("--model-file", c.model_file);
    // The files the run reads out of a directory (a log written beside them is no input).
    auto files_of = [&](const char* flag, const std::string& dir, std::initializer_list<const char*> names) {
      if (dir.empty()) return;
      std::error_code ec;
      if (!fs::is_directory(dir, ec)) return inputs.emplace_back(flag, dir), void();
      for (const char* name : names) inputs.emplace_back(flag, (fs::path(dir) / name).string());
    };
    if (!c.init_from.empty())
      for (const std::string& file : io::hf_files_read(c.init_from)) inputs.emplace_back("--init-from", file);
    files_of("--resume", resume_dir, {"model.bin", "state.bin", "recipe.json", "history.json"});
    files_of("--tokenizer", c.tokenizer_dir, {"encoder.json", "vocab.bpe", "tokenizer.json"});
    // Two outputs of one name: the trace, written last, would replace the log.
    std::error_code ec;
    TALLY_CHECK(c.log_json.empty() || c.mem_trace.empty() ||
                    fs::weakly_canonical(c.log_json, ec) != fs::weakly_canonical(c.mem_trace, ec),
                "--log-json and --mem-trace are both '", c.mem_trace, "': the trace would replace the log");
    // The run's own files in --out-dir: its plot and `latest` would replace a log of that name.
    for (const char* own : {"loss.svg", "latest"})
      TALLY_CHECK(c.log_json.empty() || log_is_stream ||
                      fs::weakly_canonical(c.log_json, ec) != fs::weakly_canonical(fs::path(c.out_dir) / own, ec),
                  "--log-json '", c.log_json, "' is the run's own ", own, " in --out-dir '", c.out_dir,
                  "', which the run writes: give the log another name");
    const std::string rank_suffix = ".rank" + std::to_string(world.rank());
    if (!c.log_json.empty() && root) io::check_output_file("--log-json", c.log_json, inputs, io::OutputKind::FileOrStream);
    TALLY_CHECK(!c.log_json_all_ranks || !log_is_stream, "--log-json-all-ranks writes <--log-json>.rank<R> "
                "beside --log-json, and '", c.log_json, "' is a stream: give --log-json a file path");
    if (!c.log_json.empty() && c.log_json_all_ranks) io::check_output_file("--log-json-all-ranks", c.log_json + rank_suffix, inputs);
    if (!c.mem_trace.empty())
      io::check_output_file("--mem-trace", root ? c.mem_trace : rank_trace_path(c.mem_trace, world.rank()), inputs);
  }
  std::vector<std::string> earlier;
  // (A run that saves nothing leaves them, unless --overwrite says to start afresh.)
  if (root && (c.save_every > 0 || c.overwrite) && !continues) earlier = io::checkpoints_in(c.out_dir);
  const bool has_earlier = world.world().all_reduce_scalar(earlier.empty() ? 0.0 : 1.0, dist::ReduceOp::Max) > 0;
  TALLY_CHECK(!has_earlier || c.overwrite, "--out-dir '", c.out_dir, "' holds an earlier run's checkpoints",
              earlier.empty() ? "" : " (" + earlier.front() + (earlier.size() > 2 ? " ... " + earlier[earlier.size() - 2] : "") + ")",
              ": --resume ", c.out_dir, " continues that run, --overwrite starts afresh and removes them; or choose "
              "another --out-dir");

  sanitizer::SanitizeMode mode = sanitizer::parse_sanitize_mode(c.sanitize);
  auto& ledger = runtime::ledger(device);  // the training device's: where the model's bytes live
  // The GEMM peak every step line compares with, probed (and kept) before anything of the
  // run is allocated: its 12 MiB of operands are no part of the run's memory, and after the
  // model states they made a small run's memory report peak at the probe.
  TALLY_CHECK(c.dtype == "fp32" || c.dtype == "bf16", "--dtype must be fp32 or bf16, got '", c.dtype, "'");
  const DType matmul_dtype = c.dtype == "bf16" ? DType::BF16 : DType::F32;
  runtime::backend(device).measured_gemm_peak_flops(matmul_dtype);
  const std::string gemm_note = runtime::backend(device).gemm_note(matmul_dtype);
  if (!gemm_note.empty() && root) std::fprintf(stderr, "tally: note: %s\n", gemm_note.c_str());
  if (!c.mem_trace.empty()) ledger.enable_history(true, false);
  // The trace, written at the end of the run, or where it fails.
  memory::PlanParts plan_parts;  // this rank's, for --mem-trace
  const std::string trace_path = root ? c.mem_trace : rank_trace_path(c.mem_trace, world.rank());
  const bool trace_html = fs::path(c.mem_trace).extension() == ".html";
  auto write_trace = [&] {
    io::create_directories_for("--mem-trace", trace_path, fs::path(trace_path).parent_path().string());
    const std::vector<memory::MemoryEvent> events = ledger.take_history();
    if (trace_html) memory::write_html_report(trace_path, events, plan_parts);
    else memory::write_chrome_trace(trace_path, events, 1 << 20, plan_parts);
  };
  WriteOnFailure trace_on_failure(c.mem_trace.empty() ? std::function<void()>() : [&] {
    write_trace();
    std::fprintf(stderr, "tally: the memory %s of the run up to its failure is in %s\n", trace_html ? "report" : "trace",
                 trace_path.c_str());
  });
  ledger.reset_peaks();  // set-up's peak is this run's (a process may have trained before)
  int64_t setup_peak = 0;  // tensor/pipeline parallel and ZeRO-2/3: building the model and sharding it
  int64_t resume_peak = 0;  // --resume: set-up up to the checkpoint read

  // Every rank builds the same model (same seed, or the same file). A resume that names no
  // model builds the checkpoint's (the --model default would be another shape).
  TrainConfig source = c;
  if (!resume_dir.empty() && !c.model_given && c.model_file.empty() && c.init_from.empty())
    source.model_file = (fs::path(resume_dir) / "model.bin").string();
  const nn::TransformerConfig mc = model_config(source.model, source.model_file, source.init_from);
  TALLY_CHECK(c.seq_len <= mc.max_seq_len, "--seq-len ", c.seq_len, " exceeds the model's maximum sequence length ",
              mc.max_seq_len);
  // Tensor and pipeline parallel: this rank builds only its shard of the model (its
  // pipeline chunks, its slices of the heads, MLP and vocabulary).
  const int TP = world.tp(), PP = world.pp();
  const bool model_parallel = TP * PP > 1;
  const dist::PipelineSchedule schedule = dist::parse_pipeline_schedule(c.pp_schedule);
  dist::check_pipeline(schedule, PP, c.virtual_stages, c.grad_accum, mc.n_layer, c.pp_last_stage_layers);
  const nn::ModelShard shard = model_parallel ? dist::pipeline_shard(mc.n_layer, PP, world.pp_rank(), c.virtual_stages,
                                                                     TP, world.tp_rank(), c.pp_last_stage_layers)
                                              : nn::ModelShard{};
  // What a checkpoint saves and a resume compares; the ranks compare it too, below.
  auto recipe = run_recipe(c, world);
  {
    // Before anything whose sizes depend on them is exchanged.
    auto settings = recipe;
    const std::pair<std::string, std::string> more[] = {
        {"the model", mc.describe()},
        {"--tp x --pp x data-parallel ranks",
         std::to_string(TP) + " x " + std::to_string(PP) + " x " + std::to_string(world.dp())},
        {"--grad-accum", std::to_string(c.grad_accum)},
        {"--zero", std::to_string(c.zero)},
        {"--sp", c.sequence_parallel ? "on" : "off"},
        {"--pp-schedule", c.pp_schedule},
        {"--virtual-stages", std::to_string(c.virtual_stages)},
        {"--pp-last-stage-layers", std::to_string(c.pp_last_stage_layers)},
        {"--recompute", c.recompute},
        {"--chunked-loss", c.chunked_loss ? "on" : "off"},
        {"--val-every", std::to_string(c.val_every)},
        {"--val-batches", std::to_string(c.val_batches)},
        {"--val-data", c.val_data.empty() ? "none" : "given"},
        {"--save-every", std::to_string(c.save_every)},
        {"--bucket-mb", std::to_string(c.bucket_mb)},  // the data-parallel all-reduces' sizes and count
        // Every rank samples (ZeRO-3 gathers in each forward): the same tokens, the same draws.
        {"--sample-every", std::to_string(c.sample_every)},
        {"--sample-tokens", std::to_string(c.sample_tokens)},
        {"--temperature", std::to_string(c.temperature)},
        {"--top-k", std::to_string(c.top_k)},
        {"--resume", resume_dir.empty() ? "none" : fs::path(resume_dir).filename().string()},
        // Where the weights come from: the comparison of their bytes below runs only where
        // a file is read, so every rank must take that branch or none.
        {"the weights' source", !resume_dir.empty()       ? "the checkpoint"
                                : !c.model_file.empty()   ? "--model-file"
                                : !c.init_from.empty()    ? "--init-from"
                                                          : "--model " + c.model + " drawn from --seed"}};
    settings.insert(settings.end(), std::begin(more), std::end(more));
    check_ranks_agree(world, settings);
  }
  optim::AdamWConfig ac;
  ac.beta1 = c.beta1;
  ac.beta2 = c.beta2;
  ac.eps = c.eps;
  ac.weight_decay = c.weight_decay;
  // The model, built without the blocks the run does not keep whole: ZeRO-2 keeps gradient
  // shards of its own, ZeRO-3 its parameters too. ZeRO-3's optimizer binds the parameters
  // and takes each rank's part of the weights as they are read or drawn, one whole
  // parameter at a time: no rank ever holds the whole model.
  auto model = std::make_unique<nn::Transformer>(mc, shard,
                                                 c.zero < 2    ? nn::Blocks::ParametersAndGradients
                                                 : c.zero == 2 ? nn::Blocks::Parameters
                                                               : nn::Blocks::None);
  std::unique_ptr<dist::ZeroOptimizer> zero;
  if (c.zero == 3) {
    zero = std::make_unique<dist::ZeroOptimizer>(model->params(), ac, dp_group, c.zero);
    model->set_residency(zero.get());
  }
  // A resume's weights are the checkpoint's: a model flag beside it only names the model
  // (its file was read and then overwritten before).
  uint32_t weights_crc = 0;
  std::vector<int64_t> hf_crcs;
  const bool compare_hf = resume_dir.empty() && !source.init_from.empty() && world.size() > 1;
  if (resume_dir.empty()) weights_crc = fill_weights(source, *model, compare_hf ? &hf_crcs : nullptr);
  else {
    try {
      weights_crc = io::load_checkpoint_model(resume_dir, *model);  // before ZeRO-1/2 shard it
    } catch (const Error& e) {
      // A shape mismatch here is the run's model flag against the checkpoint's model: say
      // which flag. Any other failure (a corrupt file) is the file's, as it was.
      std::string what = e.what();
      if (what.find("but the model is") == std::string::npos) throw;
      if (what.rfind("tally: ", 0) == 0) what = what.substr(7);
      TALLY_FAIL("--resume '", c.resume, "': ", what, " (",
                 c.model_given ? "--model " + c.model
                 : !c.model_file.empty() ? "--model-file " + c.model_file
                                         : "--init-from " + c.init_from,
                 " names another model than the checkpoint's; without a model flag a resume builds the checkpoint's)");
    }
  }
  // Set-up's peak: the shard's parameters and gradients, and one whole parameter beside
  // them: what the plan's set-up is.
  if (model_parallel) setup_peak = ledger.stats().peak_allocated;
  // Every rank read the same bytes: a node holding another copy of the model file, or a
  // stale copy of the checkpoint, would train its replica from other weights unseen.
  // (After tensor/pipeline set-up's peak is taken: the exchange's few bytes are no part of
  // it. ZeRO-2/3 take theirs later, and these bytes are far below their peak moment.)
  if (!resume_dir.empty() || !source.model_file.empty())
    check_ranks_agree(world, {{resume_dir.empty() ? "--model-file's contents (CRC-32 of its weights)"
                                                  : "--resume's model.bin (CRC-32 of its weights)",
                               std::to_string(weights_crc)}});
  if (compare_hf) check_ranks_read_the_same_weights(world, hf_crcs, mc);
  std::unique_ptr<dist::TensorParallel> tensor_parallel;
  if (TP > 1) {
    tensor_parallel = std::make_unique<dist::TensorParallel>(world.tp_group(), c.sequence_parallel);
    model->set_tensor_parallel(tensor_parallel.get());
  }
  model->set_recompute(nn::parse_recompute(c.recompute));
  model->move_to(device);  // built and loaded on the host; trained where --device says
  std::unique_ptr<dist::PipelineStage> pipeline;
  if (PP > 1) pipeline = std::make_unique<dist::PipelineStage>(*model, world.pp_group(), schedule, c.virtual_stages);
  // The optimizer: AdamW over the whole block, or ZeRO over the data-parallel group
  // (ZeRO-3's is made with the model, above).
  std::unique_ptr<optim::AdamW> adamw;
  if (c.zero == 0) adamw = std::make_unique<optim::AdamW>(model->params(), ac);
  else if (!zero) zero = std::make_unique<dist::ZeroOptimizer>(model->params(), ac, dp_group, c.zero);
  // ZeRO-2/3's set-up peak: ZeRO-2's parameter block and shards, just made; ZeRO-3's
  // shards and the one whole parameter it read or drew at a time.
  if (c.zero >= 2) setup_peak = ledger.stats().peak_allocated;
  optim::Optimizer& opt = adamw ? static_cast<optim::Optimizer&>(*adamw) : *zero;
  if (zero && zero->stage() >= 2) model->set_residency(zero.get());
  // After the optimizer: its state is allocated first, as the plan orders the parts.
  model->set_matmul_dtype(matmul_dtype);
  const int64_t loss_chunk_rows = c.chunked_loss ? nn::Transformer::default_loss_chunk_rows(mc.padded_vocab_size) : 0;
  model->set_loss_chunk_rows(loss_chunk_rows);
  // Plain data parallel and ZeRO-1 average full gradients with bucketed all-reduces.
  std::unique_ptr<dist::GradientAllReduce> all_reduce;
  if (c.zero <= 1 && D > 1)
    all_reduce = std::make_unique<dist::GradientAllReduce>(model->params(), dp_group,
                                                           static_cast<int64_t>(c.bucket_mb * (1 << 20)));

  // One process's gradients are final once backward has written them, so their norm (what
  // clipping needs before AdamW) is summed during the step's last backward, each gradient
  // while it is still in cache, instead of in a pass of its own after it (optim/grad_norm.h).
  // Data parallel's gradients change once more, in the all-reduce, and are summed after it.
  std::optional<optim::BackwardGradientNorm> backward_norm;
  // On a GPU each gradient's sum would be a wait for the device in the middle of backward,
  // so the norm is one sum over the gradient block after it (one wait).
  if (!model_parallel && !zero && D == 1 && device.is_cpu()) backward_norm.emplace(model->params());

  data::TokenLoader train_loader(c.train_data, c.batch_size, c.seq_len, mc.vocab_size, "--train-data");
  if (c.shuffle) train_loader.shuffle_sequences(c.seed);
  std::unique_ptr<data::TokenLoader> val_loader;
  if (!c.val_data.empty()) val_loader = std::make_unique<data::TokenLoader>(c.val_data, c.batch_size, c.seq_len, mc.vocab_size, "--val-data");
  // The data each rank reads (a path may differ between machines; what it holds may not).
  // The tokens themselves, not only their count: a node holding another subset of shards of
  // one size (llm.c's are all 100M tokens), or a stale copy, trained on them unseen.
  check_ranks_agree(world, {{"--train-data's token count", std::to_string(train_loader.total_tokens())},
                            {"--val-data's token count", val_loader ? std::to_string(val_loader->total_tokens()) : "none"},
                            {"--train-data's tokens (a fingerprint of every token)", std::to_string(train_loader.fingerprint())},
                            {"--val-data's tokens (a fingerprint of every token)",
                             val_loader ? std::to_string(val_loader->fingerprint()) : "none"}});
  // A resume on other training data would not continue the run (the batches differ): the
  // data joins the recipe, by its token count as the ranks compare it (a checkpoint saved
  // before it was there compares as equal).
  recipe.emplace_back("--train-data's token count", std::to_string(train_loader.total_tokens()));
  // A vocabulary wider than 16 bits (LLaMA-3's 128,256) is not the tokenizer that wrote a
  // 16-bit shard (GPT-2's writes those): the ids are valid, the text they stand for is not.
  for (const data::TokenLoader* loader : {&train_loader, val_loader.get()}) {
    const std::string narrow = loader && mc.vocab_size > 65536 ? loader->first_16_bit_shard() : "";
    if (!narrow.empty() && root)
      std::fprintf(stderr, "tally: warning: shard '%s' holds 16-bit tokens (a tokenizer of at most 65,536, such as "
                   "GPT-2's), but the model's vocabulary has %lld: was it tokenized for this model?\n",
                   narrow.c_str(), static_cast<long long>(mc.vocab_size));
  }
  // A validation shard that is also a training shard (a glob that takes in the split held
  // out, the same file under two names): the validation loss would measure text the model
  // trains on. Said, not refused: a smoke run may validate on its training data on purpose.
  if (val_loader && root) {
    for (const std::string& val_file : val_loader->files()) {
      std::error_code ec;
      auto same = std::find_if(train_loader.files().begin(), train_loader.files().end(),
                               [&](const std::string& train_file) { return fs::equivalent(val_file, train_file, ec); });
      if (same == train_loader.files().end()) continue;
      std::fprintf(stderr, "tally: warning: --val-data shard '%s' is also a --train-data shard ('%s'): the validation "
                   "loss measures text the model trains on\n", val_file.c_str(), same->c_str());
      break;  // once: the first is enough to say the splits overlap
    }
  }
  // Validation reads consecutive batches; past the end of the data they would wrap around
  // and count tokens twice. At most the batches the data holds (at least one).
  int64_t val_batches = c.val_batches;
  if (val_loader) {
    const int64_t held = std::max<int64_t>(1, (val_loader->total_tokens() - 1) / val_loader->tokens_per_batch());
    if (val_batches > held) {
      log("validation: --val-batches %lld, but --val-data holds %lld tokens: %lld batch%s of %lld x %lld; "
          "validating on those\n",
          static_cast<long long>(val_batches), static_cast<long long>(val_loader->total_tokens()),
          static_cast<long long>(held), held == 1 ? "" : "es", static_cast<long long>(c.batch_size),
          static_cast<long long>(c.seq_len));
      val_batches = held;
    }
  }
  Detokenizer detok(c.tokenizer_dir);
  // Checked now, not at the first sample after training.
  if (detok.tok) check_tokenizer_for_model(*detok.tok, c.tokenizer_dir, mc.vocab_size, "", root);
  Rng sample_rng(c.seed + 1);

  int64_t start_step = 0;
  std::string resumed_history;  // the checkpoint's record of the steps before start_step
  std::vector<int64_t> saved_steps;  // the checkpoints this run wrote (--keep-last counts them)
  if (!resume_dir.empty()) {
    io::TrainingState st = io::load_checkpoint_state(resume_dir, *model, opt);
    // Reading it stages the moments one unit at a time beside the model states: a peak of
    // set-up the plan leaves out, said at the first step when above the steps' own.
    resume_peak = ledger.stats().peak_allocated;
    check_ranks_agree(world, {{"--resume's state.bin (CRC-32 of its contents)", std::to_string(st.content_crc)}});
    TALLY_CHECK(st.step <= c.steps, "--resume '", c.resume, "': the checkpoint is at step ", st.step, ", beyond --steps ",
                c.steps, "; to train further, raise --steps with --allow-recipe-change (--steps is part of the run's "
                "recipe: its learning-rate schedule ends there)");
    const std::string changes = recipe_changes(st.recipe, recipe);
    TALLY_CHECK(changes.empty() || c.allow_recipe_change, "--resume '", c.resume,
                "': this run would not continue the checkpoint's run exactly: ", changes,
                ". Use the checkpoint's settings, or pass --allow-recipe-change to continue anyway");
    if (!changes.empty()) log("resuming with a changed recipe (--allow-recipe-change): %s\n", changes.c_str());
    start_step = st.step;
    resumed_history = std::move(st.history);
    sample_rng.set_state(st.rng_state);
    log("resumed from %s at step %lld\n", resume_dir.c_str(), static_cast<long long>(start_step));
  }

  const int64_t N = c.grad_accum, B = c.batch_size, T = c.seq_len;
  const int64_t tokens_per_step = N * D * B * T;  // over all data-parallel ranks
  // Each rank does its share of the model's work: 1/(tp x pp) of it under model parallelism.
  const double rank_step_flops =
      model->flops_per_token(T) * static_cast<double>(N * B * T) / static_cast<double>(world.tp() * world.pp());
  double gemm_peak = runtime::backend(device).measured_gemm_peak_flops(matmul_dtype);
  bool gemm_peak_probed_again = false;
  const int64_t P = model->num_parameters();  // this rank's (its shard's under --tp/--pp)
  log("model: %s, %lld parameters\n", mc.describe().c_str(), static_cast<long long>(parameter_count(mc)));
  log("data: %lld train tokens in %zu shard(s)%s; step = %lld rank(s) x %lld microbatch(es) x %lld x %lld = %lld tokens\n",
      static_cast<long long>(train_loader.total_tokens()), train_loader.files().size(),
      val_loader ? (", " + std::to_string(val_loader->total_tokens()) + " val tokens").c_str() : "",
      static_cast<long long>(D), static_cast<long long>(N), static_cast<long long>(B), static_cast<long long>(T),
      static_cast<long long>(tokens_per_step));
  if (c.steps > 0 && c.warmup_steps > c.steps && root)
    std::fprintf(stderr, "tally: warning: --warmup-steps %lld is longer than --steps %lld: the learning rate never "
                 "reaches --lr (at most %.3g)\n", static_cast<long long>(c.warmup_steps), static_cast<long long>(c.steps),
                 learning_rate(c, c.steps - 1));
  {
    // How many times the run reads its data. In file order every pass is the same
    // sequence of batches: say so when there is more than one.
    const double passes = static_cast<double>(c.steps * tokens_per_step) / static_cast<double>(train_loader.tokens_per_pass());
    if (c.shuffle)
      log("data order: shuffled (--shuffle, seed %llu): %lld sequences of %lld tokens, in a new order on every pass; "
          "--steps %lld read %s\n",
          static_cast<unsigned long long>(c.seed), static_cast<long long>(train_loader.tokens_per_pass() / T),
          static_cast<long long>(T), static_cast<long long>(c.steps), passes_str(passes).c_str());
    else if (passes > 1.0)
      log("data order: file order; --steps %lld read %s, every pass the same text in the same order "
          "(--shuffle reads each pass in a new order)\n", static_cast<long long>(c.steps), passes_str(passes).c_str());
  }
  if (model_parallel)
    log("model parallel: %s%s%s, recompute %s; this rank holds %lld of the %lld parameters\n",
        TP > 1 ? ("tensor parallel " + std::to_string(TP) + (c.sequence_parallel ? " with sequence parallel" : "")).c_str() : "",
        TP > 1 && PP > 1 ? ", " : "",
        PP > 1 ? ("pipeline " + std::to_string(PP) + " stages, " + dist::pipeline_schedule_name(schedule) +
                  (c.virtual_stages > 1 ? " x " + std::to_string(c.virtual_stages) + " chunks" : ""))
                     .c_str()
               : "",
        c.recompute.c_str(), static_cast<long long>(model->num_parameters()), static_cast<long long>(parameter_count(mc)));
  // ZeRO shards over the data-parallel ranks: with one, it changes nothing (said, not left
  // for the start-up line to suggest otherwise).
  if (c.zero > 0 && D == 1 && root)
    std::fprintf(stderr, "tally: warning: --zero %d shards the optimizer state over data-parallel ranks; this run has "
                 "one, so it saves nothing (launch more ranks with mpirun, or leave --zero out)\n", c.zero);
  // --bucket-mb sizes plain data parallel's and ZeRO-1's all-reduce; a run without one says so.
  if (c.bucket_mb_given && !all_reduce && root)
    std::fprintf(stderr, "tally: warning: --bucket-mb %g sizes the buckets of data parallel's gradient all-reduce; this "
                 "run has %s, so it does nothing\n", c.bucket_mb,
                 D == 1 ? "one data-parallel rank and no all-reduce"
                        : "ZeRO stage 2 or 3, which reduce-scatters gradients instead");
  log("parallel: %s, %s\n", world.describe().c_str(),
      c.zero ? ("ZeRO stage " + std::to_string(c.zero) + (D == 1 ? " over 1 data-parallel rank: nothing sharded" : ""))
                   .c_str()
             : (D > 1 ? "bucketed all-reduce of " + std::to_string(all_reduce->buckets().size()) + " buckets"
                     : model_parallel ? "no data parallel" : "one process")
                        .c_str());
  log("threads: %d per rank, measured %s GEMM peak %.0f GFLOP/s%s\n", omp_get_max_threads(),
      matmul_dtype == DType::BF16 ? "bf16" : "fp32", gemm_peak / 1e9,
      matmul_dtype == DType::BF16 ? " (mixed precision: bf16 GEMM operands, fp32 master weights and optimizer)" : "");

  // Rank 0 writes the job's rows; with --log-json-all-ranks every rank also writes its own.
  std::unique_ptr<StepLog> json_log, rank_json_log;
  if (!c.log_json.empty() && root) json_log = std::make_unique<StepLog>(c.log_json, start_step);
  if (!c.log_json.empty() && root && start_step == 0 && !log_is_stream) {
    // A fresh run's log starts empty: per-rank logs an earlier run wrote beside it that
    // this run will not rewrite (a rank it does not have, or all of them without
    // --log-json-all-ranks) would contradict it, and are removed. (A resumed run's earlier
    // rows are the run's own: left.)
    const fs::path log_path(c.log_json);
    const std::string prefix = log_path.filename().string() + ".rank";
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(log_path.parent_path().empty() ? fs::path(".") : log_path.parent_path(), ec)) {
      const std::string name = entry.path().filename().string();
      if (name.size() <= prefix.size() || name.rfind(prefix, 0) != 0 ||
          name.find_first_not_of("0123456789", prefix.size()) != std::string::npos)
        continue;
      const int64_t r = std::atoll(name.c_str() + prefix.size());
      if ((!c.log_json_all_ranks || r >= world.size()) && fs::remove(entry.path(), ec))
        log("log: removed %s, an earlier run's log of rank %lld\n", entry.path().c_str(), static_cast<long long>(r));
    }
  }
  if (!c.log_json.empty() && c.log_json_all_ranks)
    rank_json_log = std::make_unique<StepLog>(c.log_json + ".rank" + std::to_string(world.rank()), start_step);

  // The run's record, drawn into <out-dir>/loss.svg and saved with every checkpoint: a
  // resumed run's earlier steps come from its checkpoint (or, from a checkpoint older than
  // that record, from its log), and so does its best validation loss so far.
  RunCurve curve;
  curve.name = "";
  const std::string plot_path = (fs::path(c.out_dir) / "loss.svg").string();
  double best_val = std::numeric_limits<double>::infinity();
  int64_t best_val_step = 0;
  if (start_step > 0) {
    RunCurve earlier;
    if (!resumed_history.empty()) earlier = curve_from_json(resumed_history, resume_dir + "/history.json");
    else if (root && !c.log_json.empty() && !log_is_stream && fs::exists(c.log_json)) earlier = read_run_log(c.log_json, "");
    for (size_t i = 0; i < earlier.steps.size() && earlier.steps[i] <= start_step; ++i)
      curve.add_step(earlier.steps[i], earlier.loss[i], earlier.lr[i], earlier.tokens[i]);
    for (auto& [step, v] : earlier.val)
      if (step <= start_step) {
        curve.add_val(step, v);
        if (v < best_val) best_val = v, best_val_step = step;
      }
  }
  // Tokens seen by the end of each step: the resumed run's count goes on from its record
  // (step x tokens a step is wrong after a resume that changed the batch).
  int64_t tokens_seen = start_step * tokens_per_step;
  if (!curve.steps.empty() && curve.steps.back() == start_step && curve.tokens.back() > 0)
    tokens_seen = curve.tokens.back();
  // A run that does not save, in an --out-dir holding another run's checkpoints, would
  // replace that run's plot with its own: it draws none, and says so.
  const bool plot_is_anothers = root && c.save_every == 0 && !continues && !c.overwrite && !io::checkpoints_in(c.out_dir).empty();
  if (plot_is_anothers)
    log("loss plot: not drawn: --out-dir '%s' holds another run's checkpoints and its loss.svg (give this run an "
        "--out-dir of its own to draw one)\n", c.out_dir.c_str());
  auto write_plot = [&] {
    if (!root || plot_is_anothers) return;
    fs::create_directories(c.out_dir);
    write_loss_svg(plot_path, {curve}, "tally: " + mc.describe());
  };
  const auto run_start = std::chrono::steady_clock::now();

  sanitizer::Sanitizer sanitizer(mode, sanitized_devices(device));
  TrainResult result;
  int64_t live_after_forward = 0;
  // The plan: every rank's peak from the configuration alone, printed beside the measured one.
  int64_t planned_peak = 0;  // this rank's
  std::vector<int64_t> rank_planned_peaks;  // every rank's
  std::vector<std::string> plan_notes;  // where the plan said its peak moment may not hold
  {
    PlanInput pi;
    pi.model = mc;
    pi.batch_size = B;
    pi.seq_len = T;
    pi.grad_accum = N;
    pi.world = static_cast<int>(D * TP * PP);
    pi.tp = static_cast<int>(TP);
    pi.sequence_parallel = c.sequence_parallel;
    pi.pp = PP;
    pi.pp_schedule = c.pp_schedule;
    pi.virtual_stages = c.virtual_stages;
    pi.pp_last_stage_layers = c.pp_last_stage_layers;
    pi.zero = c.zero;
    pi.val_loader = val_loader != nullptr;
    pi.bf16 = matmul_dtype == DType::BF16;
    pi.device = c.device;  // (the plan counts what the device changes: the GEMM library's workspace, the loader)
    pi.loss_chunk_rows = loss_chunk_rows;
    pi.recompute = model->recompute();
    const MemoryPlan plan = plan_memory(pi);
    for (const RankPlan& r : plan.ranks) {
      rank_planned_peaks.push_back(r.predicted_peak_bytes);
      result.predicted_setup_bytes = std::max(result.predicted_setup_bytes, r.setup_bytes);
    }
    const RankPlan& rank_plan = plan.ranks[static_cast<size_t>(world.rank())];
    planned_peak = rank_plan.predicted_peak_bytes;
    plan_parts = rank_plan.parts;
    plan_notes = plan.notes;
  }
  // Who holds the peak, for the check against the plan after the second step.
  ledger.track_peak_owners(true);
  // fp32 param, grad, m, v (ZeRO: this rank's share), and bf16's copy of the parameters.
  const int64_t states_bytes = (zero ? zero->footprint().total() : 16 * P) + (matmul_dtype == DType::BF16 ? 2 * P : 0);

  // What this stage's schedule needs at most; every step checks it held no more.
  const int64_t in_flight_bound =
      pipeline ? dist::pipeline_in_flight_bound(schedule, PP, world.pp_rank(), N, c.virtual_stages) : 0;
  namespace profiler = runtime::profiler;
  profiler::enable(c.profile_ops);
  if (!earlier.empty()) {  // --overwrite (rank 0 found them): every check has passed
    io::remove_checkpoints(c.out_dir);
    log("--overwrite: removed the earlier run's checkpoints from %s\n", c.out_dir.c_str());
  }
  if (start_step >= c.steps)
    log("nothing to train: the run is at step %lld of --steps %lld\n", static_cast<long long>(start_step),
        static_cast<long long>(c.steps));
  for (int64_t step = start_step; step < c.steps; ++step) {
    auto t0 = std::chrono::steady_clock::now();
    sanitizer.begin_step(step);
    ledger.reset_peaks();
    const int64_t tp_bytes_before = world.tp_group().stats().payload_bytes;
    double loss_sum = 0;
    if (pipeline) {
      // The loader's buffers are refilled per call: each microbatch keeps its own copy
      // (the embedding and the loss save them for backward, which runs later).
      auto batch_of = [&](int64_t mb) {
        const data::Batch& b = train_loader.batch_at(step, mb * D + dp_rank, N * D);
        auto own = [&](const Tensor& t) {
          Tensor copy = Tensor::empty(t.shape(), t.dtype(), device, current_owner("microbatch_tokens"));
          copy.copy_(t);
          return copy;
        };
        return std::pair<Tensor, Tensor>{own(b.inputs), own(b.targets)};
      };
      // Data parallel overlaps its all-reduce with the step's last backward, which under
      // gpipe and 1f1b finishes every parameter of the stage; interleaved chunks finish at
      // different times, so their reduction starts after the pipeline.
      profiler::PhaseScope phase("pipeline");
      loss_sum = pipeline->run(N, batch_of, 1.0 / static_cast<double>(N * D), sanitizer, [&] {
        if (all_reduce && c.virtual_stages == 1) all_reduce->arm();
      });
      if (all_reduce) {
        if (c.virtual_stages > 1) all_reduce->arm();
        all_reduce->finish();
      }
      TALLY_CHECK(pipeline->last().max_in_flight <= in_flight_bound, "pipeline stage ", world.pp_rank(), " held ",
                  pipeline->last().max_in_flight, " microbatches at once; the ", c.pp_schedule, " schedule needs ", in_flight_bound);
      loss_sum = world.pp_group().all_reduce_scalar(loss_sum, dist::ReduceOp::Sum);  // the last stage's
    }
    for (int64_t mb = 0; mb < (pipeline ? 0 : N); ++mb) {
      sanitizer.begin_microbatch(mb);
      const bool last = mb + 1 == N;
      if (all_reduce && last) all_reduce->arm();  // reduce while the last backward runs
      {
        // This rank's share of the global batch: microbatch mb*D + r of D*N.
        const data::Batch& batch = train_loader.batch_at(step, mb * D + dp_rank, N * D);
        std::optional<profiler::PhaseScope> phase(std::in_place, "forward");
        Tensor loss = model->forward(on_device(batch.inputs), on_device(batch.targets)).loss;
        if (live_after_forward == 0) {
          // At the end of the first forward the live set is exactly model states + loader
          // buffers + saved activations (measured; the plan predicts it).
          live_after_forward = ledger.stats().allocated;
        }
        loss_sum += loss.item();  // R4: only the number escapes the microbatch
        phase.emplace("backward");
        if (backward_norm && last) backward_norm->arm();
        (N * D == 1 ? loss : ops::scale(loss, 1.0 / static_cast<double>(N * D))).backward();
      }
      if (zero) zero->finish_microbatch();
      if (all_reduce && last) all_reduce->finish();
      sanitizer.end_microbatch();
    }
    if (model_parallel) {
      // The tied embedding's two copies (first and last stage) take the sum of their
      // gradients; under sequence parallelism each rank's replicated parameters saw only
      // its slice of the sequence, so their gradients are summed over the group.
      dist::sum_tied_embedding_gradients(*model, world.pp_group());
      if (tensor_parallel && c.sequence_parallel) dist::sum_replicated_gradients(*model, world.tp_group());
    }
    std::optional<profiler::PhaseScope> phase(std::in_place, "grad_norm");
    const double norm = model_parallel ? dist::model_parallel_gradient_norm(*model, world)
                        : zero         ? zero->gradient_norm()
                        : backward_norm ? backward_norm->finish()
                        : !device.is_cpu() ? optim::block_gradient_norm(model->params())
                                        : optim::gradient_norm(model->params());
    loss_sum = dp_group.all_reduce_scalar(loss_sum, dist::ReduceOp::Sum);
    const double lr = learning_rate(c, step);
    // A non-finite loss or gradient would silently turn every parameter into NaN.
    TALLY_CHECK(std::isfinite(loss_sum) && std::isfinite(norm), "step ", step + 1, ": loss ", loss_sum / static_cast<double>(N * D),
                ", gradient norm ", norm, " is not finite; stopping before the update (try a lower --lr or --grad-clip)");
    phase.emplace("optimizer");
    {
      autograd::NoGradGuard ng;
      OwnerScope scope("optimizer");
      const double scale = optim::clip_scale(norm, c.grad_clip);
      if (zero) zero->step(lr, scale);
      else {
        adamw->step(lr, scale);
        model->params().discard_grads();  // the next step's backward writes them afresh: no zeroing pass
      }
    }
    phase.reset();
    sanitizer.end_step();
    // A device runs the step's last kernels after the host has queued them: the step ends
    // when they have run.
    if (!device.is_cpu()) runtime::backend(device).default_stream().synchronize();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

    memory::Stats s = ledger.stats();
    StepMetrics m;
    m.step = step + 1;
    m.loss = loss_sum / static_cast<double>(N * D);
    m.lr = lr;
    m.grad_norm = norm;
    m.ms = seconds * 1e3;
    m.tokens_per_s = static_cast<double>(tokens_per_step) / seconds;
    m.gemm_peak_frac = rank_step_flops / seconds / gemm_peak;
    if (m.gemm_peak_frac > 1.0 && !gemm_peak_probed_again) {
      // A step faster than the probe's GEMMs: a neighbour slowed the probe. Probe once more
      // (after the step's time was taken) and keep the larger.
      gemm_peak = runtime::backend(device).measured_gemm_peak_flops(matmul_dtype, /*probe_again=*/true);
      gemm_peak_probed_again = true;
      m.gemm_peak_frac = rank_step_flops / seconds / gemm_peak;
    }
    // Memory: the maximum over ranks, and every rank's peak.
    dist::Communicator& everyone = world.world();
    m.live_bytes = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(s.allocated), dist::ReduceOp::Max));
    m.peak_bytes = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(s.peak_allocated), dist::ReduceOp::Max));
    m.reserved_bytes = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(s.reserved), dist::ReduceOp::Max));
    for (double p : everyone.all_gather_scalar(static_cast<double>(s.peak_allocated)))
      m.rank_peak_bytes.push_back(static_cast<int64_t>(p));
    m.live_after_forward_bytes = live_after_forward;
    m.rank_predicted_peak_bytes = rank_planned_peaks;
    for (int64_t p : rank_planned_peaks) m.predicted_peak_bytes = std::max(m.predicted_peak_bytes, p);
    m.peak_rss_bytes = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(memory::peak_rss_bytes()), dist::ReduceOp::Max));
    m.tp_payload_bytes = world.tp_group().stats().payload_bytes - tp_bytes_before;
    if (c.profile_ops) m.ops = profiler::take();
    if (pipeline) {
      const dist::PipelineStepStats& ps = pipeline->last();
      m.pp_sent_bytes = ps.bytes_sent;
      m.rank_idle_frac = everyone.all_gather_scalar(ps.seconds > 0 ? ps.idle_seconds / ps.seconds : 0.0);
      for (double f : m.rank_idle_frac) m.bubble_frac += f / static_cast<double>(world.size());
      m.max_in_flight = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(ps.max_in_flight), dist::ReduceOp::Max));
    }
    if (step == start_step + 1 || (step == start_step && c.steps == start_step + 1)) {
      // From the second step on the peak is the steady one (the first also builds caches).
      if (pipeline) {
        log("memory: measured peak %s (largest over ranks; this rank's %s with params+grads+adam %s); a stage held at "
            "most %lld microbatches at once (%s)\n",
            format_bytes(m.peak_bytes).c_str(), format_bytes(s.peak_allocated).c_str(), format_bytes(states_bytes).c_str(),
            static_cast<long long>(m.max_in_flight), c.pp_schedule.c_str());
      } else {
        log("memory: measured peak %s = live after forward %s (params+grads+adam %s, activations and data of one "
            "microbatch %s) + transients %s\n",
            format_bytes(s.peak_allocated).c_str(), format_bytes(live_after_forward).c_str(),
            format_bytes(states_bytes).c_str(), format_bytes(live_after_forward - states_bytes).c_str(),
            format_bytes(s.peak_allocated - live_after_forward).c_str());
      }
      {
        // The largest plan beside the largest peak (rank 0 prints); every rank checks its own.
        const double off_max = static_cast<double>(m.peak_bytes - m.predicted_peak_bytes) /
                               static_cast<double>(std::max<int64_t>(m.predicted_peak_bytes, 1));
        log("memory: planned peak %s (tally plan%s), measured %s: %+.2f%%\n", format_bytes(m.predicted_peak_bytes).c_str(),
            world.size() > 1 ? "; the largest over ranks, each rank's own checked" : "", format_bytes(m.peak_bytes).c_str(),
            100.0 * off_max);
        const double off = static_cast<double>(s.peak_allocated - planned_peak) / static_cast<double>(planned_peak);
        if (std::abs(off) > 0.05) {
          // A moment the plan itself said may not hold (tally plan prints its notes) is named.
          std::string said;
          for (const std::string& note : plan_notes)
            if (note.rfind("set-up", 0) != 0) said += (said.empty() ? "; the plan noted: " : "; ") + note;
          std::fprintf(stderr, "tally: warning: rank %lld's measured peak %s is %+.1f%% off the plan %s: %s; "
                       "--mem-trace F.html shows who holds what%s\n", static_cast<long long>(world.rank()),
                       format_bytes(s.peak_allocated).c_str(), 100.0 * off, format_bytes(planned_peak).c_str(),
                       explain_peak(plan_parts, ledger.peak_owners()).c_str(), said.c_str());
        }
      }
      ledger.track_peak_owners(false);
      result.setup_peak_bytes = static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(setup_peak), dist::ReduceOp::Max));
      const char* above = result.setup_peak_bytes > m.peak_bytes ? "; above the steps' peak: each rank needs it free at start-up" : "";
      result.resume_peak_bytes =
          static_cast<int64_t>(everyone.all_reduce_scalar(static_cast<double>(resume_peak), dist::ReduceOp::Max));
      if (result.resume_peak_bytes > m.peak_bytes)
        log("memory: reading the checkpoint peaked at %s (largest over ranks), above the steps' peak %s: its optimizer "
            "state is staged one unit at a time beside the model states, which the plan leaves out; a rank needs it "
            "free at start-up\n",
            format_bytes(result.resume_peak_bytes).c_str(), format_bytes(m.peak_bytes).c_str());
      if (result.predicted_setup_bytes > 0)
        log("memory: set-up peak %s (largest over ranks: %s), planned %s%s%s\n", format_bytes(result.setup_peak_bytes).c_str(),
            model_parallel ? "this rank's shard built, one whole parameter read beside it"
                           : c.zero == 3 ? "this rank's ZeRO-3 shards, one whole parameter read beside them"
                                         : "the parameter block and this rank's ZeRO-2 shards: its model states",
            format_bytes(result.predicted_setup_bytes).c_str(),
            source.init_from.empty() ? "" : " for the model; reading HuggingFace files adds one file tensor at a time, "
                                            "in the file's dtype and layout, which the plan does not know",
            above);
      if (D > 1) {
        const auto& st = s.allocated_by_category;
        const int64_t held = st[static_cast<int>(Category::Parameter)] + st[static_cast<int>(Category::Gradient)] +
                             st[static_cast<int>(Category::OptimizerState)];
        std::string formula = c.zero == 0 ? "16P" : c.zero == 1 ? "8P + 8P/D" : c.zero == 2 ? "4P + 12P/D" : "16P/D";
        if (matmul_dtype == DType::BF16) formula += " + 2P (bf16 copy)";
        log("memory per rank: model states %s by the formula %s (D=%lld), %s in the ledger\n",
            format_bytes(states_bytes).c_str(), formula.c_str(), static_cast<long long>(D), format_bytes(held).c_str());
      }
      if (all_reduce) {
        const dist::ReductionStats& r = all_reduce->last();
        const double ring = 2.0 * static_cast<double>(D - 1) / static_cast<double>(D) * static_cast<double>(r.payload_bytes);
        log("all-reduce per step: %s of gradients (4P = %s) in %d buckets; a ring sends 2(D-1)/D of it per rank: %s; "
            "%.0f%% of the %.0f ms all-reduce time was hidden behind backward\n",
            format_bytes(r.payload_bytes).c_str(), format_bytes(4 * P).c_str(), r.buckets, format_bytes(static_cast<int64_t>(ring)).c_str(),
            r.comm_seconds > 0 ? 100.0 * r.hidden_seconds / r.comm_seconds : 0.0, r.comm_seconds * 1e3);
      }
    }
    // Progress: the share of steps done, and the time left at the pace of the steps so far
    // (validation, samples and checkpoints included).
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const int64_t done = step + 1 - start_step, left = c.steps - step - 1;
    const std::string eta = left == 0 ? "done" : "ETA " + duration_str(elapsed / static_cast<double>(done) * static_cast<double>(left));
    log("step %5lld/%lld %3.0f%% | loss %.4f | norm %.3f | lr %.2e | %.0f ms | %.1f%% of GEMM peak | %.0f tok/s | mem %s live, %s peak | %s\n",
        static_cast<long long>(m.step), static_cast<long long>(c.steps), 100.0 * static_cast<double>(m.step) / static_cast<double>(c.steps),
        m.loss, m.grad_norm, m.lr, m.ms, 100.0 * m.gemm_peak_frac, m.tokens_per_s, format_bytes(m.live_bytes).c_str(),
        format_bytes(m.peak_bytes).c_str(), eta.c_str());
    if (c.profile_ops) {
      // Where this step's time went, per phase: the largest kernels, and what no kernel
      // accounts for (allocation, graph building, dispatch: the framework's own cost).
      std::string table = profiler::format(m.ops);
      for (size_t at = 0; (at = table.find('\n', at)) != std::string::npos && at + 1 < table.size(); at += 3)
        table.insert(at + 1, "  ");
      // Rank 0's own: under a pipeline its stage's kernels, and "untimed" holds its waits
      // for the other stages' activations and gradients too.
      if (world.size() > 1)
        log("  (rank 0's kernels%s)\n", PP > 1 ? ": pipeline stage 0; its untimed time includes waiting for the other stages" : "");
      log("  %s", table.c_str());
    }
    tokens_seen += tokens_per_step;
    curve.add_step(m.step, m.loss, m.lr, tokens_seen);

    nlohmann::json j = {{"step", m.step},       {"loss", m.loss},           {"lr", m.lr},
                        {"grad_norm", m.grad_norm}, {"ms", m.ms},           {"tokens_per_s", m.tokens_per_s},
                        {"gemm_peak_frac", m.gemm_peak_frac}, {"live_bytes", m.live_bytes}, {"peak_bytes", m.peak_bytes},
                        {"reserved_bytes", m.reserved_bytes}, {"live_after_forward_bytes", m.live_after_forward_bytes},
                        {"predicted_peak_bytes", m.predicted_peak_bytes},
                        {"rank_peak_bytes", m.rank_peak_bytes}, {"rank_predicted_peak_bytes", m.rank_predicted_peak_bytes},
                        {"peak_rss_bytes", m.peak_rss_bytes},
                        {"tokens", tokens_seen}};
    if (pipeline) {
      j["bubble_frac"] = m.bubble_frac;
      j["rank_idle_frac"] = m.rank_idle_frac;
      j["max_in_flight"] = m.max_in_flight;
      j["pp_sent_bytes"] = m.pp_sent_bytes;
    }
    if (TP > 1) j["tp_payload_bytes"] = m.tp_payload_bytes;
    if (c.profile_ops) {
      // {"forward": {"ms": 452.1, "kernels": {"gemm": {"ms": 301.2, "calls": 49, "gflop": 42.5}, ...}}, ...}
      nlohmann::json phases = nlohmann::json::object();
      for (const profiler::PhaseRow& p : m.ops.phases) phases[p.phase] = {{"ms", p.ms}, {"kernel_ms", p.kernel_ms}, {"kernels", nlohmann::json::object()}};
      for (const profiler::KernelRow& k : m.ops.kernels) {
        nlohmann::json row = {{"ms", k.ms}, {"calls", k.calls}};
        if (k.flops > 0) row["gflop"] = k.flops / 1e9;
        phases[k.phase]["kernels"][k.kernel] = row;
      }
      j["ops"] = phases;
    }
    const bool last = step + 1 == c.steps;
    if (val_loader && ((c.val_every > 0 && m.step % c.val_every == 0) || last)) {
      double vl = evaluate(*model, pipeline.get(), *val_loader, val_batches);  // every rank: ZeRO-3 gathers collectively
      result.final_val_loss = vl;
      j["val_loss"] = vl;
      log("val loss %.4f\n", vl);
      curve.add_val(m.step, vl);
      if (vl < best_val) best_val = vl, best_val_step = m.step;
      write_plot();
    }
    const bool sample_now =
        (c.sample_every > 0 && m.step % c.sample_every == 0) || (last && c.sample_tokens > 0 && c.sample_every >= 0);
    if (sample_now && model_parallel && last)
      log("sample: not drawn: sampling runs on a whole model, and this run's is split by --tp/--pp; %s\n",
          c.save_every > 0 ? ("`tally sample --model-file " + c.out_dir + "` draws from its checkpoints").c_str()
                           : "save checkpoints (--save-every) and `tally sample --model-file <out-dir>` draws from them");
    // A sample that fails is rethrown only after this step's checkpoint is saved: showing
    // text must never cost the training it shows.
    std::exception_ptr sample_error;
    if (sample_now && !model_parallel) {
      try {
        SampleOptions so;
        so.tokens = c.sample_tokens;
        so.temperature = c.temperature;
        so.top_k = c.top_k;
        auto ids = sample(*model, {detok.start_token(mc)}, so, sample_rng);  // every rank, same draws
        log("sample:\n---\n%s\n---\n", detok.text(ids).c_str());
      } catch (...) {
        sample_error = std::current_exception();
      }
    }
    // The row goes to the log before the checkpoint: a checkpointed step always has its row.
    const bool checkpoint = c.save_every > 0 && (m.step % c.save_every == 0 || last);
    if (json_log) json_log->append(j.dump());
    crash_point("row", m.step);
    if (rank_json_log) {
      j["rank"] = world.rank();
      j["rank_live_bytes"] = s.allocated;
      j["rank_peak_allocated_bytes"] = s.peak_allocated;
      rank_json_log->append(j.dump());
    }
    if (checkpoint) {
      if (json_log) json_log->sync();
      if (rank_json_log) rank_json_log->sync();
      io::TrainingState st;
      st.step = m.step;
      st.rng_state = sample_rng.state();
      st.recipe = recipe;
      st.history = curve_to_json(curve);
      // What writing holds beside the run's live memory (the next step resets the peak).
      ledger.reset_peaks();
      const int64_t live_before_save = ledger.stats().allocated;
      result.last_checkpoint = io::save_checkpoint(c.out_dir, *model, opt, st, world, [&](int pp_rank, int tp_rank) {
        return dist::pipeline_shard(mc.n_layer, PP, pp_rank, c.virtual_stages, TP, tp_rank, c.pp_last_stage_layers);
      });
      const double save_held = everyone.all_reduce_scalar(
          static_cast<double>(ledger.stats().peak_allocated - live_before_save), dist::ReduceOp::Max);
      log("saved %s (writing held %s beside the live memory%s)\n", result.last_checkpoint.c_str(),
          format_bytes(static_cast<int64_t>(save_held)).c_str(), world.size() > 1 ? ", largest over ranks" : "");
      if (c.keep_last > 0 && root) {
        saved_steps.push_back(m.step);
        const std::vector<std::string> removed =
            io::remove_older_checkpoints(c.out_dir, result.last_checkpoint, c.keep_last, start_step, saved_steps);
        if (!removed.empty())
          log("removed %zu older checkpoint%s (--keep-last %lld): %s%s\n", removed.size(), removed.size() == 1 ? "" : "s",
              static_cast<long long>(c.keep_last), removed.front().c_str(),
              removed.size() > 1 ? (" ... " + removed.back()).c_str() : "");
      }
      crash_point("checkpoint", m.step);
    }
    if (sample_error) std::rethrow_exception(sample_error);
    result.history.push_back(m);
    result.final_loss = m.loss;
    result.steps_run++;
    if (on_step) on_step(m);
  }
  result.boundaries = sanitizer.boundaries();
  if (std::isfinite(best_val)) result.best_val_loss = best_val, result.best_val_step = best_val_step;
  if (result.steps_run > 0) {
    write_plot();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - run_start).count();
    const int64_t tokens = result.steps_run * tokens_per_step;
    std::string summary = "done: " + std::to_string(result.steps_run) + " steps in " + duration_str(seconds) + ", " +
                          std::to_string(tokens) + " tokens (" + std::to_string(static_cast<int64_t>(tokens / std::max(seconds, 1e-9))) +
                          " tok/s, " + passes_str(static_cast<double>(tokens) / static_cast<double>(train_loader.tokens_per_pass())) +
                          " over the training data)";
    if (std::isfinite(best_val))
      summary += "; best val loss " + fmt_fixed(best_val, 4) + " at step " + std::to_string(best_val_step);
    if (!result.last_checkpoint.empty()) summary += "; checkpoint " + result.last_checkpoint;
    if (!c.log_json.empty()) summary += "; log " + c.log_json;
    if (!plot_is_anothers) summary += "; plot " + plot_path;
    log("%s\n", summary.c_str());
  }
  if (c.return_parameters && !model_parallel) result.parameters = gather_parameters(*model);
  if (!c.mem_trace.empty()) {
    write_trace();
    log("memory %s written to %s%s\n", trace_html ? "report" : "trace (open in ui.perfetto.dev or chrome://tracing)",
        trace_path.c_str(),
        world.size() > 1 ? (", and each other rank's beside it, .rank<R> before the extension (" +
                            rank_trace_path(c.mem_trace, 1) + ")").c_str()
                         : "");
  }
  model->set_residency(nullptr);
  return result;
}

}  // namespace tally::train
