// The trainer: one loop for every mode. Each step runs N microbatches per rank (forward,
// backward with the loss scaled by 1/(N x data-parallel ranks)), averages the gradients
// over the data-parallel group (bucketed all-reduce, or ZeRO's reduce-scatter), clips the
// gradient norm, takes an AdamW step, and logs on rank 0. The sanitizer scopes every step
// and microbatch on every rank, so --sanitize strict turns any growth of live memory or
// surviving graph into an error.
//
// Data order: microbatch j of step k on data-parallel rank r reads what a single process
// with D x N microbatches per step reads as microbatch j*D + r, so a run on D ranks sees
// exactly the batches of the single-process run with the same global batch.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dist/world.h"
#include "nn/transformer.h"
#include "runtime/profiler.h"
#include "sanitizer/sanitizer.h"

namespace tally::train {

struct TrainConfig {
  // model
  std::string model = "d6";
  bool model_given = true;  // --model was on the command line; without it (and a file) a resume builds the checkpoint's model
  std::string model_file;  // llm.c .bin to start from
  std::string init_from;   // HuggingFace model.safetensors to start from
  // data
  std::string train_data;
  std::string val_data;
  std::string tokenizer_dir;  // encoder.json + vocab.bpe, or an llm.c tokenizer .bin, to print samples
  // shape of a step
  int64_t batch_size = 4;
  int64_t seq_len = 64;
  int64_t grad_accum = 1;
  int64_t steps = 20;
  // optimizer
  double lr = 3e-4;
  int64_t warmup_steps = 0;
  std::string lr_schedule = "cosine";
  double min_lr_frac = 0.0;
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;
  // run
  int threads = 0;  // 0: OpenMP's default
  uint64_t seed = 1337;
  bool shuffle = false;  // read the training sequences in a new order every pass (seeded by `seed`)
  int64_t val_every = 0;
  int64_t val_batches = 8;
  bool val_batches_given = false;  // --val-batches was on the command line (refused without --val-data)
  int64_t sample_every = 0;
  int64_t sample_tokens = 64;
  double temperature = 1.0;
  int64_t top_k = 40;
  int64_t save_every = 0;
  int64_t keep_last = 0;  // after each save, keep only the newest N checkpoints up to it (0 = keep every one)
  std::string out_dir = "out";
  std::string resume;
  bool overwrite = false;  // start afresh in an out_dir that holds an earlier run's checkpoints (removed)
  bool allow_recipe_change = false;  // resume even though batch shape, schedule or optimizer differ from the checkpoint's
  std::string log_json;
  std::string sanitize = "off";
  std::string mem_trace;
  bool quiet = false;
  // parallelism over MPI (launch with mpirun): data, tensor and pipeline parallel
  int dp = 0;  // 0: world size / (tp * pp)
  int tp = 1;
  int pp = 1;
  std::string pp_schedule = "1f1b";  // gpipe | 1f1b | interleaved
  int virtual_stages = 1;            // model chunks per pipeline rank (interleaved)
  int64_t pp_last_stage_layers = 0;  // layers of the last pipeline stage (0: split evenly)
  bool sequence_parallel = false;    // --sp: norms and residuals sharded along the sequence (needs --tp > 1)
  std::string recompute = "none";    // none | selective | full
  int zero = 0;              // 0: plain data parallel; 1, 2, 3: ZeRO stage
  double bucket_mb = 25;     // all-reduce bucket size (MiB)
  bool bucket_mb_given = false;  // --bucket-mb was on the command line (a run without the all-reduce says it does nothing)
  bool log_json_all_ranks = false;  // also write <log-json>.rank<R> on every rank
  bool return_parameters = false;   // fill TrainResult::parameters (tests)
  bool profile_ops = false;         // time every kernel; the step line and the JSONL row get the table
  std::string dtype = "fp32";       // fp32 | bf16: mixed precision, the projections' GEMMs in bf16
  std::string device = "cpu";       // cpu | cuda | cuda:N: where the model, its gradients and optimizer live
  bool chunked_loss = false;        // the head and the loss fused in chunks: the logits never all live
};

// The device named by --device ("cpu", "cuda", "cuda:N"); throws naming the flag when the
// text is not one or no such device is visible to this process.
Device parse_device(const std::string& text);

// The devices whose ledgers a run's sanitizer reads: the host's (loaders, token staging)
// and the training device's, where a GPU run's activations, gradients and saved tensors
// live (reading only the host's, a GPU run's S1 checks saw none of them).
std::vector<Device> sanitized_devices(Device training);

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;
  double lr = 0;
  double grad_norm = 0;
  double ms = 0;
  double tokens_per_s = 0;
  double gemm_peak_frac = 0;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t live_after_forward_bytes = 0;  // measured: model states + loader + one microbatch's saved activations
  int64_t predicted_peak_bytes = 0;      // the memory plan's (plan.h), the maximum over ranks like peak_bytes
  std::vector<int64_t> rank_peak_bytes;  // one per rank (live_bytes and peak_bytes are the maxima)
  std::vector<int64_t> rank_predicted_peak_bytes;  // the plan's, one per rank
  int64_t peak_rss_bytes = 0;            // the process's resident-set high-water mark (maximum over ranks)
  double bubble_frac = 0;                // pipeline: the share of the step stages wait for a neighbour (mean over ranks)
  std::vector<double> rank_idle_frac;    // pipeline: that share on each rank
  int64_t max_in_flight = 0;             // pipeline: most microbatches one stage held at once (maximum over ranks)
  int64_t tp_payload_bytes = 0;          // tensor parallel: bytes handed to the tp group's collectives this step (rank 0)
  int64_t pp_sent_bytes = 0;             // pipeline: activation and gradient bytes rank 0 sent this step
  runtime::profiler::Report ops;         // --profile-ops: this rank's time per phase and kernel
};

struct TrainResult {
  int64_t steps_run = 0;
  double final_loss = 0;
  double final_val_loss = -1;
  // Set-up's peak (the largest over ranks: measured, and the plan's; 0 when the plan has
  // none, without tensor/pipeline parallelism).
  int64_t setup_peak_bytes = 0, predicted_setup_bytes = 0;
  int64_t resume_peak_bytes = 0;  // --resume: the peak of set-up up to the checkpoint read (largest over ranks)
  double best_val_loss = -1;  // the lowest validation loss of the whole run (a resumed one's included), -1 if none
  int64_t best_val_step = 0;
  std::vector<StepMetrics> history;
  std::string last_checkpoint;
  std::vector<sanitizer::Boundary> boundaries;  // the sanitizer's step/microbatch records (this rank)
  Tensor parameters;  // the final parameter block (gathered), when config.return_parameters
};

double learning_rate(const TrainConfig& c, int64_t step);

// What a resume would change in the run a checkpoint saved ("--lr was 0.001, now 0.002,
// ..."), or "" when nothing: `saved` is the checkpoint's recipe, `now` this run's.
std::string recipe_changes(const std::vector<std::pair<std::string, std::string>>& saved,
                           const std::vector<std::pair<std::string, std::string>>& now);

// The model's shape, from --model-file (an llm.c header), --init-from (a HuggingFace
// safetensors header) or else the --model preset; reads headers only (train and plan).
nn::TransformerConfig model_config(const std::string& preset, const std::string& model_file, const std::string& init_from);

// Runs the configured training on `world` (every rank calls it). `on_step` (optional)
// sees each step's metrics.
TrainResult run_training(const TrainConfig& config, const dist::World& world,
                         const std::function<void(const StepMetrics&)>& on_step = {});
// The same on a world made from the config's layout (MPI when launched by mpirun).
TrainResult run_training(const TrainConfig& config, const std::function<void(const StepMetrics&)>& on_step = {});

}  // namespace tally::train
