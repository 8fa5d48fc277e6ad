// The `tally` command: train, sample, tokenize, export, plan, plot, memory.
#include <omp.h>

#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include "core/checked.h"
#include "core/random.h"
#include "data/documents.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "dist/world.h"
#include "io/checkpoint.h"
#include "io/files.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "memory/report.h"
#include "nn/transformer.h"
#include "ops/install.h"
#include "apps/flags.h"
#include "train/dry_run.h"
#include "train/fit.h"
#include "train/plan.h"
#include "train/plot.h"
#include "train/sampler.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

struct SampleArgs {
  std::string model_file, tokenizer, prompt;
  int64_t tokens = 128;
  int64_t count = 1;
  bool stop_at_eot = true;
  double temperature = 1.0;
  int64_t top_k = 40;
  double top_p = 1.0;
  uint64_t seed = 1337;
  int threads = 0;
};

// --model-file takes a model file, a checkpoint directory (its model.bin) or a training
// --out-dir (the checkpoint its `latest` names), so `tally sample --model-file out/run1` works.
std::string resolve_model_file(const std::string& path) {
  namespace fs = std::filesystem;
  if (!fs::is_directory(path)) return path;
  if (fs::exists(fs::path(path) / "model.bin")) return (fs::path(path) / "model.bin").string();
  const std::string dir = io::latest_step_dir(path, "--model-file");
  TALLY_CHECK(!dir.empty(), "--model-file '", path,
              "': a directory with neither model.bin (a checkpoint) nor 'latest' (a training --out-dir)");
  const fs::path model = fs::path(dir) / "model.bin";
  TALLY_CHECK(fs::exists(model), "--model-file '", path, "': 'latest' names '", fs::path(dir).filename().string(),
              "', which has no model.bin");
  return model.string();
}

// The model a --model-file names: an llm.c file, a checkpoint or out-dir (resolved as
// above), or a HuggingFace model directory. Sets `*file` to what was read.
std::unique_ptr<nn::Transformer> load_model(const std::string& path, std::string* file) {
  const bool hf = io::is_hf_model_dir(path);
  *file = hf ? path : resolve_model_file(path);
  // Sampling and export run no backward: no gradient block (half the memory).
  auto model = std::make_unique<nn::Transformer>(hf ? io::read_hf_config(*file) : io::read_llmc_config(*file),
                                                 nn::ModelShard{}, nn::Blocks::Parameters);
  if (hf) io::load_hf(*file, *model);
  else io::load_llmc(*file, *model);
  return model;
}

int run_sample(const SampleArgs& a) {
  TALLY_CHECK(a.count >= 1, "--count must be at least 1, got ", a.count);
  TALLY_CHECK(a.tokens >= 0 && a.tokens <= train::kMaxSampleTokens, "--tokens must be in 0..", train::kMaxSampleTokens,
              ", got ", a.tokens);
  TALLY_CHECK(std::isfinite(a.temperature) && a.temperature >= 0, "--temperature must be a finite number >= 0 (0: greedy), got ",
              a.temperature);
  TALLY_CHECK(a.top_k >= 0, "--top-k must be >= 0 (0: no truncation), got ", a.top_k);
  TALLY_CHECK(a.threads >= 0 && a.threads <= 1024, "--threads must be in 0..1024 (0: all cores), got ", a.threads);
  TALLY_CHECK(a.top_p > 0 && a.top_p <= 1, "--top-p must be in (0, 1] (1: no truncation), got ", a.top_p);
  TALLY_CHECK(a.prompt.empty() || !a.tokenizer.empty(),
              "--prompt needs --tokenizer (tokenizer.json, or encoder.json + vocab.bpe) to turn the text into tokens");
  if (a.threads > 0) omp_set_num_threads(a.threads);
  std::string model_file;
  const std::unique_ptr<nn::Transformer> loaded = load_model(a.model_file, &model_file);
  const nn::Transformer& model = *loaded;
  std::vector<int32_t> prompt;
  std::unique_ptr<data::Tokenizer> tok;
  if (!a.tokenizer.empty()) tok = std::make_unique<data::Tokenizer>(data::Tokenizer::load_path(a.tokenizer));
  if (tok) train::check_tokenizer_for_model(*tok, a.tokenizer, model.config().vocab_size, model_file, true);
  if (tok && !a.prompt.empty()) {
    TALLY_CHECK(tok->can_encode(), "--prompt needs tokenizer.json or encoder.json + vocab.bpe (an llm.c tokenizer .bin only decodes)");
    prompt = tok->encode(a.prompt);
  }
  // A sample starts as a document does (after the separator `tally tokenize` writes) and
  // ends at the end of text or the next document.
  const train::DocumentBounds bounds = train::document_bounds(model.config(), tok.get());
  const int32_t start = bounds.start;
  if (tok && tok->is_llama3()) prompt.insert(prompt.begin(), start);  // LLaMA: <|begin_of_text|> always leads
  if (prompt.empty()) prompt.push_back(start);
  if (static_cast<int64_t>(prompt.size()) > model.config().max_seq_len)
    std::fprintf(stderr, "tally: warning: the prompt is %zu tokens and the model's context %lld: samples continue its last %lld\n",
                 prompt.size(), static_cast<long long>(model.config().max_seq_len),
                 static_cast<long long>(model.config().max_seq_len));
  train::SampleOptions so;
  so.tokens = a.tokens;
  so.temperature = a.temperature;
  so.top_k = a.top_k;
  so.top_p = a.top_p;
  if (a.stop_at_eot) so.stop_tokens = bounds.stops;
  Rng rng(a.seed);
  for (int64_t n = 0; n < a.count; ++n) {
    if (a.count > 1) std::printf("%s--- sample %lld\n", n ? "\n" : "", static_cast<long long>(n + 1));
    auto ids = train::sample(model, prompt, so, rng);
    if (a.stop_at_eot && !ids.empty() &&
        std::find(so.stop_tokens.begin(), so.stop_tokens.end(), ids.back()) != so.stop_tokens.end())
      ids.pop_back();  // the end, not text
    if (tok) std::printf("%s%s\n", a.prompt.c_str(), train::decode_known(*tok, ids).c_str());
    else {
      for (int32_t i : ids) std::printf("%d ", i);
      std::printf("\n");
    }
  }
  return 0;
}

// tally plan takes tally train's command line (apps/flags.h) and predicts that run's memory.
struct PlanArgs {
  train::TrainConfig run;
  int world = 0;  // ranks the job would run on (0: --dp x --tp x --pp)
  bool val = false, json = false;
  std::string fit;  // --fit MEMORY: search the layouts of --world that fit
  int64_t global_batch = 0;
  double fit_tflops = 0, fit_link_gbps = 25;
  int fit_top = 10;
};

// tally plan --fit: the layouts of the world that fit (train/fit.h).
int run_fit(const PlanArgs& a, const train::TrainConfig& c, const nn::TransformerConfig& model, bool validates) {
  TALLY_CHECK(a.world > 0, "--fit searches the layouts of a world: give it --world N (the ranks of the job)");
  TALLY_CHECK(a.global_batch >= 0 && a.fit_tflops >= 0 && a.fit_link_gbps > 0 && a.fit_top >= 1,
              "--global-batch and --fit-tflops must be >= 0, --fit-link-gbps > 0 and --fit-top >= 1");
  train::FitOptions o;
  o.memory_bytes = train::parse_memory_size(a.fit);
  o.world = a.world;
  o.global_batch = a.global_batch;
  o.flops_per_s = a.fit_tflops * 1e12;
  o.link_bytes_per_s = a.fit_link_gbps * 1e9;
  o.top = a.fit_top;
  o.validates = validates;
  const train::FitResult r = train::fit_layouts(c, model, o);
  if (a.json) std::printf("%s\n", train::fit_json(r, o).c_str());
  else
    std::printf("%s", train::fit_text(r, o, c.model.file.empty() ? c.model.preset : c.model.file).c_str());
  return 0;
}

int run_plan(const PlanArgs& a) {
  train::TrainConfig c = a.run;
  // A checkpoint or out-dir plans for its model, as sample and export read it (train
  // refuses one, to tell --resume from a new run's --model-file).
  if (!c.model.file.empty() && !io::is_hf_model_dir(c.model.file)) c.model.file = resolve_model_file(c.model.file);
  const nn::TransformerConfig model = train::model_config(c.model);
  c.validate_settings();
  TALLY_CHECK(c.batch.seq_len <= model.max_seq_len, "--seq-len ", c.batch.seq_len,
              " exceeds the model's maximum sequence length ", model.max_seq_len);
  const bool validates = a.val || !c.data.val.empty();
  if (!a.fit.empty()) return run_fit(a, c, model, validates);
  const train::ParallelismConfig& p = c.parallel;
  TALLY_CHECK(a.world >= 0 && p.dp >= 0, "--world and --dp must be >= 0, got --world ", a.world, " --dp ", p.dp);
  // --world 0: the ranks --dp x --tp x --cp x --pp make (one data-parallel rank without --dp).
  const int64_t model_parallel = checked_mul(checked_mul(p.tp, p.pp, "--tp x --pp"), p.cp, "--tp x --pp x --cp");
  const int64_t world = a.world > 0 ? a.world : checked_mul(std::max(p.dp, 1), model_parallel, "--dp x --tp x --cp x --pp");
  TALLY_CHECK(world <= 1 << 20, "--world ", world, " is more ranks than the plan models (at most 2^20)");
  TALLY_CHECK(p.dp == 0 || p.dp * model_parallel == world, "--dp ", p.dp, " x --tp ", p.tp,
              p.cp > 1 ? " x --cp " + std::to_string(p.cp) : std::string(), " x --pp ", p.pp, " is not --world ", world);
  // The dry run of the run's steps on the meta device, once for each rank whose steps
  // differ (each pipeline stage); plan_memory checks the layout as train does.
  const train::MemoryPlan plan = train::plan_memory(c, model, world, validates);
  std::printf("%s\n", a.json ? train::plan_json(plan).c_str() : train::plan_text(plan, c, model, world).c_str());
  return 0;
}

struct MemoryArgs {
  std::string trace, other, out = "memory.html";
};

int run_memory_report(const MemoryArgs& a) {
  io::check_output_file("-o", a.out, {{"the trace", a.trace}});
  const memory::MemoryTrace trace = memory::read_memory_trace(a.trace);
  memory::write_html_report(a.out, trace.events, trace.plan);
  std::printf("wrote %s (%zu events)\n", a.out.c_str(), trace.events.size());
  return 0;
}

int run_memory_diff(const MemoryArgs& a) {
  std::printf("%s", memory::diff_memory_traces(memory::read_memory_trace(a.trace), memory::read_memory_trace(a.other)).c_str());
  return 0;
}

struct TokenizeArgs {
  std::string tokenizer;
  std::vector<std::string> inputs;
  std::string out_prefix;
  double val_fraction = 0.1;
  std::string separator;     // a line that separates documents inside a file ("%" for fortunes)
  uint64_t shuffle_seed = 0;  // 0: keep the documents in input order
};

// Documents: each input file, or each piece of one between --separator lines. Each is
// written as the separator token then its tokens (llm.c's convention: GPT-2's
// <|endoftext|>, LLaMA-3's <|begin_of_text|>). With --shuffle-seed the documents
// are shuffled first; the last --val-fraction of the tokens go to <prefix>_val.bin, the
// rest to <prefix>_train.bin, on a document boundary where one is near (data/documents.h).
int run_tokenize(const TokenizeArgs& a) {
  // Only an encoding tokenizer will do: say so of a path that is not one (load_path would
  // read any other file as an llm.c tokenizer .bin and report its magic).
  {
    namespace fs = std::filesystem;
    std::error_code ec;
    TALLY_CHECK(fs::is_directory(a.tokenizer, ec) || fs::path(a.tokenizer).extension() == ".json",
                "tokenize: --tokenizer '", a.tokenizer, "' ", fs::exists(a.tokenizer, ec) ? "is not one" : "does not exist",
                ": expected a directory with tokenizer.json (LLaMA-3) or encoder.json + vocab.bpe (GPT-2), or a "
                "tokenizer.json");
  }
  data::Tokenizer tok = data::Tokenizer::load_path(a.tokenizer);
  TALLY_CHECK(tok.can_encode(), "tokenize: --tokenizer must hold tokenizer.json or encoder.json + vocab.bpe (an llm.c "
              "tokenizer .bin only decodes)");
  TALLY_CHECK(a.val_fraction >= 0 && a.val_fraction < 1, "--val-fraction must be in [0, 1)");
  TALLY_CHECK(!a.out_prefix.empty() && a.out_prefix.back() != '/',
              "tokenize: --out must be a path prefix (it writes <prefix>_train.bin and <prefix>_val.bin), got '",
              a.out_prefix, "'");
  // Both outputs checked before anything is read or written: neither may be an input (the
  // stale split's removal would delete it) nor a directory (found only after _train.bin).
  std::vector<std::pair<std::string, std::string>> input_files;
  for (const std::string& path : a.inputs) input_files.emplace_back("an input", path);
  for (const char* suffix : {"_train.bin", "_val.bin"})
    io::check_output_file("--out", a.out_prefix + suffix, input_files);
  std::vector<std::string> documents;
  for (const std::string& path : a.inputs) {
    std::ifstream in(path, std::ios::binary);
    TALLY_CHECK(in.good(), "tokenize: cannot read input '", path, "'");
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string text = ss.str();
    // Text has no NUL byte; a binary file (a token shard, `data/*`) would be tokenized as
    // garbage without a word.
    const size_t nul = text.find('\0');
    TALLY_CHECK(nul == std::string::npos, "tokenize: input '", path, "' holds a NUL byte at offset ", nul,
                ": expected a text file (is it a token shard or another binary file?)");
    size_t separator_lines = 0;
    for (std::string& d : data::split_documents(text, a.separator, &separator_lines)) documents.push_back(std::move(d));
    if (!a.separator.empty() && separator_lines == 0)
      std::fprintf(stderr, "tally: warning: no line of '%s' is the --separator '%s': the file is one document\n",
                   path.c_str(), a.separator.c_str());
  }
  TALLY_CHECK(!documents.empty(), "tokenize: the inputs hold no text");
  if (a.shuffle_seed != 0) data::shuffle_documents(documents, a.shuffle_seed);
  std::vector<std::vector<int32_t>> encoded;
  std::vector<size_t> counts;
  for (const std::string& d : documents) {
    encoded.push_back(tok.encode(d));
    counts.push_back(encoded.back().size() + 1);
  }
  const data::ValidationSplit split = data::validation_split(counts, a.val_fraction);
  // Documents [0, first_val) train, the rest validate; with a cut, document first_val - 1
  // trains its head and validates its last split.cut tokens (each part after a separator).
  const size_t first_val = encoded.size() - split.whole;
  std::vector<int32_t> train, val;
  for (size_t i = 0; i < encoded.size(); ++i) {
    const std::vector<int32_t>& d = encoded[i];
    const size_t head = split.cut > 0 && i + 1 == first_val ? d.size() - split.cut : d.size();
    std::vector<int32_t>& out = i < first_val ? train : val;
    out.push_back(tok.document_separator_id());
    out.insert(out.end(), d.begin(), d.begin() + static_cast<std::ptrdiff_t>(head));
    if (head < d.size()) {
      val.push_back(tok.document_separator_id());
      val.insert(val.end(), d.begin() + static_cast<std::ptrdiff_t>(head), d.end());
    }
  }
  // GPT-2's ids fit uint16 (llm.c's version 1 shards); LLaMA-3's 128,256 need uint32 (version 7).
  const data::TokenWidth width = tok.vocab_size() <= 65536 ? data::TokenWidth::U16 : data::TokenWidth::U32;
  // A split was asked for but none could be made (under half a token): a _val.bin an earlier
  // run left under this prefix would hold documents that _train.bin now holds too, so it is
  // removed before the new split is written. With --val-fraction 0 it may be a held-out set
  // of the user's own: kept, with a warning.
  const std::string val_path = a.out_prefix + "_val.bin";
  const bool stale_val = val.empty() && a.val_fraction > 0 && fs::exists(val_path);
  if (stale_val) fs::remove(val_path);
  if (val.empty() && a.val_fraction == 0 && fs::exists(val_path))
    std::fprintf(stderr, "tally: warning: %s is not from this run (--val-fraction 0 makes no split): if it holds "
                 "any of these documents, validation measures text the model trains on\n", val_path.c_str());
  const size_t whole_train = first_val - (split.cut > 0 ? 1 : 0);
  const std::string cut_text = split.cut > 0 ? std::to_string(split.cut) + " tokens of document " + std::to_string(first_val) : "";
  io::create_directories_for("--out", a.out_prefix, fs::path(a.out_prefix).parent_path().string());
  data::write_token_shard(a.out_prefix + "_train.bin", train, width);
  std::printf("wrote %s_train.bin (%zu tokens: %zu document%s%s)\n", a.out_prefix.c_str(), train.size(), whole_train,
              whole_train == 1 ? "" : "s", split.cut > 0 ? (" and all but the last " + cut_text).c_str() : "");
  if (!val.empty()) {
    data::write_token_shard(val_path, val, width);
    std::string parts = split.cut > 0 ? "the last " + cut_text : "";
    if (split.whole > 0)
      parts += (parts.empty() ? "" : " and ") + std::to_string(split.whole) + " document" + (split.whole == 1 ? "" : "s");
    std::printf("wrote %s (%zu tokens, %.1f%%: %s)%s\n", val_path.c_str(), val.size(),
                100.0 * static_cast<double>(val.size()) / static_cast<double>(train.size() + val.size()), parts.c_str(),
                split.cut > 0 ? "; the document is cut, as no whole documents come within a quarter of --val-fraction" : "");
  } else {
    // Why none: the fraction is under half a token, or no whole documents come near it and
    // the document at the boundary is too short to cut (its separator and one token).
    const bool under_half = a.val_fraction * static_cast<double>(train.size()) < 0.5;
    std::printf("no validation split: %zu document%s of %zu tokens, --val-fraction %g%s%s\n", encoded.size(),
                encoded.size() == 1 ? "" : "s", train.size(), a.val_fraction,
                a.val_fraction == 0 ? ""
                : under_half        ? " (under half a token)"
                                    : " (no whole documents come within a quarter of it, and the document at the boundary "
                                      "is too short to cut)",
                stale_val ? ("; removed the earlier " + val_path + ", whose documents are in the training split now").c_str() : "");
  }
  return 0;
}

struct ExportArgs {
  std::string model_file, out, format = "hf";
  bool bf16 = false;
};

// A trained model out of tally: a HuggingFace directory (transformers loads it) or an llm.c
// model file.
int run_export(const ExportArgs& a) {
  // (Empty, the HuggingFace files went to the current directory.)
  TALLY_CHECK(!a.out.empty(), "export: -o is empty: expected ", a.format == "hf" ? "a directory" : "a file path");
  std::string model_file;
  const std::unique_ptr<nn::Transformer> loaded = load_model(a.model_file, &model_file);
  const nn::Transformer& model = *loaded;
  if (a.format == "hf") {
    io::save_hf(a.out, model, a.bf16);
  } else {
    io::check_output_file("-o", a.out, {});  // (the input may be rewritten: it is read whole first)
    io::save_llmc(a.out, model, a.bf16);
  }
  std::printf("wrote %s (%s, %s, %s)\n", a.out.c_str(), a.format == "hf" ? "HuggingFace" : "llm.c",
              model.config().describe().c_str(), a.bf16 ? "bf16" : "fp32");
  return 0;
}

struct PlotArgs {
  std::vector<std::string> logs;
  std::string out = "loss.svg";
  std::string title = "training loss";
};

// Names a run after its log: the file's stem, or its folder's name for the usual "log.jsonl".
std::string run_name(const std::string& path) {
  fs::path p(path);
  std::string stem = p.stem().string();
  if ((stem == "log" || stem.empty()) && p.has_parent_path() && !p.parent_path().filename().empty())
    return p.parent_path().filename().string();
  return stem;
}

int run_plot(const PlotArgs& a) {
  TALLY_CHECK(!a.out.empty() && !fs::is_directory(a.out), "plot: -o '", a.out, "' must name the SVG file to write");
  std::vector<std::pair<std::string, std::string>> inputs;
  for (const std::string& log : a.logs) inputs.emplace_back("the log", log);
  io::check_output_file("-o", a.out, inputs);
  std::vector<train::RunCurve> runs;
  for (const std::string& log : a.logs) runs.push_back(train::read_run_log(log, run_name(log)));
  train::write_loss_svg(a.out, runs, a.title);
  std::printf("wrote %s (%zu run%s)\n", a.out.c_str(), runs.size(), runs.size() == 1 ? "" : "s");
  return 0;
}

}  // namespace

// Every error the program prints starts with "tally:"; the library's own errors already do,
// and the few that come from the standard library are named for what they mean.
std::string error_message(const std::exception& e) {
  if (dynamic_cast<const std::bad_alloc*>(&e))
    return "tally: out of memory (std::bad_alloc): a size taken from a file or a flag is more than this machine can hold";
  const std::string what = e.what();
  if (what.rfind("tally:", 0) == 0) return what;
  if (dynamic_cast<const std::filesystem::filesystem_error*>(&e)) return "tally: file system: " + what;
  return "tally: " + what;
}

// CLI11 answers a mistyped command ("tally trian", "tally memory reprot") with "A
// subcommand is required": name the word and the commands there are instead.
std::string unknown_command(CLI::App& app, int argc, char** argv) {
  CLI::App* level = &app;
  std::string path = "tally";
  for (int i = 1; i < argc; ++i) {
    const std::string word = argv[i];
    const std::vector<CLI::App*> commands = level->get_subcommands([](CLI::App*) { return true; });
    if (word.empty() || word[0] == '-' || commands.empty()) return "";
    CLI::App* next = nullptr;
    for (CLI::App* c : commands)
      if (c->check_name(word)) next = c;
    if (!next) {
      std::string names;
      for (const CLI::App* c : commands) names += (names.empty() ? "" : ", ") + c->get_name();
      return path + ": unknown command '" + word + "' (commands: " + names + "; `" + path + " --help` says what each does)";
    }
    level = next;
    path += " " + word;
  }
  return "";
}

namespace {

void add_sample(CLI::App& app, SampleArgs& sa) {
  auto* s = app.add_subcommand("sample", "Generate text from a GPT-2 or LLaMA-3 model (KV-cached decoding)");
  apps::add_value(*s, "--model-file", sa.model_file,
                       "An llm.c model (.bin), a checkpoint directory, a training --out-dir (its latest checkpoint), or a "
                       "HuggingFace model directory")
      ->required();
  apps::add_value(*s, "--tokenizer", sa.tokenizer, apps::kTokenizerHelp);
  apps::add_value(*s, "--prompt", sa.prompt, "Text to continue (needs a tokenizer that encodes)");
  apps::add_value(*s, "--tokens", sa.tokens, "Most tokens to generate per sample")->capture_default_str();
  apps::add_value(*s, "--count", sa.count, "Samples to draw, each from the prompt")->capture_default_str();
  // A value given to either switch counts (CLI11 passes --flag=false as -1).
  auto* stop = s->add_flag("--stop-at-eot", [&sa](int64_t on) { sa.stop_at_eot = on > 0; },
                           "End a sample at the end of text or the next document's start (the default)");
  s->add_flag("--no-stop-at-eot", [&sa](int64_t on) { sa.stop_at_eot = on <= 0; },
              "Keep generating past the end of text or the next document's start (by default a sample ends there)")
      ->excludes(stop);
  apps::add_value(*s, "--temperature", sa.temperature, "0 = greedy")->capture_default_str();
  apps::add_value(*s, "--top-k", sa.top_k, "0 = no truncation")->capture_default_str();
  apps::add_value(*s, "--top-p", sa.top_p, "Nucleus: keep the likeliest tokens up to this probability mass (1 = all)")
      ->capture_default_str();
  apps::add_value(*s, "--seed", sa.seed, "Seed of the draws")->capture_default_str();
  apps::add_value(*s, "--threads", sa.threads, "CPU threads (0 = all)")->capture_default_str();
}

void add_tokenize(CLI::App& app, TokenizeArgs& ta) {
  auto* k = app.add_subcommand("tokenize", "Turn text files into llm.c token shards (GPT-2 or LLaMA-3)");
  apps::add_value(*k, "--tokenizer", ta.tokenizer, "A directory with tokenizer.json (LLaMA-3) or encoder.json + vocab.bpe (GPT-2)")
      ->required();
  apps::add_value(*k, "--out", ta.out_prefix, "Output prefix: writes <prefix>_train.bin and <prefix>_val.bin")->required();
  apps::add_value(*k, "--val-fraction", ta.val_fraction, "Share of tokens for validation, taken from the end: whole documents "
                      "where they come within a quarter of it, else the boundary document is cut")
      ->capture_default_str();
  apps::add_value(*k, "--separator", ta.separator, "A line that separates documents inside a file (e.g. % in fortune files)");
  apps::add_value(*k, "--shuffle-seed", ta.shuffle_seed, "Shuffle the documents with this seed before the split (0: keep their order)")
      ->capture_default_str();
  apps::add_value(*k, "inputs", ta.inputs, "Text files")->required()->check(CLI::ExistingFile);
}

void add_export(CLI::App& app, ExportArgs& ea) {
  auto* x = app.add_subcommand("export", "Write a model in another format: a HuggingFace directory or an llm.c file");
  apps::add_value(*x, "--model-file", ea.model_file,
                      "An llm.c model (.bin), a checkpoint directory, a training --out-dir, or a HuggingFace model directory")
      ->required();
  apps::add_value(*x, "--format", ea.format, "hf (config.json + model.safetensors) or llmc (.bin)")
      ->check(CLI::IsMember({"hf", "llmc"}))
      ->capture_default_str();
  apps::add_value(*x, "-o,--out", ea.out, "The directory (hf) or file (llmc) to write")->required();
  x->add_flag("--bf16", ea.bf16, "Write bf16 weights (rounded to nearest even) instead of fp32");
}

// Returns the report and diff commands.
std::pair<CLI::App*, CLI::App*> add_memory(CLI::App& app, MemoryArgs& ma) {
  auto* mem = app.add_subcommand("memory", "Memory tools over traces written by `tally train --mem-trace F.json`");
  mem->require_subcommand(1);
  auto* mr = mem->add_subcommand("report", "Draw a trace as a self-contained HTML page: live bytes by category and owner, "
                                           "step bands, who holds the peak, the plan beside it");
  apps::add_value(*mr, "trace", ma.trace, "A trace (.json) from --mem-trace")->required()->check(CLI::ExistingFile);
  apps::add_value(*mr, "-o,--out", ma.out, "The HTML page to write")->capture_default_str();
  auto* md = mem->add_subcommand("diff", "Which owners held more or less in trace B than in A, and from which step");
  apps::add_value(*md, "a", ma.trace, "Trace A (.json)")->required()->check(CLI::ExistingFile);
  apps::add_value(*md, "b", ma.other, "Trace B (.json)")->required()->check(CLI::ExistingFile);
  return {mr, md};
}

void add_plan(CLI::App& app, PlanArgs& pl) {
  auto* q = app.add_subcommand("plan", "Predict every rank's memory peak and its parts for a training run, without "
                                       "running it: give it `tally train`'s command line");
  apps::add_run_flags(*q, pl.run);
  apps::add_value(*q, "--world", pl.world, "Ranks the job would run on (mpirun -np; 0 = --dp x --tp x --pp)")->capture_default_str();
  q->add_flag("--val", pl.val, "The run validates (as --val-data says): count its loader's buffers");
  q->add_flag("--json", pl.json, "Print the plan as JSON");
  apps::add_value(*q, "--fit", pl.fit,
                  "Search the layouts of --world that fit this memory a rank (e.g. 80GiB), best first by an estimated "
                  "step time; each is planned by the dry run");
  apps::add_value(*q, "--global-batch", pl.global_batch,
                  "With --fit: sequences a step, held fixed over the layouts (0: --batch-size x --grad-accum x --dp)")
      ->capture_default_str();
  apps::add_value(*q, "--fit-tflops", pl.fit_tflops,
                  "With --fit: each rank's TFLOP/s for the estimate (0: the GEMM peak measured in this process)")
      ->capture_default_str();
  apps::add_value(*q, "--fit-link-gbps", pl.fit_link_gbps, "With --fit: each rank's link, GB/s, for the estimate")
      ->capture_default_str();
  apps::add_value(*q, "--fit-top", pl.fit_top, "With --fit: the layouts to list")->capture_default_str();
}

void add_plot(CLI::App& app, PlotArgs& pa) {
  auto* p = app.add_subcommand("plot", "Draw the loss curves of one or more runs (their --log-json files) into one SVG");
  apps::add_value(*p, "logs", pa.logs, "Logs written by `tally train --log-json`")->required()->check(CLI::ExistingFile);
  apps::add_value(*p, "-o,--out", pa.out, "The SVG to write")->capture_default_str();
  apps::add_value(*p, "--title", pa.title, "The plot's title")->capture_default_str();
}

// Under mpirun every rank runs this; a rank that fails ends the whole job (never a hang
// of the others in a collective), naming itself and the error.
int run_train(const CLI::App& command, train::TrainConfig& tc) {
  apps::note_given_flags(command, tc);
  const auto [unused_flag, draws_none] = apps::unused_sample_flag(command, tc);
  std::unique_ptr<dist::World> world;
  try {
    world = dist::World::create({tc.parallel.dp, tc.parallel.tp, tc.parallel.pp, tc.parallel.cp, tc.parallel.ep});
    TALLY_CHECK(unused_flag.empty(), unused_flag, " sets the samples a run prints, and ", draws_none, " draws none");
    train::run_training(tc, *world);
    return 0;
  } catch (const std::exception& e) {
    const std::string message = error_message(e);
    if (world && world->size() > 1) world->abort(message);
    if (!world) dist::World::end_job_if_launched(message);
    std::fprintf(stderr, "%s\n", message.c_str());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  tally::ops::install();
  CLI::App app{"tally: train GPT-2 and LLaMA-3 with flat memory and every byte accounted for"};
  app.require_subcommand(1);
  train::TrainConfig tc;
  auto* train_command = app.add_subcommand("train", "Train a GPT-2 or LLaMA-3 model on llm.c token shards");
  apps::add_run_flags(*train_command, tc);
  train_command->get_option("--train-data")->required();
  SampleArgs sa;
  TokenizeArgs ta;
  ExportArgs ea;
  PlotArgs pa;
  MemoryArgs ma;
  PlanArgs pl;
  add_sample(app, sa);
  add_tokenize(app, ta);
  add_export(app, ea);
  const auto [report, diff] = add_memory(app, ma);
  add_plan(app, pl);
  add_plot(app, pa);
  if (const std::string unknown = unknown_command(app, argc, argv); !unknown.empty()) {
    std::fprintf(stderr, "%s\n", unknown.c_str());
    return 2;
  }
  CLI11_PARSE(app, argc, argv);
  if (train_command->parsed()) return run_train(*train_command, tc);
  try {
    if (app.got_subcommand("sample")) return run_sample(sa);
    if (app.got_subcommand("tokenize")) return run_tokenize(ta);
    if (app.got_subcommand("plot")) return run_plot(pa);
    if (app.got_subcommand("export")) return run_export(ea);
    if (app.got_subcommand("plan")) return run_plan(pl);
    if (report->parsed()) return run_memory_report(ma);
    if (diff->parsed()) return run_memory_diff(ma);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", error_message(e).c_str());
    return 1;
  }
  return 0;
}
