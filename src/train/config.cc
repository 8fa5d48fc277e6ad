#include "train/config.h"

#include <charconv>
#include <cmath>
#include <filesystem>
#include <limits>

#include "core/checked.h"
#include "core/error.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "runtime/backend.h"
#include "train/sampler.h"

namespace tally::train {

namespace fs = std::filesystem;

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

void validate_numbers(const TrainConfig& c) {
  const OptimizerConfig& o = c.optimizer;
  // Every real-valued flag must be a number: checked first, so NaN and infinity are named as such.
  for (auto [flag, value] : {std::pair{"--lr", o.lr}, {"--min-lr-frac", o.min_lr_frac}, {"--beta1", o.beta1},
                             {"--beta2", o.beta2}, {"--temperature", c.sampling.temperature}, {"--grad-clip", o.grad_clip},
                             {"--weight-decay", o.weight_decay}, {"--bucket-mb", c.parallel.bucket_mb}})
    TALLY_CHECK(std::isfinite(value), flag, " must be a finite number, got ", value);
}

void validate_batch(const TrainConfig& c) {
  const BatchConfig& b = c.batch;
  TALLY_CHECK(b.batch_size > 0, "--batch-size must be positive, got ", b.batch_size);
  TALLY_CHECK(b.seq_len > 0, "--seq-len must be positive, got ", b.seq_len);
  TALLY_CHECK(b.grad_accum > 0, "--grad-accum must be positive, got ", b.grad_accum);
  TALLY_CHECK(b.steps >= 0, "--steps must be >= 0, got ", b.steps);
  // Sizes derived from flags are checked before anything is allocated: B x T x N tokens per
  // step, and the loader reads B x T + 1 tokens per microbatch.
  checked_product({b.batch_size, b.seq_len, b.grad_accum, 8}, "--batch-size x --seq-len x --grad-accum");
  checked_product({b.steps, b.batch_size, b.seq_len, b.grad_accum, c.parallel.dp},
                  "the run's tokens, --steps x --batch-size x --seq-len x --grad-accum x --dp");
}

void validate_optimizer(const OptimizerConfig& o) {
  TALLY_CHECK(o.lr > 0, "--lr must be positive, got ", o.lr);
  TALLY_CHECK(o.min_lr_frac >= 0 && o.min_lr_frac <= 1, "--min-lr-frac must be in [0, 1], got ", o.min_lr_frac);
  TALLY_CHECK(o.beta1 >= 0 && o.beta1 < 1 && o.beta2 >= 0 && o.beta2 < 1, "--beta1/--beta2 must be in [0, 1)");
  TALLY_CHECK(o.eps > 0 && std::isfinite(o.eps), "--eps must be positive and finite, got ", o.eps);
  // AdamW keeps its moments and divides in fp32 (optim/adamw.h): these flags must survive the
  // rounding. A beta that rounds to 1 freezes its moment (beta2: every update is m/eps); an
  // eps below fp32's normal range rounds, or flushes, to 0, and a zero gradient's update is 0/0.
  for (auto [flag, beta] : {std::pair{"--beta1", o.beta1}, {"--beta2", o.beta2}})
    TALLY_CHECK(static_cast<float>(beta) < 1.0f, flag, " ", shortest_decimal(beta),
                " is 1 in fp32, where AdamW keeps its moments (the largest beta below 1 there is 1 - 2^-24 = 0.99999994)");
  TALLY_CHECK(static_cast<float>(o.eps) >= std::numeric_limits<float>::min(), "--eps ", o.eps,
              " is below fp32's smallest normal number (1.2e-38), where AdamW divides by it");
  TALLY_CHECK(o.warmup_steps >= 0, "--warmup-steps must be >= 0, got ", o.warmup_steps);
  TALLY_CHECK(o.grad_clip >= 0, "--grad-clip must be >= 0 (0 = off)");
  TALLY_CHECK(o.weight_decay >= 0, "--weight-decay must be >= 0");
  // A flag that would do nothing without another: said, not ignored.
  TALLY_CHECK(o.schedule != LrSchedule::Constant || o.min_lr_frac == 0, "--min-lr-frac ", o.min_lr_frac,
              " is where --lr-schedule cosine ends; --lr-schedule constant has no end to set");
}

void validate_outputs(const TrainConfig& c) {
  const ValidationConfig& v = c.validation;
  const SamplingConfig& s = c.sampling;
  const CheckpointConfig& k = c.checkpoint;
  TALLY_CHECK(v.batches > 0, "--val-batches must be positive, got ", v.batches);
  TALLY_CHECK(s.tokens >= 0, "--sample-tokens must be >= 0, got ", s.tokens);
  TALLY_CHECK(s.temperature >= 0, "--temperature must be >= 0, got ", s.temperature);
  TALLY_CHECK(c.model.file.empty() || c.model.init_from.empty(), "--model-file and --init-from are exclusive");
  TALLY_CHECK(v.every >= 0, "--val-every must be >= 0 (0: only at the end), got ", v.every);
  // Flags that would do nothing without another: said, not ignored.
  TALLY_CHECK(v.every == 0 || !c.data.val.empty(), "--val-every ", v.every,
              " validates on --val-data, which this run does not have");
  TALLY_CHECK(!v.batches_given || !c.data.val.empty(), "--val-batches ", v.batches,
              " sets the batches of a validation on --val-data, which this run does not have");
  TALLY_CHECK(!k.allow_recipe_change || !k.resume.empty(),
              "--allow-recipe-change lets --resume continue a run with another recipe; this run resumes none");
  TALLY_CHECK(!c.metrics.log_json_all_ranks || !c.metrics.log_json.empty(),
              "--log-json-all-ranks writes <--log-json>.rank<R> beside --log-json, which this run does not have");
  TALLY_CHECK(k.save_every >= 0, "--save-every must be >= 0 (0: never), got ", k.save_every);
  TALLY_CHECK(k.keep_last >= 0, "--keep-last must be >= 0 (0: keep every checkpoint), got ", k.keep_last);
  TALLY_CHECK(k.keep_last == 0 || k.save_every > 0, "--keep-last ", k.keep_last,
              " keeps the newest checkpoints --save-every writes, and this run saves none");
  TALLY_CHECK(s.every >= -1, "--sample-every must be >= -1 (-1: never, 0: only at the end), got ", s.every);
  TALLY_CHECK(s.every <= 0 || s.tokens > 0, "--sample-every ", s.every, " prints a sample of "
              "--sample-tokens tokens every ", s.every, " steps, and --sample-tokens is 0; give it a length, or "
              "--sample-every -1 for none");
  TALLY_CHECK(s.top_k >= 0, "--top-k must be >= 0 (0: no truncation), got ", s.top_k);
  TALLY_CHECK(s.tokens >= 0 && s.tokens <= kMaxSampleTokens, "--sample-tokens must be in 0..", kMaxSampleTokens,
              ", got ", s.tokens);
  TALLY_CHECK(c.compute.threads >= 0 && c.compute.threads <= kMaxThreads, "--threads must be in 0..", kMaxThreads,
              " (0: all cores), got ", c.compute.threads);
}

}  // namespace

const char* lr_schedule_name(LrSchedule schedule) { return schedule == LrSchedule::Constant ? "constant" : "cosine"; }

void TrainConfig::validate() const {
  validate_numbers(*this);
  TALLY_CHECK(!data.train.empty(), "--train-data is required (a glob of llm.c token shards; make them with `tally tokenize`)");
  validate_settings();
}

void TrainConfig::validate_settings() const {
  validate_numbers(*this);
  validate_batch(*this);
  validate_optimizer(optimizer);
  validate_outputs(*this);
  // (At least a byte: a smaller bucket would truncate to 0 bytes. At most a TiB, so its size in
  // bytes is an int64: past any use for one all-reduce.)
  TALLY_CHECK(parallel.bucket_mb * (1 << 20) >= 1 && parallel.bucket_mb <= 1048576,
              "--bucket-mb must be from one byte (2^-20) to 1048576 MiB, got ", parallel.bucket_mb);
}

bool is_device_name(const std::string& text) {
  const bool cuda_n = text.starts_with("cuda:") && text.size() > 5 && text.size() < 10 &&
                      text.find_first_not_of("0123456789", 5) == std::string::npos;
  return text == "cpu" || text == "cuda" || cuda_n;
}

Device parse_device(const std::string& text) {
  TALLY_CHECK(is_device_name(text), "--device: expected cpu, cuda or cuda:N, got '", text, "'");
  if (text == "cpu") return Device::cpu();
  return text == "cuda" ? Device::cuda(0) : Device::cuda(std::stoi(text.substr(5)));
}

void check_device_visible(Device d) {
  if (d.is_cpu()) return;
  const int visible = runtime::device_count(DeviceType::CUDA);
  TALLY_CHECK(d.index < visible, "--device ", d.str(), ": ",
              visible == 0 ? std::string("no CUDA device is visible to this process") +
#ifdef TALLY_CUDA
                                 " (tally is built with CUDA; is a GPU present and its driver loaded?)"
#else
                                 " (this tally is built without CUDA: /usr/local/cuda/bin/nvcc was not found at build time)"
#endif
                           : std::to_string(visible) + " CUDA device(s) are visible (cuda:0 .. cuda:" +
                                 std::to_string(visible - 1) + ")");
}

void check_layout_flags(const LayoutFlags& f) {
  TALLY_CHECK(f.zero >= 0 && f.zero <= 3, "--zero must be 0, 1, 2 or 3, got ", f.zero);
  // One GPU a run for now: the communicator that would reduce between GPUs (NCCL) is not
  // built yet, and MPI's moves host memory.
  TALLY_CHECK(f.device.is_cpu() || f.world == 1, "--device ", f.device.str(), " with ", f.world,
              " processes: multi-GPU training needs the NCCL communicator, which tally does not have yet; "
              "run one process per GPU run, or train on --device cpu under mpirun");
  TALLY_CHECK(f.device.is_cpu() || f.zero == 0, "--device ", f.device.str(), " with --zero ", f.zero,
              ": ZeRO shards over data-parallel GPUs, which need the NCCL communicator tally does not have yet");
  TALLY_CHECK(!f.sequence_parallel || f.tp > 1, "--sp (sequence parallel) shards along the sequence over the "
              "tensor-parallel group: it needs --tp > 1");
  TALLY_CHECK(f.cp >= 1, "--cp must be >= 1, got ", f.cp);
  TALLY_CHECK(f.seq_len % (2 * f.cp) == 0 || f.cp == 1, "--cp ", f.cp, ": each sequence is cut into 2 x ", f.cp,
              " chunks (rank r holds chunks r and ", 2 * f.cp, "-1-r), so --seq-len ", f.seq_len,
              " must be a multiple of ", 2 * f.cp);
  TALLY_CHECK(!f.sequence_parallel || (f.seq_len / f.cp) % f.tp == 0, "--sp: --seq-len ", f.seq_len,
              f.cp > 1 ? " / --cp " + std::to_string(f.cp) : std::string(), " must divide into --tp ", f.tp, " ranks");
  TALLY_CHECK(f.cp == 1 || f.device.is_cpu(), "--cp ", f.cp, " with --device ", f.device.str(),
              ": context parallelism's collectives are MPI's, on the CPU");
  TALLY_CHECK(f.ep >= 1, "--ep must be >= 1, got ", f.ep);
  TALLY_CHECK(f.ep == 1 || f.device.is_cpu(), "--ep ", f.ep, " with --device ", f.device.str(),
              ": expert parallel's all-to-alls are MPI's, on the CPU");
  TALLY_CHECK(f.ep == 1 || f.zero <= 1, "--ep ", f.ep, " with --zero ", f.zero,
              ": ZeRO-2/3 over expert-parallel ranks is not supported yet (their experts differ); use --zero 1 or 0");
  TALLY_CHECK(f.tp * f.pp == 1 || f.zero <= 1, "--zero ", f.zero, " with --tp/--pp: the model is already sharded by "
              "tensor and pipeline parallelism; use --zero 1 (optimizer state sharded over the data-parallel group)");
  TALLY_CHECK(!f.bf16 || f.zero <= 2, "--dtype bf16 with --zero 3: the GEMMs read a bf16 copy of the whole parameter "
              "block, which ZeRO-3 does not keep; use --zero 2 or lower");
  TALLY_CHECK(!f.chunked_loss || f.tp == 1, "--chunked-loss with --tp: the tensor-parallel loss is vocabulary-parallel "
              "already (no rank holds the whole logits)");
}

void check_layout(const TrainConfig& c, int64_t world) {
  const ParallelismConfig& p = c.parallel;
  check_layout_flags({world, p.tp, p.pp, p.sequence_parallel, c.batch.seq_len, p.zero, c.compute.dtype == DType::BF16,
                      c.compute.chunked_loss, c.compute.device, p.cp, p.ep});
}

std::vector<Device> sanitized_devices(Device training) {
  if (training.is_cpu()) return {training};
  return {Device::cpu(), training};
}

double learning_rate(const OptimizerConfig& o, int64_t steps, int64_t step) {
  if (o.warmup_steps > 0 && step < o.warmup_steps)
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  if (o.schedule == LrSchedule::Constant) return o.lr;
  // From the peak on the first step after the warm-up to min_lr on the last step that
  // trains (steps - 1); one step after the warm-up stays at the peak.
  const double min_lr = o.lr * o.min_lr_frac;
  const int64_t decay_steps = steps - 1 - o.warmup_steps;
  const double progress =
      decay_steps <= 0 ? 0.0 : std::min(1.0, static_cast<double>(step - o.warmup_steps) / static_cast<double>(decay_steps));
  return min_lr + 0.5 * (1.0 + std::cos(M_PI * progress)) * (o.lr - min_lr);
}

nn::TransformerConfig model_config(const ModelConfig& m) {
  if (!m.file.empty()) {
    // The directories a user may mean here are other flags' (a HuggingFace model, a checkpoint).
    const bool hf = io::is_hf_model_dir(m.file);
    const bool checkpoint = fs::exists(fs::path(m.file) / "state.bin") || fs::exists(fs::path(m.file) / "latest");
    TALLY_CHECK(!hf, "--model-file '", m.file, "' is a HuggingFace model directory: --init-from ", m.file,
                " starts from it (--model-file takes an llm.c model file, .bin)");
    TALLY_CHECK(!checkpoint, "--model-file '", m.file, "' is a checkpoint or training --out-dir: --resume ", m.file,
                " continues its run, and --model-file with its step directory's model.bin starts a new run from its "
                "weights (--model-file takes an llm.c model file, .bin)");
    return io::read_llmc_config(m.file);
  }
  if (!m.init_from.empty()) return io::read_hf_config(m.init_from);
  return nn::TransformerConfig::preset(m.preset);
}

}  // namespace tally::train
