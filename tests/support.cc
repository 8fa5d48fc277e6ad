#include "support.h"

#include <chrono>

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "autograd/grad_mode.h"
#include "core/random.h"
#include "data/token_shard.h"
#include "dist/world.h"
#include "nn/llmc_layout.h"
#include "ops/install.h"
#include "ops/ops.h"

#include <nlohmann/json.hpp>

namespace tally::test {

std::string temp_path(const std::string& name) {
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test = info ? std::string(info->test_suite_name()) + "." + info->name() : "no_test";
  for (char& c : test)
    if (c == '/') c = '_';  // parameterized tests: Suite/Case.Name/3
  // The process id and the process's start time: ids repeat across runs of the suite, and a
  // directory left by an earlier run (a checkpoint, a log) must never be taken for this one's.
  static const std::string run = std::to_string(::getpid()) + "_" +
                                 std::to_string(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000007);
  return ::testing::TempDir() + "/tally_" + test + "_" + run + "_" + name;
}

std::string shared_run_id(const dist::World& world) {
  const bool root = world.is_root();
  const auto agreed = [&](double mine) {
    return static_cast<int64_t>(world.world().all_reduce_scalar(root ? mine : 0.0, dist::ReduceOp::Max));
  };
  const int64_t pid = agreed(static_cast<double>(::getpid()));
  const int64_t start = agreed(static_cast<double>(std::chrono::steady_clock::now().time_since_epoch().count() % 1000000007));
  return std::to_string(pid) + "_" + std::to_string(start);
}

bool has_temporaries(const std::string& path) {
  const std::filesystem::path p(path);
  const std::filesystem::path dir = p.parent_path().empty() ? std::filesystem::path(".") : p.parent_path();
  const std::string prefix = p.filename().string() + ".tmp";
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().filename().string().starts_with(prefix)) return true;
  return false;
}

std::string write_random_shard(const std::string& name, int64_t n, int vocab, uint64_t seed) {
  std::vector<int32_t> tokens(static_cast<size_t>(n));
  Rng rng(seed);
  for (auto& t : tokens) t = static_cast<int32_t>(rng.next_u64() % static_cast<uint64_t>(vocab));
  std::string path = temp_path(name);
  data::write_token_shard(path, tokens, data::TokenWidth::U16);
  return path;
}

std::string gpt2_byte_token(unsigned char b) {
  int next = 0, cp = -1;
  for (int x = 0; x < 256; ++x) {
    const bool printable = (x >= 0x21 && x <= 0x7E) || (x >= 0xA1 && x <= 0xAC) || x >= 0xAE;
    const int c = printable ? x : 256 + next++;
    if (x == b) cp = c;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string gpt2_token_of(const std::string& bytes) {
  std::string s;
  for (unsigned char b : bytes) s += gpt2_byte_token(b);
  return s;
}

std::string small_llama3_tokenizer_json() {
  // GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the others are
  // U+0100 onwards in byte order.
  auto byte_char = [](int b) {
    const auto printable = [](int c) { return (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF); };
    int shifted = 0;
    for (int c = 0; c < b; ++c) shifted += !printable(c);
    const uint32_t cp = printable(b) ? static_cast<uint32_t>(b) : 256u + static_cast<uint32_t>(shifted);
    std::string s;
    if (cp < 0x80) s += static_cast<char>(cp);
    else s += static_cast<char>(0xC0 | (cp >> 6)), s += static_cast<char>(0x80 | (cp & 0x3F));
    return s;
  };
  nlohmann::json vocab = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_char(b)] = b;
  vocab["bc"] = 256;
  vocab["bcb"] = 257;
  const std::string regex =
      "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|"
      "\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
  const nlohmann::json file = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"bc b", "b c"}}, {"ignore_merges", true}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"}, {"pattern", {{"Regex", regex}}}, {"behavior", "Isolated"}, {"invert", false}},
              {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}}}}},
          {"normalizer", nullptr},
          {"added_tokens",
           {{{"id", 258}, {"content", "<|begin_of_text|>"}}, {{"id", 259}, {"content", "<|end_of_text|>"}}}}};
  return file.dump();
}

TinyTokenizerFiles write_tiny_gpt2_tokenizer(const std::string& dir,
                                             const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json enc = nlohmann::json::object();
  int id = 0;
  for (int b = 0; b < 256; ++b) enc[gpt2_byte_token(static_cast<unsigned char>(b))] = id++;
  std::string vocab = "#version: 0.2\n";
  for (const auto& [a, b] : merges) {
    if (!enc.contains(gpt2_token_of(a + b))) enc[gpt2_token_of(a + b)] = id++;
    vocab += gpt2_token_of(a) + " " + gpt2_token_of(b) + "\n";
  }
  enc["<|endoftext|>"] = id++;
  TinyTokenizerFiles f{dir + "/encoder.json", dir + "/vocab.bpe"};
  write_all(f.encoder, enc.dump());
  write_all(f.vocab, vocab);
  return f;
}

train::TrainConfig tiny_train_config(const std::string& train_data) {
  train::TrainConfig c;
  c.model.file = fixture_path("gpt2_tiny.bin");
  c.data.train = train_data;
  c.batch.batch_size = 2;
  c.batch.seq_len = 16;
  c.compute.threads = 1;
  c.metrics.quiet = true;
  c.sampling.every = -1;
  c.sampling.tokens = 0;
  c.memory.keep_boundaries = true;  // the tests read every boundary's record
  return c;
}

std::vector<int64_t> log_steps(const std::string& jsonl_path) {
  std::istringstream rows(read_all(jsonl_path));
  std::vector<int64_t> steps;
  for (std::string line; std::getline(rows, line);)
    if (!line.empty()) steps.push_back(nlohmann::json::parse(line).at("step").get<int64_t>());
  return steps;
}

const char* chromium() {
  for (const char* c : {"/usr/bin/chromium", "/usr/bin/chromium-browser"})
    if (std::filesystem::exists(c)) return c;
  return nullptr;
}

std::string fixture_path(const std::string& name) { return std::string(TALLY_SOURCE_DIR) + "/tests/fixtures/" + name; }

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_all(const std::string& path, const std::string& data) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << data;
  ASSERT_TRUE(out.good()) << "cannot write " << path;
}

double relative_l2(const Tensor& actual, const Tensor& expected) {
  Tensor d = ops::sub(actual.to(DType::F64), expected.to(DType::F64));
  Tensor e = expected.to(DType::F64);
  return std::sqrt(ops::sum(ops::mul(d, d)).item()) / std::max(std::sqrt(ops::sum(ops::mul(e, e)).item()), 1e-30);
}

Bf16GradientDiffs expect_bf16_gradients(const nn::Transformer& model, const io::SafetensorsFile& fp32,
                                        const io::SafetensorsFile& autocast) {
  Bf16GradientDiffs d;
  for (auto& [name, shape] : nn::llmc_tensor_layout(model.config())) {
    Tensor grad = stacked_llmc_grad(model, name);
    EXPECT_EQ(grad.dtype(), DType::F32) << name;
    const double vs_fp32 = relative_l2(grad, fp32.at("grad." + name));
    const double vs_autocast = relative_l2(grad, autocast.at("grad." + name));
    d.worst_vs_fp32 = std::max(d.worst_vs_fp32, vs_fp32);
    d.best_vs_fp32 = std::min(d.best_vs_fp32, vs_fp32);
    d.worst_vs_autocast = std::max(d.worst_vs_autocast, vs_autocast);
    EXPECT_LT(vs_fp32, 1e-2) << "gradient of " << name << " against fp32";
    EXPECT_GT(vs_fp32, 1e-4) << "gradient of " << name << " equals fp32's: the GEMMs did not run in bf16";
    EXPECT_LT(vs_autocast, 1e-2) << "gradient of " << name << " against PyTorch autocast";
  }
  return d;
}

Diff compare(const Tensor& actual, const Tensor& expected) {
  EXPECT_EQ(actual.shape(), expected.shape()) << actual.str() << " vs " << expected.str();
  Diff d;
  if (actual.shape() != expected.shape()) {
    d.max_abs = INFINITY;
    return d;
  }
  auto a = actual.to_vector<double>();
  auto e = expected.to_vector<double>();
  for (size_t i = 0; i < a.size(); ++i) {
    d.max_abs = std::max(d.max_abs, std::abs(a[i] - e[i]));
    d.ref_scale = std::max(d.ref_scale, std::abs(e[i]));
  }
  return d;
}

void expect_close(const Tensor& actual, const Tensor& expected, double rtol, double atol, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what << ": result undefined";
  ASSERT_EQ(actual.shape(), expected.shape()) << what << ": " << actual.str() << " vs " << expected.str();
  auto a = actual.to_vector<double>();
  auto e = expected.to_vector<double>();
  size_t bad = 0, first = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(std::abs(a[i] - e[i]) <= atol + rtol * std::abs(e[i]))) {
      if (bad++ == 0) first = i;
    }
  }
  EXPECT_EQ(bad, 0u) << what << ": " << bad << " of " << a.size() << " elements differ; first at " << first
                     << ": got " << a[first] << ", expected " << e[first] << " (rtol " << rtol << ", atol " << atol
                     << ")";
}

Tensor random_tensor(const Shape& shape, uint64_t seed, DType dtype) {
  std::vector<double> v(static_cast<size_t>(shape_numel(shape)));
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (double& x : v) {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    x = static_cast<double>(s >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0;
  }
  Tensor t = Tensor::from_vector(v, shape);
  return dtype == DType::F64 ? t : t.to(dtype);
}

double gradcheck(const std::function<Tensor(const std::vector<Tensor>&)>& f, std::vector<Tensor> inputs, double eps) {
  for (Tensor& t : inputs)
    if (is_floating(t.dtype())) t.set_requires_grad(true);
  Tensor out = f(inputs);
  Tensor w = random_tensor(out.shape(), 99);
  Tensor loss = ops::sum(ops::mul(out, w));
  loss.backward();
  double worst = 0;
  for (Tensor& t : inputs) {
    if (!is_floating(t.dtype())) continue;
    Tensor analytic = t.grad();
    EXPECT_TRUE(analytic.defined()) << "no gradient reached " << t.str();
    if (!analytic.defined()) return INFINITY;
    auto ga = analytic.to_vector<double>();
    double* p = t.data<double>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      double orig = p[i];
      double plus, minus;
      {
        autograd::NoGradGuard ng;
        p[i] = orig + eps;
        plus = ops::sum(ops::mul(f(inputs), w)).item();
        p[i] = orig - eps;
        minus = ops::sum(ops::mul(f(inputs), w)).item();
        p[i] = orig;
      }
      double numeric = (plus - minus) / (2 * eps);
      double err = std::abs(numeric - ga[i]) / std::max(1.0, std::abs(numeric));
      worst = std::max(worst, err);
    }
  }
  return worst;
}

}  // namespace tally::test

namespace tally::test {
Tensor stacked_llmc_grad(const nn::Transformer& m, const std::string& name) {
  for (const nn::LlmcTensor& t : nn::llmc_tensors(m)) {
    if (t.name != name) continue;
    std::vector<Tensor> parts;
    for (size_t i : t.params) {
      Tensor g = m.params()[i].grad();
      if (t.vocab_rows) g = g.slice(0, 0, m.config().vocab_size);
      parts.push_back(g.reshape({-1}));
    }
    return ops::cat(parts, 0).reshape(t.shape);
  }
  ADD_FAILURE() << "no llm.c tensor " << name;
  return Tensor();
}
namespace {
// Prints only failures, prefixed with the rank: what the other ranks contribute to the log.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::fprintf(stderr, "rank %d: %s:%d: %s\n", rank_, r.file_name() ? r.file_name() : "?", r.line_number(),
                   r.summary());
  }

 private:
  int rank_;
};
}  // namespace

int run_tests_under_mpi(int argc, char** argv, dist::World** world) {
  ops::install();
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<dist::World> w = dist::World::create({});
  *world = w.get();
  if (!w->is_root()) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(w->rank()));
  }
  const int rc = RUN_ALL_TESTS();
  // A rank whose tests failed must not leave the others waiting at the next collective.
  const double failed = w->world().all_reduce_scalar(rc != 0 ? 1.0 : 0.0, dist::ReduceOp::Max);
  if (failed != 0 && rc == 0) std::fprintf(stderr, "rank %d: tests passed here but failed on another rank\n", w->rank());
  *world = nullptr;
  w.reset();
  return failed != 0 ? 1 : 0;
}

}  // namespace tally::test
