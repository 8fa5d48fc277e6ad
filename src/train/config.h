// The configuration of a training run: typed, and split by concern (torchtitan's job
// config), each part what one part of the trainer reads. `tally train` and `tally plan`
// declare their shared flags once (apps/flags.cc) and parse them straight into these
// fields, enums and the device included; nothing downstream compares strings.
//
// validate() checks every value and what must hold between values, and each error names
// the flag and what was expected; check_layout() the flags of the parallel layout against
// a world of ranks, in the same words for train and plan.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "dist/pipeline.h"
#include "nn/transformer.h"
#include "sanitizer/sanitizer.h"

namespace tally::train {

enum class LrSchedule { Constant, Cosine };
const char* lr_schedule_name(LrSchedule schedule);  // "constant" | "cosine"

// Where the model's shape and first weights come from: a preset, an llm.c file or a
// HuggingFace model (one of them).
struct ModelConfig {
  std::string preset = "d6";    // --model
  bool preset_given = true;     // --model was on the command line; without it (and a file) a resume builds the checkpoint's model
  std::string file;             // --model-file: an llm.c .bin to start from
  std::string init_from;        // --init-from: a HuggingFace model to start from
};

struct DataConfig {
  std::string train;      // --train-data: a glob of llm.c token shards
  std::string val;        // --val-data
  std::string tokenizer;  // --tokenizer: to print samples as text
  bool shuffle = false;   // --shuffle: a new order of the training sequences every pass (seeded by --seed)
};

// The shape of a step: B x T tokens a microbatch, N microbatches a data-parallel rank.
struct BatchConfig {
  int64_t batch_size = 4;  // --batch-size (B)
  int64_t seq_len = 64;    // --seq-len (T)
  int64_t grad_accum = 1;  // --grad-accum (N)
  int64_t steps = 20;      // --steps
};

// AdamW and its learning-rate schedule.
struct OptimizerConfig {
  double lr = 3e-4;
  int64_t warmup_steps = 0;
  LrSchedule schedule = LrSchedule::Cosine;  // --lr-schedule
  double min_lr_frac = 0.0;                  // where cosine ends, a fraction of --lr
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;  // 0: off
};

// The parallel layout over MPI (launch with mpirun): data, tensor, context and pipeline
// parallel, ZeRO over the replicas (data x context parallel; dist/world.h).
struct ParallelismConfig {
  int dp = 0;  // 0: world size / (tp x cp x pp)
  int tp = 1;
  int pp = 1;
  int cp = 1;  // --cp: each sequence's tokens split over C ranks
  int ep = 1;  // --ep: each sparse layer's experts split over E of the data-parallel ranks
  bool sequence_parallel = false;  // --sp: norms and residuals sharded along the sequence (needs --tp > 1)
  dist::PipelineSchedule pp_schedule = dist::PipelineSchedule::OneFOneB;
  int virtual_stages = 1;            // model chunks per pipeline rank (interleaved)
  int64_t pp_last_stage_layers = 0;  // layers of the last pipeline stage (0: split evenly)
  int zero = 0;                      // 0: plain data parallel; 1, 2, 3: ZeRO stage
  double bucket_mb = 25;             // the all-reduce's bucket size (MiB)
  bool bucket_mb_given = false;      // --bucket-mb was on the command line (a run without the all-reduce says it does nothing)
};

// Where and how the step computes.
struct ComputeConfig {
  Device device = Device::cpu();  // --device: where the model, its gradients and optimizer live
  DType dtype = DType::F32;       // --dtype: F32, or BF16 (mixed precision, the projections' GEMMs in bf16)
  bool chunked_loss = false;      // the head and the loss fused in chunks: the logits never all live
  nn::Recompute recompute = nn::Recompute::None;
  double moe_capacity_factor = 0;  // --moe-capacity-factor: experts' capacity (0: dropless)
  double moe_balance_loss_coef = 0;  // --moe-balance-loss-coef: each sparse layer's Switch balance loss (0: off)
  double moe_z_loss_coef = 0;        // --moe-z-loss-coef: each sparse layer's router z-loss (0: off)
  int threads = 0;                // 0: OpenMP's default
  bool profile_ops = false;       // time every kernel; the step line and the JSONL row get the table
};

struct ValidationConfig {
  int64_t every = 0;            // --val-every (0: only at the end)
  int64_t batches = 8;          // --val-batches
  bool batches_given = false;   // --val-batches was on the command line (refused without --val-data)
};

struct SamplingConfig {
  int64_t every = 0;   // --sample-every (0: only at the end, -1: never)
  int64_t tokens = 64;  // --sample-tokens
  double temperature = 1.0;
  int64_t top_k = 40;
};

struct CheckpointConfig {
  std::string out_dir = "out";
  std::string resume;               // a checkpoint directory, or an --out-dir with `latest`
  bool overwrite = false;           // start afresh in an out_dir that holds an earlier run's checkpoints (removed)
  bool allow_recipe_change = false; // resume though batch shape, schedule or optimizer differ from the checkpoint's
  int64_t save_every = 0;           // 0: never
  int64_t keep_last = 0;            // after each save, keep only the newest N checkpoints up to it (0: every one)
};

struct MetricsConfig {
  std::string log_json;            // one JSON row a step
  bool log_json_all_ranks = false; // also <log_json>.rank<R> on every rank
  bool quiet = false;              // only warnings and errors
};

struct MemoryConfig {
  sanitizer::SanitizeMode sanitize = sanitizer::SanitizeMode::Off;
  std::string trace;  // --mem-trace: a Perfetto/Chrome trace (.json) or an HTML report (.html)
  // TrainResult::boundaries: the sanitizer's record of every step and microbatch boundary
  // (tests read it). Off, a run keeps nothing per microbatch: the record grows with steps x
  // microbatches, 4096 microbatches a step for 10,000 steps would be 2.3 GB of it.
  bool keep_boundaries = false;
};

struct TrainConfig {
  ModelConfig model;
  DataConfig data;
  BatchConfig batch;
  OptimizerConfig optimizer;
  ParallelismConfig parallel;
  ComputeConfig compute;
  ValidationConfig validation;
  SamplingConfig sampling;
  CheckpointConfig checkpoint;
  MetricsConfig metrics;
  MemoryConfig memory;
  uint64_t seed = 1337;            // the weights' initialization, the shuffle and the samples
  bool return_parameters = false;  // fill TrainResult::parameters (tests)
  dist::LossHook on_microbatch_loss;  // for a program that logs each microbatch's loss (dist/pipeline.h)

  // Every value in its range and the values consistent with each other; throws naming
  // the flag. (What needs the data, the model or the world is checked where they are.)
  void validate_settings() const;
  // The settings, and that there is training data: what a run needs before it starts.
  void validate() const;
};

// The flags of a run's layout, against a world of `world` ranks: what tally train refuses,
// tally plan refuses alike, in the same words. (The pipeline's own checks are
// dist::check_pipeline's, the tensor-parallel splits the model's.)
struct LayoutFlags {
  int64_t world = 1;  // ranks
  int tp = 1, pp = 1;
  bool sequence_parallel = false;  // --sp
  int64_t seq_len = 64;
  int zero = 0;
  bool bf16 = false;  // --dtype bf16
  bool chunked_loss = false;
  Device device = Device::cpu();
  int cp = 1;  // --cp
  int ep = 1;  // --ep
};
void check_layout_flags(const LayoutFlags& flags);
void check_layout(const TrainConfig& config, int64_t world);

// The device named by --device ("cpu", "cuda", "cuda:N"); throws naming the flag when the
// text is not one. Whether it is visible is check_device_visible's.
Device parse_device(const std::string& text);
// Whether `text` names a device as --device takes it.
bool is_device_name(const std::string& text);
// Throws naming --device when no such device is visible to this process.
void check_device_visible(Device device);

// The devices whose ledgers a run's sanitizer reads: the host's (loaders, token staging)
// and the training device's, where a GPU run's activations, gradients and saved tensors
// live.
std::vector<Device> sanitized_devices(Device training);

// The learning rate of step `step` (from 0): linear warm-up to --lr, then constant, or a
// cosine to --lr x --min-lr-frac reached on the last step that trains (steps - 1).
double learning_rate(const OptimizerConfig& optimizer, int64_t steps, int64_t step);

// The model's shape, from --model-file (an llm.c header), --init-from (a HuggingFace
// safetensors header) or else the --model preset; reads headers only (train and plan).
nn::TransformerConfig model_config(const ModelConfig& model);

}  // namespace tally::train
