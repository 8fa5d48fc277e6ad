// Hostile inputs and interrupted runs: sizes from files and flags that wrap, files that are
// silently accepted, problems found late, killed saves and full disks. Each test here was
// written against a defect found by mutating valid files and command lines.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/checked.h"
#include "core/json_input.h"
#include "data/loader.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "io/files.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "memory/report.h"
#include "support.h"
#include "nn/init.h"
#include "dist/world.h"
#include "train/checkpointer.h"
#include "train/config.h"
#include "train/plot.h"
#include "train/step_log.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;
using test::message_of;

namespace {

std::string int32s(const std::vector<int32_t>& head, size_t total_ints) {
  std::vector<int32_t> ints(total_ints, 0);
  std::copy(head.begin(), head.end(), ints.begin());
  return std::string(reinterpret_cast<const char*>(ints.data()), ints.size() * 4);
}

train::TrainConfig tiny_config(const std::string& data) {
  train::TrainConfig c = test::tiny_train_config(data);
  c.batch.steps = 2;
  c.optimizer.lr = 1e-3;
  c.checkpoint.out_dir = test::temp_path("out");
  return c;
}

}  // namespace

// ---------------------------------------------------------------- 1. sizes that wrap

TEST(CheckedArithmetic, MultiplyAndAddRefuseOverflowAndNegativeSizes) {
  EXPECT_EQ(checked_mul(int64_t{1} << 31, int64_t{1} << 31, "x"), int64_t{1} << 62);
  EXPECT_NE(message_of<Error>([] { checked_mul(int64_t{1} << 32, int64_t{1} << 32, "rows x cols"); })
                .find("rows x cols: 4294967296 x 4294967296 overflows"),
            std::string::npos);
  EXPECT_NE(message_of<Error>([] { checked_add(std::numeric_limits<int64_t>::max(), 1, "sum"); }).find("overflows"),
            std::string::npos);
  EXPECT_NE(message_of<Error>([] { checked_mul(-1, 4, "bytes"); }).find("negative"), std::string::npos);
  EXPECT_NE(message_of<Error>([] { shape_numel(Shape{int64_t{1} << 40, int64_t{1} << 40}); }).find("2^63"),
            std::string::npos);
}

TEST(Hardening, ModelHeaderWhoseByteCountWrapsToTheFileSizeIsRefused) {
  // V = Vp = 1, T = 2, C = 2^30, L = 660764199: the parameter count x 4 is 0 mod 2^64, so
  // 1024 + 4 x count wraps to exactly this header-only file's 1024 bytes. Unchecked, the
  // size check passed and the model's construction crashed.
  const std::string path = test::temp_path("wrapping_model.bin");
  test::write_all(path, int32s({20240326, 3, 2, 1, 660764199, 1, 1 << 30, 1}, 256));
  const std::string msg = message_of<Error>([&] { io::read_llmc_config(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflows"), std::string::npos) << msg;
}

TEST(Hardening, SafetensorsShapeWhoseElementCountWrapsIsRefused) {
  // 2^32 x 2^32 F32 wraps to 0 elements: an empty data range "matched" it.
  const std::string header = R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})";
  std::string file(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(file.data(), &len, 8);
  const std::string path = test::temp_path("wrapping.safetensors");
  test::write_all(path, file + header);
  const std::string msg = message_of<Error>([&] { io::read_safetensors(path); });
  EXPECT_NE(msg.find("tensor 'w' shape"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflows"), std::string::npos) << msg;
}

// nlohmann parses any depth without recursing, but copying or printing a value recurses once
// a level: a 120 KB encoder.json of '[' overflowed the stack (a segfault, no message) where
// the loader copied or printed the value it refused. Every JSON file tally reads is parsed
// with its depth bounded, and the error names the file.
TEST(Hardening, DeeplyNestedJsonIsRefusedNamingTheFileNotACrash) {
  const int depth = 200000;
  const std::string deep = std::string(depth, '[') + std::string(depth, ']');
  auto expect_refused = [](const std::string& path, const std::function<void()>& read) {
    const std::string msg = message_of<Error>(read);
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find("nested deeper than 64 levels"), std::string::npos) << msg;
  };
  const std::string dir = test::temp_path("deep_json");
  fs::create_directories(dir + "/gpt2");
  fs::create_directories(dir + "/llama3");
  fs::create_directories(dir + "/hf");
  // GPT-2's encoder.json, beside a vocab.bpe that would be fine.
  test::write_all(dir + "/gpt2/encoder.json", "{\"a\": " + deep + "}");
  test::write_all(dir + "/gpt2/vocab.bpe", "#version: 0.2\n");
  expect_refused(dir + "/gpt2/encoder.json", [&] { data::Tokenizer::load_path(dir + "/gpt2"); });
  // LLaMA-3's tokenizer.json, deep where the loader prints what it refuses.
  test::write_all(dir + "/llama3/tokenizer.json",
                  "{\"model\": {\"type\": \"BPE\", \"vocab\": {}, \"merges\": [], \"dropout\": " + deep + "}}");
  expect_refused(dir + "/llama3/tokenizer.json", [&] { data::Tokenizer::load_path(dir + "/llama3"); });
  // A safetensors header.
  const std::string header = "{\"w\": " + deep + "}";
  std::string file(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(file.data(), &len, 8);
  test::write_all(dir + "/deep.safetensors", file + header);
  expect_refused(dir + "/deep.safetensors", [&] { io::read_safetensors(dir + "/deep.safetensors"); });
  // A HuggingFace directory's shard index, then its config (beside an empty safetensors).
  test::write_all(dir + "/hf/model.safetensors.index.json", "{\"weight_map\": " + deep + "}");
  expect_refused(dir + "/hf/model.safetensors.index.json", [&] { io::read_hf_config(dir + "/hf"); });
  fs::remove(dir + "/hf/model.safetensors.index.json");
  std::string empty_safetensors(8, '\0');
  empty_safetensors[0] = 2;
  test::write_all(dir + "/hf/model.safetensors", empty_safetensors + "{}");
  test::write_all(dir + "/hf/config.json", "{\"model_type\": " + deep + "}");
  expect_refused(dir + "/hf/config.json", [&] { io::read_hf_config(dir + "/hf"); });
  // A memory trace and a step log, tally's own files.
  test::write_all(dir + "/trace.json", "{\"tally_memory\": " + deep + "}");
  expect_refused(dir + "/trace.json", [&] { memory::read_memory_trace(dir + "/trace.json"); });
  test::write_all(dir + "/log.jsonl", "{\"step\": 1, \"loss\": " + deep + "}\n");
  expect_refused(dir + "/log.jsonl", [&] { train::read_run_log(dir + "/log.jsonl", "run"); });
}

// nlohmann's get<std::vector<int64_t>> truncates a float: "shape":[2.9] loaded as [2].
// The depth bound was a parse callback, and nlohmann's callback parser scans a container's
// members after each value it closes: reading was quadratic in an array's objects (a 1.9 MB
// safetensors header of {} took 57 s, a 100 MB memory trace over an hour). The reader is
// linear: two million empty objects (6 MB) read in well under the time the quadratic
// reader took for a third as many.
TEST(Hardening, JsonIsReadInTimeLinearInItsValues) {
  const int64_t n = 2000000;
  std::string header = "{\"junk\":[";
  header.reserve(static_cast<size_t>(3 * n + 16));
  for (int64_t i = 0; i < n; ++i) header += i ? ",{}" : "{}";
  header += "]}";
  const auto start = std::chrono::steady_clock::now();
  const nlohmann::json parsed = parse_json(header, "probe");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(parsed["junk"].size(), static_cast<size_t>(n));
  EXPECT_LT(seconds, 30.0) << "reading JSON must be linear in its values";
  // The same file as a safetensors header is refused for what it holds, naming the file.
  std::string file(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(file.data(), &len, 8);
  const std::string path = test::temp_path("junk_header.safetensors");
  test::write_all(path, file + header);
  const std::string msg = message_of<Error>([&] { io::read_safetensors(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

TEST(Hardening, SafetensorsShapesAndOffsetsMustBeIntegersNotFloats) {
  auto write_header = [](const std::string& name, const std::string& header, int64_t data_bytes) {
    std::string file(8, '\0');
    const uint64_t len = header.size();
    std::memcpy(file.data(), &len, 8);
    const std::string path = test::temp_path(name);
    test::write_all(path, file + header + std::string(static_cast<size_t>(data_bytes), '\0'));
    return path;
  };
  for (const char* header : {R"({"w":{"dtype":"F32","shape":[2.9],"data_offsets":[0,8]}})",
                             R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0.5,8.7]}})"}) {
    const std::string path = write_header("float_shape.safetensors", header, 8);
    const std::string msg = message_of<Error>([&] { io::read_safetensors(path); });
    EXPECT_NE(msg.find("tensor 'w' has a non-integer shape or data_offsets"), std::string::npos) << header << ": " << msg;
  }
  // A header longer than safetensors allows (100,000,000 bytes) is refused before it is read.
  std::string file(8, '\0');
  const uint64_t len = 100'000'001;
  std::memcpy(file.data(), &len, 8);
  const std::string path = test::temp_path("huge_header.safetensors");
  {
    std::ofstream out(path, std::ios::binary);
    out << file;
    out.seekp(static_cast<std::streamoff>(8 + len));
    out.put('\0');  // sparse: the size is there, the bytes are not written
  }
  const std::string msg = message_of<Error>([&] { io::read_safetensors(path); });
  EXPECT_NE(msg.find("header length 100000001 is over safetensors' limit of 100000000 bytes"), std::string::npos) << msg;
}

TEST(Hardening, FlagsWhoseProductWrapsAreRefusedBeforeAnythingRuns) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 1000, 97, 1));
  c.batch.batch_size = int64_t{1} << 32;
  c.batch.seq_len = int64_t{1} << 32;
  const std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--batch-size x --seq-len x --grad-accum"), std::string::npos) << msg;
}

// Meta's SwiGLU rounding, (hidden + multiple_of - 1) / multiple_of, wrapped for a
// multiple_of near 2^63 (a LLaMA config's value).
TEST(Hardening, ASwigluWidthThatOverflowsIsRefusedNotWrapped) {
  const std::string msg = message_of<Error>([] { nn::llama_ffn_hidden(64, std::numeric_limits<int64_t>::max(), 0); });
  EXPECT_NE(msg.find("multiple_of"), std::string::npos) << msg;
  EXPECT_NE(msg.find("overflows a 64-bit size"), std::string::npos) << msg;
  EXPECT_NE(message_of<Error>([] { nn::llama_ffn_hidden(64, 256, 1e300); }).find("ffn_dim_multiplier"), std::string::npos);
  EXPECT_EQ(nn::llama_ffn_hidden(4096, 1024, 1.3), 14336);  // LLaMA-3.1 8B
}

TEST(Hardening, ThreadsOutsideTheSaneRangeAreRefused) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 1000, 97, 1));
  c.compute.threads = 100000;
  EXPECT_NE(message_of<Error>([&] { train::run_training(c); }).find("--threads must be in 0..1024"), std::string::npos);
  c.compute.threads = -3;
  EXPECT_NE(message_of<Error>([&] { train::run_training(c); }).find("got -3"), std::string::npos);
}

TEST(Hardening, LlmcTokenizerWithAHugeVocabularyIsRefusedBeforeAllocating) {
  // 2^31 - 1 tokens announced in a file of 1034 bytes: unchecked, this allocated tens of GiB.
  const std::string path = test::temp_path("huge_vocab_tokenizer.bin");
  test::write_all(path, int32s({20240328, 1, std::numeric_limits<int32_t>::max()}, 256) + std::string(10, '\1'));
  const std::string msg = message_of<Error>([&] { data::Tokenizer::load_llmc(path); });
  EXPECT_NE(msg.find("hold at most 5"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- 2. silent acceptance

TEST(Hardening, DataAndTokenizersOfAnotherModelFamilyAreWarnedAbout) {
  // A LLaMA-3-sized vocabulary trained on a 16-bit (GPT-2) shard, and printed its samples
  // through GPT-2's tokenizer, without a word: the ids are in range, the text is not theirs.
  train::TrainConfig c = tiny_config(test::write_random_shard("t16.bin", 5000, 97, 1));  // 16-bit
  c.model.file.clear();
  c.model.preset = "llama3-d1";  // vocabulary 128,256
  c.batch.steps = 1;
  c.data.tokenizer = test::temp_path("small_tok");
  fs::create_directories(c.data.tokenizer);
  test::write_tiny_gpt2_tokenizer(c.data.tokenizer, {});  // 257 tokens
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("shard '" + c.data.train + "' holds 16-bit tokens"), std::string::npos) << err;
  EXPECT_NE(err.find("--tokenizer '" + c.data.tokenizer + "' has 257 tokens and the model 128256"), std::string::npos) << err;
  // The matching pair says nothing.
  train::TrainConfig same = tiny_config(c.data.train);
  same.batch.steps = 1;
  ::testing::internal::CaptureStderr();
  train::run_training(same);
  EXPECT_EQ(::testing::internal::GetCapturedStderr().find("warning"), std::string::npos);
}

TEST(Hardening, AModelGivenToTheWrongFlagNamesTheRightOne) {
  // A HuggingFace directory or a checkpoint given as --model-file was "expected a regular
  // file, found a directory"; an llm.c file given as --init-from read its magic as a
  // safetensors header length ("header length 12905142691 exceeds the file size").
  const std::string hf = test::fixture_path("llama3_tiny_hf");
  std::string msg = message_of<Error>([&] { train::model_config({"d6", true, hf, ""}); });
  EXPECT_NE(msg.find("is a HuggingFace model directory: --init-from " + hf), std::string::npos) << msg;
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  fs::remove_all(c.checkpoint.out_dir);
  c.batch.steps = 1;
  c.checkpoint.save_every = 1;
  train::run_training(c);
  msg = message_of<Error>([&] { train::model_config({"d6", true, c.checkpoint.out_dir, ""}); });
  EXPECT_NE(msg.find("is a checkpoint or training --out-dir: --resume " + c.checkpoint.out_dir), std::string::npos) << msg;
  msg = message_of<Error>([&] { train::model_config({"d6", true, "", test::fixture_path("llama3_tiny.bin")}); });
  EXPECT_NE(msg.find("is an llm.c model file (magic 20240803), not safetensors"), std::string::npos) << msg;
  // A bare GPT-2 save (model.safetensors, no config.json) is a HuggingFace directory too:
  // `sample --model-file` said it had "neither model.bin nor latest".
  const std::string bare = test::temp_path("bare_gpt2");
  {
    nn::Transformer m(io::read_llmc_config(test::fixture_path("gpt2_tiny.bin")));
    io::save_hf(bare, m);
  }
  fs::remove(bare + "/config.json");
  EXPECT_TRUE(io::is_hf_model_dir(bare));
  // (The tiny model's 32-wide layer is not GPT-2's 64-wide heads, so without config.json
  // its head count is unknown: read as a HuggingFace file, it says so.)
  msg = message_of<Error>([&] { io::read_hf_config(bare); });
  EXPECT_NE(msg.find("no n_head metadata"), std::string::npos) << msg;
}

TEST(Hardening, ADirectoryGivenAsAModelOrStateFileIsNamedAsSuch) {
  const std::string dir = test::temp_path("a_directory");
  fs::create_directories(dir);
  const std::string msg = message_of<Error>([&] { io::read_llmc_config(dir); });
  EXPECT_NE(msg.find("expected a regular file, found a directory"), std::string::npos) << msg;
  EXPECT_NE(message_of<Error>([&] { io::read_safetensors(dir); }).find("found a directory"), std::string::npos);
}

TEST(Hardening, IntegerTensorsAreNotTakenAsFloatWeights) {
  // A HuggingFace GPT-2 file whose ln_f.weight is declared I32.
  nn::Transformer model(io::read_llmc_config(test::fixture_path("gpt2_tiny.bin")));
  std::vector<std::pair<std::string, Tensor>> tensors;
  const auto& params = model.params();
  for (size_t i = 0; i < params.size(); ++i) {
    const std::string& name = params.spec(i).name;
    Tensor t = params[i].detach().contiguous();
    const bool conv1d = name.rfind("h.", 0) == 0 && name.find(".weight") != std::string::npos && name.find("ln_") == std::string::npos;
    if (conv1d) t = t.transpose(0, 1).contiguous();
    if (name == "wte") t = t.slice(0, 0, model.config().vocab_size).contiguous();
    if (name == "ln_f.weight") t = Tensor::zeros(t.shape(), DType::I32);
    tensors.emplace_back(name == "wte" || name == "wpe" ? name + ".weight" : name, t);
  }
  const std::string path = test::temp_path("int_weight.safetensors");
  io::write_safetensors(path, tensors, {{"n_head", std::to_string(model.config().n_head)}});
  nn::Transformer target(io::read_hf_config(path));
  const std::string msg = message_of<Error>([&] { io::load_hf(path, target); });
  EXPECT_NE(msg.find("ln_f.weight is int32, expected a float weight"), std::string::npos) << msg;
  // The head count from the file's metadata: "4abc" was read as 4 (std::stoll stops early).
  io::write_safetensors(path, tensors, {{"n_head", std::to_string(model.config().n_head) + "abc"}});
  const std::string head_msg = message_of<Error>([&] { io::read_hf_config(path); });
  EXPECT_NE(head_msg.find("metadata n_head '4abc' is not a positive integer"), std::string::npos) << head_msg;
}

TEST(Hardening, HuggingFaceConfigsThatContradictTheWeightsOrTheModelAreRefusedNamingTheFile) {
  // GPT-2's config.json was read for n_head only: an n_layer, n_embd, vocab_size or
  // n_positions that the weights contradict, a layer_norm_epsilon of -1 or another
  // activation loaded without a word. LLaMA's rms_norm_eps -1 loaded and sampled NaN, its
  // hidden_act was ignored, and the model's own checks did not name the file.
  const std::string gpt2 = test::temp_path("hf_gpt2");
  {
    nn::Transformer m(io::read_llmc_config(test::fixture_path("gpt2_tiny.bin")));
    io::load_llmc(test::fixture_path("gpt2_tiny.bin"), m);
    io::save_hf(gpt2, m);
  }
  const nlohmann::json gpt2_config = nlohmann::json::parse(test::read_all(gpt2 + "/config.json"));
  EXPECT_NO_THROW(io::read_hf_config(gpt2));
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* expected;
  };
  for (const Case& k : {Case{"n_layer", 3, "\"n_layer\" is 3 but the weights have 2"},
                        Case{"n_embd", 64, "\"n_embd\" is 64 but the weights have 32"},
                        Case{"vocab_size", 50257, "\"vocab_size\" is 50257 but the weights have 97"},
                        Case{"n_positions", 1024, "\"n_positions\" is 1024 but the weights have 32"},
                        Case{"layer_norm_epsilon", -1, "\"layer_norm_epsilon\" is -1, expected a positive number"},
                        Case{"activation_function", "relu", "activation_function 'relu'"},
                        // Attention scalings HF's GPT-2 has and tally's not: trained the
                        // unscaled model without a word.
                        Case{"scale_attn_by_inverse_layer_idx", true, "scale_attn_by_inverse_layer_idx is true"},
                        Case{"scale_attn_weights", false, "scale_attn_weights is false"}}) {
    nlohmann::json j = gpt2_config;
    j[k.key] = k.value;
    test::write_all(gpt2 + "/config.json", j.dump());
    const std::string msg = message_of<Error>([&] { io::read_hf_config(gpt2); });
    EXPECT_NE(msg.find("HuggingFace config '" + gpt2 + "/config.json'"), std::string::npos) << k.key << ": " << msg;
    EXPECT_NE(msg.find(k.expected), std::string::npos) << k.key << ": " << msg;
  }
  const std::string llama = test::temp_path("hf_llama");
  fs::copy(test::fixture_path("llama3_tiny_hf"), llama);
  const nlohmann::json llama_config = nlohmann::json::parse(test::read_all(llama + "/config.json"));
  for (const Case& k : {Case{"rope_scaling", {{"rope_type", nullptr}, {"type", "llama3"}, {"factor", 8.0}},
                             "rope_scaling's rope_type is null, expected a string"},
                        Case{"rms_norm_eps", -1, "\"rms_norm_eps\" is -1, expected a positive number"},
                        Case{"hidden_act", "relu", "hidden_act 'relu'"},
                        Case{"rope_theta", 0, "rope_theta must be positive"},
                        // The shape was taken from the config alone: a model of the config's
                        // size was built before the weights were read (20,000 layers took
                        // 28 s to find its tensors missing).
                        Case{"num_hidden_layers", 3, "\"num_hidden_layers\" is 3 but the weights have 2 layers"},
                        Case{"num_hidden_layers", 20000, "\"num_hidden_layers\" is 20000 but the weights have 2 layers"},
                        Case{"vocab_size", 50, "\"vocab_size\" 50 and \"hidden_size\" 32 but model.embed_tokens.weight is [97,32]"}}) {
    nlohmann::json j = llama_config;
    j[k.key] = k.value;
    test::write_all(llama + "/config.json", j.dump());
    const std::string msg = message_of<Error>([&] { io::read_hf_config(llama); });
    EXPECT_NE(msg.find("HuggingFace config '" + llama + "/config.json'"), std::string::npos) << k.key << ": " << msg;
    EXPECT_NE(msg.find(k.expected), std::string::npos) << k.key << ": " << msg;
  }
}

// A LLaMA config.json with vocab_size 1e11 beside weights without model.embed_tokens.weight
// built a model of that size before looking: "out of memory" instead of the missing tensor.
TEST(Hardening, ALlamaConfigBesideWeightsWithoutTheEmbeddingNamesTheMissingTensor) {
  const std::string dir = test::temp_path("hf_no_embedding");
  fs::remove_all(dir);
  fs::copy(test::fixture_path("llama3_tiny_hf"), dir);
  const std::string first = dir + "/model-00001-of-00002.safetensors";
  const io::SafetensorsFile a = io::read_safetensors(first);
  std::vector<std::pair<std::string, Tensor>> kept;
  for (const std::string& name : a.order)
    if (name != "model.embed_tokens.weight") kept.emplace_back(name, a.at(name));
  io::write_safetensors(first, kept, {});
  nlohmann::json index = nlohmann::json::parse(test::read_all(dir + "/model.safetensors.index.json"));
  index["weight_map"].erase("model.embed_tokens.weight");
  test::write_all(dir + "/model.safetensors.index.json", index.dump());
  nlohmann::json config = nlohmann::json::parse(test::read_all(dir + "/config.json"));
  config["vocab_size"] = 100000000000;
  test::write_all(dir + "/config.json", config.dump());
  const std::string msg = message_of<Error>([&] { io::read_hf_config(dir); });
  EXPECT_NE(msg.find("have no model.embed_tokens.weight"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("out of memory"), std::string::npos) << msg;
}

// A tensor in two shards was taken from one without a word: GPT-2's loader kept the first
// file's, LLaMA's the last's. And a LLaMA directory without its config.json was read as a
// GPT-2 model, refused for a missing 'wte.weight'.
TEST(Hardening, AHuggingFaceTensorInTwoShardsOrALlamaWithoutItsConfigIsRefused) {
  const std::string dir = test::temp_path("hf_twice");
  fs::copy(test::fixture_path("llama3_tiny_hf"), dir);
  const std::string first = dir + "/model-00001-of-00002.safetensors", second = dir + "/model-00002-of-00002.safetensors";
  {
    const io::SafetensorsFile a = io::read_safetensors(first), b = io::read_safetensors(second);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : b.order) tensors.emplace_back(name, b.at(name));
    tensors.emplace_back("model.embed_tokens.weight", a.at("model.embed_tokens.weight"));
    io::write_safetensors(second, tensors);
  }
  const std::string msg = message_of<Error>([&] { io::read_hf_config(dir); });
  EXPECT_NE(msg.find("tensor 'model.embed_tokens.weight' is in both '" + first + "' and '" + second + "'"),
            std::string::npos) << msg;

  const std::string bare = test::temp_path("hf_no_config");
  fs::copy(test::fixture_path("llama3_tiny_hf"), bare);
  fs::remove(bare + "/config.json");
  const std::string why = message_of<Error>([&] { io::read_hf_config(bare); });
  EXPECT_NE(why.find("holds LLaMA's tensors (model.embed_tokens.weight) but no config.json"), std::string::npos) << why;
}

// The index's weight_map was read only for its file names: a tensor it put in another
// shard, or a model.safetensors beside it (which loaders disagree about), loaded without a
// word; a config.json that is a broken link was taken as no config at all.
TEST(Hardening, AHuggingFaceIndexThatDisagreesWithItsShardsOrABrokenConfigLinkIsRefused) {
  const std::string dir = test::temp_path("hf_index_moved");
  fs::remove_all(dir);
  fs::copy(test::fixture_path("llama3_tiny_hf"), dir);
  const std::string index_path = dir + "/model.safetensors.index.json";
  nlohmann::json index = nlohmann::json::parse(test::read_all(index_path));
  const std::string first = "model-00001-of-00002.safetensors", second = "model-00002-of-00002.safetensors";
  ASSERT_EQ(index["weight_map"]["model.embed_tokens.weight"], first);
  index["weight_map"]["model.embed_tokens.weight"] = second;
  test::write_all(index_path, index.dump());
  std::string msg = message_of<Error>([&] { io::read_hf_config(dir); });
  EXPECT_NE(msg.find("maps tensor 'model.embed_tokens.weight' to '" + dir + "/" + second + "', but it is in '" + dir +
                     "/" + first + "'"),
            std::string::npos) << msg;
  index["weight_map"].erase("model.embed_tokens.weight");
  test::write_all(index_path, index.dump());
  msg = message_of<Error>([&] { io::read_hf_config(dir); });
  EXPECT_NE(msg.find("does not list tensor 'model.embed_tokens.weight'"), std::string::npos) << msg;

  const std::string both = test::temp_path("hf_index_and_single");
  fs::remove_all(both);
  fs::copy(test::fixture_path("llama3_tiny_hf"), both);
  fs::copy_file(both + "/" + first, both + "/model.safetensors");
  msg = message_of<Error>([&] { io::read_hf_config(both); });
  EXPECT_NE(msg.find("has both model.safetensors and model.safetensors.index.json"), std::string::npos) << msg;

  const std::string linked = test::temp_path("hf_config_link");
  fs::remove_all(linked);
  fs::copy(test::fixture_path("llama3_tiny_hf"), linked);
  fs::remove(linked + "/config.json");
  fs::create_symlink(linked + "/gone.json", linked + "/config.json");
  msg = message_of<Error>([&] { io::read_hf_config(linked); });
  EXPECT_NE(msg.find("HuggingFace config '" + linked + "/config.json' is a link to '" + linked + "/gone.json', which "
                     "does not exist"),
            std::string::npos) << msg;
}

TEST(Hardening, ATruncatedVocabBpeIsRefusedNamingATokenNoMergeMakes) {
  const std::string dir = test::temp_path("tok");
  fs::create_directories(dir);
  // Encoder: the 256 byte tokens, "ab" and "abc", and <|endoftext|>; then the merges file
  // loses its last line ("ab c").
  test::write_tiny_gpt2_tokenizer(dir, {{"a", "b"}, {"ab", "c"}});
  EXPECT_NO_THROW(data::Tokenizer::load(dir + "/encoder.json", dir + "/vocab.bpe"));
  test::write_all(dir + "/vocab.bpe", "#version: 0.2\na b\n");
  const std::string msg = message_of<Error>([&] { data::Tokenizer::load(dir + "/encoder.json", dir + "/vocab.bpe"); });
  EXPECT_NE(msg.find("1 merges make 1 of encoder.json's 2 merged tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("\"abc\""), std::string::npos) << msg;
}

TEST(Hardening, BadNumbersInFlagsAreRefused) {
  const std::string data = test::write_random_shard("t.bin", 1000, 97, 1);
  struct Case {
    std::function<void(train::TrainConfig&)> set;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {[](auto& c) { c.optimizer.eps = std::numeric_limits<double>::infinity(); }, "--eps must be positive and finite"},
      {[](auto& c) { c.sampling.temperature = std::nan(""); }, "--temperature must be a finite number"},
      {[](auto& c) { c.optimizer.lr = std::nan(""); }, "--lr must be a finite number"},
      {[](auto& c) { c.checkpoint.save_every = -1; }, "--save-every must be >= 0"},
      {[](auto& c) { c.validation.every = -5; }, "--val-every must be >= 0"},
      {[](auto& c) { c.sampling.top_k = -1; }, "--top-k must be >= 0"},
      {[](auto& c) { c.sampling.every = -2; }, "--sample-every must be >= -1"},
      // 1e13 MiB in bytes is past int64: the bucket size's conversion was undefined.
      {[](auto& c) { c.parallel.bucket_mb = 1e13; }, "--bucket-mb must be from one byte (2^-20) to 1048576 MiB, got 1e+13"},
      // Positive, but less than a byte: "must be positive" came from the bucketing, a layer down.
      {[](auto& c) { c.parallel.bucket_mb = 1e-9; }, "--bucket-mb must be from one byte (2^-20) to 1048576 MiB, got 1e-09"},
      // AdamW keeps its moments in fp32: a beta within 3e-8 of 1 was accepted and rounded to 1
      // there, so its moment never moved (beta2: every update m/eps, the loss 4.6 -> 2e6).
      {[](auto& c) { c.optimizer.beta2 = 0.99999999; }, "--beta2 0.99999999 is 1 in fp32"},
      {[](auto& c) { c.optimizer.beta1 = 0.99999999; }, "--beta1 0.99999999 is 1 in fp32"},
      // ... and an eps below fp32's normal range was 0 there: 0/0 on a gradient that is zero.
      {[](auto& c) { c.optimizer.eps = 1e-50; }, "--eps 1e-50 is below fp32's smallest normal number"},
      {[](auto& c) { c.model.file.clear(), c.model.preset = "d99999999999999999999"; }, "--model d99999999999999999999: depth"},
      // The run's token count (steps x tokens a step) wrapped: 2^58 steps of 32 tokens.
      {[](auto& c) { c.batch.steps = int64_t{1} << 58; }, "the run's tokens, --steps x --batch-size"},
      // One forward a token, the text held whole: a trillion tokens never ended.
      {[](auto& c) { c.sampling.tokens = 1'000'000'000'000; }, "--sample-tokens must be in 0..1000000"},
  };
  for (const Case& k : cases) {
    train::TrainConfig c = tiny_config(data);
    k.set(c);
    const std::string msg = message_of<Error>([&] { train::run_training(c); });
    EXPECT_NE(msg.find(k.expected), std::string::npos) << "expected '" << k.expected << "', got '" << msg << "'";
  }
}

// --val-every without --val-data validated nothing, and --log-json-all-ranks without
// --log-json wrote nothing, both without a word.
TEST(Hardening, FlagsThatWouldDoNothingAreRefusedNamingWhatTheyNeed) {
  const std::string data = test::write_random_shard("t.bin", 1000, 97, 1);
  train::TrainConfig c = tiny_config(data);
  c.validation.every = 1;
  std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--val-every 1 validates on --val-data, which this run does not have"), std::string::npos) << msg;
  c = tiny_config(data);
  c.metrics.log_json_all_ranks = true;
  msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--log-json-all-ranks writes"), std::string::npos) << msg;
  c = tiny_config(data);
  c.optimizer.schedule = train::LrSchedule::Constant;
  c.optimizer.min_lr_frac = 0.5;
  msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--min-lr-frac 0.5 is where --lr-schedule cosine ends"), std::string::npos) << msg;
  c = tiny_config(data);
  c.validation.batches_given = true;
  msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--val-batches 8 sets the batches of a validation on --val-data, which this run does not have"),
            std::string::npos) << msg;
  c = tiny_config(data);
  c.checkpoint.allow_recipe_change = true;
  msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--allow-recipe-change lets --resume continue a run with another recipe; this run resumes none"),
            std::string::npos) << msg;
  // The run's own files in its --out-dir: the plot replaced a log of that name.
  for (const char* own : {"loss.svg", "latest"}) {
    c = tiny_config(data);
    c.metrics.log_json = c.checkpoint.out_dir + "/" + own;
    msg = message_of<Error>([&] { train::run_training(c); });
    EXPECT_NE(msg.find("--log-json '" + c.metrics.log_json + "' is the run's own " + own + " in --out-dir"), std::string::npos)
        << msg;
  }
  // A pipeline schedule without a pipeline ran as one process, without a word.
  for (dist::PipelineSchedule schedule : {dist::PipelineSchedule::GPipe, dist::PipelineSchedule::Interleaved}) {
    c = tiny_config(data);
    c.parallel.pp_schedule = schedule;
    msg = message_of<Error>([&] { train::run_training(c); });
    EXPECT_NE(msg.find(std::string("--pp-schedule ") + dist::pipeline_schedule_name(schedule) + " needs --pp > 1"),
              std::string::npos) << msg;
  }
}

TEST(Hardening, ResumingBeyondStepsOrWithAnotherRecipeIsRefusedSayingWhatDiffers) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.batch.steps = 4;
  c.checkpoint.save_every = 4;
  fs::remove_all(c.checkpoint.out_dir);
  train::run_training(c);
  train::TrainConfig r = c;
  r.checkpoint.resume = c.checkpoint.out_dir;
  r.batch.steps = 3;
  std::string msg = message_of<Error>([&] { train::run_training(r); });
  EXPECT_NE(msg.find("the checkpoint is at step 4, beyond --steps 3"), std::string::npos) << msg;
  // Its advice is what the recipe check then takes (raising --steps alone was refused).
  EXPECT_NE(msg.find("raise --steps with --allow-recipe-change"), std::string::npos) << msg;

  r.batch.steps = 8;  // longer: the cosine schedule changes, so bit-exactness is gone
  r.optimizer.lr = 3e-4;  // %.17g is 0.00029999999999999997: said as typed
  r.batch.batch_size = 4;
  msg = message_of<Error>([&] { train::run_training(r); });
  EXPECT_NE(msg.find("--batch-size was 2, now 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--steps was 4, now 8"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--lr was 0.001, now 3e-04."), std::string::npos) << msg;
  EXPECT_EQ(msg.find("0.000299999"), std::string::npos) << msg;
  EXPECT_NE(msg.find("--allow-recipe-change"), std::string::npos) << msg;
  r.checkpoint.allow_recipe_change = true;
  r.checkpoint.save_every = 0;
  EXPECT_EQ(train::run_training(r).steps_run, 4);
}

namespace {
// A run of `steps` steps that saved at step 2, the step directory, and the configuration
// that resumes from it (to `steps`, saving nothing).
struct SavedAtStep2 {
  std::string dir;
  train::TrainConfig resume;
};
SavedAtStep2 save_at_step_2(int64_t steps) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.batch.steps = steps;
  c.checkpoint.save_every = 2;
  fs::remove_all(c.checkpoint.out_dir);
  train::run_training(c);
  SavedAtStep2 saved{c.checkpoint.out_dir + "/step_00000002", c};
  saved.resume.checkpoint.resume = saved.dir;
  saved.resume.checkpoint.save_every = 0;
  return saved;
}
}  // namespace

// --shuffle joined the recipe after checkpoints had been saved without it: those runs read
// in file order, so their missing key compares as "off" (it compared equal to anything,
// and a resume with --shuffle changed the data order unseen). A recipe-less checkpoint
// (older still) compares equal, as before.
TEST(Hardening, ARecipeSavedBeforeAKeyExistedComparesAsItsOldBehaviour) {
  const std::vector<std::pair<std::string, std::string>> old_recipe = {{"--batch-size", "4"}, {"--seed", "1337"}};
  EXPECT_EQ(train::recipe_changes(old_recipe, {{"--batch-size", "4"}, {"--shuffle", "on"}}), "--shuffle was off, now on");
  EXPECT_EQ(train::recipe_changes(old_recipe, {{"--batch-size", "4"}, {"--shuffle", "off"}}), "");
  EXPECT_EQ(train::recipe_changes({}, {{"--batch-size", "8"}, {"--shuffle", "on"}}), "");
  EXPECT_EQ(train::recipe_changes({{"--shuffle", "on"}, {"--seed", "1"}}, {{"--shuffle", "on"}, {"--seed", "2"}}),
            "--seed was 1, now 2");
}

TEST(Hardening, ChecksumsTurnBitRotIntoAClearError) {
  SavedAtStep2 saved = save_at_step_2(2);
  saved.resume.batch.steps = 3;
  for (const char* file : {"state.bin", "model.bin"}) {
    const std::string path = saved.dir + "/" + file;
    const std::string good = test::read_all(path);
    std::string rotten = good;
    rotten[rotten.size() - 7] ^= 0x10;  // one bit of the last tensor
    test::write_all(path, rotten);
    const std::string msg = message_of<Error>([&] { train::run_training(saved.resume); });
    EXPECT_NE(msg.find("checksum mismatch"), std::string::npos) << file << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    test::write_all(path, good);
  }
}

// A state.bin's version field is outside its checksum; set back from 4 to 2 it turned the
// CRC and the recipe/history checks off, and corrupted moments resumed with rc 0.
TEST(Hardening, AStateWhoseVersionWasSetBackIsRefusedNotReadWithoutItsChecks) {
  SavedAtStep2 saved = save_at_step_2(2);
  saved.resume.batch.steps = 3;
  const std::string path = saved.dir + "/state.bin";
  const std::string good = test::read_all(path);
  for (const int32_t older : {3, 2, 1}) {
    std::string edited = good;
    std::memcpy(edited.data() + 4, &older, 4);
    edited[edited.size() - 7] ^= 0x10;  // and a moment corrupted
    test::write_all(path, edited);
    const std::string msg = message_of<Error>([&] { train::run_training(saved.resume); });
    EXPECT_NE(msg.find("the version field is corrupt"), std::string::npos) << older << ": " << msg;
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
  }
  test::write_all(path, good);
}

// A version-2 state carries no record of the run's steps (history.json came with version
// 4); resumed with a new --log-json, the record was looked for in that log, which the run
// had just created empty: "plot: log ... has no steps".
TEST(Hardening, AVersion2StateResumesWithANewLogAndItsPlotStartsAtTheResumedStep) {
  SavedAtStep2 saved = save_at_step_2(4);
  saved.resume.metrics.log_json = test::temp_path("version2_new_log.jsonl");
  fs::remove(saved.resume.metrics.log_json);
  const std::string path = saved.dir + "/state.bin";
  std::string state = test::read_all(path);
  const int32_t version = 2;
  std::memcpy(state.data() + 4, &version, 4);
  std::memset(state.data() + 64, 0, 12);  // no checksums: version 2 stored none
  test::write_all(path, state);
  fs::remove(saved.dir + "/history.json");
  ASSERT_NO_THROW(train::run_training(saved.resume));
  EXPECT_EQ(test::log_steps(saved.resume.metrics.log_json), (std::vector<int64_t>{3, 4}));
}

// A killed run's temporaries beside its log (the writability probe, an unfinished rewrite)
// are removed by the next run that writes that log; a live process's are kept.
TEST(Hardening, AKilledRunsTemporariesBesideItsLogAreRemovedByTheNextRun) {
  const std::string dir = test::temp_path("abandoned_temporaries");
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string log = dir + "/log.jsonl";
  // A pid no process has: beyond the kernel's pid_max.
  const std::string dead = std::to_string(1 << 23);
  const std::string live = std::to_string(::getpid());
  for (const std::string& name : std::vector<std::string>{"log.jsonl.tmp.probe." + dead, "log.jsonl.tmp." + dead + ".0", "log.jsonl.tmp",
                                  "log.jsonl.tmp." + live + ".7", "log.jsonl.notes"})
    test::write_all(dir + "/" + name, "x");
  io::check_output_file("--log-json", log, {});
  std::vector<std::string> left;
  for (const auto& e : fs::directory_iterator(dir)) left.push_back(e.path().filename().string());
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{"log.jsonl.notes", "log.jsonl.tmp." + live + ".7"}));
}

// llm.c's header holds its sizes and LLaMA's rope_theta as 32-bit integers: a model whose
// values do not fit was written anyway (max_position_embeddings 4294967360 became maxT 64,
// rope_theta 1e12 INT_MIN). What the format cannot hold is refused, and nothing is written.
TEST(Hardening, AModelWhoseValuesDoNotFitLlmcsHeaderIsRefusedNotTruncated) {
  struct Case {
    const char* field;
    std::function<void(nn::TransformerConfig&)> set;
  };
  const std::vector<Case> cases = {{"max_seq_len", [](nn::TransformerConfig& c) { c.max_seq_len = 4294967360LL; }},
                                   {"rope_theta", [](nn::TransformerConfig& c) { c.rope_theta = 1e12; }}};
  for (const Case& k : cases) {
    nn::TransformerConfig config = nn::TransformerConfig::preset("llama3-d1");
    config.vocab_size = 97;
    config.padded_vocab_size = 128;
    k.set(config);
    const nn::Transformer model = nn::Transformer::layout_only(config);
    const std::string path = test::temp_path(std::string("unfit_") + k.field + ".bin");
    fs::remove(path);
    const std::string msg = message_of<Error>(
        [&] { io::save_llmc(path, model, [&](size_t i) { return Tensor::zeros(model.params().spec(i).shape); }, false); });
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string(k.field) + " "), std::string::npos) << msg;
    EXPECT_NE(msg.find("does not fit llm.c's header"), std::string::npos) << msg;
    EXPECT_FALSE(fs::exists(path)) << k.field;
  }
}

// model.bin's checksum covered its weights, not its header: one flipped bit in the head
// count (12 -> 8 still divides the width, and the file's size does not depend on it), in a
// LLaMA double (rope_theta, norm_eps) or in the checksum's own mark (which turned the check
// off) resumed a different model without a word. The header has a checksum of its own.
TEST(Hardening, ABitFlippedInAModelFileHeaderIsACorruptFileNotAnotherModel) {
  auto flipped = [](const std::string& path, size_t byte, unsigned char bit) {
    std::string bytes = test::read_all(path);
    bytes[byte] = static_cast<char>(bytes[byte] ^ bit);
    const std::string rotten = path + ".rotten.bin";
    test::write_all(rotten, bytes);
    return rotten;
  };
  for (const char* preset : {"d1", "llama3-d1"}) {
    nn::TransformerConfig config = nn::TransformerConfig::preset(preset);
    config.n_embd = 96;  // 4 heads of 24: one bit more (0x08) makes 12 heads of 8, as plausible
    config.n_head = 4;
    config.n_kv_head = config.llama_architecture() ? 2 : 4;
    config.vocab_size = 97;  // small files
    config.padded_vocab_size = 128;
    nn::Transformer model(config);
    nn::init_weights(model, 3);
    const std::string path = test::temp_path(std::string(preset) + ".bin");
    io::save_llmc(path, model);
    EXPECT_NO_THROW(io::read_llmc_config(path)) << preset;
    struct Flip {
      const char* what;
      size_t byte;
      unsigned char bit;
    };
    std::vector<Flip> flips = {{"the head count", 5 * 4, 0x08}, {"the checksum mark", 250 * 4, 0x01},
                               {"the checksum mark's top byte", 250 * 4 + 3, 0x80}};
    if (config.llama_architecture()) flips.push_back({"rope_theta", 236 * 4 + 6, 0x01});
    for (const Flip& f : flips) {
      const std::string rotten = flipped(path, f.byte, f.bit);
      const std::string msg = message_of<Error>([&] {
        nn::Transformer loaded(io::read_llmc_config(rotten));
        io::load_llmc(rotten, loaded);
      });
      EXPECT_NE(msg.find("model file '" + rotten + "'"), std::string::npos) << preset << ", " << f.what << ": " << msg;
      EXPECT_NE(msg.find("corrupt"), std::string::npos) << preset << ", " << f.what << ": " << msg;
    }
    // A file saved before the header had its checksum (the "tlay" mark, slot 252 zero)
    // still loads, its weights still checked.
    std::string older = test::read_all(path);
    const int32_t tlay = 0x79616C74, zero = 0;
    std::memcpy(older.data() + 250 * 4, &tlay, 4);
    std::memcpy(older.data() + 252 * 4, &zero, 4);
    const std::string older_path = path + ".tlay.bin";
    test::write_all(older_path, older);
    nn::Transformer loaded(io::read_llmc_config(older_path));
    EXPECT_NO_THROW(io::load_llmc(older_path, loaded)) << preset;
  }
}

// recipe.json was the only guard on a resume, and deleting it turned the check off: the
// run resumed with another batch shape and a learning rate 3000 times higher, without a
// word. state.bin now holds the CRC-32 of recipe.json and history.json: a checkpoint that
// lost either, or whose either was edited, is refused naming the file.
TEST(Hardening, ACheckpointMissingOrWithAnEditedRecipeOrHistoryIsRefusedNamingTheFile) {
  const SavedAtStep2 saved = save_at_step_2(3);
  for (const char* file : {"recipe.json", "history.json"}) {
    const std::string path = saved.dir + "/" + file;
    const std::string good = test::read_all(path);
    fs::remove(path);
    std::string msg = message_of<Error>([&] { train::run_training(saved.resume); });
    EXPECT_NE(msg.find("checkpoint file '" + path + "' is missing"), std::string::npos) << msg;
    // A trailing space: still the same JSON, other bytes. (Not string::insert: GCC 12's
    // -Wrestrict misfires on it when optimizing, bug 105329, and CI builds with -Werror.)
    const std::string edited = good + " ";
    test::write_all(path, edited);
    msg = message_of<Error>([&] { train::run_training(saved.resume); });
    EXPECT_NE(msg.find("checkpoint file '" + path + "': checksum mismatch"), std::string::npos) << msg;
    test::write_all(path, good);
  }
  EXPECT_EQ(train::run_training(saved.resume).steps_run, 1);
}

// A resume that named no model built the --model default (d6) and failed on the
// checkpoint's other shape, naming a model the user never gave. It now builds the
// checkpoint's; a model flag that names another shape is said to be the cause.
TEST(Hardening, AResumeWithoutAModelFlagBuildsTheCheckpointsModel) {
  const SavedAtStep2 saved = save_at_step_2(3);
  train::TrainConfig r = saved.resume;
  r.model.file.clear();
  r.model.preset = "d6";
  r.model.preset_given = false;
  EXPECT_EQ(train::run_training(r).steps_run, 1);
  r.model.preset = "d1";
  r.model.preset_given = true;
  const std::string msg = message_of<Error>([&] { train::run_training(r); });
  EXPECT_NE(msg.find("--resume '" + saved.dir + "': model file"), std::string::npos) << msg;
  EXPECT_NE(msg.find("(--model d1 names another model than the checkpoint's"), std::string::npos) << msg;
}

// ---------------------------------------------------------------- 3. checked late

TEST(Hardening, AnOutOfVocabularyTokenIsFoundBeforeTheFirstStepNamingShardAndSplit) {
  std::vector<int32_t> tokens(5000, 3);
  tokens[4321] = 500;  // the tiny model has 97 tokens; a 2-step run never reaches position 4321
  const std::string path = test::temp_path("oov.bin");
  data::write_token_shard(path, tokens, data::TokenWidth::U16);
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.data.val = path;
  const std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--val-data shard '" + path + "': token 500 at position 4321"), std::string::npos) << msg;
  // A 32-bit shard's token past INT32_MAX (a corrupt one: no writer makes it) is named by
  // its value, not by the int32 it reads as (the message said "token -1").
  const std::string wide = test::temp_path("oov32.bin");
  data::write_token_shard(wide, tokens, data::TokenWidth::U32);
  std::string bytes = test::read_all(wide);
  const size_t at = 256 * sizeof(int32_t) + 4321 * sizeof(uint32_t);  // past the 256-int header
  bytes.replace(at, 4, std::string(4, '\xff'));
  test::write_all(wide, bytes);
  c.data.val = wide;
  const std::string wide_msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(wide_msg.find("--val-data shard '" + wide + "': token 4294967295 at position 4321"), std::string::npos)
      << wide_msg;
}

TEST(Hardening, ValidationDataThatIsAlsoTrainingDataIsWarnedAbout) {
  // A --val-data shard among --train-data's files: the validation loss would measure text
  // the model trains on, and nothing said so. Named whichever path reaches it.
  test::write_random_shard("overlap_train_a.bin", 5000, 97, 1);
  const std::string train_b = test::write_random_shard("overlap_train_b.bin", 5000, 97, 2);
  train::TrainConfig c = tiny_config(test::temp_path("overlap_train_*.bin"));
  c.batch.steps = 1;
  c.data.val = fs::path(train_b).parent_path().string() + "/./" + fs::path(train_b).filename().string();
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("warning: --val-data shard '" + c.data.val + "' is also a --train-data shard ('" + train_b + "')"),
            std::string::npos)
      << err;
  // Validation data of its own says nothing.
  c.data.val = test::write_random_shard("overlap_val.bin", 5000, 97, 3);
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("warning"), std::string::npos) << err;
}

// --zero shards over data-parallel ranks: on one it changes nothing, and the start-up line
// said "ZeRO stage 1" as if memory were saved. Said, as the trainer says other flags that
// would do nothing; --zero 0 says nothing.
TEST(Hardening, ZeroWithOneDataParallelRankIsWarnedAbout) {
  train::TrainConfig c = tiny_config(test::write_random_shard("zero_one_rank.bin", 5000, 97, 4));
  c.batch.steps = 1;
  c.metrics.quiet = false;
  c.parallel.zero = 1;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  std::string err = ::testing::internal::GetCapturedStderr();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(err.find("warning: --zero 1 shards the optimizer state over data-parallel ranks; this run has one, so it "
                     "saves nothing"),
            std::string::npos)
      << err;
  EXPECT_NE(out.find("ZeRO stage 1 over 1 data-parallel rank: nothing sharded"), std::string::npos) << out;
  c.parallel.zero = 0;
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("--zero"), std::string::npos) << err;
}

// --bucket-mb sizes the buckets of data parallel's all-reduce; with one rank there is none,
// and the flag was taken without a word (as --zero was).
TEST(Hardening, ABucketSizeWithoutADataParallelAllReduceIsWarnedAbout) {
  train::TrainConfig c = tiny_config(test::write_random_shard("bucket_one_rank.bin", 5000, 97, 4));
  c.batch.steps = 1;
  c.parallel.bucket_mb = 1;
  c.parallel.bucket_mb_given = true;
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("warning: --bucket-mb 1 sizes the buckets of data parallel's gradient all-reduce; this run has "
                     "one data-parallel rank and no all-reduce, so it does nothing"),
            std::string::npos)
      << err;
  c.parallel.bucket_mb_given = false;  // the default, not given: nothing said
  ::testing::internal::CaptureStderr();
  train::run_training(c);
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(err.find("--bucket-mb"), std::string::npos) << err;
}

// A run resumed from step 2 of an out-dir holding steps 2, 4 and 6 of an abandoned run, saving
// at 3 and 6 with --keep-last 2: its step 3 was removed as "older" and the abandoned run's
// step 4 kept. The abandoned run's later checkpoints are left alone (not this run's to
// remove), and not counted among the ones --keep-last keeps.
TEST(Hardening, KeepLastAfterAResumeFromAnEarlierCheckpointKeepsThisRunsNewest) {
  const std::string dir = test::temp_path("keep_resumed");
  auto make = [&](int64_t step) {
    char name[32];
    std::snprintf(name, sizeof name, "step_%08lld", static_cast<long long>(step));
    fs::create_directories(fs::path(dir) / name);
    test::write_all((fs::path(dir) / name / "state.bin").string(), "x");
    return std::string(name);
  };
  for (int64_t step : {2, 4, 6}) make(step);  // the abandoned run's
  test::write_all(dir + "/latest", "step_00000006\n");
  // Resumed at 2; this run saves 3, then 6 (over the abandoned run's 6).
  EXPECT_TRUE(io::remove_older_checkpoints(dir, dir + "/" + make(3), 2, /*resumed_step=*/2, {3}).empty());
  const std::vector<std::string> removed = io::remove_older_checkpoints(dir, dir + "/" + make(6), 2, 2, {3, 6});
  EXPECT_EQ(removed, std::vector<std::string>{"step_00000002"});
  for (const char* kept : {"step_00000003", "step_00000004", "step_00000006"})
    EXPECT_TRUE(fs::exists(fs::path(dir) / kept)) << kept;
  // --keep-last 1 at its step 8: its own 3 and 6 go, the abandoned run's 4 stays.
  EXPECT_EQ(io::remove_older_checkpoints(dir, dir + "/" + make(8), 1, 2, {3, 6, 8}),
            (std::vector<std::string>{"step_00000003", "step_00000006"}));
  EXPECT_TRUE(fs::exists(fs::path(dir) / "step_00000004"));
}

// The tokens a run has seen, in its log rows and history, were step x tokens a step: a
// resume that changed the batch (--allow-recipe-change) rewrote its past at the new size.
TEST(Hardening, TokensSeenAccumulateAcrossAResumeThatChangesTheBatch) {
  train::TrainConfig c = tiny_config(test::write_random_shard("tokens_resume.bin", 20000, 97, 4));
  c.batch.steps = 2;
  c.checkpoint.save_every = 2;
  c.checkpoint.out_dir = test::temp_path("tokens_resume_out");
  c.metrics.log_json = test::temp_path("tokens_resume.jsonl");
  train::run_training(c);  // 2 steps of 2 x 16 tokens
  c.batch.steps = 3;
  c.batch.batch_size = 4;  // 64 tokens a step from here
  c.checkpoint.resume = c.checkpoint.out_dir;
  c.checkpoint.allow_recipe_change = true;
  train::run_training(c);
  std::vector<int64_t> tokens;
  std::istringstream rows(test::read_all(c.metrics.log_json));
  for (std::string line; std::getline(rows, line);)
    if (!line.empty()) tokens.push_back(nlohmann::json::parse(line).at("tokens").get<int64_t>());
  EXPECT_EQ(tokens, (std::vector<int64_t>{32, 64, 128}));
}

// Reading a checkpoint stages its optimizer state beside the model states: with a small
// batch that was the run's real peak (131.37 MiB against the steps' 109.65 for d2 at 1 x 16
// tokens), and the run said "+0.00%" against the plan without a word of it.
TEST(Hardening, AResumeWhoseCheckpointReadPeaksAboveTheStepsSaysSo) {
  train::TrainConfig c = tiny_config(test::write_random_shard("resume_peak.bin", 20000, 97, 4));
  c.model.file.clear();
  c.model.preset = "d2";
  c.batch.batch_size = 1;
  c.batch.steps = 2;
  c.checkpoint.save_every = 2;
  c.checkpoint.out_dir = test::temp_path("resume_peak_out");
  train::run_training(c);
  c.batch.steps = 3;
  c.checkpoint.resume = c.checkpoint.out_dir;
  c.checkpoint.allow_recipe_change = true;
  c.checkpoint.save_every = 0;
  c.metrics.quiet = false;
  ::testing::internal::CaptureStdout();
  const train::TrainResult r = train::run_training(c);
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_FALSE(r.history.empty());
  EXPECT_GT(r.resume_peak_bytes, r.history.back().peak_bytes) << "this shape's checkpoint read peaks above its steps";
  EXPECT_NE(out.find("memory: reading the checkpoint peaked at " + memory::format_bytes(r.resume_peak_bytes) +
                     " (largest over ranks), above the steps' peak"),
            std::string::npos) << out;
}

TEST(Hardening, BadOutputPathsFailBeforeTraining) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.batch.steps = 1000000;  // would take hours if the check came after training
  c.checkpoint.out_dir = test::temp_path("a_file");
  test::write_all(c.checkpoint.out_dir, "x");
  EXPECT_NE(message_of<Error>([&] { train::run_training(c); }).find("is a file, expected a directory"),
            std::string::npos);
  c.checkpoint.out_dir = test::temp_path("out_ok");
  c.memory.trace = test::temp_path("trace_dir");
  fs::create_directories(c.memory.trace);
  EXPECT_NE(message_of<Error>([&] { train::run_training(c); }).find("--mem-trace"), std::string::npos);
  // A path under a file: "file system: filesystem error: cannot create directories: Not a
  // directory" named no flag. And a --train-data pattern that matches nothing named none.
  const std::string file = test::temp_path("plain_file");
  test::write_all(file, "x");
  struct Case {
    const char* flag;
    std::function<void(train::TrainConfig&)> set;
  };
  for (const Case& k : {Case{"--out-dir", [&](train::TrainConfig& t) { t.checkpoint.out_dir = file + "/sub"; }},
                        Case{"--log-json", [&](train::TrainConfig& t) { t.metrics.log_json = file + "/sub/log.jsonl"; }},
                        Case{"--mem-trace", [&](train::TrainConfig& t) { t.memory.trace = file + "/sub/trace.json"; }},
                        // Not a file it can write: refused at the start, not after the run.
                        Case{"--mem-trace", [&](train::TrainConfig& t) { t.memory.trace = "/dev/full"; }},
                        Case{"--train-data", [&](train::TrainConfig& t) { t.data.train = file + "_*.bin"; }},
                        Case{"--val-data", [&](train::TrainConfig& t) { t.data.val = file + "_*.bin"; }}}) {
    train::TrainConfig b = tiny_config(c.data.train);
    k.set(b);
    const std::string msg = message_of<Error>([&] { train::run_training(b); });
    EXPECT_EQ(msg.rfind(std::string("tally: ") + k.flag + " '", 0), 0u) << k.flag << ": " << msg;
  }
}

TEST(Hardening, ATokenizerLargerThanTheModelsVocabularyIsRefusedBeforeTraining) {
  // The tiny model has 97 tokens; a GPT-2-style tokenizer has 257 (256 bytes and
  // <|endoftext|>). Training used to run every step and then fail in the final sample
  // (the separator, id 256, is out of the embedding's range) before the last checkpoint
  // was saved: the whole run was lost.
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.data.tokenizer = test::temp_path("big_tok");
  fs::create_directories(c.data.tokenizer);
  test::write_tiny_gpt2_tokenizer(c.data.tokenizer, {});
  c.batch.steps = 3;
  c.checkpoint.save_every = 3;
  c.sampling.every = 0;  // one sample, at the end
  c.sampling.tokens = 4;
  c.metrics.log_json = c.checkpoint.out_dir + "/log.jsonl";
  const std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--tokenizer '" + c.data.tokenizer + "' has 257 tokens"), std::string::npos) << msg;
  EXPECT_NE(msg.find("only 97"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(c.metrics.log_json) && fs::file_size(c.metrics.log_json) > 0) << "refused before the first step";
}

TEST(Hardening, MoreValidationBatchesThanTheValidationDataHoldsAreCappedNotWrapped) {
  // --val-batches beyond the data wrapped around and evaluated the same tokens again and
  // again (10^6 batches of a 5,000-token split ran for hours) and weighted the wrapped part
  // twice. Capped at the batches the data holds ((5000 - 1) / 32 tokens per batch = 156),
  // 1,000 asked for give what 156 give.
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.data.val = test::write_random_shard("v.bin", 5000, 97, 2);
  c.batch.steps = 1;
  c.validation.batches = 156;
  const double all = train::run_training(c).final_val_loss;
  c.validation.batches = 1000;
  EXPECT_EQ(train::run_training(c).final_val_loss, all);
  c.validation.batches = 155;  // the cap is not below what the data holds
  EXPECT_NE(train::run_training(c).final_val_loss, all);
}

TEST(Hardening, AFreshRunDoesNotOverwriteAnEarlierRunsCheckpoints) {
  // A second run (another model, or the same recipe started over) into the same --out-dir
  // replaced the first run's checkpoints step by step; with other step numbers the
  // directory ended up holding both runs' checkpoints under one `latest`.
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  fs::remove_all(c.checkpoint.out_dir);
  c.batch.steps = 4;
  c.checkpoint.save_every = 2;
  train::run_training(c);
  const std::string first = test::read_all(c.checkpoint.out_dir + "/step_00000004/model.bin");
  train::TrainConfig again = c;
  again.batch.steps = 3;
  again.checkpoint.save_every = 3;
  again.seed = 7;
  const std::string msg = message_of<Error>([&] { train::run_training(again); });
  EXPECT_NE(msg.find("--out-dir '" + c.checkpoint.out_dir + "' holds an earlier run's checkpoints (step_00000002 ... step_00000004)"),
            std::string::npos) << msg;
  EXPECT_NE(msg.find("--resume " + c.checkpoint.out_dir), std::string::npos) << msg;
  EXPECT_NE(msg.find("--overwrite"), std::string::npos) << msg;
  EXPECT_EQ(test::read_all(c.checkpoint.out_dir + "/step_00000004/model.bin"), first) << "the earlier checkpoints are untouched";
  // --overwrite removes them only once every check has passed: a run refused for another
  // reason (a tokenizer of another model) leaves them.
  again.checkpoint.overwrite = true;
  again.data.tokenizer = test::temp_path("tok257");
  fs::create_directories(again.data.tokenizer);
  test::write_tiny_gpt2_tokenizer(again.data.tokenizer, {});
  EXPECT_THROW(train::run_training(again), Error);
  EXPECT_EQ(test::read_all(c.checkpoint.out_dir + "/step_00000004/model.bin"), first) << "a refused --overwrite removes nothing";
  // Continuing into the directory it continues from cannot also overwrite it.
  train::TrainConfig both = again;
  both.data.tokenizer.clear();
  both.checkpoint.resume = c.checkpoint.out_dir;
  both.batch.steps = 5;
  both.checkpoint.allow_recipe_change = true;
  EXPECT_NE(message_of<Error>([&] { train::run_training(both); }).find("--overwrite with --resume"), std::string::npos);
  // A run resumed from another directory's checkpoint is a new run here: refused as well.
  train::TrainConfig elsewhere = c;
  elsewhere.checkpoint.out_dir = test::temp_path("other_out");
  elsewhere.batch.steps = 2;
  elsewhere.checkpoint.save_every = 2;
  train::run_training(elsewhere);
  train::TrainConfig moved = c;
  moved.checkpoint.resume = elsewhere.checkpoint.out_dir;
  moved.checkpoint.allow_recipe_change = true;
  EXPECT_NE(message_of<Error>([&] { train::run_training(moved); }).find("holds an earlier run's checkpoints"),
            std::string::npos);
  again.data.tokenizer.clear();
  train::run_training(again);
  EXPECT_EQ(io::checkpoints_in(c.checkpoint.out_dir), (std::vector<std::string>{"step_00000003", "latest"}))
      << "only the new run's checkpoints";
  // Continuing a run, and runs that save nothing, are not affected.
  train::TrainConfig resumed = again;
  resumed.checkpoint.overwrite = false;
  resumed.batch.steps = 4;
  resumed.checkpoint.allow_recipe_change = true;  // the schedule's length changes
  resumed.checkpoint.resume = c.checkpoint.out_dir;
  EXPECT_NO_THROW(train::run_training(resumed));
  train::TrainConfig unsaved = c;
  unsaved.checkpoint.save_every = 0;
  EXPECT_NO_THROW(train::run_training(unsaved));
  EXPECT_EQ(io::checkpoints_in(c.checkpoint.out_dir), (std::vector<std::string>{"step_00000003", "step_00000004", "latest"}))
      << "a run that saves nothing leaves them";
  // ... unless it says --overwrite: then it starts afresh there too, and its plot is not
  // drawn beside another run's checkpoints (it kept them, and replaced their loss.svg).
  unsaved.checkpoint.overwrite = true;
  EXPECT_NO_THROW(train::run_training(unsaved));
  EXPECT_TRUE(io::checkpoints_in(c.checkpoint.out_dir).empty()) << "--overwrite removes the earlier run's checkpoints";
  // A first save that a kill interrupted before `latest` (a step directory, or its .tmp)
  // is no earlier run: starting again is not refused.
  train::TrainConfig interrupted = c;
  interrupted.checkpoint.out_dir = test::temp_path("interrupted");
  fs::create_directories(interrupted.checkpoint.out_dir + "/step_00000002");
  fs::create_directories(interrupted.checkpoint.out_dir + "/step_00000002.tmp");
  EXPECT_NO_THROW(train::run_training(interrupted));
}

// From a user's review: outputs written over the run's own inputs. `--log-json` naming
// the training shard truncated it to 0 bytes, and the loader's mapping of it then crashed
// the run with SIGBUS; `--mem-trace` over a shard, or over --model-file, replaced them
// after training. A path ending in '/' was made as a directory and then refused as one.
// Each is refused before anything runs, naming both flags, and the input is intact.
TEST(Hardening, AnOutputThatIsTheRunsOwnInputIsRefusedBeforeItIsTouched) {
  const std::string shard = test::write_random_shard("own_input.bin", 5000, 97, 1);
  const std::string bytes = test::read_all(shard);
  const std::string model_copy = test::temp_path("own_model.bin");
  fs::copy_file(test::fixture_path("gpt2_tiny.bin"), model_copy, fs::copy_options::overwrite_existing);
  struct Case {
    const char* output;
    std::function<void(train::TrainConfig&)> set;
    const char* input;
  };
  const std::string val = test::write_random_shard("own_val.bin", 2000, 97, 2);
  const std::string val_bytes = test::read_all(val);
  const std::string hf = test::temp_path("own_hf");
  fs::remove_all(hf);
  fs::copy(test::fixture_path("llama3_tiny_hf"), hf, fs::copy_options::recursive);
  const std::string hf_config = test::read_all(hf + "/config.json");
  for (const Case& k : {Case{"--log-json", [&](train::TrainConfig& t) { t.metrics.log_json = shard; }, "--train-data"},
                        Case{"--log-json", [&](train::TrainConfig& t) { t.data.val = val; t.metrics.log_json = val; }, "--val-data"},
                        Case{"--log-json", [&](train::TrainConfig& t) { t.model.file = model_copy; t.metrics.log_json = model_copy; },
                             "--model-file"},
                        Case{"--mem-trace", [&](train::TrainConfig& t) {
                               t.model.file.clear();
                               t.model.init_from = hf;
                               t.memory.trace = hf + "/config.json";
                             }, "--init-from"}}) {
    train::TrainConfig c = tiny_config(shard);
    k.set(c);
    const std::string msg = message_of<Error>([&] { train::run_training(c); });
    EXPECT_NE(msg.find(std::string(k.output) + " '"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::string("is ") + k.input), std::string::npos) << msg;
    EXPECT_NE(msg.find("would destroy the input"), std::string::npos) << msg;
  }
  // A trace over a shard: refused by its name already (a trace is .json or .html).
  train::TrainConfig traced = tiny_config(shard);
  traced.memory.trace = shard;
  EXPECT_NE(message_of<Error>([&] { train::run_training(traced); }).find("expected a path ending in .json"), std::string::npos);
  EXPECT_EQ(test::read_all(val), val_bytes) << "the validation shard is untouched";
  EXPECT_EQ(test::read_all(hf + "/config.json"), hf_config) << "the HuggingFace config is untouched";
  EXPECT_EQ(test::read_all(shard), bytes) << "the shard is untouched";
  EXPECT_EQ(test::read_all(model_copy), test::read_all(test::fixture_path("gpt2_tiny.bin"))) << "the model is untouched";
  // A name that can only be a directory's: refused, and nothing is made.
  train::TrainConfig slash = tiny_config(shard);
  slash.memory.trace = test::temp_path("traces_new") + "/";
  EXPECT_NE(message_of<Error>([&] { train::run_training(slash); }).find("ends in '/'"), std::string::npos);
  EXPECT_FALSE(fs::exists(test::temp_path("traces_new"))) << "no directory is left behind";
}

// From the same review: --overwrite removed every directory whose name began with step_,
// the user's step_notes/ included; a resume onto other training data went on silently
// (README: "resume is exact or refused"); every checkpoint was kept (17 GB in a minute at
// --save-every 1 on d1) with no way to keep fewer; per-rank logs of an earlier, wider run
// were left contradicting the new log.
TEST(Hardening, OverwriteKeepsTheUsersFilesAndResumeRefusesOtherData) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  fs::remove_all(c.checkpoint.out_dir);
  c.batch.steps = 4;
  c.checkpoint.save_every = 2;
  train::run_training(c);
  fs::create_directories(c.checkpoint.out_dir + "/step_notes");
  test::write_all(c.checkpoint.out_dir + "/step_notes/mine.txt", "keep me");
  fs::create_directories(c.checkpoint.out_dir + "/step_00000099");
  test::write_all(c.checkpoint.out_dir + "/step_00000099/mine.txt", "and me");
  // Other data (another token count) is another run.
  train::TrainConfig other_data = c;
  other_data.batch.steps = 6;
  other_data.checkpoint.resume = c.checkpoint.out_dir;
  other_data.data.train = test::write_random_shard("t_other.bin", 3000, 97, 2);
  const std::string msg = message_of<Error>([&] { train::run_training(other_data); });
  EXPECT_NE(msg.find("--train-data's token count was 5000, now 3000"), std::string::npos) << msg;
  train::TrainConfig again = c;
  again.checkpoint.overwrite = true;
  train::run_training(again);
  EXPECT_EQ(test::read_all(c.checkpoint.out_dir + "/step_notes/mine.txt"), "keep me");
  EXPECT_EQ(test::read_all(c.checkpoint.out_dir + "/step_00000099/mine.txt"), "and me") << "no state.bin: not a checkpoint";
  // --keep-last 2: each save leaves the newest two.
  train::TrainConfig kept = c;
  kept.checkpoint.out_dir = test::temp_path("keep_last");
  fs::remove_all(kept.checkpoint.out_dir);
  kept.batch.steps = 5;
  kept.checkpoint.save_every = 1;
  kept.checkpoint.keep_last = 2;
  train::run_training(kept);
  EXPECT_EQ(io::checkpoints_in(kept.checkpoint.out_dir), (std::vector<std::string>{"step_00000004", "step_00000005", "latest"}));
  // Resumed from step 2 of a longer run: the later checkpoints (4, 5) are that run's, left.
  train::TrainConfig longer = kept;
  longer.checkpoint.out_dir = test::temp_path("keep_last_resumed");
  fs::remove_all(longer.checkpoint.out_dir);
  longer.checkpoint.keep_last = 0;
  train::run_training(longer);  // steps 1 .. 5
  train::TrainConfig back = longer;
  back.checkpoint.keep_last = 1;
  back.checkpoint.resume = longer.checkpoint.out_dir + "/step_00000002";
  back.batch.steps = 3;
  back.checkpoint.allow_recipe_change = true;  // a shorter schedule
  train::run_training(back);
  EXPECT_EQ(io::checkpoints_in(longer.checkpoint.out_dir),
            (std::vector<std::string>{"step_00000003", "step_00000004", "step_00000005", "latest"}));
  train::TrainConfig no_saves = c;
  no_saves.checkpoint.save_every = 0;
  no_saves.checkpoint.keep_last = 1;
  EXPECT_NE(message_of<Error>([&] { train::run_training(no_saves); }).find("--keep-last 1 keeps"), std::string::npos);
  // A per-rank log of a rank this run does not have (an earlier run of 4 ranks) is removed.
  train::TrainConfig logged = c;
  logged.checkpoint.out_dir = test::temp_path("rank_logs");
  fs::remove_all(logged.checkpoint.out_dir);
  logged.checkpoint.save_every = 0;
  logged.metrics.log_json = logged.checkpoint.out_dir + "/log.jsonl";
  fs::create_directories(logged.checkpoint.out_dir);
  test::write_all(logged.metrics.log_json + ".rank3", "{}\n");
  test::write_all(logged.metrics.log_json + ".ranked_by_me", "mine\n");
  train::run_training(logged);
  EXPECT_FALSE(fs::exists(logged.metrics.log_json + ".rank3"));
  EXPECT_TRUE(fs::exists(logged.metrics.log_json + ".ranked_by_me"));
  // Outputs beside the files a run reads are no inputs: a log in the tokenizer's directory
  // (where `tally tokenize` writes the shards too), run twice.
  train::TrainConfig beside = c;
  beside.checkpoint.out_dir = test::temp_path("beside_out");
  fs::remove_all(beside.checkpoint.out_dir);
  beside.checkpoint.save_every = 0;
  {
    // A model of the tokenizer's 257 tokens.
    nn::TransformerConfig config = io::read_llmc_config(c.model.file);
    config.vocab_size = 257;
    config.padded_vocab_size = 384;
    nn::Transformer m(config);
    nn::init_weights(m, 1);
    beside.model.file = test::temp_path("beside_model.bin");
    io::save_llmc(beside.model.file, m);
  }
  beside.data.tokenizer = test::temp_path("beside_tok");
  fs::create_directories(beside.data.tokenizer);
  test::write_tiny_gpt2_tokenizer(beside.data.tokenizer, {});
  beside.metrics.log_json = beside.data.tokenizer + "/log.jsonl";
  EXPECT_NO_THROW(train::run_training(beside));
  EXPECT_NO_THROW(train::run_training(beside)) << "the second run's log exists: still no input";
  // A stream is written as it is.
  beside.metrics.log_json = "/dev/null";
  EXPECT_NO_THROW(train::run_training(beside));
  // One name for two outputs: the trace would replace the log.
  beside.metrics.log_json = beside.checkpoint.out_dir + "/both.json";
  beside.memory.trace = beside.checkpoint.out_dir + "/both.json";
  EXPECT_NE(message_of<Error>([&] { train::run_training(beside); }).find("the trace would replace the log"),
            std::string::npos);
}

// `--init-from DIR/model.safetensors` reads DIR/config.json too, but only the file itself
// counted as the run's input: `--log-json DIR/config.json` passed the check and the log
// replaced the config, so the next run read rows of JSON as the model's shape.
TEST(Hardening, ALogOverTheConfigBesideAnInitFromFileIsRefused) {
  train::TrainConfig c = tiny_config(test::write_random_shard("init_from_file.bin", 5000, 97, 5));
  const std::string dir = test::temp_path("init_from_file");
  fs::remove_all(dir);
  {
    nn::Transformer m(io::read_llmc_config(c.model.file));
    io::load_llmc(c.model.file, m);
    io::save_hf(dir, m);
  }
  const std::string config = test::read_all(dir + "/config.json");
  c.model.file.clear();
  c.model.init_from = dir + "/model.safetensors";
  c.metrics.log_json = dir + "/config.json";
  const std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--log-json '" + c.metrics.log_json + "' is --init-from '" + c.metrics.log_json + "'"), std::string::npos) << msg;
  EXPECT_EQ(test::read_all(dir + "/config.json"), config) << "the config is untouched";
  c.metrics.log_json = dir + "/log.jsonl";  // beside it, a log is no input
  EXPECT_NO_THROW(train::run_training(c));
}

// A stream as --log-json (/dev/null, a pipe, the process's own stdout through /dev/fd/N or
// /dev/stdout) passed the output check, and then a run that saved failed at its first
// checkpoint (fsync of /dev/null: EINVAL), a resume failed reading the log back ("expected a
// regular file") to drop its later rows, and /dev/stdout redirected to a file was truncated
// by the log's own open and its rows overwritten by the process's later output. A stream is
// written front to back through the descriptor it names (sharing its offset), never read
// back, replaced or fsync'ed; the outputs that are whole files written atomically (plot,
// export, memory report, trace) refuse a stream before any work.
TEST(Hardening, AStreamLogTakesEveryRowOfRunsThatSaveAndResume) {
  train::TrainConfig c = tiny_config(test::write_random_shard("stream_log.bin", 5000, 97, 4));
  c.checkpoint.out_dir = test::temp_path("stream_log_out");
  fs::remove_all(c.checkpoint.out_dir);
  c.batch.steps = 4;
  c.checkpoint.save_every = 2;
  c.metrics.log_json = "/dev/null";
  EXPECT_NO_THROW(train::run_training(c)) << "a run that saves, logging to /dev/null";
  train::TrainConfig resumed = c;
  resumed.checkpoint.resume = c.checkpoint.out_dir + "/step_00000002";
  EXPECT_NO_THROW(train::run_training(resumed)) << "a resume logging to /dev/null";
  // The process's own descriptor, open on a file that already holds a line (as a shell's
  // `> run.log` holds what the run printed before): the rows follow it, none overwritten.
  const std::string file = test::temp_path("stream_log_fd.txt");
  const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::write(fd, "printed before\n", 15), 15);
  const std::string descriptor = "/dev/fd/" + std::to_string(fd);
  EXPECT_TRUE(io::is_stream(descriptor));
  EXPECT_TRUE(io::is_stream("/dev/null"));
  EXPECT_FALSE(io::is_stream(file));
  fs::remove_all(c.checkpoint.out_dir);
  train::TrainConfig to_fd = c;
  to_fd.metrics.log_json = descriptor;
  train::run_training(to_fd);  // steps 1 .. 4, saved at 2 and 4
  resumed.metrics.log_json = descriptor;
  train::run_training(resumed);  // steps 3 .. 4 again: a stream keeps what it was given
  ASSERT_EQ(::write(fd, "printed after\n", 14), 14);
  ::close(fd);
  std::istringstream lines(test::read_all(file));
  std::vector<std::string> got;
  for (std::string line; std::getline(lines, line);) {
    const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
    got.push_back(row.is_object() && row.contains("step") ? "step " + std::to_string(row["step"].get<int64_t>()) : line);
  }
  EXPECT_EQ(got, (std::vector<std::string>{"printed before", "step 1", "step 2", "step 3", "step 4", "step 3", "step 4",
                                           "printed after"}));
  EXPECT_FALSE(test::has_temporaries(file));
  // Files written whole and atomically refuse a stream up front, naming the flag.
  for (const std::string& stream : {std::string("/dev/null"), descriptor}) {
    const std::string msg = message_of<Error>([&] { io::check_output_file("-o", stream, {}); });
    EXPECT_NE(msg.find("-o '" + stream + "' is a stream"), std::string::npos) << msg;
  }
  EXPECT_NO_THROW(io::check_output_file("--log-json", "/dev/null", {}, io::OutputKind::FileOrStream));
  // Per-rank logs go beside --log-json, which a stream has no directory for.
  train::TrainConfig all_ranks = c;
  all_ranks.metrics.log_json_all_ranks = true;
  EXPECT_NE(message_of<Error>([&] { train::run_training(all_ranks); }).find("--log-json-all-ranks"), std::string::npos);
}

// Two writers of one file at once (two runs finishing into one --out-dir: ctest -j2 ran two
// trainings that each wrote out/loss.svg). Both shared "<path>.tmp": the second truncated
// the first's bytes, and whichever committed second found its temporary renamed away and
// failed. Each writer now has its own temporary: both commit, the file holds one of them
// whole, and no temporary is left.
TEST(Hardening, TwoWritersOfOneFileBothCommitAndLeaveOneWholeFile) {
  const std::string dir = test::temp_path("two_writers");
  fs::create_directories(dir);
  const std::string path = dir + "/loss.svg";
  const std::string first(4096, 'a'), second(100, 'b');
  {
    AtomicFile a(path), b(path);
    a.write(first.data(), first.size());
    b.write(second.data(), second.size());
    ASSERT_NO_THROW(a.commit());
    EXPECT_EQ(test::read_all(path), first);
    ASSERT_NO_THROW(b.commit());
    EXPECT_EQ(test::read_all(path), second) << "the last commit wins, whole";
  }
  size_t entries = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    ++entries;
    EXPECT_EQ(entry.path().filename(), "loss.svg");
  }
  EXPECT_EQ(entries, 1u) << "no temporary left behind";
}

TEST(Hardening, OutputsAreWrittenThroughLinksAndNeverReplaceDevicesOrDirectories) {
  // Every write is a temporary file renamed over the destination. Renaming over a symbolic
  // link replaced the link with a file (its target kept the old bytes); renaming over
  // `-o /dev/full` as root replaced the device node with a file and reported success.
  const std::string dir = test::temp_path("links");
  fs::create_directories(dir);
  const std::string real = dir + "/real.bin", link = dir + "/link.bin", link2 = dir + "/link2.bin";
  test::write_all(real, "old");
  fs::create_symlink("real.bin", link);   // relative, as `ln -s` makes them
  fs::create_symlink(link, link2);        // a link to a link
  {
    AtomicFile out(link2);
    out.write("new", 3);
    out.commit();
  }
  EXPECT_TRUE(fs::is_symlink(link)) << "the link stays a link";
  EXPECT_TRUE(fs::is_symlink(link2));
  EXPECT_EQ(test::read_all(real), "new") << "the file it points to is replaced";
  data::write_token_shard(link, {1, 2, 3}, data::TokenWidth::U16);
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(fs::file_size(real), 256 * 4 + 3 * 2) << "a token shard through the link";
  // A dangling link: the file it names is created.
  const std::string dangling = dir + "/dangling.bin";
  fs::create_symlink("made.bin", dangling);
  {
    AtomicFile out(dangling);
    out.write("x", 1);
    out.commit();
  }
  EXPECT_TRUE(fs::is_symlink(dangling));
  EXPECT_EQ(test::read_all(dir + "/made.bin"), "x");
  // Special files and directories are refused, named, and left as they were. (A FIFO made
  // here stands for the devices: a regression must not be able to replace /dev/null.)
  const std::string fifo = dir + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& target : {fifo, dir}) {
    const std::string msg = message_of<Error>([&] { AtomicFile out(target); });
    EXPECT_NE(msg.find("'" + target + "' is a"), std::string::npos) << msg;
    EXPECT_NE(msg.find("expected the path of a regular file"), std::string::npos) << msg;
    EXPECT_NE(message_of<Error>([&] { data::write_token_shard(target, {1}, data::TokenWidth::U16); }).find("token shard"),
              std::string::npos);
  }
  EXPECT_TRUE(fs::is_fifo(fifo));
  EXPECT_FALSE(test::has_temporaries(fifo));
  // /dev/stdout leads into /proc/self/fd: a descriptor, never a file to rename over.
  if (fs::is_symlink("/dev/stdout")) {
    const std::string msg = message_of<Error>([&] { AtomicFile out("/dev/stdout"); });
    EXPECT_NE(msg.find("a link to a process's file descriptor"), std::string::npos) << msg;
  }
}

// ---------------------------------------------------------------- 4. durability

TEST(Hardening, AKillWhileReSavingAStepLeavesALoadableCheckpoint) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.batch.steps = 2;
  c.checkpoint.save_every = 2;
  fs::remove_all(c.checkpoint.out_dir);
  train::run_training(c);
  // The state a kill leaves between moving the old step aside and renaming the new one in:
  // `latest` names step_00000002, which is gone; step_00000002.old is complete; a half
  // written step_00000002.tmp lies beside it.
  const std::string step = c.checkpoint.out_dir + "/step_00000002";
  fs::rename(step, step + ".old");
  fs::create_directories(step + ".tmp");
  test::write_all(step + ".tmp/state.bin", "half");
  // and the temporaries of `latest` and the plot that the same kill cut short (pid 4194305
  // is above Linux's largest pid_max: no process has it). A live process's temporary (this
  // one's: another run finishing into the same directory) is left alone.
  const std::string latest_tmp = c.checkpoint.out_dir + "/latest.tmp.4194305.0", plot_tmp = c.checkpoint.out_dir + "/loss.svg.tmp.4194305.1";
  const std::string live_tmp = c.checkpoint.out_dir + "/loss.svg.tmp." + std::to_string(::getpid()) + ".9";
  test::write_all(latest_tmp, "step_0000");
  test::write_all(plot_tmp, "<svg");
  test::write_all(live_tmp, "<svg");
  EXPECT_EQ(io::resolve_checkpoint(c.checkpoint.out_dir), step + ".old");
  io::recover_out_dir(c.checkpoint.out_dir);
  EXPECT_TRUE(fs::exists(step + "/state.bin"));
  EXPECT_FALSE(fs::exists(step + ".old"));
  EXPECT_FALSE(fs::exists(step + ".tmp"));
  EXPECT_FALSE(fs::exists(latest_tmp));
  EXPECT_FALSE(fs::exists(plot_tmp));
  EXPECT_TRUE(fs::exists(live_tmp));
  fs::remove(live_tmp);
  EXPECT_EQ(io::resolve_checkpoint(c.checkpoint.out_dir), step);
}

// Two runs in one --out-dir: a run's start-up repair (which removes unfinished saves,
// step_N.tmp and step_N.old) removed the save another live run had in progress, and in that
// run's re-save of the step `latest` names could remove both copies of it. A run that saves
// now holds a lock on its --out-dir: another that would save there is refused naming the
// holder's pid, and one that saves nothing trains beside it without repairing anything.
TEST(Hardening, ARunSavingIntoAnOutDirLocksItAgainstAnotherRunsRepairAndSaves) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.checkpoint.save_every = 2;
  fs::remove_all(c.checkpoint.out_dir);
  fs::create_directories(c.checkpoint.out_dir);
  // The other run, saving step 4 now (this process holds the lock as it would).
  io::OutDirLock other = io::OutDirLock::try_take(c.checkpoint.out_dir);
  ASSERT_TRUE(other.held());
  const std::string in_progress = c.checkpoint.out_dir + "/step_00000004.tmp";
  fs::create_directories(in_progress);
  const std::string msg = message_of<Error>([&] { train::run_training(c); });
  EXPECT_NE(msg.find("--out-dir '" + c.checkpoint.out_dir + "' is in use by another tally run (pid " + std::to_string(::getpid()) +
                     ")"),
            std::string::npos)
      << msg;
  EXPECT_TRUE(fs::exists(in_progress));
  train::TrainConfig watcher = c;
  watcher.checkpoint.save_every = 0;
  EXPECT_EQ(train::run_training(watcher).steps_run, 2);
  EXPECT_TRUE(fs::exists(in_progress)) << "a run beside a live saver repaired its directory";
  // Once the other run is gone its leftovers are repaired, and this run saves.
  other = io::OutDirLock();
  EXPECT_EQ(train::run_training(c).steps_run, 2);
  EXPECT_FALSE(fs::exists(in_progress));
  EXPECT_TRUE(fs::exists(c.checkpoint.out_dir + "/step_00000002/state.bin"));
}

TEST(Hardening, ALatestFileWithCrlfResolves) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.checkpoint.save_every = 2;
  fs::remove_all(c.checkpoint.out_dir);
  train::run_training(c);
  test::write_all(c.checkpoint.out_dir + "/latest", "step_00000002\r\n");
  EXPECT_EQ(io::resolve_checkpoint(c.checkpoint.out_dir), c.checkpoint.out_dir + "/step_00000002");
}

TEST(Hardening, ResumedLogsHaveEveryStepOnceAndCheckpointedRowsComeFirst) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.batch.steps = 6;
  c.checkpoint.save_every = 3;
  fs::remove_all(c.checkpoint.out_dir);
  c.metrics.log_json = c.checkpoint.out_dir + "/log.jsonl";
  train::run_training(c);
  // As if killed after step 5 (its row written) and resumed from step 3's checkpoint.
  ASSERT_EQ(test::log_steps(c.metrics.log_json), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  std::istringstream rows(test::read_all(c.metrics.log_json));
  std::string killed, line;
  for (int i = 0; i < 5 && std::getline(rows, line); ++i) killed += line + "\n";
  test::write_all(c.metrics.log_json, killed + "{\"step\": 6, \"lo");  // and a torn last line
  train::TrainConfig r = c;
  r.checkpoint.resume = c.checkpoint.out_dir + "/step_00000003";
  r.checkpoint.save_every = 0;
  train::run_training(r);
  EXPECT_EQ(test::log_steps(c.metrics.log_json), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
}

// A resumed run forgot what came before its checkpoint unless --log-json held it: its
// loss.svg began at the resume, and "best val loss" was the best since then. The
// checkpoint now carries the run's record (history.json): resumed without a log, the run
// ends with the uninterrupted run's record, byte for byte, and its best validation loss.
TEST(Hardening, AResumedRunKeepsTheRecordAndBestValidationOfTheStepsBeforeIt) {
  train::TrainConfig c = tiny_config(test::write_random_shard("t.bin", 5000, 97, 1));
  c.data.val = test::write_random_shard("v.bin", 2000, 97, 2);
  c.validation.every = 1;
  c.validation.batches = 2;
  c.batch.steps = 6;
  c.checkpoint.save_every = 3;
  c.optimizer.lr = 1.0;  // diverges after the first steps: the best validation comes before the resume
  c.optimizer.schedule = train::LrSchedule::Constant;
  fs::remove_all(c.checkpoint.out_dir);
  const train::TrainResult full = train::run_training(c);
  ASSERT_GT(full.best_val_loss, 0);
  ASSERT_LE(full.best_val_step, 3) << "the test wants the best validation before the checkpoint";
  const std::string want = test::read_all(c.checkpoint.out_dir + "/step_00000006/history.json");
  EXPECT_NE(want.find("\"val\""), std::string::npos);
  train::TrainConfig r = c;
  r.checkpoint.resume = c.checkpoint.out_dir + "/step_00000003";
  const train::TrainResult resumed = train::run_training(r);
  EXPECT_EQ(resumed.steps_run, 3);
  EXPECT_EQ(resumed.best_val_loss, full.best_val_loss);
  EXPECT_EQ(resumed.best_val_step, full.best_val_step);
  EXPECT_EQ(test::read_all(c.checkpoint.out_dir + "/step_00000006/history.json"), want);
}

TEST(Hardening, AFullDiskIsAnErrorNotATruncatedLog) {
  if (!fs::exists("/dev/full")) GTEST_SKIP() << "no /dev/full";
  train::StepLog log("/dev/full", 0);
  const std::string msg = message_of<Error>([&] {
    for (int i = 0; i < 10000; ++i) log.append(std::string(100, 'x'));  // past any stdio buffer
  });
  EXPECT_NE(msg.find("--log-json: writing '/dev/full' failed: No space left on device"), std::string::npos) << msg;
}

// Expert parallel composes with data and pipeline parallel, ZeRO-1 and recomputation; what it does
// not compose with yet is refused before anything starts, naming both flags.
TEST(Hardening, ExpertParallelFlagsThatDoNotComposeAreRefusedNamingThem) {
  train::LayoutFlags f;
  f.world = 2;
  f.ep = 2;
  train::check_layout_flags(f);  // --dp 2 --ep 2: fine
  f.zero = 1;
  train::check_layout_flags(f);  // ZeRO-1 shards the experts' moments over their replicas
  f.zero = 2;
  std::string m = test::message_of<Error>([&] { train::check_layout_flags(f); });
  EXPECT_NE(m.find("--ep 2 with --zero 2"), std::string::npos) << m;
  f.zero = 0;
  f.ep = 0;
  m = test::message_of<Error>([&] { train::check_layout_flags(f); });
  EXPECT_NE(m.find("--ep must be >= 1"), std::string::npos) << m;
  // One process: experts split over ranks need ranks.
  m = test::message_of<Error>([] { dist::World::create({1, 1, 1, 1, 2}); });
  EXPECT_NE(m.find("--ep 2"), std::string::npos) << m;
  EXPECT_NE(m.find("mpirun -np 2"), std::string::npos) << m;
}
