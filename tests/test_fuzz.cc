// A deterministic mutation fuzzer over every file type tally reads: a valid file is mutated
// (bit flips, interesting bytes and header integers, truncation, growth, deleted and
// duplicated spans; in text, huge numbers and a span repeated 200,000 times) and handed to
// the reader. A reader may accept the
// file or refuse it with an error that starts with "tally:"; anything else fails the test:
// another exception (std::bad_alloc, a bare std::out_of_range), a crash or a sanitizer
// report (the suite also runs under ASan+UBSan), or a hang (over 10 s for one file).
//
// CI runs TALLY_FUZZ_ITERATIONS (default 500) mutations per file type with a fixed seed.
// Longer local runs change both:
//   TALLY_FUZZ_ITERATIONS=20000 TALLY_FUZZ_SEED=7 build-asan/test_fuzz
// A failure prints the seed and iteration, and leaves the mutated file at the printed path.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>

#include <nlohmann/json.hpp>

#include "core/random.h"
#include "data/token_shard.h"
#include "data/tokenizer.h"
#include "io/checkpoint.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "memory/report.h"
#include "nn/transformer.h"
#include "optim/adamw.h"
#include "support.h"
#include "train/plot.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::atoll(v) : fallback;
}

std::string mutate(std::string s, Rng& rng, bool text) {
  auto pick = [&](uint64_t n) { return n == 0 ? uint64_t{0} : rng.next_u64() % n; };
  const int rounds = 1 + static_cast<int>(pick(3));
  for (int r = 0; r < rounds; ++r) {
    switch (pick(text ? 9 : 7)) {
      case 0:  // one bit
        if (!s.empty()) s[pick(s.size())] ^= static_cast<char>(1u << pick(8));
        break;
      case 1: {  // an interesting byte
        static const unsigned char bytes[] = {0x00, 0xFF, 0x7F, 0x80, 0x01, '"', '{', '\n'};
        if (!s.empty()) s[pick(s.size())] = static_cast<char>(bytes[pick(sizeof bytes)]);
        break;
      }
      case 2: {  // an interesting int32 in the first 1 KiB (the binary headers)
        static const int32_t ints[] = {0, -1, 1, 2, 255, 65535, 1 << 30, std::numeric_limits<int32_t>::max(),
                                       std::numeric_limits<int32_t>::min(), 1024, 50257, 50304};
        if (s.size() >= 4) {
          const size_t at = pick(std::min<size_t>(s.size(), 1024) / 4) * 4;
          const int32_t v = ints[pick(sizeof ints / sizeof ints[0])];
          std::memcpy(s.data() + at, &v, 4);
        }
        break;
      }
      case 3:  // truncated
        s.resize(pick(s.size() + 1));
        break;
      case 4: {  // grown
        const size_t n = 1 + pick(64);
        for (size_t i = 0; i < n; ++i) s.push_back(static_cast<char>(pick(256)));
        break;
      }
      case 5: {  // a span deleted
        if (s.empty()) break;
        const size_t at = pick(s.size()), n = 1 + pick(std::min<size_t>(64, s.size() - at));
        s.erase(at, n);
        break;
      }
      case 6: {  // a span duplicated
        if (s.empty()) break;
        const size_t at = pick(s.size()), n = 1 + pick(std::min<size_t>(64, s.size() - at));
        s.insert(at, s.substr(at, n));
        break;
      }
      case 7: {  // text: a digit replaced by a huge or negative number
        static const char* numbers[] = {"99999999999999999999", "-1", "4294967296", "1e308", "-0", "18446744073709551615"};
        const size_t from = pick(s.size() + 1);
        const size_t at = s.find_first_of("0123456789", from);
        if (at != std::string::npos) s.replace(at, 1, numbers[pick(sizeof numbers / sizeof numbers[0])]);
        break;
      }
      case 8: {  // text: a short span repeated 200,000 times (`{},{},...`: a reader must stay linear)
        if (s.empty()) break;
        const size_t at = pick(s.size()), n = 1 + pick(std::min<size_t>(8, s.size() - at));
        const std::string span = s.substr(at, n);
        std::string many;
        many.reserve(span.size() * 200000);
        for (int k = 0; k < 200000; ++k) many += span;
        s.insert(at, many);
        break;
      }
    }
  }
  return s;
}

// Runs `read` on `iterations` mutations of `original`, written to `path` each time.
void fuzz(const std::string& kind, const std::string& original, const std::string& path, bool text,
          const std::function<void()>& read) {
  const int64_t iterations = env_int("TALLY_FUZZ_ITERATIONS", 500);
  const uint64_t seed = static_cast<uint64_t>(env_int("TALLY_FUZZ_SEED", 1));
  Rng rng(seed * 1000003 + std::hash<std::string>{}(kind));
  int64_t accepted = 0;
  for (int64_t i = 0; i < iterations; ++i) {
    test::write_all(path, mutate(original, rng, text));
    const auto t0 = std::chrono::steady_clock::now();
    std::string failure;
    try {
      read();
      ++accepted;
    } catch (const std::exception& e) {
      if (std::string(e.what()).rfind("tally:", 0) != 0) failure = std::string("a non-tally error: ") + e.what();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (seconds > 10) failure = "took " + std::to_string(seconds) + " s";
    ASSERT_TRUE(failure.empty()) << kind << " seed " << seed << " iteration " << i << ": " << failure
                                 << " (the mutated file is " << path << ")";
  }
  // Most mutations must be refused: a reader that accepts everything checks nothing.
  EXPECT_LT(accepted, iterations) << kind;
}

}  // namespace

TEST(Fuzz, LlmcModelFiles) {
  const std::string original = test::read_all(test::fixture_path("gpt2_tiny.bin"));
  const std::string path = test::temp_path("model.bin");
  fuzz("llm.c model", original, path, false, [&] {
    nn::Transformer model(io::read_llmc_config(path));
    io::load_llmc(path, model);
  });
}

TEST(Fuzz, TokenShards) {
  const std::string shard = test::write_random_shard("valid.bin", 3000, 97, 5);
  const std::string path = test::temp_path("shard.bin");
  fuzz("token shard", test::read_all(shard), path, false, [&] {
    data::TokenShard s = data::TokenShard::open(path);
    (void)s.find_token_at_or_above(97);
    std::vector<int32_t> all(static_cast<size_t>(s.size()));
    s.read(0, s.size(), all.data());
  });
}

TEST(Fuzz, SafetensorsFiles) {
  const std::string original = test::read_all(test::fixture_path("gpt2_tiny_ref.safetensors"));
  const std::string path = test::temp_path("model.safetensors");
  fuzz("safetensors", original, path, false, [&] { io::read_safetensors(path); });
}

TEST(Fuzz, TrainingStates) {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard("t.bin", 3000, 97, 1));
  c.batch.steps = 1;
  c.checkpoint.save_every = 1;
  c.checkpoint.out_dir = test::temp_path("ckpt");
  train::run_training(c);
  const std::string dir = c.checkpoint.out_dir + "/step_00000001";
  const std::string original = test::read_all(dir + "/state.bin");
  nn::Transformer model(io::read_llmc_config(c.model.file));
  optim::AdamW adamw(model.params(), optim::AdamWConfig{});
  fuzz("training state", original, dir + "/state.bin", false, [&] { io::load_checkpoint_state(dir, model, adamw); });
  test::write_all(dir + "/state.bin", original);
  // recipe.json and history.json: state.bin's CRC of each refuses any change, so their
  // parsers (which read checkpoints older than the CRC, and a history that passed it) are
  // fuzzed directly.
  const std::string recipe = test::read_all(dir + "/recipe.json"), history = test::read_all(dir + "/history.json");
  fuzz("checkpoint recipe", recipe, dir + "/recipe.json", true, [&] { io::load_checkpoint_recipe(dir); });
  fuzz("run history", history, dir + "/history.json", true,
       [&] { train::curve_from_json(test::read_all(dir + "/history.json"), dir + "/history.json"); });
  fuzz("checkpoint recipe and its CRC", recipe, dir + "/recipe.json", true,
       [&] { io::load_checkpoint_state(dir, model, adamw); });
}

TEST(Fuzz, TokenizerFiles) {
  // A small real-format vocabulary: the 256 byte tokens, a few merges, <|endoftext|>.
  const std::string dir = test::temp_path("tok");
  fs::create_directories(dir);
  const test::TinyTokenizerFiles files =
      test::write_tiny_gpt2_tokenizer(dir, {{"t", "h"}, {"th", "e"}, {" ", "the"}, {"o", "n"}});
  const std::string &encoder = files.encoder, &bpe = files.vocab;
  const std::string encoder_text = test::read_all(encoder), vocab = test::read_all(bpe);
  auto load_and_use = [&] {
    data::Tokenizer tok = data::Tokenizer::load(encoder, bpe);
    const auto ids = tok.encode("the one on the thin line");
    (void)tok.decode(ids);
  };
  ASSERT_NO_THROW(load_and_use());
  fuzz("encoder.json", encoder_text, encoder, true, load_and_use);
  test::write_all(encoder, encoder_text);
  fuzz("vocab.bpe", vocab, bpe, true, load_and_use);
}

TEST(Fuzz, LlmcTokenizerFiles) {
  std::vector<int32_t> header(256, 0);
  header[0] = 20240328;
  header[1] = 2;
  header[2] = 300;
  header[3] = 299;
  std::string file(reinterpret_cast<const char*>(header.data()), 1024);
  for (int t = 0; t < 300; ++t) {
    const std::string bytes = t < 256 ? std::string(1, static_cast<char>(t)) : "tok" + std::to_string(t);
    file += static_cast<char>(bytes.size());
    file += bytes;
  }
  const std::string path = test::temp_path("tokenizer.bin");
  fuzz("llm.c tokenizer", file, path, false, [&] {
    data::Tokenizer tok = data::Tokenizer::load_llmc(path);
    std::vector<int32_t> ids;
    for (int i = 0; i < tok.vocab_size(); i += 7) ids.push_back(i);
    (void)tok.decode(ids);
  });
}

TEST(Fuzz, MemoryTraces) {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard("trace_data.bin", 3000, 97, 1));
  c.batch.steps = 1;
  c.memory.trace = test::temp_path("fuzz_trace.json");
  train::run_training(c);
  const std::string original = test::read_all(c.memory.trace);
  const std::string path = test::temp_path("trace.json");
  fuzz("memory trace", original, path, true, [&] {
    const memory::MemoryTrace trace = memory::read_memory_trace(path);
    (void)memory::diff_memory_traces(trace, trace);
  });
}

TEST(Fuzz, HfTokenizerJson) {
  const std::string dir = test::temp_path("fuzz_tokenizer_json");
  fs::create_directories(dir);
  const std::string path = dir + "/tokenizer.json";
  fuzz("tokenizer.json", test::small_llama3_tokenizer_json(), path, true, [&] {
    data::Tokenizer tok = data::Tokenizer::load_path(dir);
    (void)tok.decode(tok.encode("bcbc <|end_of_text|> abc"));
  });
}

// A HuggingFace directory as save_pretrained writes a sharded model (the LLaMA fixture):
// config.json, two shards and model.safetensors.index.json. The config and the index are
// fuzzed.
TEST(Fuzz, HfConfigAndShardIndex) {
  const std::string dir = test::temp_path("fuzz_hf");
  fs::remove_all(dir);
  fs::copy(test::fixture_path("llama3_tiny_hf"), dir);
  auto load = [&] {
    nn::Transformer m(io::read_hf_config(dir));
    io::load_hf(dir, m);
  };
  ASSERT_NO_THROW(load());
  const std::string config = test::read_all(dir + "/config.json");
  const std::string index = test::read_all(dir + "/model.safetensors.index.json");
  fuzz("config.json", config, dir + "/config.json", true, load);
  test::write_all(dir + "/config.json", config);
  fuzz("model.safetensors.index.json", index, dir + "/model.safetensors.index.json", true, load);
}
