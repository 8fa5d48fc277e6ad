#include "apps/flags.h"

#include <charconv>
#include <string>
#include <utility>
#include <vector>

namespace tally::apps {

const CLI::Validator kNonNegativeInteger(
    [](std::string& value) {
      uint64_t parsed = 0;
      const char* end = value.data() + value.size();
      const auto [stop, error] = std::from_chars(value.data(), end, parsed);
      // (from_chars reads digits only into an unsigned type: no sign, no space, not empty.)
      return error == std::errc() && stop == end ? std::string()
                                                 : "expected a non-negative integer below 2^64, got " + value;
    },
    "");

const CLI::Validator kPositiveInteger(
    [](std::string& value) {
      const bool digits = !value.empty() && value.find_first_not_of("0123456789") == std::string::npos;
      return digits && value.find_first_not_of('0') != std::string::npos ? std::string()
                                                                          : "expected a positive integer, got " + value;
    },
    "");

namespace {

template <class T> using Choices = std::vector<std::pair<std::string, T>>;

// "a, b or c"
template <class T> std::string names_of(const Choices<T>& choices) {
  std::string out;
  for (size_t i = 0; i < choices.size(); ++i)
    out += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i].first;
  return out;
}

// An option that takes one of `choices` by name into `field` (an enum).
template <class T>
CLI::Option* add_choice(CLI::App& app, const std::string& flag, T& field, Choices<T> choices, const std::string& help) {
  std::string shown;
  for (const auto& [name, value] : choices)
    if (value == field) shown = name;
  CLI::Option* option = app.add_option_function<std::string>(
      flag,
      [&field, choices](const std::string& text) {
        for (const auto& [name, value] : choices)
          if (name == text) field = value;
      },
      help + " (" + names_of(choices) + ")");
  option->check(CLI::Validator(
      [choices](std::string& text) {
        for (const auto& entry : choices)
          if (entry.first == text) return std::string();
        return "expected " + names_of(choices) + ", got '" + text + "'";
      },
      ""));
  option->default_str(shown);
  return option;
}

void add_model_flags(CLI::App& t, train::TrainConfig& c) {
  auto* preset = add_value(t, "--model", c.model.preset, kModelHelp)->capture_default_str();
  auto* file = add_value(t, "--model-file", c.model.file,
                            "Start from an llm.c model file (.bin, GPT-2 or LLaMA-3); tally plan also takes a checkpoint "
                            "or a training --out-dir, for its model's shape");
  auto* hf = add_value(t, "--init-from", c.model.init_from,
                          "Start from a HuggingFace model: a directory (config.json + model.safetensors or shards) or a "
                          "GPT-2 model.safetensors");
  // One source for the model: a preset named beside a file is refused, not ignored.
  preset->excludes(file)->excludes(hf);
  file->excludes(hf);
}

void add_data_flags(CLI::App& t, train::TrainConfig& c) {
  add_value(t, "--train-data", c.data.train, "Glob of training token shards (llm.c's format; `tally tokenize` writes them)");
  add_value(t, "--val-data", c.data.val, "Glob of validation token shards");
  add_value(t, "--tokenizer", c.data.tokenizer, kTokenizerHelp);
  t.add_flag("--shuffle", c.data.shuffle,
             "Read the training data as sequences of --seq-len + 1 tokens in a new random order on every pass over it "
             "(seeded by --seed); without it, batches follow the files' order, the same on every pass");
  add_value(t, "--batch-size", c.batch.batch_size, "Sequences per microbatch (B)")->capture_default_str();
  add_value(t, "--seq-len", c.batch.seq_len, "Tokens per sequence (T)")->capture_default_str();
  add_value(t, "--grad-accum", c.batch.grad_accum, "Microbatches per step on each data-parallel rank")->capture_default_str();
  add_value(t, "--steps", c.batch.steps, "Optimizer steps")->capture_default_str();
}

void add_optimizer_flags(CLI::App& t, train::TrainConfig& c) {
  train::OptimizerConfig& o = c.optimizer;
  add_value(t, "--lr", o.lr, "Peak learning rate")->capture_default_str();
  add_value(t, "--warmup-steps", o.warmup_steps, "Linear warmup steps")->capture_default_str();
  add_choice<train::LrSchedule>(t, "--lr-schedule", o.schedule,
                                {{"constant", train::LrSchedule::Constant}, {"cosine", train::LrSchedule::Cosine}},
                                "The learning rate after the warm-up");
  add_value(t, "--min-lr-frac", o.min_lr_frac, "Learning rate of the last step as a fraction of --lr (cosine)")->capture_default_str();
  add_value(t, "--weight-decay", o.weight_decay, "Decoupled weight decay on 2-D weights")->capture_default_str();
  add_value(t, "--beta1", o.beta1, "AdamW's decay of the gradient's running mean")->capture_default_str();
  add_value(t, "--beta2", o.beta2, "AdamW's decay of the squared gradient's running mean")->capture_default_str();
  add_value(t, "--eps", o.eps, "AdamW's epsilon, added to the root of the second moment")->capture_default_str();
  add_value(t, "--grad-clip", o.grad_clip, "Clip the global gradient norm (0 = off)")->capture_default_str();
  add_value(t, "--seed", c.seed, "Seed of the weights' initialization (without --model-file) and of the samples")
      ->capture_default_str();
}

void add_evaluation_flags(CLI::App& t, train::TrainConfig& c) {
  add_value(t, "--val-every", c.validation.every, "Validate every N steps (and at the end)")->capture_default_str();
  add_value(t, "--val-batches", c.validation.batches, "Batches per validation")->capture_default_str();
  train::SamplingConfig& s = c.sampling;
  add_value(t, "--sample-every", s.every, "Print a sample every N steps (and at the end; -1 never)")->capture_default_str();
  add_value(t, "--sample-tokens", s.tokens, "Tokens per sample")->capture_default_str();
  add_value(t, "--temperature", s.temperature, "Temperature of the printed samples (0 = greedy)")->capture_default_str();
  add_value(t, "--top-k", s.top_k, "The printed samples draw from the K likeliest tokens (0 = all)")->capture_default_str();
}

void add_output_flags(CLI::App& t, train::TrainConfig& c) {
  train::CheckpointConfig& k = c.checkpoint;
  add_value(t, "--save-every", k.save_every, "Checkpoint every N steps (and at the end; 0 = never)")->capture_default_str();
  add_value(t, "--keep-last", k.keep_last, "Keep only the newest N checkpoints: each save removes the older ones "
               "(0 = keep every one)")->capture_default_str();
  add_value(t, "--out-dir", k.out_dir, "Where checkpoints and the loss plot go")->capture_default_str();
  add_value(t, "--resume", k.resume, "Resume from a checkpoint directory (or an --out-dir with 'latest'), with its "
               "weights; a --model, --model-file or --init-from beside it only names the model, which must be the "
               "checkpoint's");
  t.add_flag("--overwrite", k.overwrite,
             "Start afresh in an --out-dir that holds an earlier run's checkpoints, removing them (without it such a "
             "run is refused when it saves)");
  t.add_flag("--allow-recipe-change", k.allow_recipe_change,
             "Resume even if batch shape, schedule or optimizer differ from the checkpoint's run");
  add_value(t, "--log-json", c.metrics.log_json, "Write one JSON object per step to this file: a new run starts it "
               "empty, a --resume keeps its rows up to the checkpoint's step and appends");
  t.add_flag("--log-json-all-ranks", c.metrics.log_json_all_ranks, "Also write <log-json>.rank<R> on every rank");
  t.add_flag("--quiet", c.metrics.quiet, "Print nothing but warnings and errors (no start-up, step or summary lines)");
  using sanitizer::SanitizeMode;
  add_choice<SanitizeMode>(t, "--sanitize", c.memory.sanitize,
                           {{"off", SanitizeMode::Off}, {"warn", SanitizeMode::Warn}, {"strict", SanitizeMode::Strict}},
                           "Memory sanitizer: growth of live memory or a surviving graph is reported, or an error");
  add_value(t, "--mem-trace", c.memory.trace, "Write the memory history: a Perfetto/Chrome trace (.json) or an HTML "
               "report with a plot (.html)");
}

void add_parallel_flags(CLI::App& t, train::TrainConfig& c) {
  train::ParallelismConfig& p = c.parallel;
  add_value(t, "--dp", p.dp, "Data-parallel ranks (0 = world size / (tp x cp x pp)); launch with mpirun -np N")->capture_default_str();
  add_value(t, "--tp", p.tp, "Tensor-parallel ranks: heads, MLP width and vocabulary split over them (Megatron)")
      ->check(kPositiveInteger)->capture_default_str();
  t.add_flag("--sp", p.sequence_parallel, "Sequence parallel: norms and residuals sharded along the sequence over the --tp group");
  add_value(t, "--cp", p.cp, "Context-parallel ranks: each sequence's tokens split over them, keys and values "
               "all-gathered for attention (--seq-len a multiple of 2 x cp)")
      ->check(kPositiveInteger)->capture_default_str();
  add_value(t, "--ep", p.ep, "Expert-parallel ranks, within the data-parallel ones: each sparse layer's experts split "
               "over them, tokens exchanged by all-to-all (must divide --dp)")
      ->check(kPositiveInteger)->capture_default_str();
  add_value(t, "--pp", p.pp, "Pipeline-parallel stages: the layers split into P stages")->check(kPositiveInteger)->capture_default_str();
  using dist::PipelineSchedule;
  add_choice<PipelineSchedule>(t, "--pp-schedule", p.pp_schedule,
                               {{"gpipe", PipelineSchedule::GPipe}, {"1f1b", PipelineSchedule::OneFOneB},
                                {"interleaved", PipelineSchedule::Interleaved}},
                               "Pipeline schedule (1f1b needs --grad-accum >= --pp)");
  add_value(t, "--virtual-stages", p.virtual_stages, "Model chunks per pipeline rank (--pp-schedule interleaved)")
      ->check(kPositiveInteger)->capture_default_str();
  add_value(t, "--pp-last-stage-layers", p.pp_last_stage_layers,
               "Layers of the last pipeline stage, beside the head (0: split evenly); the rest are spread evenly")
      ->check(kNonNegativeInteger)->capture_default_str();
  add_value(t, "--zero", p.zero, "ZeRO stage over the data-parallel group: 0 (off), 1 (optimizer state), 2 (+ gradients), "
               "3 (+ parameters)")->check(CLI::Range(0, 3))->capture_default_str();
  add_value(t, "--bucket-mb", p.bucket_mb, "Gradient all-reduce bucket size in MiB (data parallel, ZeRO-1)")->capture_default_str();
}

void add_compute_flags(CLI::App& t, train::TrainConfig& c) {
  train::ComputeConfig& k = c.compute;
  using nn::Recompute;
  add_choice<Recompute>(t, "--recompute", k.recompute,
                        {{"none", Recompute::None}, {"selective", Recompute::Selective}, {"full", Recompute::Full}},
                        "Activation recomputation: selective recomputes the attention core, full each layer");
  add_value(t, "--moe-capacity-factor", k.moe_capacity_factor,
            "Mixture of experts: each expert takes at most factor x tokens x k / experts of a microbatch's "
            "(token, expert) pairs, the rest dropped and counted, every expert padded to it so that memory is "
            "the same every step (0 = dropless; experts / k never drops)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  add_value(t, "--moe-balance-loss-coef", k.moe_balance_loss_coef,
            "Mixture of experts: each sparse layer's load-balancing loss on its own tokens (Switch's, Megatron-Core's "
            "aux_loss: E / (N^2 k) x sum over experts of choices x probability sums; 1 when even), times this, "
            "added to the objective (0 = off; beside the model's own router_aux_loss_coef)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  add_value(t, "--moe-z-loss-coef", k.moe_z_loss_coef,
            "Mixture of experts: each sparse layer's router z-loss (ST-MoE's: the mean over its tokens of "
            "logsumexp(router logits)^2), times this, added to the objective (0 = off)")
      ->check(CLI::NonNegativeNumber)->capture_default_str();
  add_choice<DType>(t, "--dtype", k.dtype, {{"fp32", DType::F32}, {"bf16", DType::BF16}},
                    "GEMM precision: bf16 is mixed precision (bf16 operands for the projections' and attention's "
                    "products; fp32 master weights, gradients, optimizer state, norms, softmax and loss)");
  auto* device = t.add_option_function<std::string>(
      "--device", [&k](const std::string& text) { k.device = train::parse_device(text); },
      "Where to train: cpu, cuda or cuda:N (one process per GPU run)");
  device->check(CLI::Validator(
      [](std::string& text) {
        return train::is_device_name(text) ? std::string() : "expected cpu, cuda or cuda:N, got '" + text + "'";
      },
      ""));
  device->default_str(k.device.str());
  t.add_flag("--chunked-loss", k.chunked_loss,
             "Fuse the LM head with the loss in chunks of rows, so the (batch x seq, vocab) logits are never all "
             "in memory (one more head GEMM per microbatch)");
  add_value(t, "--threads", k.threads, "CPU threads (0 = all)")->capture_default_str();
  t.add_flag("--profile-ops", k.profile_ops,
             "Time every kernel: after each step line, where each phase's time went (and in the --log-json row)");
}

}  // namespace

void add_run_flags(CLI::App& command, train::TrainConfig& c) {
  add_model_flags(command, c);
  add_data_flags(command, c);
  add_optimizer_flags(command, c);
  add_evaluation_flags(command, c);
  add_output_flags(command, c);
  add_parallel_flags(command, c);
  add_compute_flags(command, c);
}

void note_given_flags(const CLI::App& command, train::TrainConfig& c) {
  c.model.preset_given = command.get_option("--model")->count() > 0;
  c.parallel.bucket_mb_given = command.get_option("--bucket-mb")->count() > 0;
  c.validation.batches_given = command.get_option("--val-batches")->count() > 0;
}

// None is drawn with --sample-every -1, nor with --sample-tokens 0.
std::pair<std::string, std::string> unused_sample_flag(const CLI::App& command, const train::TrainConfig& c) {
  std::string draws_none;
  if (c.sampling.every == -1) draws_none = "--sample-every -1";
  else if (c.sampling.tokens == 0) draws_none = "--sample-tokens 0";
  if (draws_none.empty()) return {};
  for (const char* flag : {"--sample-tokens", "--temperature", "--top-k"})
    if (!draws_none.starts_with(flag) && command.get_option(flag)->count() > 0) return {flag, draws_none};
  return {};
}

}  // namespace tally::apps
