// The `tally` command: train, sample, tokenize.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/random.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "dist/world.h"
#include "io/model_files.h"
#include "nn/transformer.h"
#include "train/sampler.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

data::Gpt2Tokenizer load_tokenizer(const std::string& dir) {
  if (fs::is_regular_file(dir)) return data::Gpt2Tokenizer::load_llmc(dir);
  return data::Gpt2Tokenizer::load((fs::path(dir) / "encoder.json").string(), (fs::path(dir) / "vocab.bpe").string());
}

void add_train(CLI::App& app, train::TrainConfig& c) {
  auto* t = app.add_subcommand("train", "Train a GPT-2 model on llm.c token shards");
  t->add_option("--model", c.model, "Preset: gpt2, gpt2-medium, gpt2-large, gpt2-xl, dN (depth N)")->capture_default_str();
  t->add_option("--model-file", c.model_file, "Start from an llm.c GPT-2 model file (.bin)");
  t->add_option("--init-from", c.init_from, "Start from a HuggingFace GPT-2 model.safetensors");
  t->add_option("--train-data", c.train_data, "Glob of training token shards")->required();
  t->add_option("--val-data", c.val_data, "Glob of validation token shards");
  t->add_option("--tokenizer", c.tokenizer_dir, "Directory with encoder.json + vocab.bpe (or an llm.c tokenizer .bin) to print samples as text");
  t->add_option("--batch-size", c.batch_size, "Sequences per microbatch (B)")->capture_default_str();
  t->add_option("--seq-len", c.seq_len, "Tokens per sequence (T)")->capture_default_str();
  t->add_option("--grad-accum", c.grad_accum, "Microbatches per step")->capture_default_str();
  t->add_option("--steps", c.steps, "Optimizer steps")->capture_default_str();
  t->add_option("--lr", c.lr, "Peak learning rate")->capture_default_str();
  t->add_option("--warmup-steps", c.warmup_steps, "Linear warmup steps")->capture_default_str();
  t->add_option("--lr-schedule", c.lr_schedule, "constant or cosine")->check(CLI::IsMember({"constant", "cosine"}))->capture_default_str();
  t->add_option("--min-lr-frac", c.min_lr_frac, "Final learning rate as a fraction of --lr (cosine)")->capture_default_str();
  t->add_option("--weight-decay", c.weight_decay, "Decoupled weight decay on 2-D weights")->capture_default_str();
  t->add_option("--beta1", c.beta1)->capture_default_str();
  t->add_option("--beta2", c.beta2)->capture_default_str();
  t->add_option("--eps", c.eps)->capture_default_str();
  t->add_option("--grad-clip", c.grad_clip, "Clip the global gradient norm (0 = off)")->capture_default_str();
  t->add_option("--threads", c.threads, "CPU threads (0 = all)")->capture_default_str();
  t->add_option("--seed", c.seed)->capture_default_str();
  t->add_option("--val-every", c.val_every, "Validate every N steps (and at the end)")->capture_default_str();
  t->add_option("--val-batches", c.val_batches, "Batches per validation")->capture_default_str();
  t->add_option("--sample-every", c.sample_every, "Print a sample every N steps (and at the end; -1 never)")->capture_default_str();
  t->add_option("--sample-tokens", c.sample_tokens, "Tokens per sample")->capture_default_str();
  t->add_option("--temperature", c.temperature)->capture_default_str();
  t->add_option("--top-k", c.top_k)->capture_default_str();
  t->add_option("--save-every", c.save_every, "Checkpoint every N steps (and at the end; 0 = never)")->capture_default_str();
  t->add_option("--out-dir", c.out_dir, "Where checkpoints go")->capture_default_str();
  t->add_option("--resume", c.resume, "Resume from a checkpoint directory (or an --out-dir with 'latest')");
  t->add_option("--log-json", c.log_json, "Append one JSON object per step to this file");
  t->add_option("--sanitize", c.sanitize, "Memory sanitizer: off, warn or strict")->check(CLI::IsMember({"off", "warn", "strict"}))->capture_default_str();
  t->add_option("--mem-trace", c.mem_trace, "Write the memory history: a Perfetto/Chrome trace (.json) or an HTML report with a plot (.html)");
  t->add_flag("--quiet", c.quiet, "Print nothing per step");
  t->add_option("--dp", c.dp, "Data-parallel ranks (0 = world size / (tp x pp)); launch with mpirun -np N")->capture_default_str();
  t->add_option("--tp", c.tp, "Tensor-parallel ranks (not implemented yet: 1)")->capture_default_str();
  t->add_option("--pp", c.pp, "Pipeline-parallel stages (not implemented yet: 1)")->capture_default_str();
  t->add_option("--zero", c.zero, "ZeRO stage over the data-parallel group: 0 (off), 1 (optimizer state), 2 (+ gradients), 3 (+ parameters)")
      ->check(CLI::Range(0, 3))->capture_default_str();
  t->add_option("--bucket-mb", c.bucket_mb, "Gradient all-reduce bucket size in MiB (data parallel, ZeRO-1)")->capture_default_str();
  t->add_flag("--log-json-all-ranks", c.log_json_all_ranks, "Also write <log-json>.rank<R> on every rank");
}

struct SampleArgs {
  std::string model_file, tokenizer, prompt;
  int64_t tokens = 128;
  double temperature = 1.0;
  int64_t top_k = 40;
  uint64_t seed = 1337;
  int threads = 0;
};

int run_sample(const SampleArgs& a) {
  if (a.threads > 0) omp_set_num_threads(a.threads);
  nn::Transformer model(io::read_llmc_gpt2_config(a.model_file));
  io::load_llmc_gpt2(a.model_file, model);
  std::vector<int32_t> prompt;
  std::unique_ptr<data::Gpt2Tokenizer> tok;
  if (!a.tokenizer.empty()) tok = std::make_unique<data::Gpt2Tokenizer>(load_tokenizer(a.tokenizer));
  if (tok && !a.prompt.empty()) {
    TALLY_CHECK(tok->can_encode(), "--prompt needs encoder.json + vocab.bpe (an llm.c tokenizer .bin only decodes)");
    prompt = tok->encode(a.prompt);
  }
  if (prompt.empty()) prompt.push_back(tok ? tok->eot_id() : static_cast<int32_t>(model.config().vocab_size - 1));
  train::SampleOptions so{a.tokens, a.temperature, a.top_k};
  Rng rng(a.seed);
  auto ids = train::sample(model, prompt, so, rng);
  if (tok) std::printf("%s%s\n", a.prompt.c_str(), tok->decode(ids).c_str());
  else for (int32_t i : ids) std::printf("%d ", i);
  std::printf("\n");
  return 0;
}

struct TokenizeArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string out_prefix;
  double val_fraction = 0.1;
};

// Each input file is one document: EOT, then its tokens (the llm.c convention). The
// last val_fraction of the tokens goes to <prefix>_val.bin, the rest to _train.bin.
int run_tokenize(const TokenizeArgs& a) {
  data::Gpt2Tokenizer tok = load_tokenizer(a.tokenizer);
  TALLY_CHECK(tok.can_encode(), "tokenize: --tokenizer must be a directory with encoder.json and vocab.bpe");
  TALLY_CHECK(a.val_fraction >= 0 && a.val_fraction < 1, "--val-fraction must be in [0, 1)");
  std::vector<int32_t> all;
  for (const std::string& path : a.inputs) {
    std::ifstream in(path, std::ios::binary);
    TALLY_CHECK(in.good(), "tokenize: cannot read input '", path, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    all.push_back(tok.eot_id());
    auto ids = tok.encode(ss.str());
    all.insert(all.end(), ids.begin(), ids.end());
  }
  const auto n_val = static_cast<size_t>(static_cast<double>(all.size()) * a.val_fraction);
  std::vector<int32_t> train(all.begin(), all.end() - static_cast<std::ptrdiff_t>(n_val));
  std::vector<int32_t> val(all.end() - static_cast<std::ptrdiff_t>(n_val), all.end());
  data::write_token_shard(a.out_prefix + "_train.bin", train, data::TokenWidth::U16);
  std::printf("wrote %s_train.bin (%zu tokens)\n", a.out_prefix.c_str(), train.size());
  if (!val.empty()) {
    data::write_token_shard(a.out_prefix + "_val.bin", val, data::TokenWidth::U16);
    std::printf("wrote %s_val.bin (%zu tokens)\n", a.out_prefix.c_str(), val.size());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tally: train GPT-2 with flat memory and every byte accounted for"};
  app.require_subcommand(1);
  train::TrainConfig tc;
  add_train(app, tc);

  SampleArgs sa;
  auto* s = app.add_subcommand("sample", "Generate text from an llm.c GPT-2 model file");
  s->add_option("--model-file", sa.model_file, "llm.c GPT-2 model (.bin), e.g. <out-dir>/step_N/model.bin")->required();
  s->add_option("--tokenizer", sa.tokenizer, "Directory with encoder.json + vocab.bpe, or an llm.c tokenizer .bin");
  s->add_option("--prompt", sa.prompt, "Text to continue (needs encoder.json + vocab.bpe)");
  s->add_option("--tokens", sa.tokens, "Tokens to generate")->capture_default_str();
  s->add_option("--temperature", sa.temperature, "0 = greedy")->capture_default_str();
  s->add_option("--top-k", sa.top_k, "0 = no truncation")->capture_default_str();
  s->add_option("--seed", sa.seed)->capture_default_str();
  s->add_option("--threads", sa.threads)->capture_default_str();

  TokenizeArgs ta;
  auto* k = app.add_subcommand("tokenize", "Turn text files into llm.c GPT-2 token shards");
  k->add_option("--tokenizer", ta.tokenizer, "Directory with encoder.json + vocab.bpe")->required();
  k->add_option("--out", ta.out_prefix, "Output prefix: writes <prefix>_train.bin and <prefix>_val.bin")->required();
  k->add_option("--val-fraction", ta.val_fraction, "Share of tokens for validation")->capture_default_str();
  k->add_option("inputs", ta.inputs, "Text files")->required()->check(CLI::ExistingFile);

  CLI11_PARSE(app, argc, argv);
  if (app.got_subcommand("train")) {
    // Under mpirun every rank runs this; a rank that fails ends the whole job (never a
    // hang of the others in a collective), naming itself and the error.
    std::unique_ptr<dist::World> world;
    try {
      world = dist::World::create({tc.dp, tc.tp, tc.pp});
      train::run_training(tc, *world);
      return 0;
    } catch (const std::exception& e) {
      if (world && world->size() > 1) world->abort(e.what());
      std::fprintf(stderr, "%s\n", e.what());
      return 1;
    }
  }
  try {
    if (app.got_subcommand("sample")) return run_sample(sa);
    if (app.got_subcommand("tokenize")) return run_tokenize(ta);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
