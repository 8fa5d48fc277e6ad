// GPT-2 end to end against PyTorch (fixtures from scripts/gen_gpt2_reference.py), the
// llm.c and HuggingFace file formats, bit-exact resume, and memory flatness of training.
//
// Tolerances (fp32 on both sides, different summation orders): logits and loss agree to
// ~1e-7 relative; we allow 2e-5 absolute on logits (|logits| <= 0.54) and 1e-5 on each
// loss, 100x the observed noise yet far below the 8e-3 the loss moves per step, so a
// wrong update or a wrong gradient fails. Gradients are compared relative to each tensor's
// largest entry (some, like ln_1.weight's, are ~1e-3 in total): 1e-4.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include <nlohmann/json.hpp>

#include "autograd/engine.h"
#include "autograd/observer.h"
#include "data/token_shard.h"
#include "io/files.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "io/safetensors.h"
#include "nn/transformer.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"
#include "runtime/backend.h"
#include "support.h"
#include "nn/init.h"
#include "nn/llmc_layout.h"
#include "train/trainer.h"

using namespace tally;
namespace fs = std::filesystem;

namespace {
const io::SafetensorsFile& ref() {
  static io::SafetensorsFile f = io::read_safetensors(test::fixture_path("gpt2_tiny_ref.safetensors"));
  return f;
}

std::unique_ptr<nn::Transformer> tiny_model() {
  const std::string path = test::fixture_path("gpt2_tiny.bin");
  auto m = std::make_unique<nn::Transformer>(io::read_llmc_config(path));
  io::load_llmc(path, *m);
  return m;
}


double relative_max_diff(const Tensor& a, const Tensor& b) {
  test::Diff d = test::compare(a, b);
  return d.max_abs / std::max(d.ref_scale, 1e-30);
}

std::vector<double> train_on_fixture_batch(nn::Transformer& m, optim::AdamWConfig ac, double lr, double clip,
                                           std::vector<double>* norms) {
  optim::AdamW opt(m.params(), ac);
  std::vector<double> losses;
  for (int i = 0; i < 10; ++i) {
    Tensor loss = m.forward(ref().at("x"), ref().at("y")).loss;
    losses.push_back(loss.item());
    loss.backward();
    double norm = ops::global_norm({m.params().flat_grads()});
    if (norms) norms->push_back(norm);
    opt.step(lr, optim::clip_scale(norm, clip));
    m.params().discard_grads();  // as the trainer does: the next backward writes them afresh
  }
  return losses;
}
}  // namespace

TEST(Gpt2Parity, LogitsLossAndEveryGradientMatchPyTorchAtStepZero) {
  auto m = tiny_model();
  auto r = m->forward(ref().at("x"), ref().at("y"), true);
  test::expect_close(r.logits, ref().at("logits"), 0, 2e-5, "logits");
  EXPECT_NEAR(r.loss.item(), ref().at("loss").item(), 1e-5);
  r.logits = Tensor();
  r.loss.backward();
  for (auto& [name, shape] : nn::llmc_tensor_layout(m->config())) {
    double rel = relative_max_diff(test::stacked_llmc_grad(*m, name), ref().at("grad." + name));
    EXPECT_LT(rel, 1e-4) << "gradient of " << name;
  }
}

// The head and loss fused in chunks of 5 rows (the batch has 64, so 13 chunks, the last
// partial): the same math in another order, held to the unfused test's tolerances.
TEST(Gpt2Parity, ChunkedLossMatchesPyTorchLossAndEveryGradient) {
  auto m = tiny_model();
  m->set_loss_chunk_rows(5);
  Tensor loss = m->forward(ref().at("x"), ref().at("y")).loss;
  EXPECT_NEAR(loss.item(), ref().at("loss").item(), 1e-5);
  loss.backward();
  for (auto& [name, shape] : nn::llmc_tensor_layout(m->config())) {
    double rel = relative_max_diff(test::stacked_llmc_grad(*m, name), ref().at("grad." + name));
    EXPECT_LT(rel, 1e-4) << "gradient of " << name;
  }
}

// --chunked-loss's chunk: 32 MiB of fp32 logits, but never under 128 rows, where the head's
// GEMMs slow down (transformer.h has the measurements).
TEST(ChunkedLoss, ThirtyTwoMiBOfLogitsButNeverFewerThan128Rows) {
  EXPECT_EQ(nn::Transformer::default_loss_chunk_rows(50304), 166);   // GPT-2: 32 MiB / (4 x 50,304)
  EXPECT_EQ(nn::Transformer::default_loss_chunk_rows(128256), 128);  // LLaMA-3: 65 rows of 32 MiB
  EXPECT_EQ(nn::Transformer::default_loss_chunk_rows(65536), 128);   // exactly 128 rows of 32 MiB
  EXPECT_EQ(nn::Transformer::default_loss_chunk_rows(256), 32768);   // a test model's vocabulary
}

TEST(Gpt2Parity, TenAdamWStepsMatchPyTorchLosses) {
  auto m = tiny_model();
  optim::AdamWConfig ac{0.9, 0.999, 1e-8, 0.01, /*decay_all=*/true};
  auto losses = train_on_fixture_batch(*m, ac, 1e-4, 0, nullptr);
  auto expected = ref().at("losses").to_vector<double>();
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(losses[i], expected[i], 1e-5) << "step " << i;
}

TEST(Gpt2Parity, DecayOn2dWeightsAndClippingMatchPyTorch) {
  auto m = tiny_model();
  optim::AdamWConfig ac{0.9, 0.95, 1e-8, 0.1, /*decay_all=*/false};
  std::vector<double> norms;
  auto losses = train_on_fixture_batch(*m, ac, 3e-4, 1.0, &norms);
  auto expected = ref().at("losses_wd2d").to_vector<double>();
  auto expected_norms = ref().at("grad_norms_wd2d").to_vector<double>();
  for (int i = 0; i < 10; ++i) {
    EXPECT_NEAR(losses[i], expected[i], 1e-5) << "step " << i;
    EXPECT_NEAR(norms[i], expected_norms[i], 1e-4 * expected_norms[i]) << "step " << i;
  }
}

// --dtype bf16 (mixed precision): the projections' GEMMs and attention's tile products take
// bf16 operands, everything else stays fp32. Reference: the fp32 fixture, and PyTorch's CPU autocast (bfloat16) on the
// same model and batch (scripts/gen_bf16_reference.py). bf16 keeps 8 significant bits, a
// relative rounding of u = 2^-8 ~ 3.9e-3 per operand. Tolerances, per quantity:
//  - the loss: 1e-4 relative (u/40). The logits' rounding errors are unbiased and average
//    out in the mean over rows; measured 1.0e-5 from fp32 and 1.8e-5 from autocast;
//  - every gradient: relative L2 error <= 1e-2 (2.5u: a few rounded operands per product,
//    and dy is rounded once more in backward) against fp32 and against autocast; measured
//    1.9e-3..4.6e-3 and at most 6.0e-3 (printed); autocast itself lands 2.6e-3..5.9e-3
//    from fp32;
//  - and each must differ from fp32 by more than 1e-4, or the GEMMs did not run in bf16;
//  - 10 AdamW steps: each loss within 2e-4 of autocast's (measured at most 4e-5).

TEST(Gpt2MixedPrecision, Bf16MatchesFp32AndPyTorchAutocastWithinBf16Rounding) {
  static io::SafetensorsFile autocast = io::read_safetensors(test::fixture_path("gpt2_tiny_bf16_ref.safetensors"));
  auto m = tiny_model();
  m->set_matmul_dtype(DType::BF16);
  EXPECT_EQ(m->params().compute_copy(0).dtype(), DType::BF16);
  Tensor loss = m->forward(ref().at("x"), ref().at("y")).loss;
  EXPECT_EQ(loss.dtype(), DType::F32);
  const double fp32_loss = ref().at("loss").item();
  EXPECT_NEAR(loss.item(), fp32_loss, 1e-4 * fp32_loss);
  EXPECT_NEAR(loss.item(), autocast.at("loss").item(), 1e-4 * fp32_loss);
  loss.backward();
  const test::Bf16GradientDiffs d = test::expect_bf16_gradients(*m, ref(), autocast);
  std::printf("bf16 loss %.7f: %.2g from fp32, %.2g from autocast; gradients, relative L2: against fp32 %.2g-%.2g, "
              "against autocast at most %.2g\n", loss.item(), std::abs(loss.item() - fp32_loss),
              std::abs(loss.item() - autocast.at("loss").item()), d.best_vs_fp32, d.worst_vs_fp32, d.worst_vs_autocast);
  m->params().zero_grad();

  // Ten AdamW steps: the bf16 copy must follow the master weights after every update.
  auto losses = train_on_fixture_batch(*m, optim::AdamWConfig{0.9, 0.999, 1e-8, 0.01, true}, 1e-4, 0, nullptr);
  auto expected = autocast.at("losses").to_vector<double>();
  for (int i = 0; i < 10; ++i) EXPECT_NEAR(losses[i], expected[i], 2e-4) << "step " << i;
  EXPECT_LT(losses[9], losses[0] - 0.04) << "the loss must fall (by 0.069 in fp32)";
  for (size_t i = 0; i < m->params().size(); ++i)
    test::expect_close(m->params().compute_copy(i).to(DType::F32), m->params()[i].to(DType::BF16).to(DType::F32), 0, 0,
                       m->params().spec(i).name);
}

TEST(Gpt2MixedPrecision, ALossOnTheReturnedBf16LogitsBackpropagatesBesideTheCrossEntropy) {
  // Under bf16 the head's logits are bf16 and returned widened to fp32. A term on the
  // returned logits (a z-loss, say) sends the logits a second gradient beside the
  // cross-entropy's, and the engine sums the two in bf16: the sum once had no bf16 kernel.
  // The gradient of loss + 0 * mean(logits) is the loss's own (to bf16 rounding of the sum).
  auto m = tiny_model();
  m->set_matmul_dtype(DType::BF16);
  nn::ForwardResult plain = m->forward(ref().at("x"), ref().at("y"));
  plain.loss.backward();
  Tensor want = test::stacked_llmc_grad(*m, "wte").clone();
  m->params().zero_grad();
  nn::ForwardResult r = m->forward(ref().at("x"), ref().at("y"), true);
  ASSERT_EQ(r.logits.dtype(), DType::F32);
  ops::add(r.loss, ops::scale(ops::mean(r.logits), 0.0)).backward();
  test::expect_close(test::stacked_llmc_grad(*m, "wte"), want, 0, 1e-6, "wte's gradient");
}

// Selective recomputation keeps only attention's q, k, v, and backward makes the output and
// log-sum-exp again. What a forward leaves live drops by exactly what nothing else holds:
// the log-sum-exp (H floats per token per layer), since the output projection saves the
// attention output anyway (under mixed precision a bf16 output, which it takes as it is:
// once an fp32 one, of which it kept a bf16 copy, so C floats more went). There q, k, v stay the attention's
// bf16 copies: keeping the fp32 q, k, v views instead, as a checkpoint of the attention's
// inputs would, holds the whole fp32 projection and makes selective cost more than no
// recomputation. The loss and gradients do not change.
TEST(Gpt2Recompute, SelectiveAttentionKeepsOnlyQkvInFp32AndBf16) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    auto m = tiny_model();
    m->set_matmul_dtype(dtype);
    const nn::TransformerConfig& c = m->config();
    const Tensor& x = ref().at("x");
    auto forward_holds = [&](nn::Recompute r, double* loss_value, std::vector<float>* grad) {
      m->set_recompute(r);
      m->params().zero_grad();
      const int64_t base = runtime::ledger().stats().allocated;
      Tensor loss = m->forward(x, ref().at("y")).loss;
      const int64_t held = runtime::ledger().stats().allocated - base;
      loss.backward();
      *loss_value = loss.item();
      *grad = m->params().flat_grads().to_vector<float>();
      return held;
    };
    double loss_none = 0, loss_selective = 0, warm = 0;
    std::vector<float> grad_none, grad_selective, unused;
    forward_holds(nn::Recompute::None, &warm, &unused);  // gradients and caches allocated once
    const int64_t none = forward_holds(nn::Recompute::None, &loss_none, &grad_none);
    const int64_t selective = forward_holds(nn::Recompute::Selective, &loss_selective, &grad_selective);
    const int64_t tokens = x.numel();
    const std::string tag = dtype_name(dtype);
    EXPECT_EQ(none - selective, c.n_layer * tokens * c.n_head * 4) << tag;
    EXPECT_EQ(loss_selective, loss_none) << tag;
    EXPECT_EQ(grad_selective, grad_none) << tag << ": the recomputed forward is the same kernel on the same inputs";
  }
}

// Data parallel buckets its all-reduce on "this parameter's gradient is final": every
// parameter must be announced exactly once per backward, in backward order, although the
// linear and embedding weights' gradients are written in place (grad sinks), and the
// tied token embedding (used by the first and the last op) only once both uses are done.
TEST(Gpt2Backward, EveryParameterIsAnnouncedFinalOnceInBackwardOrder) {
  auto m = tiny_model();
  struct {
    std::vector<std::string> order;
  } rec;
  for (size_t i = 0; i < m->params().size(); ++i)
    m->params()[i].register_post_accumulate_hook([&](const Tensor& leaf) { rec.order.push_back(leaf.name()); });
  for (int pass = 0; pass < 2; ++pass) {  // the second backward has its gradient sinks allocated
    rec.order.clear();
    m->forward(ref().at("x"), ref().at("y")).loss.backward();
    ASSERT_EQ(rec.order.size(), m->params().size()) << "pass " << pass;
    std::set<std::string> unique(rec.order.begin(), rec.order.end());
    EXPECT_EQ(unique.size(), m->params().size()) << "pass " << pass;
    auto at = [&](const std::string& n) { return std::find(rec.order.begin(), rec.order.end(), n) - rec.order.begin(); };
    const int64_t L = m->config().n_layer;
    EXPECT_LT(at("ln_f.weight"), at("h." + std::to_string(L - 1) + ".mlp.c_proj.weight"));
    EXPECT_LT(at("h." + std::to_string(L - 1) + ".ln_1.weight"), at("h.0.mlp.c_fc.weight"));
    EXPECT_LT(at("h.0.ln_1.weight"), at("wpe"));
    EXPECT_EQ(rec.order.back(), "wte") << "the tied embedding is final only after the embedding's backward, "
                                          "not when the head (its first use in backward) is done";
  }
}

// The trainer sums the gradient norm during a step's last backward, each parameter's
// gradient as the engine announces it final (optim/grad_norm.h), instead of in a pass of its
// own after backward. The sum must be the norm of the gradients AdamW then reads, bit for
// bit the per-parameter sum taken after backward, however a step reaches a gradient: a
// GEMM writing it in place, the tied embedding's two uses, a recomputed layer's own
// backward, an earlier microbatch's gradient the last one adds to, and a parameter the last
// backward does not reach at all (summed by finish()). Against the flat block's sum, whose
// fp32 blocks of 4096 straddle parameters, it agrees within the rounding of those partial
// sums (~1e-7 relative): 1e-6.
TEST(Gpt2Backward, TheNormSummedDuringBackwardIsTheNormOfTheFinalGradients) {
  for (DType dtype : {DType::F32, DType::BF16})
    for (nn::Recompute recompute : {nn::Recompute::None, nn::Recompute::Full}) {
      auto m = tiny_model();
      m->set_matmul_dtype(dtype);
      m->set_recompute(recompute);
      const nn::ParameterStore& params = m->params();
      optim::BackwardGradientNorm during(params);
      auto microbatch = [&] { m->forward(ref().at("x"), ref().at("y")).loss.backward(); };
      for (int microbatches : {1, 2, 1}) {
        const std::string tag = std::string(dtype_name(dtype)) + (recompute == nn::Recompute::Full ? ", full recompute" : "") +
                                ", " + std::to_string(microbatches) + " microbatch(es)";
        params.discard_grads();
        for (int mb = 0; mb < microbatches; ++mb) {
          if (mb + 1 == microbatches) during.arm();
          microbatch();
        }
        const double norm = during.finish();
        EXPECT_EQ(norm, optim::gradient_norm(params)) << tag;
        EXPECT_NEAR(norm, ops::global_norm({params.flat_grads()}), 1e-6 * norm) << tag;
        EXPECT_GT(norm, 0.0) << tag;
      }
      // The last backward reaches wpe only; every other gradient is the first microbatch's.
      params.discard_grads();
      microbatch();
      during.arm();
      const Tensor& wpe = params.get("wpe");
      ops::sum(ops::mul(wpe, wpe)).backward();
      EXPECT_EQ(during.finish(), optim::gradient_norm(params)) << dtype_name(dtype) << ", a last backward reaching wpe only";
    }
}

// The trainer discards the gradients after AdamW instead of zeroing them (a pass writing
// 4 bytes per parameter), and the next backward writes them afresh: each weight
// gradient's first GEMM runs with beta 0, the embeddings' scatters start from zeros, the
// norms' gradients are copied. One backward after a discard gives the gradients of one
// after zero_grad bit for bit, and a second microbatch adds to them as before, in fp32
// and bf16; the buffers are poisoned with NaN, so reading their stale bytes shows.
TEST(Gpt2Backward, DiscardedGradientsAreWrittenAfreshBitForBit) {
  for (DType dtype : {DType::F32, DType::BF16}) {
    auto m = tiny_model();
    m->set_matmul_dtype(dtype);
    auto backward = [&] {
      m->forward(ref().at("x"), ref().at("y")).loss.backward();
      return m->params().flat_grads().to_vector<float>();
    };
    m->params().zero_grad();
    const std::vector<float> one = backward(), two = backward();
    const Tensor block = m->params().flat_grads();  // a handle: sees the bytes, discarded or not
    m->params().discard_grads();
    block.fill_(std::nan(""));
    EXPECT_EQ(backward(), one) << dtype_name(dtype);
    EXPECT_EQ(backward(), two) << dtype_name(dtype);
  }
}

TEST(ParameterStore, DiscardedGradientsReadZeroAndARangeSettlesOnlyItsOwn) {
  nn::ParameterStore s;
  s.declare("a", {2}, true);
  s.declare("b", {3}, true);
  s.declare("c", {1}, false);
  s.allocate();
  const Tensor block = s.flat_grads();
  block.fill_(1.0);
  s.discard_grads();
  block.fill_(std::nan(""));
  // Data parallel reduces b and c while backward may still write a.
  EXPECT_EQ(s.grads_of(1, 3).to_vector<float>(), std::vector<float>(4, 0.f));
  const std::vector<float> bytes = block.to_vector<float>();
  EXPECT_TRUE(std::isnan(bytes[0]) && std::isnan(bytes[1])) << "a's gradient must be left for backward to write";
  EXPECT_EQ(s.grads_of(0, 0).numel(), 0);
  EXPECT_EQ(s.flat_grads().to_vector<float>(), std::vector<float>(6, 0.f));
  // Written since, a gradient is no longer discarded: reading the block leaves it alone.
  s.discard_grads();
  s[1].grad().fill_(2.0);
  block.fill_(3.0);
  EXPECT_EQ(s.flat_grads().to_vector<float>(), (std::vector<float>{0, 0, 3, 3, 3, 0}));
  EXPECT_THROW(s.grads_of(2, 4), Error);
}

TEST(Gpt2Files, LlmcRoundTripIsExactInFp32AndRoundedInBf16) {
  auto m = tiny_model();
  std::string p32 = test::temp_path("tiny32.bin"), p16 = test::temp_path("tiny16.bin");
  io::save_llmc(p32, *m);
  io::save_llmc(p16, *m, true);
  EXPECT_EQ(fs::file_size(p32), fs::file_size(test::fixture_path("gpt2_tiny.bin")));
  EXPECT_EQ(fs::file_size(p16), 1024 + 2 * static_cast<uintmax_t>(m->num_parameters()));
  nn::Transformer a(io::read_llmc_config(p32)), b(io::read_llmc_config(p16));
  io::load_llmc(p32, a);
  io::load_llmc(p16, b);
  test::expect_close(a.params().flat_params(), m->params().flat_params(), 0, 0, "fp32 round trip");
  test::expect_close(b.params().flat_params(), m->params().flat_params(), 1.0 / 256, 1e-30, "bf16 round trip");
  // A LayerNorm eps other than GPT-2's 1e-5 (a HuggingFace config's layer_norm_epsilon,
  // which --init-from trains with) is kept: llm.c's header has no slot for it, and a
  // checkpoint read back as 1e-5, so a resume or an export changed the model unseen.
  nn::TransformerConfig wide_eps = m->config();
  wide_eps.norm_eps = 0.3;
  nn::Transformer e(wide_eps);
  nn::init_weights(e, 3);
  const std::string pe = test::temp_path("eps.bin");
  io::save_llmc(pe, e);
  EXPECT_EQ(io::read_llmc_config(pe).norm_eps, 0.3);
  EXPECT_EQ(io::read_llmc_config(p32).norm_eps, 1e-5);
  EXPECT_EQ(io::read_llmc_config(test::fixture_path("gpt2_tiny.bin")).norm_eps, 1e-5) << "llm.c's files: GPT-2's";
}

TEST(Gpt2Files, CorruptModelFilesFailNamingTheFileAndTheMismatch) {
  std::string good = test::fixture_path("gpt2_tiny.bin");
  std::string bytes = io::read_file(good);
  auto expect_error = [&](const std::string& content, const std::string& needle) {
    std::string p = test::temp_path("bad.bin");
    { std::ofstream(p, std::ios::binary) << content; }
    try {
      io::read_llmc_config(p);
      ADD_FAILURE() << "no error for " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(bytes.substr(0, bytes.size() - 4), "needs 123392 bytes");  // truncated
  std::string bad_magic = bytes;
  bad_magic[0] = 1;
  expect_error(bad_magic, "magic");
  std::string bad_version = bytes;
  bad_version[4] = 9;
  expect_error(bad_version, "version 9");
  expect_error("short", "1024-byte header");
}

TEST(Gpt2Files, HuggingFaceSafetensorsImportTransposesConv1dWeights) {
  auto m = tiny_model();
  // Write the model the way HuggingFace stores GPT-2: Conv1D weights as (in, out).
  std::vector<std::pair<std::string, Tensor>> tensors;
  for (size_t i = 0; i < m->params().size(); ++i) {
    std::string name = m->params().spec(i).name;
    Tensor p = m->params()[i].detach();
    bool conv = name.rfind("h.", 0) == 0 && name.find(".weight") != std::string::npos && name.find("ln_") == std::string::npos;
    if (name == "wte") p = p.slice(0, 0, m->config().vocab_size);
    if (name == "wte" || name == "wpe") name += ".weight";
    tensors.emplace_back("transformer." + name, conv ? p.transpose(0, 1).contiguous() : p);
  }
  std::string path = test::temp_path("model.safetensors");
  io::write_safetensors(path, tensors, {{"n_head", "4"}});
  nn::TransformerConfig c = io::read_hf_config(path);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.padded_vocab_size, 128);
  nn::Transformer h(c);
  io::load_hf(path, h);
  test::expect_close(h.params().flat_params(), m->params().flat_params(), 0, 0, "HF import");

  // Sharded, as save_pretrained writes a large GPT-2 (gpt2-xl in fp32): two files and an
  // index. The config was read from the first file only ("missing tensor 'wte.weight'").
  const std::string dir = test::temp_path("gpt2_sharded");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const size_t half = tensors.size() / 2;
  const std::vector<std::pair<std::string, Tensor>> first(tensors.begin() + static_cast<std::ptrdiff_t>(half), tensors.end()),
      second(tensors.begin(), tensors.begin() + static_cast<std::ptrdiff_t>(half));  // wte in the second file
  io::write_safetensors(dir + "/model-00001-of-00002.safetensors", first, {});
  io::write_safetensors(dir + "/model-00002-of-00002.safetensors", second, {});
  nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
  for (const auto& [name, t] : first) index["weight_map"][name] = "model-00001-of-00002.safetensors";
  for (const auto& [name, t] : second) index["weight_map"][name] = "model-00002-of-00002.safetensors";
  test::write_all(dir + "/model.safetensors.index.json", index.dump());
  test::write_all(dir + "/config.json", R"({"model_type": "gpt2", "n_head": 4})");
  nn::Transformer sharded(io::read_hf_config(dir));
  io::load_hf(dir, sharded);
  test::expect_close(sharded.params().flat_params(), m->params().flat_params(), 0, 0, "sharded HF import");

  // A tensor the model has no place for was read past; a head of its own (untied) was
  // ignored and the model predicted with wte, unlike HF. Both refused. Old saves' mask
  // buffers and a tied model's stored head are what GPT-2 files carry: accepted.
  auto with = [&](const std::string& extra_name, const Tensor& extra) {
    std::vector<std::pair<std::string, Tensor>> more = tensors;
    more.emplace_back(extra_name, extra);
    const std::string file = test::temp_path("extra.safetensors");
    io::write_safetensors(file, more, {{"n_head", "4"}});
    return file;
  };
  const Tensor stray = Tensor::zeros({32, 96});
  const std::string msg = test::message_of<Error>([&] {
    nn::Transformer x(c);
    io::load_hf(with("transformer.h.5.attn.c_attn.weight", stray), x);
  });
  EXPECT_NE(msg.find("unexpected tensor 'transformer.h.5.attn.c_attn.weight'"), std::string::npos) << msg;
  {
    nn::Transformer x(c);
    EXPECT_NO_THROW(io::load_hf(with("transformer.h.0.attn.bias", Tensor::zeros({4})), x));
  }
  // The stored head is accepted only as what a tied model stores: wte's own values. One of
  // another shape, or of wte's shape with other values (an untied head), was taken without
  // a word when no config.json said tie_word_embeddings: false.
  Tensor wte;
  for (const auto& [name, t] : tensors)
    if (name == "transformer.wte.weight") wte = t;
  ASSERT_TRUE(wte.defined());
  {
    nn::Transformer x(c);
    EXPECT_NO_THROW(io::load_hf(with("lm_head.weight", wte.contiguous()), x));
    test::expect_close(x.params().flat_params(), m->params().flat_params(), 0, 0, "HF import with a tied head stored");
  }
  Tensor untied = wte.contiguous().clone();
  untied.data<float>()[untied.numel() - 1] += 1.0f;  // one value of the last row
  for (const auto& [head, expected] : {std::pair{Tensor::zeros({4}), std::string("is [4], expected wte's")},
                                       std::pair{untied, std::string("differs from wte")}}) {
    const std::string refused = test::message_of<Error>([&] {
      nn::Transformer x(c);
      io::load_hf(with("lm_head.weight", head), x);
    });
    EXPECT_NE(refused.find("lm_head.weight"), std::string::npos) << refused;
    EXPECT_NE(refused.find(expected), std::string::npos) << refused;
  }
  test::write_all(dir + "/config.json", R"({"model_type": "gpt2", "n_head": 4, "tie_word_embeddings": false})");
  EXPECT_NE(test::message_of<Error>([&] { io::read_hf_config(dir); }).find("tie_word_embeddings is false"),
            std::string::npos);
}

// ---------------------------------------------------------------- trainer
namespace {

train::TrainConfig tiny_config() {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard("train.bin", 5000, 97, 1));
  c.compute.threads = 0;  // these tests run on OMP_NUM_THREADS threads (CTest sets 2)
  c.batch.grad_accum = 2;
  c.optimizer.lr = 1e-3;
  c.optimizer.warmup_steps = 2;
  return c;
}
}  // namespace

TEST(Trainer, ResumeIsBitExact) {
  // An 8-step run that checkpoints at step 4; resuming from that checkpoint must
  // reproduce steps 5..8 exactly (same losses and gradient norms, bit for bit), in file
  // order and shuffled. The shuffled run's data (300 tokens: 18 sequences of 16, and 4 a
  // step) is read almost twice, so the resumed steps cross into the second pass.
  for (const bool shuffle : {false, true}) {
    SCOPED_TRACE(shuffle ? "--shuffle" : "file order");
    train::TrainConfig c = tiny_config();
    if (shuffle) c.data.train = test::write_random_shard("train_300.bin", 300, 97, 3);
    c.batch.steps = 8;
    c.checkpoint.save_every = 4;
    c.data.shuffle = shuffle;
    c.checkpoint.out_dir = test::temp_path("ckpt");
    fs::remove_all(c.checkpoint.out_dir);
    auto full = train::run_training(c);
    c.checkpoint.save_every = 0;
    c.checkpoint.resume = c.checkpoint.out_dir + "/step_00000004";
    auto resumed = train::run_training(c);
    ASSERT_EQ(resumed.history.size(), 4u);
    for (int i = 0; i < 4; ++i) {
      EXPECT_EQ(resumed.history[i].loss, full.history[4 + i].loss) << "step " << 5 + i;  // exact, not near
      EXPECT_EQ(resumed.history[i].grad_norm, full.history[4 + i].grad_norm) << "step " << 5 + i;
    }
    // The data's order is part of the run's recipe: resuming it the other way is refused,
    // naming the flag.
    c.data.shuffle = !shuffle;
    try {
      train::run_training(c);
      ADD_FAILURE() << "a resume that changes --shuffle was accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--shuffle was"), std::string::npos) << e.what();
    }
  }
}

// The cosine ends at --min-lr-frac on the last step that trains (step steps-1): it used to
// reach it one step after the run, so the last step ran above it (a 10-step run with 3 of
// warm-up ended at 1.45e-3 for a final 1e-3; two steps without warm-up ended half-way).
TEST(Trainer, LearningRateScheduleWarmsUpThenDecays) {
  train::TrainConfig c;
  c.optimizer.lr = 1.0;
  c.batch.steps = 111;
  c.optimizer.warmup_steps = 10;
  c.optimizer.min_lr_frac = 0.1;
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 0), 0.1);
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 9), 1.0);
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 10), 1.0);
  EXPECT_NEAR(train::learning_rate(c.optimizer, c.batch.steps, 60), 0.55, 1e-12);
  EXPECT_NEAR(train::learning_rate(c.optimizer, c.batch.steps, 110), 0.1, 1e-12);  // the last step
  c.batch.steps = 11;  // one step after the warm-up: the peak (the cosine has nowhere to go)
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 10), 1.0);
  c.batch.steps = 2;
  c.optimizer.warmup_steps = 0;
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 0), 1.0);
  EXPECT_NEAR(train::learning_rate(c.optimizer, c.batch.steps, 1), 0.1, 1e-12);
  c.optimizer.schedule = train::LrSchedule::Constant;
  EXPECT_DOUBLE_EQ(train::learning_rate(c.optimizer, c.batch.steps, 60), 1.0);
}

TEST(Trainer, BadFlagsFailWithTheFlagName) {
  train::TrainConfig c = tiny_config();
  c.batch.steps = 1;
  c.batch.grad_accum = 0;
  try {
    train::run_training(c);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--grad-accum"), std::string::npos) << e.what();
  }
  c = tiny_config();
  c.data.train = "/nonexistent/*.bin";
  EXPECT_THROW(train::run_training(c), std::exception);
}

// ZeRO in one process (a world of one, no MPI): every stage trains as the plain run does,
// with and without the chunked loss and gradient accumulation. The single-process
// communicator's all-gather once copied through Tensor::copy_, which bumps the storage's
// version, so stage 3's re-gather before backward looked like an in-place write to
// every saved weight ("modified in place after it was saved") and the run failed.
// The shards are the whole buffers here, so the results are bit-identical.
TEST(Trainer, ZeroStagesInOneProcessTrainAsThePlainRun) {
  for (const bool chunked : {false, true}) {
    train::TrainConfig c = tiny_config();
    c.batch.steps = 3;
    c.batch.grad_accum = 2;
    c.compute.chunked_loss = chunked;
    const train::TrainResult want = train::run_training(c);
    for (int zero = 1; zero <= 3; ++zero) {
      c.parallel.zero = zero;
      const std::string what = "zero " + std::to_string(zero) + (chunked ? ", chunked loss" : "");
      train::TrainResult got;
      ASSERT_NO_THROW(got = train::run_training(c)) << what;
      ASSERT_EQ(got.history.size(), want.history.size()) << what;
      for (size_t s = 0; s < want.history.size(); ++s)
        EXPECT_EQ(got.history[s].loss, want.history[s].loss) << what << ", step " << s + 1;
    }
  }
}

TEST(Trainer, LossFallsOnRepeatedData) {
  train::TrainConfig c = tiny_config();
  c.data.train = test::write_random_shard("small.bin", 2 * 16 * 2 + 1, 97, 7);  // one step's worth: memorizable
  c.batch.steps = 30;
  c.optimizer.lr = 3e-3;
  auto r = train::run_training(c);
  EXPECT_LT(r.history.back().loss, r.history.front().loss - 1.0);
}

// Many steps x microbatches under --sanitize strict:
// live bytes at every step boundary identical, census empty, peak identical from step 2.
namespace {
void expect_flat_under_strict_sanitizer(const std::string& model_file, int64_t steps, int64_t microbatches,
                                        const std::string& dtype = "fp32", bool chunked_loss = false) {
  const char* steps_env = std::getenv("TALLY_FLAT_STEPS");
  const char* mb_env = std::getenv("TALLY_FLAT_MICROBATCHES");
  train::TrainConfig c;
  // A tiny fixture model: the invariants are about boundaries (200 x 64 = 12,800 of
  // them), not model size, and this keeps the test well under a minute.
  c.model.file = model_file;
  c.data.train = test::write_random_shard("flat.bin", 20000, 97, 3);
  c.batch.batch_size = 1;
  c.batch.seq_len = 8;
  c.batch.steps = steps_env ? std::atoll(steps_env) : steps;
  c.batch.grad_accum = mb_env ? std::atoll(mb_env) : microbatches;
  c.memory.sanitize = sanitizer::SanitizeMode::Strict;
  c.memory.keep_boundaries = true;
  c.compute.dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
  c.compute.chunked_loss = chunked_loss;
  c.metrics.quiet = true;
  c.sampling.every = -1;
  c.sampling.tokens = 0;
  auto r = train::run_training(c);  // strict: any growth or surviving graph throws
  int64_t live = -1, peak = -1;
  size_t steps_seen = 0;
  for (const auto& b : r.boundaries) {
    EXPECT_EQ(b.live_nodes, 0u);
    EXPECT_EQ(b.live_saved, 0u);
    if (b.microbatch >= 0) continue;
    ++steps_seen;
    if (b.step < 1) continue;
    if (live < 0) live = b.allocated, peak = b.peak_allocated;
    ASSERT_EQ(b.allocated, live) << "step " << b.step;
    ASSERT_EQ(b.peak_allocated, peak) << "step " << b.step;
  }
  EXPECT_EQ(steps_seen, static_cast<size_t>(c.batch.steps));
}
}  // namespace

// Thousands of microbatches a step (seed 001's RL runs needed 4K+): every microbatch
// boundary after the first has the same live bytes, and a run that is not asked for the
// boundaries' record keeps none (it would grow with steps x microbatches).
TEST(Trainer, AStepOf1024MicrobatchesKeepsEveryBoundaryFlatAndNoRecordOfThem) {
  train::TrainConfig c = test::tiny_train_config(test::write_random_shard("many.bin", 20000, 97, 4));
  c.batch.batch_size = 1;
  c.batch.seq_len = 8;
  c.batch.steps = 2;
  c.batch.grad_accum = 1024;
  c.memory.sanitize = sanitizer::SanitizeMode::Strict;
  c.checkpoint.out_dir = test::temp_path("many_out_kept");
  const train::TrainResult r = train::run_training(c);
  int64_t live = -1;
  size_t microbatches = 0;
  for (const auto& b : r.boundaries) {
    ASSERT_EQ(b.live_nodes, 0u);
    if (b.microbatch < 0 || (b.step == 0 && b.microbatch == 0)) continue;
    ++microbatches;
    if (live < 0) live = b.allocated;
    ASSERT_EQ(b.allocated, live) << "step " << b.step << " microbatch " << b.microbatch;
  }
  EXPECT_EQ(microbatches, size_t{2 * 1024 - 1});
  c.memory.keep_boundaries = false;
  c.checkpoint.out_dir = test::temp_path("many_out_not_kept");
  EXPECT_TRUE(train::run_training(c).boundaries.empty());
}

TEST(Trainer, MemoryIsFlatAcrossStepsAndMicrobatchesUnderStrictSanitizer) {
  expect_flat_under_strict_sanitizer(test::fixture_path("gpt2_tiny.bin"), 200, 64);
}

// The same for LLaMA (RMSNorm, rotary, grouped-query attention, SwiGLU, untied head).
TEST(Trainer, LlamaMemoryIsFlatAcrossStepsAndMicrobatchesUnderStrictSanitizer) {
  expect_flat_under_strict_sanitizer(test::fixture_path("llama3_tiny.bin"), 100, 32);
}

// Mixed precision adds a bf16 parameter copy refreshed after every update and bf16 copies
// saved for backward: still nothing may grow or survive a boundary.
TEST(Trainer, Bf16MemoryIsFlatAcrossStepsAndMicrobatchesUnderStrictSanitizer) {
  expect_flat_under_strict_sanitizer(test::fixture_path("gpt2_tiny.bin"), 50, 8, "bf16");
  expect_flat_under_strict_sanitizer(test::fixture_path("llama3_tiny.bin"), 30, 8, "bf16");
  expect_flat_under_strict_sanitizer(test::fixture_path("gpt2_tiny.bin"), 30, 8, "bf16", /*chunked_loss=*/true);
  expect_flat_under_strict_sanitizer(test::fixture_path("gpt2_tiny.bin"), 30, 8, "fp32", /*chunked_loss=*/true);
}
