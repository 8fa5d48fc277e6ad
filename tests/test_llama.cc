// LLaMA-3 end to end against PyTorch (fixtures from scripts/gen_llama3_reference.py): the
// model read from llm.c's LLaMA file, logits, loss and every gradient at step 0, 10 AdamW
// steps, HuggingFace import (sharded, permuted q/k) and export, llm.c round trips, the
// presets' sizes, and KV-cache decoding for both families.
//
// Tolerances as GPT-2's (test_gpt2.cc): both sides fp32 with different summation orders.
// Logits are ~1e-1 here: 2e-5 absolute; each loss 1e-5 (the loss moves 7e-3 per step);
// gradients relative to each tensor's largest entry, 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>

#include "autograd/grad_mode.h"
#include "data/tokenizer.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "nn/transformer.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "support.h"
#include "nn/init.h"
#include "nn/llmc_layout.h"
#include "train/plan.h"
#include "train/sampler.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {
const io::SafetensorsFile& ref() {
  static io::SafetensorsFile f = io::read_safetensors(test::fixture_path("llama3_tiny_ref.safetensors"));
  return f;
}

std::unique_ptr<nn::Transformer> tiny_llama() {
  const std::string path = test::fixture_path("llama3_tiny.bin");
  auto m = std::make_unique<nn::Transformer>(io::read_llmc_config(path));
  io::load_llmc(path, *m);
  return m;
}


std::vector<double> train_steps(nn::Transformer& m, optim::AdamWConfig ac, double lr, double clip) {
  optim::AdamW opt(m.params(), ac);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) {
    Tensor loss = m.forward(ref().at("x"), ref().at("y")).loss;
    losses.push_back(loss.item());
    loss.backward();
    opt.step(lr, optim::clip_scale(ops::global_norm({m.params().flat_grads()}), clip));
    m.params().zero_grad();
  }
  return losses;
}

void expect_same_weights(const nn::Transformer& a, const nn::Transformer& b, double atol, const std::string& what) {
  ASSERT_EQ(a.params().size(), b.params().size()) << what;
  for (size_t i = 0; i < a.params().size(); ++i)
    test::expect_close(a.params()[i], b.params()[i], 0, atol, what + ": " + a.params().spec(i).name);
}
}  // namespace

TEST(LlamaFiles, LlmcFileFromTrainLlama3PyRecoversWhatItsHeaderTruncated) {
  // train_llama3.py wrote ffn_dim_multiplier 1.3 as 1 and norm_eps 1e-5 as 0.
  nn::TransformerConfig c = io::read_llmc_config(test::fixture_path("llama3_tiny.bin"));
  EXPECT_TRUE(c.family == nn::TransformerConfig::Family::Llama3);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_kv_head, 2);
  EXPECT_EQ(c.n_embd, 32);
  EXPECT_EQ(c.ffn_hidden, 128) << "from the file size; the header's multiplier (1) would give 96";
  EXPECT_EQ(nn::llama_ffn_hidden(32, 32, 1.0), 96);
  // The rounding kept is one that gives the width: the header's (32, 1) did not, an export
  // wrote it to config.json, and the import chose another pair, so llm.c -> HF -> llm.c
  // changed the header.
  EXPECT_EQ(nn::llama_ffn_hidden(c.n_embd, c.multiple_of, c.ffn_dim_multiplier), c.ffn_hidden)
      << c.multiple_of << ", " << c.ffn_dim_multiplier;
  EXPECT_EQ(c.vocab_size, 97);
  EXPECT_EQ(c.padded_vocab_size, 128);
  EXPECT_DOUBLE_EQ(c.norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 500000.0);
  EXPECT_DOUBLE_EQ(c.rope_factor, 8.0);
  EXPECT_FALSE(c.tie_embeddings);
}

TEST(LlamaModel, RotaryFrequenciesMatchMetasLlama31Scaling) {
  auto m = tiny_llama();
  // The fixture's frequencies fall in all three bands: kept, interpolated, divided by 8.
  test::expect_close(m->inv_freq(), ref().at("inv_freq"), 1e-6, 0, "inv_freq");
}

TEST(LlamaParity, LogitsLossAndEveryGradientMatchPyTorchAtStepZero) {
  auto m = tiny_llama();
  auto r = m->forward(ref().at("x"), ref().at("y"), true);
  const int64_t V = m->config().vocab_size;
  test::expect_close(r.logits.slice(2, 0, V).contiguous(), ref().at("logits"), 0, 2e-5, "logits");
  // The padded columns' head rows are zero, so their logits are exactly zero.
  EXPECT_EQ(test::compare(r.logits.slice(2, V, m->config().padded_vocab_size).contiguous(),
                          Tensor::zeros({4, 16, m->config().padded_vocab_size - V}))
                .max_abs,
            0.0);
  EXPECT_NEAR(r.loss.item(), ref().at("loss").item(), 1e-5);
  r.logits = Tensor();
  r.loss.backward();
  for (auto& [name, shape] : nn::llmc_tensor_layout(m->config())) {
    test::Diff d = test::compare(test::stacked_llmc_grad(*m, name), ref().at("grad." + name));
    EXPECT_LT(d.max_abs / std::max(d.ref_scale, 1e-30), 1e-4) << "gradient of " << name;
  }
}

TEST(LlamaParity, TenAdamWStepsMatchPyTorchLosses) {
  auto m = tiny_llama();
  auto losses = train_steps(*m, {0.9, 0.999, 1e-8, 0.01, /*decay_all=*/true}, 1e-4, 0);
  auto expected = ref().at("losses").to_vector<double>();
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << "step " << i;
}

TEST(LlamaParity, DecayOn2dWeightsAndClippingMatchPyTorch) {
  auto m = tiny_llama();
  auto losses = train_steps(*m, {0.9, 0.95, 1e-8, 0.1, /*decay_all=*/false}, 3e-4, 1.0);
  auto expected = ref().at("losses_wd2d").to_vector<double>();
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << "step " << i;
}

// --dtype bf16 on LLaMA, against the fp32 fixture and PyTorch's CPU autocast on the same
// model and batch (scripts/gen_llama3_bf16_reference.py); the tolerances and their
// reasons are GPT-2's (test_gpt2.cc, Gpt2MixedPrecision): the loss within 1e-4 relative of
// both, every gradient within 1e-2 relative L2 of both and more than 1e-4 from fp32's (or
// the GEMMs did not run in bf16), 10 AdamW steps within 2e-4 of autocast's losses.
// Autocast itself lands 2.8e-3..7.3e-3 from fp32 on these gradients.
TEST(LlamaMixedPrecision, Bf16MatchesFp32AndPyTorchAutocastWithinBf16Rounding) {
  static io::SafetensorsFile autocast = io::read_safetensors(test::fixture_path("llama3_tiny_bf16_ref.safetensors"));
  auto m = tiny_llama();
  m->set_matmul_dtype(DType::BF16);
  Tensor loss = m->forward(ref().at("x"), ref().at("y")).loss;
  const double fp32_loss = ref().at("loss").item();
  EXPECT_NEAR(loss.item(), fp32_loss, 1e-4 * fp32_loss);
  EXPECT_NEAR(loss.item(), autocast.at("loss").item(), 1e-4 * fp32_loss);
  loss.backward();
  const test::Bf16GradientDiffs d = test::expect_bf16_gradients(*m, ref(), autocast);
  std::printf("bf16 loss %.7f: %.2g from fp32, %.2g from autocast; gradients, relative L2: against fp32 %.2g-%.2g, "
              "against autocast at most %.2g\n", loss.item(), std::abs(loss.item() - fp32_loss),
              std::abs(loss.item() - autocast.at("loss").item()), d.best_vs_fp32, d.worst_vs_fp32, d.worst_vs_autocast);
  m->params().zero_grad();
  auto losses = train_steps(*m, {0.9, 0.999, 1e-8, 0.01, /*decay_all=*/true}, 1e-4, 0);
  auto expected = autocast.at("losses").to_vector<double>();
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(losses[i], expected[i], 2e-4) << "step " << i;
  EXPECT_LT(losses[9], losses[0] - 0.04) << "the loss must fall (by 0.063 in fp32)";
}

TEST(LlamaFiles, HuggingFaceShardedImportEqualsTheLlmcFile) {
  const std::string dir = test::fixture_path("llama3_tiny_hf");
  nn::TransformerConfig c = io::read_hf_config(dir);
  nn::TransformerConfig from_llmc = tiny_llama()->config();
  EXPECT_EQ(c.describe(), from_llmc.describe());
  EXPECT_EQ(c.ffn_hidden, 128);
  EXPECT_DOUBLE_EQ(c.rope_factor, 8.0);
  EXPECT_EQ(c.rope_original_max_position, 8192);
  nn::Transformer h(c);
  io::load_hf(dir, h);
  expect_same_weights(h, *tiny_llama(), 0, "HF import");
}

TEST(LlamaFiles, HuggingFaceExportIsHfsLayoutAndRoundTripsBitExactly) {
  auto m = tiny_llama();
  const std::string out = test::temp_path("hf_export");
  io::save_hf(out, *m);
  // Tensor for tensor what HuggingFace's own conversion wrote (permuted q/k included).
  io::SafetensorsFile mine = io::read_safetensors(out + "/model.safetensors");
  size_t compared = 0;
  for (const char* shard : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    io::SafetensorsFile theirs = io::read_safetensors(test::fixture_path(std::string("llama3_tiny_hf/") + shard));
    for (const std::string& name : theirs.order) {
      test::expect_close(mine.at(name), theirs.at(name), 0, 0, name);
      ++compared;
    }
  }
  EXPECT_EQ(compared, mine.order.size());
  nn::Transformer back(io::read_hf_config(out));
  io::load_hf(out, back);
  expect_same_weights(back, *m, 0, "fp32 round trip");
  // llm.c -> HF -> llm.c is the same file, header included: HF's config has no field for
  // Meta's FFN rounding (multiple_of, ffn_dim_multiplier), so tally's export carries it.
  // Returns the model read back from HF, after checking llm.c -> HF -> llm.c gives `model`'s file.
  auto llmc_hf_llmc = [](const nn::Transformer& model, const std::string& name) {
    const std::string llmc = test::temp_path(name + ".bin"), hf = test::temp_path(name + "_hf"),
                      again = test::temp_path(name + "_again.bin");
    io::save_llmc(llmc, model);
    io::save_hf(hf, model);
    auto back = std::make_unique<nn::Transformer>(io::read_hf_config(hf));
    io::load_hf(hf, *back);
    io::save_llmc(again, *back);
    EXPECT_TRUE(test::read_all(again) == test::read_all(llmc)) << "llm.c -> HF -> llm.c changed " << name << "'s file";
    return back;
  };
  nn::Transformer d2(nn::TransformerConfig::preset("llama3-d2"));  // multiple_of 256; 512 also gives its width
  nn::init_weights(d2, 3);
  EXPECT_EQ(llmc_hf_llmc(d2, "d2")->config().multiple_of, 256);
  // The same from a train_llama3.py file, whose header's rounding did not give its width.
  nn::Transformer tiny(io::read_llmc_config(test::fixture_path("llama3_tiny.bin")));
  io::load_llmc(test::fixture_path("llama3_tiny.bin"), tiny);
  llmc_hf_llmc(tiny, "tiny");
  // bf16: the weights rounded once, and a second round trip changes nothing.
  const std::string out16 = test::temp_path("hf_export_bf16");
  io::save_hf(out16, *m, true);
  nn::Transformer b16(io::read_hf_config(out16));
  io::load_hf(out16, b16);
  for (size_t i = 0; i < m->params().size(); ++i)
    test::expect_close(b16.params()[i], m->params()[i].to(DType::BF16).to(DType::F32), 0, 0, "bf16 export");
}

TEST(LlamaFiles, ExportIntoASavedShardedModelReplacesItInsteadOfBreakingIt) {
  // HuggingFace's own save of this model is sharded: an index and two shards. Exporting
  // over it wrote model.safetensors beside them, but loaders (transformers, and tally)
  // read the index first: the directory then failed to load ("missing tensor"), or loaded
  // the old weights. The export removes the index and the shards it names.
  const std::string dir = test::temp_path("over_sharded");
  std::filesystem::copy(test::fixture_path("llama3_tiny_hf"), dir);
  test::write_all(dir + "/README.md", "kept");
  auto m = tiny_llama();
  for (size_t i = 0; i < m->params().size(); ++i) m->params()[i].detach().fill_(0.5 + 0.001 * static_cast<double>(i));
  io::save_hf(dir, *m);
  EXPECT_FALSE(std::filesystem::exists(dir + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/model-00001-of-00002.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/model-00002-of-00002.safetensors"));
  EXPECT_EQ(test::read_all(dir + "/README.md"), "kept") << "files the index does not name stay";
  nn::Transformer back(io::read_hf_config(dir)), fresh(io::read_hf_config(dir));
  io::load_hf(dir, back);
  const std::string empty_dir = test::temp_path("fresh_export");
  io::save_hf(empty_dir, *m);
  io::load_hf(empty_dir, fresh);  // the vocabulary's padding rows are not exported: compare like with like
  expect_same_weights(back, fresh, 0, "the exported weights, not the old ones");
  test::expect_close(back.params().get("h.0.attn.c_proj.weight"), m->params().get("h.0.attn.c_proj.weight"), 0, 0, "a layer");
}

TEST(LlamaFiles, LlmcRoundTripKeepsTheExactConfigTiedHeadIncluded) {
  auto m = tiny_llama();
  const std::string p = test::temp_path("llama.bin");
  io::save_llmc(p, *m);
  nn::Transformer back(io::read_llmc_config(p));
  io::load_llmc(p, back);
  EXPECT_EQ(back.config().describe(), m->config().describe());
  expect_same_weights(back, *m, 0, "llm.c round trip");

  nn::TransformerConfig tied = m->config();
  tied.tie_embeddings = true;
  tied.rope_factor = 32;  // 3.2's factor, which train_llama3.py's header cannot say
  tied.norm_eps = 1e-6;
  nn::Transformer t(tied);
  nn::init_weights(t, 5);
  io::save_llmc(p, t);
  nn::TransformerConfig read = io::read_llmc_config(p);
  EXPECT_TRUE(read.tie_embeddings);
  EXPECT_DOUBLE_EQ(read.rope_factor, 32.0);
  EXPECT_DOUBLE_EQ(read.norm_eps, 1e-6);
  nn::Transformer t2(read);
  io::load_llmc(p, t2);
  expect_same_weights(t2, t, 0, "tied round trip");
}

TEST(LlamaFiles, TruncatedOrForeignFilesFailNamingTheFile) {
  const std::string bytes = test::read_all(test::fixture_path("llama3_tiny.bin"));
  const std::string p = test::temp_path("bad.bin");
  test::write_all(p, bytes.substr(0, bytes.size() - 4));
  std::string msg = test::message_of<Error>([&] { io::read_llmc_config(p); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("no FFN width fits"), std::string::npos) << msg;
  // A config.json naming another model type.
  const std::string dir = test::temp_path("hf_other");
  fs::create_directories(dir);
  test::write_all(dir + "/config.json", R"({"model_type": "mistral"})");
  test::write_all(dir + "/model.safetensors", "");
  msg = test::message_of<Error>([&] { io::read_hf_config(dir); });
  EXPECT_NE(msg.find("mistral"), std::string::npos) << msg;
}

TEST(LlamaModel, PresetsHaveMetasParameterCounts) {
  // HuggingFace's published counts (tied embeddings for 3.2 1B and 3B, untied for 3.1 8B),
  // from the plan's formulas, with no model memory allocated.
  const std::pair<const char*, int64_t> published[] = {
      {"llama3.2-1b", 1235814400}, {"llama3.2-3b", 3212749824}, {"llama3.1-8b", 8030261248}};
  for (auto& [name, count] : published) {
    nn::TransformerConfig c = nn::TransformerConfig::preset(name);
    EXPECT_EQ(train::parameter_count(c), count) << name;
  }
  EXPECT_EQ(nn::TransformerConfig::preset("llama3.1-8b").ffn_hidden, 14336);
  EXPECT_EQ(nn::TransformerConfig::preset("llama3.2-1b").ffn_hidden, 8192);
  // And the formula agrees with a built model.
  nn::Transformer small(nn::TransformerConfig::preset("llama3-d2"));
  EXPECT_EQ(train::parameter_count(small.config()), small.num_parameters());
  EXPECT_EQ(train::parameter_count(tiny_llama()->config()), tiny_llama()->num_parameters());
  // Every llama3-dN the help offers is a valid model: N heads sharing N/2 key/value heads
  // (grouped-query attention) when N is even, else the largest divisor of N up to N/2
  // (odd N >= 5 had N/2, which does not divide N: "n_head 5 is not a multiple of 2").
  for (int n = 1; n <= 64; ++n) {
    const std::string name = "llama3-d" + std::to_string(n);
    nn::TransformerConfig c;
    ASSERT_NO_THROW(c = nn::TransformerConfig::preset(name)) << name;
    EXPECT_EQ(c.n_head, n) << name;
    EXPECT_EQ(c.n_head % c.n_kv_head, 0) << name;
    if (n % 2 == 0) {
      EXPECT_EQ(c.n_kv_head, n / 2) << name;
    }
  }
  for (auto [n, kv] : {std::pair{1, 1}, {3, 1}, {5, 1}, {9, 3}, {15, 5}, {63, 21}})
    EXPECT_EQ(nn::TransformerConfig::preset("llama3-d" + std::to_string(n)).n_kv_head, kv) << "llama3-d" << n;
}

namespace {
// Decodes `tokens` one at a time through a KV cache after a prompt of `prompt` tokens and
// compares every position's logits with one full forward.
void expect_cached_decoding_matches_full_forward(const nn::Transformer& m, const Tensor& tokens, int64_t prompt) {
  autograd::InferenceModeGuard inference;
  const int64_t B = tokens.shape()[0], T = tokens.shape()[1];
  Tensor full = m.forward(tokens, Tensor(), true).logits;
  nn::KvCache cache = m.make_kv_cache(B, T);
  std::vector<Tensor> pieces{m.forward(tokens.slice(1, 0, prompt).contiguous(), Tensor(), true, &cache).logits};
  for (int64_t t = prompt; t < T; ++t)
    pieces.push_back(m.forward(tokens.slice(1, t, t + 1).contiguous(), Tensor(), true, &cache).logits);
  EXPECT_EQ(cache.length, T);
  test::expect_close(ops::cat(pieces, 1), full, 0, 1e-5, "cached decoding");
}
}  // namespace

TEST(KvCache, IncrementalDecodingEqualsAFullForwardForBothFamilies) {
  Tensor tokens = ref().at("x").slice(0, 0, 2).contiguous();  // (2, 16)
  expect_cached_decoding_matches_full_forward(*tiny_llama(), tokens, 5);
  nn::Transformer gpt2(io::read_llmc_config(test::fixture_path("gpt2_tiny.bin")));
  io::load_llmc(test::fixture_path("gpt2_tiny.bin"), gpt2);
  expect_cached_decoding_matches_full_forward(gpt2, tokens, 1);
}

TEST(KvCache, RefusesGradientsAndOverflow) {
  auto m = tiny_llama();
  nn::KvCache cache = m->make_kv_cache(1, 4);
  Tensor five = Tensor::from_vector<int32_t>({1, 2, 3, 4, 5}, {1, 5});
  {
    autograd::InferenceModeGuard inference;
    EXPECT_NE(test::message_of<Error>([&] { m->forward(five, Tensor(), true, &cache); }).find("KV cache"),
              std::string::npos);
  }
  EXPECT_NE(test::message_of<Error>([&] { m->forward(five.slice(1, 0, 1).contiguous(), Tensor(), true, &cache); })
                .find("inference"),
            std::string::npos);
}

TEST(Sampler, TiedLogitsGoToTheLowestTokenId) {
  // Equal logits (here all of them: every weight is 0) are broken as argmax breaks them in
  // PyTorch and llm.c: the lowest token id. bf16 logits (--dtype bf16's samples) tie far
  // more often than fp32 ones: 8 significant bits. Greedy took the highest id, and top-k
  // kept the highest ids of a tied boundary.
  auto m = tiny_llama();
  m->params().flat_params().fill_(0.0);
  Rng rng(1);
  train::SampleOptions greedy;
  greedy.tokens = 3;
  greedy.temperature = 0;
  EXPECT_EQ(train::sample(*m, {1, 2, 3}, greedy, rng), (std::vector<int32_t>{0, 0, 0}));
  // top-k = 1 at any temperature keeps one token of the tie: the lowest id.
  train::SampleOptions top1 = greedy;
  top1.temperature = 1.0;
  top1.top_k = 1;
  EXPECT_EQ(train::sample(*m, {1, 2, 3}, top1, rng), (std::vector<int32_t>{0, 0, 0}));
}

TEST(Sampler, WithoutATokenizerASampleStartsAndStopsWhereTheFamilysDocumentsDo) {
  // `tally sample` without --tokenizer (and the trainer's samples) started every sample
  // from the vocabulary's last id: GPT-2's <|endoftext|>, but for LLaMA-3's 128,256 a
  // reserved token its data never holds (tokenize writes <|begin_of_text|>, 128000), and
  // stopped only there, so --stop-at-eot never ended a LLaMA sample.
  nn::TransformerConfig llama = nn::TransformerConfig::preset("llama3-d1");
  ASSERT_EQ(llama.vocab_size, 128256);
  train::DocumentBounds b = train::document_bounds(llama, nullptr);
  EXPECT_EQ(b.start, 128000);
  EXPECT_EQ(b.stops, (std::vector<int32_t>{128001, 128000}));
  nn::TransformerConfig gpt2 = nn::TransformerConfig::preset("d1");
  b = train::document_bounds(gpt2, nullptr);
  EXPECT_EQ(b.start, 50256);
  EXPECT_EQ(b.stops, (std::vector<int32_t>{50256}));
  // Another vocabulary has no known separator: its last id, as before.
  llama.vocab_size = 97;
  llama.padded_vocab_size = 128;
  b = train::document_bounds(llama, nullptr);
  EXPECT_EQ(b.start, 96);
  EXPECT_EQ(b.stops, (std::vector<int32_t>{96}));
  // An llm.c tokenizer .bin of LLaMA-3's vocabulary only decodes, and names one token, its
  // end of text (128001): samples started there and 128000 no longer stopped them, so
  // adding --tokenizer changed what was sampled. The family's bounds stand.
  std::string file(256 * sizeof(int32_t), '\0');
  const int32_t header[4] = {20240328, 2, 128256, 128001};
  std::memcpy(file.data(), header, sizeof header);
  for (int32_t id = 0; id < 128256; ++id) file += std::string{'\x01', static_cast<char>('a' + id % 26)};
  const std::string path = test::temp_path("llama3_tokenizer.bin");
  test::write_all(path, file);
  const data::Tokenizer decode_only = data::Tokenizer::load_path(path);
  ASSERT_FALSE(decode_only.can_encode());
  llama = nn::TransformerConfig::preset("llama3-d1");
  b = train::document_bounds(llama, &decode_only);
  EXPECT_EQ(b.start, 128000);
  EXPECT_EQ(b.stops, (std::vector<int32_t>{128001, 128000}));
}

// Weights holding NaN (a foreign file: training stops before such an update) sampled
// silently: greedy picked the same token every time, and the sort for top-k was given an
// ordering NaN breaks (undefined behaviour).
TEST(Sampler, LogitsThatAreNotFiniteStopTheSampleNamingThem) {
  auto m = tiny_llama();
  {
    autograd::NoGradGuard no_grad;
    m->params()[m->params().index_of("ln_f.weight")].fill_(std::numeric_limits<float>::quiet_NaN());
  }
  train::SampleOptions opt;
  opt.tokens = 4;
  Rng rng(1);
  for (double temperature : {0.0, 1.0}) {
    opt.temperature = temperature;
    const std::string msg = test::message_of<Error>([&] { train::sample(*m, {1, 2, 3}, opt, rng); });
    EXPECT_NE(msg.find("logits are not finite"), std::string::npos) << msg;
  }
}

TEST(Sampler, NucleusOfATinyMassIsGreedyAndStopTokensEndASample) {
  auto m = tiny_llama();
  train::SampleOptions greedy;
  greedy.tokens = 12;
  greedy.temperature = 0;
  Rng rng(1);
  const std::vector<int32_t> want = train::sample(*m, {1, 2, 3}, greedy, rng);
  ASSERT_EQ(want.size(), 12u);
  train::SampleOptions nucleus = greedy;
  nucleus.temperature = 1.0;
  nucleus.top_k = 0;
  nucleus.top_p = 1e-9;  // only the likeliest token is inside the nucleus
  EXPECT_EQ(train::sample(*m, {1, 2, 3}, nucleus, rng), want);
  // Decoding past the context restarts the cache from the last half and keeps going.
  train::SampleOptions longer = greedy;
  longer.tokens = 40;  // the model's context is 32
  EXPECT_EQ(train::sample(*m, {1, 2, 3}, longer, rng).size(), 40u);
  train::SampleOptions stop = greedy;
  stop.stop_tokens = {want[4]};
  const auto cut = train::sample(*m, {1, 2, 3}, stop, rng);
  EXPECT_EQ(cut.back(), want[4]);
  EXPECT_LE(cut.size(), 5u);
  // As many tokens as int64 holds: until a stop token (the prompt plus the count
  // overflowed, and the KV cache was asked for a negative length).
  stop.tokens = std::numeric_limits<int64_t>::max();
  EXPECT_EQ(train::sample(*m, {1, 2, 3}, stop, rng), cut);
}
