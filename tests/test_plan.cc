// The memory plan against the ledger: the peak predicted from the configuration alone must
// equal the peak measured in training, for several shapes (the issue asks for 2%; in one
// process every byte at the peak has a term). The multi-rank modes are checked in
// test_dist.cc.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include <nlohmann/json.hpp>

#include "dist/pipeline.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "support.h"
#include "nn/init.h"
#include "nn/llmc_layout.h"
#include "runtime/backend.h"
#include "train/dry_run.h"
#include "train/fit.h"
#include "train/plan.h"
#include "train/trainer.h"

using namespace tally;

namespace {

struct Shape3 {
  std::string model;  // preset, or a fixture model file (*.bin)
  int64_t batch, seq, accum;
  bool val;
  bool bf16 = false;  // --dtype bf16
  bool chunked = false;  // --chunked-loss
  std::string recompute = "none";  // --recompute
};

}  // namespace

TEST(Plan, PredictsTheMeasuredPeakToTheByteForSeveralShapes) {
  const std::vector<Shape3> shapes = {{"gpt2_tiny.bin", 2, 16, 1, false},   {"gpt2_tiny.bin", 4, 32, 2, true},
                                      {"d1", 2, 32, 1, false},              {"d2", 4, 16, 2, true},
                                      {"d2", 1, 64, 1, false},              {"llama3_tiny.bin", 2, 16, 1, false},
                                      {"llama3_tiny.bin", 4, 32, 2, true},  {"llama3-d1", 1, 16, 1, false},
                                      // a long sequence: attention memory is linear in T (no T x T scores),
                                      // so the plan's linear formula still holds to the byte
                                      {"d1", 1, 1024, 1, false},
                                      // mixed precision: bf16 copies saved, the parameters' copy, bf16 dy
                                      {"gpt2_tiny.bin", 2, 16, 1, false, true}, {"d2", 4, 16, 2, true, true},
                                      {"llama3_tiny.bin", 4, 32, 2, true, true}, {"llama3-d1", 1, 16, 1, false, true},
                                      // the head and loss fused in chunks (d1: 1024 rows in 166-row chunks)
                                      {"d1", 1, 1024, 1, false, false, true}, {"d1", 2, 256, 1, false, true, true},
                                      {"gpt2_tiny.bin", 4, 32, 2, true, false, true},
                                      {"llama3_tiny.bin", 4, 32, 2, true, true, true},
                                      // recomputation: selective drops the attention's saved output
                                      // and log-sum-exp; full keeps each layer's input, and recomputes
                                      // the last layer in backward (a second peak when the vocabulary is
                                      // small: the tiny models' 128 padded rows)
                                      {"d2", 4, 16, 2, true, false, false, "selective"},
                                      {"d2", 4, 16, 2, true, true, false, "selective"},
                                      {"llama3_tiny.bin", 4, 32, 2, true, false, false, "selective"},
                                      {"llama3_tiny.bin", 4, 32, 1, false, true, false, "selective"},
                                      {"d2", 4, 16, 2, true, false, false, "full"},
                                      {"d1", 1, 1024, 1, false, true, false, "full"},
                                      {"gpt2_tiny.bin", 4, 32, 2, true, false, false, "full"},
                                      {"gpt2_tiny.bin", 2, 16, 1, false, true, false, "full"},
                                      {"llama3_tiny.bin", 4, 32, 2, true, false, false, "full"},
                                      {"llama3_tiny.bin", 4, 32, 1, false, true, false, "full"},
                                      {"llama3-d1", 1, 16, 1, false, false, false, "full"},
                                      {"d2", 2, 32, 1, false, false, true, "full"},
                                      {"llama3_tiny.bin", 4, 32, 2, true, true, true, "selective"},
                                      // GPT-2 wide with a small vocabulary: the last layer's MLP backward
                                      // is the peak without recomputation too (in fp32 at the output
                                      // projection's bias gradient, under bf16 at GELU's)
                                      {"wide_small_vocab", 2, 32, 1, false}, {"wide_small_vocab", 2, 32, 1, false, true},
                                      {"wide_small_vocab", 2, 32, 1, false, false, false, "full"},
                                      {"wide_small_vocab", 2, 32, 1, false, true, false, "full"},
                                      // and LLaMA's: its SwiGLU backward (gate, up, their gradients)
                                      {"llama_wide_small_vocab", 2, 32, 1, false},
                                      {"llama_wide_small_vocab", 2, 32, 1, false, true},
                                      {"llama_wide_small_vocab", 2, 32, 1, false, true, false, "full"}};
  // A GPT-2 and a LLaMA of width 256 (LLaMA's SwiGLU 768 wide, 2 kv heads) over a 97-token
  // vocabulary (128 padded rows), written as llm.c files.
  std::map<std::string, std::string> wide_files;
  for (bool llama : {false, true}) {
    nn::TransformerConfig wide;
    wide.max_seq_len = 64;
    wide.vocab_size = 97;
    wide.padded_vocab_size = 128;
    wide.n_layer = 1;
    wide.n_head = wide.n_kv_head = 4;
    wide.n_embd = 256;
    if (llama) {
      wide.family = nn::TransformerConfig::Family::Llama3;
      wide.n_kv_head = 2;
      wide.ffn_hidden = 768;
    }
    const std::string name = llama ? "llama_wide_small_vocab" : "wide_small_vocab";
    wide_files[name] = test::temp_path(name + ".bin");
    io::save_llmc(wide_files[name], nn::Transformer(wide));
  }
  for (const Shape3& s : shapes) {
    train::TrainConfig c;
    const bool wide = wide_files.count(s.model) > 0;
    const bool file = (s.model.size() > 4 && s.model.substr(s.model.size() - 4) == ".bin") || wide;
    if (wide) c.model.file = wide_files[s.model];
    else if (file) c.model.file = test::fixture_path(s.model);
    else c.model.preset = s.model;
    const nn::TransformerConfig mc = file ? io::read_llmc_config(c.model.file) : nn::TransformerConfig::preset(s.model);
    // uint16 tokens: below 65535 for the 128,256-token LLaMA vocabulary.
    const int vocab = static_cast<int>(std::min<int64_t>(mc.vocab_size, 65535));
    c.data.train = test::write_random_shard("train.bin", 20000, vocab, 3);
    if (s.val) c.data.val = c.data.train;
    c.batch.batch_size = s.batch;
    c.batch.seq_len = s.seq;
    c.batch.grad_accum = s.accum;
    c.batch.steps = 2;
    c.validation.every = 0;
    c.validation.batches = 1;
    c.metrics.quiet = true;
    c.sampling.every = -1;
    c.compute.threads = 1;
    c.checkpoint.out_dir = test::temp_path("out");
    if (s.bf16) c.compute.dtype = DType::BF16;
    c.compute.chunked_loss = s.chunked;
    c.compute.recompute = nn::parse_recompute(s.recompute);
    const train::TrainResult r = train::run_training(c);
    const int64_t measured = r.history.back().peak_bytes;
    const memory::PeakMoment real_moment = runtime::ledger(Device::cpu()).peak_moment();  // the second step's
    const std::string what = s.model + " B" + std::to_string(s.batch) + " T" + std::to_string(s.seq) + " accum " +
                             std::to_string(s.accum) + (s.bf16 ? " bf16" : "") + (s.chunked ? " chunked loss" : "") +
                             " recompute " + s.recompute;
    // The dry run on the meta device, the real step on shapes alone, measures it, and the
    // trainer's plan line is the dry run's.
    const train::DryRun dry = train::dry_run(c, mc, s.val);
    ASSERT_EQ(dry.steps.size(), 2u) << what;
    EXPECT_EQ(dry.steps.back().peak_bytes, measured) << what;
    EXPECT_EQ(dry.steps.front().peak_bytes, r.history.front().peak_bytes) << what;
    EXPECT_EQ(r.history.back().predicted_peak_bytes, dry.steps.back().peak_bytes) << what;
    if (wide) {  // these shapes are here for that moment: check they still reach it
      EXPECT_NE(dry.steps.back().moment.owner.name_str().find(".mlp:"), std::string::npos)
          << what << ": " << train::moment_text(dry.steps.back().moment);
      EXPECT_EQ(std::string(dry.steps.back().moment.phase), "backward") << what;
    }
    // At the same moment: the same allocation, in the same phase of the same microbatch.
    const memory::PeakMoment& moment = dry.steps.back().moment;
    EXPECT_EQ(real_moment.bytes, measured) << what;
    EXPECT_EQ(train::moment_text(moment), train::moment_text(real_moment)) << what;
    EXPECT_EQ(moment.owner.step, 1) << what;
    EXPECT_NE(std::string(moment.phase), "") << what;
    // Validation after the last step, a batch without a graph beside everything the run
    // keeps, to the byte.
    EXPECT_EQ(dry.validation.peak_bytes, r.history.back().val_peak_bytes) << what << ": validation";
    if (s.val) {
      EXPECT_GT(dry.validation.peak_bytes, 0) << what;
    }
  }
}

// ZeRO in one process (a world of one, as --zero without mpirun runs): its reduce-scatter
// "piece" is the whole unit, so at the end of backward the embeddings' staging and piece
// (and, under ZeRO-3, the tied embedding gathered) outweigh the start of backward the plan
// had taken for ZeRO-2/3's peak: a --zero 2 run measured 8.1% over the plan, --zero 3
// 6.4%. The multi-rank stages are checked in test_dist.cc.
TEST(Plan, PredictsTheMeasuredPeakToTheByteForZeroInOneProcess) {
  struct Case {
    std::string model;
    int64_t batch;
    int zero;
    bool bf16 = false;
    std::string recompute = "none";
  };
  // (gpt2_tiny.bin under full recomputation: the second-to-last layer's MLP backward is the
  // peak, a whole layer unit staged and in flight beside it; it measured 5% over a plan
  // that only noted it.)
  for (const Case& k : std::vector<Case>{{"d2", 2, 1},        {"d2", 2, 2},        {"d2", 2, 3},
                                         {"d2", 8, 2},        {"d2", 8, 3},        {"d2", 2, 2, true},
                                         {"llama3-d1", 2, 2}, {"llama3-d1", 2, 3}, {"gpt2_tiny.bin", 4, 3},
                                         {"gpt2_tiny.bin", 8, 2, false, "full"}, {"gpt2_tiny.bin", 8, 3, false, "full"},
                                         {"gpt2_tiny.bin", 8, 2, true, "full"}}) {
    train::TrainConfig c;
    const bool file = k.model.size() > 4 && k.model.substr(k.model.size() - 4) == ".bin";
    if (file) c.model.file = test::fixture_path(k.model);
    else c.model.preset = k.model;
    const nn::TransformerConfig mc = file ? io::read_llmc_config(c.model.file) : nn::TransformerConfig::preset(k.model);
    c.data.train = test::write_random_shard("train.bin", 20000, static_cast<int>(std::min<int64_t>(mc.vocab_size, 65535)), 3);
    c.batch.batch_size = k.batch;
    c.batch.seq_len = 32;
    c.batch.steps = 2;
    c.parallel.zero = k.zero;
    c.metrics.quiet = true;
    c.sampling.every = -1;
    c.compute.threads = 1;
    c.checkpoint.out_dir = test::temp_path("out");
    if (k.bf16) c.compute.dtype = DType::BF16;
    c.compute.recompute = nn::parse_recompute(k.recompute);
    const train::TrainResult r = train::run_training(c);
    const train::MemoryPlan plan = train::plan_memory(c, mc, 1, false);
    const int64_t planned = plan.ranks[0].predicted_peak_bytes;
    const std::string what = k.model + " B" + std::to_string(k.batch) + " zero " + std::to_string(k.zero) + (k.bf16 ? " bf16" : "") +
                             " recompute " + k.recompute;
    // gpt2_tiny.bin: logits smaller than two layer units, so the peak comes later in
    // backward, at the last layer's MLP backward (the plan only noted it, and the run
    // measured 0.7% over it).
    EXPECT_EQ(r.history.back().peak_bytes, planned) << what;
    // And kind by kind, as the ledger tags what is alive at the peak: ZeRO's reduce-scatter
    // piece is communication.
    std::map<std::string, int64_t> planned_kinds, measured_kinds;
    for (const auto& [name, bytes] : plan.ranks[0].parts) planned_kinds[train::memory_kind(name)] += bytes;
    for (const memory::OwnerBytes& o : runtime::ledger().peak_owners()) measured_kinds[train::memory_kind(o.category)] += o.bytes;
    std::erase_if(planned_kinds, [](const auto& kv) { return kv.second == 0; });
    std::erase_if(measured_kinds, [](const auto& kv) { return kv.second == 0; });
    EXPECT_EQ(measured_kinds, planned_kinds) << what;
    EXPECT_TRUE(plan.notes.empty()) << what << ": " << plan.notes.front();
    // The dry run stands in for ZeRO (its shards, staging and gathers, no update math).
    const train::DryRun& dry = plan.dry_runs.front();
    ASSERT_EQ(dry.steps.size(), 2u) << what;
    EXPECT_EQ(dry.steps.front().peak_bytes, r.history.front().peak_bytes) << what << ": the dry run's step 1";
    EXPECT_EQ(dry.steps.back().peak_bytes, r.history.back().peak_bytes) << what << ": the dry run's step 2";
  }
}

// docs/memory-plan.md explains the peak by formulas over the model's shape and the batch;
// the dry run, on the CPU and standing in for a GPU (meta(cuda): the CUDA kernels' scratch,
// cuBLASLt's workspace, the loaders on the host), meets them to the byte. At the start of
// backward (fp32, one microbatch, a real vocabulary): the model states 16P; every
// activation of the microbatch, less the loss's log-sum-exp (freed) and with the first
// gradient dL/d(final norm output) (B T C); the loss; the tokens (the loaders' buffers on the
// CPU; on a GPU the inputs' device copy, the targets' freed by the loss's backward); on a
// GPU cuBLASLt's 32 MiB; LLaMA's rotary frequencies (D/2).
TEST(Plan, TheDryRunMeetsTheDocumentedFormulasOnTheCpuAndAGpu) {
  for (const std::string model : {"d2", "llama3-d2"})
    for (const Device device : {Device::cpu(), Device::cuda()}) {
      const std::string what = model + " on " + device.str();
      const nn::TransformerConfig m = nn::TransformerConfig::preset(model);
      train::TrainConfig c;
      c.model.preset = model;
      c.batch.batch_size = 4;
      c.batch.seq_len = 64;
      c.batch.steps = 2;
      c.compute.device = device;
      const train::MemoryPlan plan = train::plan_memory(c, m, 1, false);
      const int64_t BT = 4 * 64, C = m.n_embd, H = m.n_head, L = m.n_layer, Vp = m.padded_vocab_size;
      const int64_t P = train::parameter_count(m);
      const bool llama = m.llama_architecture();
      const int64_t layer = llama ? 6 * C + 2 * m.n_kv_head * m.head_dim() + 3 * m.ffn_dim() + H + 2 : 16 * C + 4 + H;
      const int64_t head = llama ? 2 * C + 2 + Vp : 2 * C + 3 + Vp;
      const int64_t activations = BT * (L * layer + head) * 4;
      const int64_t tokens = device.is_cpu() ? 2 * BT * 4 : BT * 4;
      const int64_t expected = 16 * P + activations - BT * 4 + BT * C * 4 + 4 + tokens +
                               (device.is_cpu() ? 0 : int64_t{32} << 20) + (llama ? m.head_dim() / 2 * 4 : 0);
      EXPECT_EQ(plan.ranks[0].predicted_peak_bytes, expected) << what;
      EXPECT_EQ(std::string(plan.dry_runs[0].steps.back().moment.phase), "backward") << what;
      // The logits: B T Vp floats, saved by the head.
      std::map<std::string, int64_t> ops(plan.activations_by_op.begin(), plan.activations_by_op.end());
      EXPECT_EQ(ops["head:linear"], BT * Vp * 4) << what;
      EXPECT_EQ(runtime::ledger(Device::meta(device.type)).stats().allocated, 0) << what;
    }
}

// What the dry run does not stand in for, it names rather than planning it wrong.
TEST(Plan, TheDryRunNamesTheLayoutsItDoesNotStandInFor) {
  train::TrainConfig c;
  c.model.preset = "d1";
  const nn::TransformerConfig mc = nn::TransformerConfig::preset("d1");
  auto refusal = [&](int64_t world = 1) {
    try {
      train::dry_run(c, mc, false, world, 0);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(ran)");
  };
  c.compute.device = Device::meta();
  EXPECT_NE(refusal().find("the dry run stands in for a real device, not --device meta(cpu)"), std::string::npos)
      << refusal();
  // It stands in for a tensor-parallel rank too, and leaves nothing behind on the meta
  // device either way.
  c.compute.device = Device::cpu();
  c.batch.batch_size = 1;
  c.batch.seq_len = 8;
  train::dry_run(c, mc, true);
  EXPECT_EQ(runtime::ledger(Device::meta()).stats().allocated, 0);
  c.model.preset = "d2";  // two heads
  c.parallel.tp = 2;
  c.parallel.sequence_parallel = true;
  train::dry_run(c, nn::TransformerConfig::preset("d2"), true, 2, 1);
  EXPECT_EQ(runtime::ledger(Device::meta()).stats().allocated, 0);
}

namespace {
train::TrainConfig plan_config(const std::string& model, int64_t batch, int64_t seq) {
  train::TrainConfig c;
  c.model.preset = model;
  c.batch.batch_size = batch;
  c.batch.seq_len = seq;
  c.batch.steps = 2;
  return c;
}
int64_t sum_of(const memory::PlanParts& parts) {
  int64_t sum = 0;
  for (const auto& [name, bytes] : parts) sum += bytes;
  return sum;
}
int64_t part(const memory::PlanParts& parts, const std::string& name) {
  for (const auto& [n, bytes] : parts)
    if (n == name) return bytes;
  return 0;
}
}  // namespace

// Every rank of the world gets its stage's plan; a rank's parts are the kinds of memory at
// its peak and add up to it; the JSON says the same.
TEST(Plan, PartsAddUpAndFollowTheirFormulas) {
  train::TrainConfig c = plan_config("gpt2", 4, 1024);
  c.parallel.zero = 1;
  const nn::TransformerConfig m = nn::TransformerConfig::preset("gpt2");
  const train::MemoryPlan plan = train::plan_memory(c, m, 4, false);
  ASSERT_EQ(plan.ranks.size(), 4u);
  ASSERT_EQ(plan.dry_runs.size(), 1u);
  const memory::PlanParts& parts = plan.ranks[0].parts;
  EXPECT_EQ(sum_of(parts), plan.ranks[0].predicted_peak_bytes);
  const int64_t P = 124475904;  // GPT-2 124M with the vocabulary padded to 50304
  EXPECT_EQ(train::parameter_count(m), P);
  EXPECT_EQ(part(parts, "parameters"), 4 * P);
  EXPECT_EQ(part(parts, "gradients"), 4 * P);
  EXPECT_NEAR(static_cast<double>(part(parts, "optimizer state")), 8.0 * P / 4, 8.0 * 16);  // a piece per unit, padded
  // The logits of one microbatch: B T Vp floats.
  std::map<std::string, int64_t> ops(plan.activations_by_op.begin(), plan.activations_by_op.end());
  EXPECT_EQ(ops["head:linear"], int64_t{4} * 1024 * 50304 * 4);
  const auto j = nlohmann::json::parse(train::plan_json(plan));
  EXPECT_EQ(j["ranks"].size(), 4u);
  EXPECT_EQ(j["ranks"][3]["predicted_peak_bytes"].get<int64_t>(), plan.ranks[3].predicted_peak_bytes);
  EXPECT_EQ(j["ranks"][3]["parts"]["parameters"].get<int64_t>(), 4 * P);
  EXPECT_EQ(j["dry_run"]["peak_bytes"].get<int64_t>(), plan.ranks[0].predicted_peak_bytes);
}

// Tensor parallel: a rank's parameters are its shard's (the model's own layout says which),
// the logits 1/tp of the vocabulary, and a layout tally train refuses is refused with its
// words. Its peaks are checked to the byte against the ledger in tests/test_parallel.cc.
TEST(Plan, TensorParallelPlansARanksShardAndRefusesWhatItDoesNotModel) {
  train::TrainConfig c = plan_config("gpt2", 4, 1024);
  c.parallel.tp = 4;
  c.parallel.sequence_parallel = true;
  c.parallel.zero = 1;
  const nn::TransformerConfig m = nn::TransformerConfig::preset("gpt2");
  const train::MemoryPlan plan = train::plan_memory(c, m, 8, false);
  ASSERT_EQ(plan.ranks.size(), 8u);
  nn::ModelShard shard;
  shard.tp = 4;
  const int64_t shard_params = nn::Transformer::layout_only(m, shard).num_parameters();
  EXPECT_LT(shard_params, 124475904 / 3);  // a quarter of the matrices, plus replicated norms and positions
  EXPECT_EQ(part(plan.ranks[5].parts, "parameters"), 4 * shard_params);
  std::map<std::string, int64_t> ops(plan.activations_by_op.begin(), plan.activations_by_op.end());
  EXPECT_EQ(ops["head:linear"], int64_t{4} * 1024 * (50304 / 4) * 4);  // this rank's vocabulary block
  auto refused = [&](const train::TrainConfig& bad, int64_t world) {
    return test::message_of<Error>([&] { train::plan_memory(bad, m, world, false); });
  };
  train::TrainConfig odd = c;
  odd.parallel.tp = 8;  // 12 heads do not divide by 8
  EXPECT_NE(refused(odd, 8).find("--tp 8: the model's 12 query heads and 12 key/value heads"), std::string::npos)
      << refused(odd, 8);
  EXPECT_NE(refused(c, 6).find("--world 6 is not a multiple of --tp 4"), std::string::npos) << refused(c, 6);
  train::TrainConfig zero3 = c;
  zero3.parallel.zero = 3;
  EXPECT_NE(refused(zero3, 8).find("--zero 3 with --tp/--pp"), std::string::npos) << refused(zero3, 8);
  // As tally train refuses it: bf16's GEMMs read a whole bf16 copy that ZeRO-3 does not keep.
  train::TrainConfig bf16_zero3 = plan_config("gpt2", 4, 1024);
  bf16_zero3.parallel.zero = 3;
  bf16_zero3.compute.dtype = DType::BF16;
  EXPECT_NE(refused(bf16_zero3, 2).find("--dtype bf16 with --zero 3"), std::string::npos) << refused(bf16_zero3, 2);
}

// The pipeline: each stage's dry run (the ledger agrees to the byte in
// tests/test_parallel.cc, every layout). Here: the stages' parameters are their shards',
// GPipe holds more than 1F1B, a step of many microbatches is planned as a few (1F1B's
// memory is periodic once warm), and what tally train refuses is refused.
TEST(Plan, PipelineStagesFollowTheirShardsAndSchedules) {
  train::TrainConfig c = plan_config("d4", 2, 64);
  c.batch.grad_accum = 8;
  c.parallel.pp = 4;
  const nn::TransformerConfig m = nn::TransformerConfig::preset("d4");
  const train::MemoryPlan one_f_one_b = train::plan_memory(c, m, 4, false);
  ASSERT_EQ(one_f_one_b.ranks.size(), 4u);
  ASSERT_EQ(one_f_one_b.dry_runs.size(), 4u);
  for (const train::RankPlan& r : one_f_one_b.ranks) {
    EXPECT_EQ(sum_of(r.parts), r.predicted_peak_bytes) << "rank " << r.rank;
    EXPECT_EQ(r.stage, r.rank);
    const nn::ModelShard shard = dist::pipeline_shard(4, 4, r.rank, 1, 1, 0);
    EXPECT_EQ(part(r.parts, "parameters"), 4 * nn::Transformer::layout_only(m, shard).num_parameters()) << "rank " << r.rank;
  }
  train::TrainConfig gpipe = c;
  gpipe.parallel.pp_schedule = dist::PipelineSchedule::GPipe;
  const train::MemoryPlan all = train::plan_memory(gpipe, m, 4, false);
  EXPECT_GT(all.ranks[1].predicted_peak_bytes, one_f_one_b.ranks[1].predicted_peak_bytes);
  // 1F1B: a step of 10^8 microbatches planned as 4 x P of them, with the same peaks.
  train::TrainConfig many = c;
  many.batch.grad_accum = 100000000;
  const train::MemoryPlan periodic = train::plan_memory(many, m, 4, false);
  ASSERT_EQ(periodic.notes.size(), 1u);
  EXPECT_NE(periodic.notes[0].find("planned with 16 of its 100000000 microbatches"), std::string::npos)
      << periodic.notes[0];
  for (size_t r = 0; r < periodic.ranks.size(); ++r)
    EXPECT_EQ(periodic.ranks[r].predicted_peak_bytes, one_f_one_b.ranks[r].predicted_peak_bytes) << "rank " << r;
  auto refused = [&](const train::TrainConfig& bad, int64_t world) {
    return test::message_of<Error>([&] { train::plan_memory(bad, m, world, false); });
  };
  train::TrainConfig few = c;
  few.batch.grad_accum = 2;
  EXPECT_NE(refused(few, 4).find("needs at least 4 microbatches"), std::string::npos) << refused(few, 4);
  train::TrainConfig zero2 = c;
  zero2.parallel.zero = 2;
  EXPECT_NE(refused(zero2, 8).find("--zero 2 with --tp/--pp"), std::string::npos) << refused(zero2, 8);
  EXPECT_NE(refused(c, 6).find("--world 6 is not a multiple of --tp 1 x --cp 1 x --pp 4"), std::string::npos)
      << refused(c, 6);
}

// Set-up: a ZeRO-3 rank holds its shards (16 bytes a padded piece) and one whole parameter
// at a time, the largest (wte); a ZeRO-1 plan over 3 ranks, which divide none of d1's
// units, peaks in the optimizer step's padded all-gather, and over 2 it does not.
TEST(Plan, PlansSetUpAndTheOptimizerStepsGather) {
  train::TrainConfig c = plan_config("gpt2-xl", 1, 64);
  c.parallel.zero = 3;
  const nn::TransformerConfig xl = nn::TransformerConfig::preset("gpt2-xl");
  const train::MemoryPlan plan = train::plan_memory(c, xl, 2, false);
  int64_t pieces = 0;
  const nn::Transformer layout = nn::Transformer::layout_only(xl);
  for (size_t u = 0; u < layout.params().num_units(); ++u) pieces += (layout.params().unit(u).numel() + 1) / 2;
  EXPECT_EQ(plan.ranks[0].setup_bytes, 16 * pieces + 4 * 50304 * 1600);
  EXPECT_LT(plan.ranks[0].setup_bytes, plan.ranks[0].predicted_peak_bytes);
  EXPECT_TRUE(plan.notes.empty()) << plan.notes.front();
  train::TrainConfig small = plan_config("d1", 2, 16);
  small.parallel.zero = 1;
  const nn::TransformerConfig d1 = nn::TransformerConfig::preset("d1");
  const memory::PeakMoment three = train::plan_memory(small, d1, 3, false).dry_runs[0].steps.back().moment;
  EXPECT_EQ(std::string(three.phase), "optimizer") << train::moment_text(three);
  const memory::PeakMoment two = train::plan_memory(small, d1, 2, false).dry_runs[0].steps.back().moment;
  EXPECT_NE(std::string(two.phase), "optimizer") << train::moment_text(two);
  small.parallel.zero = 4;
  EXPECT_NE(test::message_of<Error>([&] { train::plan_memory(small, d1, 2, false); }).find("--zero must be 0, 1, 2 or 3"),
            std::string::npos);
}

// The >5% warning names the kind of memory furthest from the plan and its largest owner at
// the peak, from the ledger's snapshot of the peak moment.
TEST(Plan, ExplainsAMissedPeakByTheLargestOwnerOfTheKindFurthestOff) {
  auto& ledger = runtime::ledger();
  ledger.track_peak_owners(true);
  ledger.reset_peaks();
  auto tag = [](Category c, const char* name) {
    OwnerTag t;
    t.category = c;
    t.name = intern_name(name);
    return t;
  };
  {
    Tensor small = Tensor::empty({1024}, DType::F32, Device::cpu(), tag(Category::Activation, "test.small_activation"));
    Tensor big = Tensor::empty({4096}, DType::F32, Device::cpu(), tag(Category::SavedForBackward, "test.big_saved"));
    Tensor param = Tensor::empty({2048}, DType::F32, Device::cpu(), tag(Category::Parameter, "test.weights"));
  }
  // Freed since: the snapshot still holds the peak moment, largest first.
  const std::vector<memory::OwnerBytes> at_peak = ledger.peak_owners();
  ledger.track_peak_owners(false);
  auto bytes_of = [&](const char* name) {
    for (const auto& o : at_peak)
      if (name_of(o.name) == name) return o.bytes;
    return int64_t{-1};
  };
  EXPECT_EQ(bytes_of("test.big_saved"), 4096 * 4);
  EXPECT_EQ(bytes_of("test.small_activation"), 1024 * 4);
  EXPECT_EQ(bytes_of("test.weights"), 2048 * 4);
  const std::string why =
      train::explain_peak({{"parameters", 2048 * 4}, {"activations (one microbatch)", 1024 * 4}}, at_peak);
  // Parameters match; activations (saved tensors included) are 16 KiB over: the largest is the saved one.
  EXPECT_EQ(why.rfind("activations are 16.0 KiB over the plan", 0), 0u) << why;
  EXPECT_NE(why.find("the largest at the peak: test.big_saved, 16.0 KiB"), std::string::npos) << why;
}

// Tensor/pipeline set-up: a rank builds only its shard, reading or drawing the whole
// model's parameters one at a time (nn::fill_whole_parameters). Its values must be
// exactly the whole model's there (same seed, same file), and set-up must hold no more than
// the shard's parameters and gradients and one whole parameter: the plan's set-up term.
TEST(Plan, AShardIsBuiltOneWholeParameterAtATimeWithTheWholeModelsValues) {
  auto& ledger = runtime::ledger();
  nn::TransformerConfig llama = nn::TransformerConfig::preset("llama3-d4");  // 4 heads, 2 kv heads, tied
  llama.vocab_size = 1000;  // a small vocabulary (with padding rows) keeps the test quick
  llama.padded_vocab_size = 1024;
  nn::TransformerConfig untied_llama = llama;
  untied_llama.tie_embeddings = false;
  for (const nn::TransformerConfig& config : {nn::TransformerConfig::preset("d2"), llama, untied_llama}) {
    nn::Transformer whole(config);
    nn::init_weights(whole, 7);
    const std::string fp32_file = test::temp_path("whole.bin"), bf16_file = test::temp_path("whole_bf16.bin");
    io::save_llmc(fp32_file, whole);
    io::save_llmc(bf16_file, whole, /*bf16=*/true);
    nn::Transformer whole_bf16(config, {}, nn::Blocks::Parameters);
    io::load_llmc(bf16_file, whole_bf16);
    const std::string hf_dir = test::temp_path("whole_hf");
    io::save_hf(hf_dir, whole);
    {
      // One process: reading HuggingFace files holds a tensor at a time (and LLaMA's q and
      // k once more, re-ordered), not the file beside the model.
      nn::Transformer from_hf(config, {}, nn::Blocks::Parameters);
      int64_t largest = 0;
      for (size_t i = 0; i < from_hf.params().size(); ++i) largest = std::max(largest, from_hf.params()[i].numel());
      ledger.reset_peaks();
      const int64_t before = ledger.stats().allocated;
      io::load_hf(hf_dir, from_hf);
      EXPECT_LE(ledger.stats().peak_allocated - before, 2 * 4 * largest) << config.describe();
      EXPECT_EQ(test::compare(from_hf.params().flat_params(), whole.params().flat_params()).max_abs, 0.0) << config.describe();
    }
    // (pp, stage, virtual stages, tp, tp rank): pipeline only, tensor only, both, and
    // interleaved (chunks 0 and 2 of 4, or 1 and 3: a model of 4 layers or more).
    const int layouts[][5] = {{2, 1, 1, 1, 0}, {1, 0, 1, 2, 1}, {2, 0, 1, 2, 1}, {2, 1, 1, 2, 0},
                              {2, 0, 2, 2, 1}, {2, 1, 2, 1, 0}};
    for (const auto& l : layouts) {
      if (l[0] * l[2] > config.n_layer) continue;
      const nn::ModelShard shard = dist::pipeline_shard(config.n_layer, l[0], l[1], l[2], l[3], l[4], 0);
      const std::string what = config.describe() + (config.tie_embeddings ? " tied" : "") + ", pp " +
                               std::to_string(l[0]) + " stage " + std::to_string(l[1]) + ", tp " + std::to_string(l[3]) +
                               " rank " + std::to_string(l[4]);
      ledger.reset_peaks();
      const int64_t before = ledger.stats().allocated;
      nn::Transformer drawn(config, shard);
      nn::init_weights(drawn, 7);
      const int64_t rotary = config.llama_architecture() ? config.head_dim() / 2 * 4 : 0;
      const int64_t scratch = nn::whole_parameter_scratch_bytes(drawn);
      EXPECT_EQ(ledger.stats().peak_allocated - before, 8 * drawn.num_parameters() + rotary + scratch) << what;
      if (l[3] > 1) EXPECT_GT(scratch, 0) << what;
      else EXPECT_EQ(scratch, 0) << what << ": a pipeline-only shard holds each of its parameters whole";
      nn::Transformer cut(config, shard), read(config, shard), read_bf16(config, shard), cut_bf16(config, shard),
          read_hf(config, shard);
      nn::load_shard_from(cut, whole);
      io::load_llmc(fp32_file, read);
      io::load_llmc(bf16_file, read_bf16);
      io::load_hf(hf_dir, read_hf);
      nn::load_shard_from(cut_bf16, whole_bf16);
      ASSERT_GT(drawn.params().size(), 0u);
      for (size_t i = 0; i < drawn.params().size(); ++i) {
        const std::string name = what + ", " + drawn.params().spec(i).name;
        EXPECT_EQ(test::compare(drawn.params()[i], cut.params()[i]).max_abs, 0.0) << name << ": drawn";
        EXPECT_EQ(test::compare(read.params()[i], cut.params()[i]).max_abs, 0.0) << name << ": read (fp32 file)";
        EXPECT_EQ(test::compare(read_bf16.params()[i], cut_bf16.params()[i]).max_abs, 0.0) << name << ": read (bf16 file)";
        EXPECT_EQ(test::compare(read_hf.params()[i], cut.params()[i]).max_abs, 0.0) << name << ": read (HuggingFace files)";
      }
    }
  }
}

// ---- tally plan --fit (train/fit.h)

namespace {
// The largest of a layout's stages' dry-run peaks.
int64_t dry_run_peak(const train::TrainConfig& c, const nn::TransformerConfig& mc, int64_t world) {
  int64_t peak = 0;
  for (int rank : train::dry_run_roles(c, world)) peak = std::max(peak, train::dry_run(c, mc, false, world, rank).peak_bytes());
  return peak;
}

train::TrainConfig fit_base(const std::string& preset) {
  train::TrainConfig c;
  c.model.preset = preset;
  c.batch.batch_size = 2;
  c.batch.seq_len = 32;
  c.batch.steps = 2;
  return c;
}
}  // namespace

TEST(Fit, ReadsMemorySizesAndNamesTheFlagOfOneItCannot) {
  EXPECT_EQ(train::parse_memory_size("80GiB"), 80LL << 30);
  EXPECT_EQ(train::parse_memory_size("512 MiB"), 512LL << 20);
  EXPECT_EQ(train::parse_memory_size("1.5TB"), 1500000000000LL);
  EXPECT_EQ(train::parse_memory_size("4096"), 4096);
  for (const std::string bad : {"", "GiB", "-1GiB", "0", "80 GiBs", "1e30GB", "nan"}) {
    try {
      train::parse_memory_size(bad);
      ADD_FAILURE() << "'" << bad << "' was taken";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--fit " + bad + ": expected a memory size"), std::string::npos) << e.what();
    }
  }
}

// The search plans a layout with at most 2 microbatches a step, or 4 x P under a pipeline:
// the peak of the whole step's microbatches, to the byte, on every stage.
TEST(Fit, FewerMicrobatchesPlanTheSamePeak) {
  const nn::TransformerConfig mc = nn::TransformerConfig::preset("d4");
  struct Layout {
    int dp, tp, pp;
    dist::PipelineSchedule schedule;
    int virtual_stages, zero;
    nn::Recompute recompute;
    int64_t microbatches;
  };
  using S = dist::PipelineSchedule;
  for (const Layout& l : std::vector<Layout>{{1, 1, 1, S::OneFOneB, 1, 0, nn::Recompute::None, 12},
                                             {4, 1, 1, S::OneFOneB, 1, 2, nn::Recompute::Full, 9},
                                             {2, 2, 1, S::OneFOneB, 1, 1, nn::Recompute::Selective, 6},
                                             {1, 1, 2, S::OneFOneB, 1, 0, nn::Recompute::None, 20},
                                             {2, 1, 2, S::Interleaved, 2, 1, nn::Recompute::None, 20},
                                             {1, 2, 2, S::OneFOneB, 1, 0, nn::Recompute::Full, 12}}) {
    train::TrainConfig c = fit_base("d4");
    c.parallel.dp = l.dp, c.parallel.tp = l.tp, c.parallel.pp = l.pp, c.parallel.pp_schedule = l.schedule;
    c.parallel.virtual_stages = l.virtual_stages, c.parallel.zero = l.zero;
    c.compute.recompute = l.recompute;
    c.batch.grad_accum = l.microbatches;
    const int64_t world = static_cast<int64_t>(l.dp) * l.tp * l.pp;
    const train::TrainConfig planned = train::with_planned_microbatches(c);
    EXPECT_LT(planned.batch.grad_accum, l.microbatches);
    for (int rank : train::dry_run_roles(c, world))
      EXPECT_EQ(train::dry_run(planned, mc, false, world, rank).peak_bytes(), train::dry_run(c, mc, false, world, rank).peak_bytes())
          << "dp " << l.dp << " tp " << l.tp << " pp " << l.pp << " zero " << l.zero << ", rank " << rank << ": "
          << planned.batch.grad_accum << " microbatches against " << l.microbatches;
  }
}

// Every layout it lists fits, fastest first by the estimate, with the peak a dry run of the
// whole step gives; tightening the memory drops exactly the layouts over it.
TEST(Fit, ListsTheLayoutsThatFitFastestFirstWithTheirDryRunPeaks) {
  const nn::TransformerConfig mc = nn::TransformerConfig::preset("d4");
  train::FitOptions o;
  o.world = 4;
  o.global_batch = 16;
  o.flops_per_s = 1e11;
  o.link_bytes_per_s = 1e9;
  o.top = 6;
  o.memory_bytes = 1LL << 40;
  const train::FitResult all = train::fit_layouts(fit_base("d4"), mc, o);
  ASSERT_EQ(all.fits.size(), 6u);
  EXPECT_EQ(all.global_batch, 16);
  EXPECT_GT(all.refused, 0);  // ZeRO-2/3 beside --tp or --pp, among others
  for (size_t i = 0; i < all.fits.size(); ++i) {
    const train::FitCandidate& f = all.fits[i];
    const train::ParallelismConfig& p = f.config.parallel;
    EXPECT_EQ(p.dp * p.tp * p.pp, 4) << f.flags();
    EXPECT_EQ(f.config.batch.batch_size * f.config.batch.grad_accum * p.dp, 16) << f.flags();
    if (i > 0) {
      EXPECT_LE(all.fits[i - 1].estimate.total_s(), f.estimate.total_s()) << f.flags();
    }
    EXPECT_EQ(f.peak_bytes, dry_run_peak(f.config, mc, 4)) << f.flags();
  }
  // The estimate's compute term by hand: 6 x parameters + 6 L q_dim T FLOPs a token, on
  // every rank at the rate; one rank's tensor-parallel bytes at the link's.
  const train::FitCandidate& best = all.fits.front();
  const double tokens = 16.0 * 32;
  const double per_token = 6.0 * static_cast<double>(nn::Transformer::layout_only(mc).num_parameters()) + 6.0 * 4 * 256 * 32;
  const train::StepEstimate e = train::estimate_step(best.config, mc, 4, o.flops_per_s, o.link_bytes_per_s);
  EXPECT_NEAR(e.total_s(), best.estimate.total_s(), 1e-12);
  ASSERT_EQ(best.config.compute.recompute, nn::Recompute::None) << best.flags();
  EXPECT_NEAR(e.compute_s, tokens * per_token / (4 * o.flops_per_s), 1e-9) << best.flags();
  // Below the largest peak, the layouts over the memory go and the others stay in order.
  int64_t largest = 0;
  for (const train::FitCandidate& f : all.fits) largest = std::max(largest, f.peak_bytes);
  o.memory_bytes = largest - 1;
  o.top = 1000;
  const train::FitResult tight = train::fit_layouts(fit_base("d4"), mc, o);
  ASSERT_FALSE(tight.fits.empty());
  for (const train::FitCandidate& f : tight.fits) EXPECT_LE(f.peak_bytes, o.memory_bytes) << f.flags();
  std::vector<std::string> kept, expected;
  for (const train::FitCandidate& f : tight.fits) kept.push_back(f.flags());
  for (const train::FitCandidate& f : all.fits)
    if (f.peak_bytes <= o.memory_bytes) expected.push_back(f.flags());
  kept.resize(std::min(kept.size(), expected.size()));
  EXPECT_EQ(kept, expected);
  EXPECT_NE(train::fit_text(tight, o, "d4").find("fit "), std::string::npos);
  const auto json = nlohmann::json::parse(train::fit_json(tight, o));
  EXPECT_EQ(json["fit"]["fits"].size(), tight.fits.size());
}
