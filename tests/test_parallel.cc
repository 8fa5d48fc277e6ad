// Tensor, sequence and pipeline parallel over MPI, and activation recomputation. This
// program runs under mpirun (CTest: Parallel.2ranks, .4ranks, .8ranks, oversubscribed on
// a small machine); each test makes the layout it names (dp x tp x pp must be the world
// size, others skip), and every rank runs every test in the same order.
//
// Parity: every layout trains 10 steps and its losses must equal those of one process
// with the same global batch within 1e-5 relative. The shards compute the same sums in
// other orders (partial products reduced over tp, per-stage gradient sums, the two copies
// of a tied embedding added after backward), which moves fp32 results by ~1e-7 relative
// per step; a wrong shard, a missing reduction or a microbatch run twice moves the loss by
// 1e-3 or more within the first steps.
//
// Memory: every run is under --sanitize strict (a surviving graph or growing live memory
// throws on the rank where it happens), and from the second step on, every step of every
// rank must end with exactly the same live bytes and the same peak.
//
// Models are tiny: 4 layers of width 32, vocabulary 97 padded to 128 (GPT-2), or 4 query
// and 2 key/value heads with an untied head (LLaMA), written at start-up from a seed.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <set>
#include <tuple>

#include "autograd/observer.h"
#include "dist/pipeline.h"
#include "dist/world.h"
#include "io/checkpoint.h"
#include "io/hf_files.h"
#include "io/model_files.h"
#include "nn/transformer.h"
#include "ops/ops.h"
#include "optim/adamw.h"
#include "runtime/backend.h"
#include "sanitizer/sanitizer.h"
#include "support.h"
#include "nn/init.h"
#include "nn/llmc_layout.h"
#include "train/dry_run.h"
#include "train/plan.h"
#include "train/trainer.h"

using namespace tally;

namespace {

dist::World* g_world = nullptr;
int world_size() { return g_world->size(); }

using Family = nn::TransformerConfig::Family;

// Four layers of width 32, 4 heads; LLaMA's architecture with 2 kv heads, an untied head,
// Qwen2's q/k/v biases, Qwen3's q/k norms and heads 16 wide (not 32 / 4), or Qwen3-MoE's
// experts besides.
nn::TransformerConfig tiny_model(Family family) {
  nn::TransformerConfig c;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_kv_head = family == Family::Gpt2 ? 4 : 2;
  c.n_embd = 32;
  c.vocab_size = 97;
  c.padded_vocab_size = 128;
  c.max_seq_len = 64;
  if (family != Family::Gpt2) {
    c.family = family;
    c.ffn_hidden = 64;
    c.rope_theta = 10000;
    c.tie_embeddings = false;
    if (family == Family::Qwen3 || family == Family::Qwen3Moe) c.head_width = 16;
    if (family == Family::Qwen3Moe) {  // 4 experts of 16, 2 a token; layer 1 dense
      c.n_experts = 4;
      c.experts_per_token = 2;
      c.moe_ffn_hidden = 16;
      c.mlp_only_layers = {1};
    }
  }
  return c;
}
std::string family_of(Family family) { return tiny_model(family).family_name(); }

// Each rank writes its own copy (same seed, same bytes): no shared directory needed.
std::string tiny_model_file(Family family) {
  static std::map<Family, std::string> paths;
  auto it = paths.find(family);
  if (it != paths.end()) return it->second;
  nn::Transformer model(tiny_model(family));
  nn::init_weights(model, 7);
  const std::string path = test::temp_path(family_of(family) + "_4layer_rank" +
                                           std::to_string(g_world->rank()) + ".bin");
  io::save_llmc(path, model);
  return paths[family] = path;
}

train::TrainConfig base_config(Family family) {
  static const std::string data = test::write_random_shard("parallel_train_rank" + std::to_string(g_world->rank()) + ".bin",
                                                           40000, 97, 11);
  train::TrainConfig c = test::tiny_train_config(data);
  c.model.file = tiny_model_file(family);
  c.batch.steps = 10;
  c.optimizer.lr = 3e-3;
  c.optimizer.warmup_steps = 2;
  c.optimizer.grad_clip = 1.0;
  c.checkpoint.out_dir = test::temp_path("parallel_out_rank" + std::to_string(g_world->rank()));
  return c;
}

struct Layout {
  int dp = 1, tp = 1, pp = 1;
  std::string schedule = "1f1b";
  int virtual_stages = 1;
  bool sp = false;
  int zero = 0;  // over the data-parallel group
  int64_t last_stage_layers = 0;  // --pp-last-stage-layers
  int cp = 1;
  int ep = 1;  // within dp
  int world() const { return dp * tp * pp * cp; }
  // `base` run in this layout.
  train::TrainConfig apply(train::TrainConfig c) const {
    c.parallel.dp = dp;
    c.parallel.tp = tp;
    c.parallel.pp = pp;
    c.parallel.pp_schedule = dist::parse_pipeline_schedule(schedule);
    c.parallel.virtual_stages = virtual_stages;
    c.parallel.sequence_parallel = sp;
    c.parallel.zero = zero;
    c.parallel.pp_last_stage_layers = last_stage_layers;
    c.parallel.cp = cp;
    c.parallel.ep = ep;
    return c;
  }
  std::string name() const {
    std::string n;
    if (dp > 1) n += "dp" + std::to_string(dp) + " ";
    if (tp > 1) n += "tp" + std::to_string(tp) + (sp ? "+sp " : " ");
    if (pp > 1) n += "pp" + std::to_string(pp) + " " + schedule + (virtual_stages > 1 ? " V=" + std::to_string(virtual_stages) : "") + " ";
    if (zero > 0) n += "zero" + std::to_string(zero) + " ";
    if (last_stage_layers > 0) n += "last" + std::to_string(last_stage_layers) + " ";
    if (cp > 1) n += "cp" + std::to_string(cp) + " ";
    if (ep > 1) n += "ep" + std::to_string(ep) + " ";
    return n;
  }
};

// `l` with context or expert parallel.
Layout with_cp(Layout l, int cp) {
  l.cp = cp;
  return l;
}
Layout with_ep(Layout l, int ep) {
  l.ep = ep;
  return l;
}

// One process, the same global batch: dp x N microbatches per step. Cached per model and
// precision.
const train::TrainResult& one_process(Family family, int64_t microbatches, const std::string& dtype = "fp32") {
  static std::map<std::tuple<Family, int64_t, std::string>, train::TrainResult> cache;
  auto key = std::make_tuple(family, microbatches, dtype);
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  train::TrainConfig c = base_config(family);
  c.batch.grad_accum = microbatches;
  c.compute.dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
  std::unique_ptr<dist::World> self = dist::World::self();
  return cache[key] = train::run_training(c, *self);
}

// `peaks`: the peaks too (not for dropless expert parallel, whose exchanged rows follow the
// routing).
void expect_flat(const train::TrainResult& r, const std::string& what, bool peaks = true) {
  int64_t live = -1, peak = -1;
  for (const auto& b : r.boundaries) {
    ASSERT_EQ(b.live_nodes, 0u) << what;
    ASSERT_EQ(b.live_saved, 0u) << what;
    if (b.microbatch >= 0 || b.step < 1) continue;
    if (live < 0) live = b.allocated, peak = b.peak_allocated;
    ASSERT_EQ(b.allocated, live) << what << ": live bytes at the end of step " << b.step + 1;
    if (peaks) {
      ASSERT_EQ(b.peak_allocated, peak) << what << ": peak of step " << b.step + 1;
    }
  }
}

// `dtype` "bf16" runs both sides in mixed precision; `chunked_loss` fuses the head and the
// loss on the sharded side only (one process keeps the plain head: the same math).
// `capacity`: the sharded side's --moe-capacity-factor (one process is dropless).
void expect_matches_one_process(const Layout& l, Family family, const std::string& recompute,
                                const std::string& dtype = "fp32", bool chunked_loss = false, double capacity = 0) {
  if (l.world() != world_size()) GTEST_SKIP() << l.name() << "needs " << l.world() << " ranks";
  const int64_t N = l.pp > 1 ? 4 : 2;  // per data-parallel rank; 1F1B over 4 stages needs 4
  const train::TrainResult& want = one_process(family, N * l.dp, dtype);
  std::unique_ptr<dist::World> world = dist::World::create({l.dp, l.tp, l.pp, l.cp, l.ep});
  train::TrainConfig c = l.apply(base_config(family));
  c.compute.recompute = nn::parse_recompute(recompute);
  c.batch.grad_accum = N;
  c.memory.sanitize = sanitizer::SanitizeMode::Strict;
  c.compute.dtype = dtype == "bf16" ? DType::BF16 : DType::F32;
  c.compute.chunked_loss = chunked_loss;
  c.compute.moe_capacity_factor = capacity;
  const train::TrainResult got = train::run_training(c, *world);
  const std::string what = family_of(family) + " " + l.name() + "recompute " + recompute + " " + dtype +
                           (chunked_loss ? " chunked loss" : "") +
                           (capacity > 0 ? " capacity " + std::to_string(capacity) : "");
  ASSERT_EQ(got.history.size(), want.history.size()) << what;
  // bf16: the GEMMs read the master weights rounded to bf16. Once fp32 accumulation order
  // (another split, another sum) moves a weight across a rounding boundary, that operand
  // differs by a bf16 ulp (2^-8 relative), so later steps agree to ~2e-5 (measured on tp2),
  // not to fp32's 1e-6; 1e-4 still catches a wrong split (1e-2 and worse).
  const double rtol = dtype == "bf16" ? 1e-4 : 1e-5;
  // The gradient norm too: AdamW's update hardly moves when a gradient is off by a factor
  // (a sum over the group that was not taken), the norm does. Under bf16 the norm follows
  // the weights' bf16 ulps more closely than the loss (6.2e-4 apart at llama tp2's step 7).
  const double norm_rtol = dtype == "bf16" ? 2e-3 : 1e-5;
  for (size_t s = 0; s < got.history.size(); ++s) {
    EXPECT_NEAR(got.history[s].loss, want.history[s].loss, rtol * std::abs(want.history[s].loss))
        << what << ": loss at step " << s + 1;
    EXPECT_NEAR(got.history[s].grad_norm, want.history[s].grad_norm, norm_rtol * std::abs(want.history[s].grad_norm))
        << what << ": gradient norm at step " << s + 1;
  }
  // The first loss is the same model on the same data: equal to rounding.
  EXPECT_NEAR(got.history[0].loss, want.history[0].loss, 1e-6 * std::abs(want.history[0].loss)) << what;
  expect_flat(got, what, l.ep == 1 || capacity > 0);
  // At a capacity the all-to-alls' bytes are fixed: each sparse layer's forward exchanges
  // its E counts (8 bytes each) and sends E x capacity rows of C floats twice (dispatch,
  // combine), backward twice more; full recomputation runs the forward once more.
  if (l.ep > 1 && capacity > 0 && l.pp == 1) {
    const nn::TransformerConfig m = tiny_model(family);
    const int64_t tokens = c.batch.batch_size * c.batch.seq_len;
    const int64_t rows = m.n_experts * static_cast<int64_t>(std::ceil(capacity * tokens * m.experts_per_token / m.n_experts));
    const int64_t forwards = recompute == "full" ? 2 : 1;
    const int64_t per_layer = forwards * (m.n_experts * 8 + 2 * rows * m.n_embd * 4) + 2 * rows * m.n_embd * 4;
    for (const train::StepMetrics& s : got.history)
      EXPECT_EQ(s.ep_payload_bytes, N * m.sparse_layer_count() * per_layer) << what << ": all-to-all bytes of a step";
  }
  // The dry run (train/dry_run.h) stands in for this rank on the meta device in every
  // layout, tensor parallel's vocabulary-parallel embedding and loss included: its steps'
  // peaks are the measured ones to the byte. (Dropless experts route at a declared bound
  // there; at a capacity, every shape is fixed.)
  const std::string refusal = train::dry_run_refusal(c);
  ASSERT_TRUE(refusal.empty()) << what << ": " << refusal;
  if (family != Family::Qwen3Moe || capacity > 0) {
    const train::DryRun dry = train::dry_run(c, train::model_config(c.model), false, world_size(), world->rank());
    ASSERT_EQ(dry.steps.size(), 2u) << what;
    const size_t me = static_cast<size_t>(world->rank());
    EXPECT_EQ(dry.steps.front().peak_bytes, got.history.front().rank_peak_bytes[me]) << what << ": the dry run's step 1";
    EXPECT_EQ(dry.steps.back().peak_bytes, got.history.back().rank_peak_bytes[me]) << what << ": the dry run's steady step";
  }
  // Set-up builds this rank's shard, filling it one whole parameter at a time (it built the
  // whole model beside it, above many layouts' step peak). Planned to the byte by the dry
  // run, which fills its shard the same way, experts' layouts included.
  EXPECT_EQ(got.setup_peak_bytes, got.predicted_setup_bytes) << what << ": set-up's peak against its plan";
  if (l.tp * l.pp > 1) {
    EXPECT_GT(got.predicted_setup_bytes, 0) << what;
  }
  // Dropless experts are planned at the balanced routing bound: the real routing moves the
  // peak.
  if (family == Family::Qwen3Moe && capacity == 0) return;
  // The memory plan (train/plan.h): every rank's measured peak is its planned one to the
  // byte, in every layout.
  const train::StepMetrics& last = got.history.back();
  ASSERT_EQ(last.rank_peak_bytes.size(), static_cast<size_t>(world_size())) << what;
  ASSERT_EQ(last.rank_predicted_peak_bytes.size(), static_cast<size_t>(world_size())) << what;
  for (size_t r = 0; r < last.rank_peak_bytes.size(); ++r)
    EXPECT_EQ(last.rank_peak_bytes[r], last.rank_predicted_peak_bytes[r]) << what << ": rank " << r << "'s measured peak against its plan";
  EXPECT_EQ(last.peak_bytes, last.predicted_peak_bytes) << what << ": the largest of each";
}

const std::vector<Layout>& layouts() {
  static const std::vector<Layout> all = {
      {1, 1, 2, "gpipe"},     {1, 1, 2, "1f1b"}, {1, 1, 4, "1f1b"}, {1, 1, 2, "interleaved", 2},
      {1, 2, 1},              {1, 2, 1, "1f1b", 1, true},           {1, 2, 2, "1f1b"},
      {2, 1, 2, "1f1b", 1, false, 1},  {2, 2, 1},  {2, 2, 2, "1f1b", 1, false, 1},  {2, 2, 2, "1f1b", 1, true},
      // the memory plan's other paths: an uneven split (3 layers, then 1 with the head), and
      // interleaved chunks under tensor parallel
      {1, 1, 2, "1f1b", 1, false, 0, 1},  {1, 2, 2, "interleaved", 2},
  };
  return all;
}

}  // namespace

class EveryLayout : public ::testing::TestWithParam<size_t> {};

TEST_P(EveryLayout, Gpt2MatchesOneProcessWithFlatMemory) {
  for (const char* recompute : {"none", "full"}) expect_matches_one_process(layouts()[GetParam()], Family::Gpt2, recompute);
}

TEST_P(EveryLayout, LlamaMatchesOneProcessWithFlatMemory) {
  for (const char* recompute : {"none", "selective"}) expect_matches_one_process(layouts()[GetParam()], Family::Llama3, recompute);
}

// Qwen2's q/k/v biases split with their rows; Qwen3's q/k norm weights are shared by the
// heads that the tensor-parallel ranks split, so their gradients are summed over the group.
TEST(QwenLayouts, MatchOneProcessWithFlatMemory) {
  const std::vector<Layout> some = {{1, 2, 1}, {1, 2, 1, "1f1b", 1, true}, {1, 2, 2, "1f1b"}, {2, 2, 2, "1f1b", 1, true, 1}};
  bool ran = false;
  for (const Layout& l : some) {
    if (l.world() != world_size()) continue;
    ran = true;
    expect_matches_one_process(l, Family::Qwen2, "none");
    expect_matches_one_process(l, Family::Qwen3, "selective");
  }
  if (!ran) GTEST_SKIP() << "no Qwen layout for " << world_size() << " ranks";
}

// Qwen3-MoE's routing is a function of each token's hidden state: pipeline stages, data
// parallel ranks (ZeRO-1 too) and recomputation route every token as one process does.
// Tensor parallel splits every expert as a dense MLP and sums the layer's output once:
// a slice's output missing from the sum, or a router gradient not summed over the group
// (the norm from step 2), moves a loss or gradient norm by far more than 1e-5.
TEST(QwenLayouts, MoeMatchesOneProcessWithFlatMemory) {
  const std::vector<Layout> some = {{1, 1, 2, "1f1b"}, {2, 1, 1, "1f1b", 1, false, 1}, {2, 1, 2, "1f1b", 1, false, 1},
                                    {1, 1, 4, "1f1b"}, {1, 2, 1}, {1, 2, 1, "1f1b", 1, true}, {1, 2, 2, "1f1b"},
                                    {2, 2, 1, "1f1b", 1, true, 1}};
  bool ran = false;
  for (const Layout& l : some) {
    if (l.world() != world_size()) continue;
    ran = true;
    for (const char* recompute : {"none", "full"}) expect_matches_one_process(l, Family::Qwen3Moe, recompute);
  }
  if (!ran) GTEST_SKIP() << "no MoE layout for " << world_size() << " ranks";
}

// Expert parallel: each rank of an expert-parallel group holds 4 / E of every sparse
// layer's experts, and the tokens its ranks route go to their experts' rank and back by
// all-to-all. A token sent to the wrong rank or expert, an output combined in the wrong
// place, an expert gradient reduced over the wrong ranks or a norm missing another rank's
// experts moves the first loss or gradient norm by far more than 1e-5. Under ZeRO-1 the
// experts' moments are sharded over the ranks that hold the same experts (dp2 ep2: none
// but the rank itself) and the rest over all of them: an expert piece updated or gathered
// over the wrong ranks moves the second step's loss.
// Dropless, the rows a rank receives follow the routing, and so do its peaks (its live
// bytes between microbatches do not); with a capacity of E / k (4 / 2: an expert takes up to
// every token, so none is dropped) every shape is fixed and the peaks are flat too.
TEST(ExpertParallelLayouts, MoeMatchesOneProcessWithFlatMemory) {
  const std::vector<Layout> some = {with_ep({2, 1, 1}, 2), with_ep({4, 1, 1}, 2), with_ep({4, 1, 1}, 4),
                                    with_ep({2, 1, 2, "1f1b"}, 2), with_ep({2, 1, 1, "1f1b", 1, false, 1}, 2),
                                    with_ep({4, 1, 1, "1f1b", 1, false, 1}, 2), with_ep({2, 2, 1}, 2),
                                    with_ep({2, 2, 1, "1f1b", 1, true, 1}, 2), with_ep({4, 2, 1}, 4),
                                    with_ep({4, 1, 2, "1f1b"}, 4), with_ep({8, 1, 1, "1f1b", 1, false, 1}, 4)};
  bool ran = false;
  for (const Layout& l : some) {
    if (l.world() != world_size()) continue;
    ran = true;
    for (const char* recompute : {"none", "full"}) {
      expect_matches_one_process(l, Family::Qwen3Moe, recompute);
      expect_matches_one_process(l, Family::Qwen3Moe, recompute, "fp32", false, /*capacity=*/2.0);
    }
  }
  if (!ran) GTEST_SKIP() << "no expert-parallel layout for " << world_size() << " ranks";
}

// Each sparse layer's balance and z-losses are seeded in that layer's backward, so they
// join the objective in pipeline stages, recomputed layers, tensor-parallel slices (each
// rank seeds 1 / T: their gradients are summed over the group) and expert-parallel ranks
// alike. A seed counted T times, a stage's losses left out of the logged objective or a
// recomputed layer seeding twice moves the loss or norm by far more than 1e-5.
TEST(RouterLossLayouts, BalanceAndZLossesMatchOneProcess) {
  struct Case {
    Layout layout;
    const char* recompute;
  };
  const std::vector<Case> cases = {{{1, 1, 2, "1f1b"}, "full"},         {{1, 2, 1, "1f1b", 1, true}, "none"},
                                   {with_ep({2, 1, 1}, 2), "full"},      {with_ep({2, 2, 1}, 2), "none"},
                                   {with_ep({2, 1, 2, "1f1b"}, 2), "full"}};
  auto with_losses = [](train::TrainConfig c) {
    c.compute.moe_balance_loss_coef = 0.05;
    c.compute.moe_z_loss_coef = 0.01;
    return c;
  };
  bool ran = false;
  for (const Case& k : cases) {
    const Layout& l = k.layout;
    if (l.world() != world_size()) continue;
    ran = true;
    const int64_t N = l.pp > 1 ? 4 : 2;
    train::TrainConfig one = with_losses(base_config(Family::Qwen3Moe));
    one.batch.grad_accum = N * l.dp;
    std::unique_ptr<dist::World> self = dist::World::self();
    const train::TrainResult want = train::run_training(one, *self);
    train::TrainConfig c = l.apply(with_losses(base_config(Family::Qwen3Moe)));
    c.batch.grad_accum = N;
    c.compute.recompute = nn::parse_recompute(k.recompute);
    c.memory.sanitize = sanitizer::SanitizeMode::Strict;
    std::unique_ptr<dist::World> world = dist::World::create({l.dp, l.tp, l.pp, l.cp, l.ep});
    const train::TrainResult got = train::run_training(c, *world);
    const std::string what = l.name() + "recompute " + k.recompute;
    ASSERT_EQ(got.history.size(), want.history.size()) << what;
    for (size_t s = 0; s < got.history.size(); ++s) {
      const train::StepMetrics &g = got.history[s], &w = want.history[s];
      EXPECT_NEAR(g.loss, w.loss, 1e-5 * std::abs(w.loss)) << what << ": loss at step " << s + 1;
      EXPECT_NEAR(g.grad_norm, w.grad_norm, 1e-5 * w.grad_norm) << what << ": gradient norm at step " << s + 1;
      EXPECT_NEAR(g.balance_loss, w.balance_loss, 1e-5 * w.balance_loss) << what << ": balance loss at step " << s + 1;
      EXPECT_NEAR(g.z_loss, w.z_loss, 1e-5 * w.z_loss) << what << ": z-loss at step " << s + 1;
      EXPECT_NEAR(g.ce_loss, w.ce_loss, 1e-5 * w.ce_loss) << what << ": cross-entropy at step " << s + 1;
    }
    EXPECT_GT(want.history[0].balance_loss, 1.0) << "two sparse layers, each 1 when perfectly even";
    expect_flat(got, what, l.ep == 1);
  }
  if (!ran) GTEST_SKIP() << "no router-loss layout for " << world_size() << " ranks";
}

// Seed 003 (verl's Megatron backend, Qwen3-30B-A3B with expert parallel): recomputation
// kept each checkpointed layer's inputs and their gradients after backward. tally's
// recomputed MoE layers, their dispatch and combine included, leave nothing behind over
// 50 steps of 16 microbatches on every rank of --ep 2.
train::TrainConfig seed003_config(int64_t steps) {
  train::TrainConfig c = with_ep({2, 1, 1}, 2).apply(base_config(Family::Qwen3Moe));
  c.compute.recompute = nn::Recompute::Full;
  c.compute.moe_capacity_factor = 1.25;  // drops some pairs, and fixes every shape
  c.batch.batch_size = 1;
  c.batch.seq_len = 32;
  c.batch.grad_accum = 16;
  c.batch.steps = steps;
  c.memory.sanitize = sanitizer::SanitizeMode::Strict;
  return c;
}

TEST(Seed003OnExpertParallel, RecomputedMoeLayersLeaveNothingOverFiftyStepsOfSixteenMicrobatches) {
  if (world_size() != 2) GTEST_SKIP() << "ep2 runs on 2 ranks";
  std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1, 1, 2});
  const train::TrainResult r = train::run_training(seed003_config(50), *world);
  ASSERT_EQ(r.history.size(), 50u);
  expect_flat(r, "seed 003 ep2 full recompute");
  int64_t dropped = 0;
  for (const train::StepMetrics& m : r.history) dropped += m.expert_dropped;
  EXPECT_GT(dropped, 0) << "capacity 1.25 drops pairs of the busiest experts";
}

// The bug itself: a gradient-inspection tool that keeps each recomputed region's inputs
// (and so their gradients) keeps them past the microbatch; the strict sanitizer stops
// every rank at the first microbatch's boundary, naming the owners that grew.
TEST(Seed003OnExpertParallel, KeepingRecomputedInputsIsCaughtAtTheNextBoundary) {
  if (world_size() != 2) GTEST_SKIP() << "ep2 runs on 2 ranks";
  std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1, 1, 2});
  struct KeepsInputs : autograd::EngineObserver {
    std::vector<Tensor> kept;
    void region_recomputed(const std::vector<Tensor>& inputs) override {
      for (const Tensor& t : inputs)  // the trainer's dry run (its plan) recomputes on the meta device first
        if (!t.device().is_meta()) kept.push_back(t);
    }
  } keeper;
  autograd::ObserverRegistration registration(keeper);
  const std::string m = test::message_of<Error>([&] { train::run_training(seed003_config(2), *world); });
  EXPECT_EQ(keeper.kept.size(), 4u) << "stopped after the first microbatch's four layers";
  EXPECT_NE(m.find("microbatch 0"), std::string::npos) << m;
  EXPECT_NE(m.find("still carry graph state"), std::string::npos) << m;
  // The recomputed layers' inputs: the embedding's output, then each layer's output.
  for (const char* owner : {"embed:embedding", "h.0.mlp:add", "h.1.mlp:add", "h.2.mlp:add"})
    EXPECT_NE(m.find(owner), std::string::npos) << owner << " in: " << m;
}

// A rank whose tokens chose none of an expert has no gradient for it when its backward
// ends, so that expert's bucket (ZeRO-2: its layer's unit) starts after the backward. It
// used to start in finish(), after the loss's all-reduce on the same group (ZeRO-2: after
// the later units), while a rank whose tokens did choose it had started it first: the
// ranks' collectives came in different orders (MPI read one all-reduce's bytes into
// another's buffer: a crash within 10 steps of this run). ZeRO-3 is refused with experts
// over data-parallel ranks: its gathers would meet such a late reduce-scatter.
TEST(MoeDataParallel, RanksWhoseTokensSkipAnExpertReduceInTheSameOrder) {
  if (world_size() != 2) GTEST_SKIP() << "dp2 runs on 2 ranks";
  train::TrainConfig one = base_config(Family::Qwen3Moe);
  one.batch.batch_size = 1;  // 32 tokens a microbatch: an expert some rank's tokens skip
  one.batch.seq_len = 32;
  one.batch.grad_accum = 8;
  std::unique_ptr<dist::World> self = dist::World::self();
  const train::TrainResult want = train::run_training(one, *self);
  for (int zero = 0; zero <= 2; ++zero) {
    std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1});
    train::TrainConfig c = Layout{2, 1, 1}.apply(one);
    c.parallel.zero = zero;
    c.batch.grad_accum = 4;
    const train::TrainResult r = train::run_training(c, *world);
    ASSERT_EQ(r.history.size(), want.history.size()) << "zero " << zero;
    for (size_t s = 0; s < r.history.size(); ++s)
      EXPECT_NEAR(r.history[s].loss, want.history[s].loss, 1e-5 * std::abs(want.history[s].loss))
          << "zero " << zero << ": step " << s + 1;
  }
  std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1});
  train::TrainConfig c = Layout{2, 1, 1}.apply(one);
  c.parallel.zero = 3;
  c.batch.grad_accum = 4;
  const std::string m = test::message_of<Error>([&] { train::run_training(c, *world); });
  EXPECT_NE(m.find("--zero 3"), std::string::npos) << m;
}

// Context parallel: each rank holds chunks r and 2C-1-r of every sequence, rotary angles
// and GPT-2's position rows follow them, and attention runs over the gathered keys and
// values with the causal mask at the chunks' own positions. A rank that took the wrong
// chunk, position or mask offset, or a gradient of the keys summed to the wrong rank,
// moves the first loss or the first gradient norm by far more than 1e-5.
TEST(ContextParallelLayouts, MatchOneProcessWithFlatMemory) {
  const std::vector<Layout> some = {with_cp({}, 2),
                                    with_cp({}, 4),
                                    with_cp({1, 2, 1}, 2),
                                    with_cp({1, 2, 1, "1f1b", 1, true}, 2),
                                    with_cp({1, 1, 2, "1f1b"}, 2),
                                    with_cp({2, 1, 1, "1f1b", 1, false, 2}, 2),
                                    with_cp({2, 1, 1, "1f1b", 1, false, 3}, 2),
                                    with_cp({2, 2, 1, "1f1b", 1, false, 1}, 2),
                                    with_cp({2, 1, 1, "1f1b", 1, false, 2}, 4)};
  bool ran = false;
  for (const Layout& l : some) {
    if (l.world() != world_size()) continue;
    ran = true;
    for (const char* recompute : {"none", "full"}) expect_matches_one_process(l, Family::Gpt2, recompute);
    for (const char* recompute : {"none", "selective"}) expect_matches_one_process(l, Family::Llama3, recompute);
    expect_matches_one_process(l, Family::Qwen3, "full");
  }
  if (!ran) GTEST_SKIP() << "no context-parallel layout for " << world_size() << " ranks";
}

// Seed 001 (docs/memory-contract.md): Fast-LLM's Qwen2.5-7B post-training, sequence-data
// parallel 2 x ZeRO-2 x full recomputation with hundreds of microbatches a step, kept each
// microbatch's loss for logging and grew 164 MiB a microbatch. Here on tiny shapes: cp2 x
// dp2 on 4 ranks, ZeRO-2, full recompute, sequences of the model's whole length, 256
// microbatches a step, each microbatch's loss kept as its value. Every microbatch boundary
// of every rank has the same live bytes from the second on, and every step the same peak.
train::TrainConfig seed001_config(int64_t microbatches) {
  train::TrainConfig c = Layout{2, 1, 1, "1f1b", 1, false, 2}.apply(base_config(Family::Qwen2));
  c.parallel.cp = 2;
  c.compute.recompute = nn::Recompute::Full;
  c.batch.batch_size = 1;
  c.batch.seq_len = 64;  // the model's max_seq_len
  c.batch.grad_accum = microbatches;
  c.batch.steps = 3;
  c.memory.sanitize = sanitizer::SanitizeMode::Strict;
  return c;
}

TEST(Seed001OnContextParallel, KeptLossValuesStayFlatOverHundredsOfMicrobatches) {
  if (world_size() != 4) GTEST_SKIP() << "cp2 x dp2 runs on 4 ranks";
  std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1, 2});
  train::TrainConfig c = seed001_config(256);
  std::vector<double> logged;  // what a logger keeps: each microbatch's value (R4)
  c.on_microbatch_loss = [&](int64_t, const Tensor& loss) { logged.push_back(loss.item()); };
  const train::TrainResult r = train::run_training(c, *world);
  EXPECT_EQ(logged.size(), static_cast<size_t>(3 * 256));
  int64_t live = -1;
  size_t microbatch_boundaries = 0;
  for (const sanitizer::Boundary& b : r.boundaries) {
    ASSERT_EQ(b.live_nodes, 0u) << "step " << b.step << " microbatch " << b.microbatch;
    if (b.microbatch < 0 || (b.step == 0 && b.microbatch == 0)) continue;
    ++microbatch_boundaries;
    if (live < 0) live = b.allocated;
    ASSERT_EQ(b.allocated, live) << "rank " << world->rank() << ": live bytes at step " << b.step << " microbatch "
                                 << b.microbatch;
  }
  EXPECT_EQ(microbatch_boundaries, size_t{3 * 256 - 1});
  expect_flat(r, "seed 001 cp2 x dp2 zero2 full recompute");
}

// The bug itself: a logger that keeps the loss tensor keeps its graph's node past the
// microbatch. The strict sanitizer stops every rank at the first microbatch's boundary and
// names what survived.
TEST(Seed001OnContextParallel, KeepingTheLossTensorIsCaughtAtTheNextBoundary) {
  if (world_size() != 4) GTEST_SKIP() << "cp2 x dp2 runs on 4 ranks";
  std::unique_ptr<dist::World> world = dist::World::create({2, 1, 1, 2});
  train::TrainConfig c = seed001_config(8);
  std::vector<Tensor> kept;
  c.on_microbatch_loss = [&](int64_t, const Tensor& loss) { kept.push_back(loss); };
  const std::string m = test::message_of<Error>([&] { train::run_training(c, *world); });
  EXPECT_EQ(kept.size(), 1u) << "stopped at the first microbatch's boundary";
  EXPECT_NE(m.find("microbatch 0"), std::string::npos) << m;
  EXPECT_NE(m.find("live graph after backward"), std::string::npos) << m;
  EXPECT_NE(m.find("storage owner 'head:loss'"), std::string::npos) << m;
}

// Mixed precision through tensor and pipeline parallel: the projections round the same
// operands to bf16 whatever the split, so the first step agrees to rounding and later ones
// within bf16's tolerance (above). The layouts without tp also fuse the head with the loss.
TEST(Bf16Layouts, MatchOneProcessWithFlatMemory) {
  const std::vector<Layout> some = {{1, 2, 1}, {1, 1, 2, "1f1b"}, {2, 2, 1, "1f1b", 1, false, 1}, {2, 2, 2, "1f1b", 1, true}};
  bool ran = false;
  for (const Layout& l : some) {
    if (l.world() != world_size()) continue;
    ran = true;
    expect_matches_one_process(l, Family::Gpt2, "none", "bf16", /*chunked_loss=*/l.tp == 1);
    expect_matches_one_process(l, Family::Llama3, "none", "bf16", /*chunked_loss=*/l.tp == 1);
  }
  if (!ran) GTEST_SKIP() << "no bf16 layout for " << world_size() << " ranks";
}

// Under bf16 the logits are bf16, so with a real vocabulary (d2: GPT-2's 50,304 rows
// beside a width of 128) the loss's forward holds more than the head's backward: every
// activation of the microbatch, the per-row losses and the final norm's fp32 output. The
// head stage's plan must have that moment, with the microbatches in flight beside it, to
// the byte, for the plain and the chunked loss.
TEST(Bf16Pipeline, TheHeadStagePeaksAtTheLossForwardAsPlanned) {
  if (world_size() != 2) GTEST_SKIP() << "pp2 runs on 2 ranks";
  for (bool chunked : {false, true}) {
    std::unique_ptr<dist::World> world = dist::World::create({1, 1, 2});
    train::TrainConfig c = Layout{1, 1, 2}.apply(base_config(Family::Gpt2));
    c.model.file.clear();
    c.model.preset = "d2";
    c.batch.batch_size = 4;  // 256 tokens: the logits (25 MiB) outweigh the tied embedding's exchange (4 MiB)
    c.batch.seq_len = 64;
    c.batch.grad_accum = 2;
    c.batch.steps = 3;
    c.compute.dtype = DType::BF16;
    c.compute.chunked_loss = chunked;
    c.memory.sanitize = sanitizer::SanitizeMode::Strict;
    const train::TrainResult r = train::run_training(c, *world);
    const std::string what = std::string("d2 pp2 bf16") + (chunked ? " chunked loss" : "");
    expect_flat(r, what);
    const train::StepMetrics& last = r.history.back();
    ASSERT_EQ(last.rank_peak_bytes.size(), 2u) << what;
    for (size_t rank = 0; rank < 2; ++rank)
      EXPECT_EQ(last.rank_peak_bytes[rank], last.rank_predicted_peak_bytes[rank]) << what << ": rank " << rank;
  }
}

INSTANTIATE_TEST_SUITE_P(Parallel, EveryLayout, ::testing::Range<size_t>(0, 13), [](const auto& info) {
  std::string n = layouts()[info.param].name();
  for (char& ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return n;
});

// ------------------------------------------------------------------ schedules
TEST(Schedule, OneFOneBHoldsAtMostPMinusSMicrobatchesAndGPipeAllOfThem) {
  for (int s = 0; s < 4; ++s) {
    EXPECT_EQ(dist::pipeline_in_flight_bound(dist::PipelineSchedule::OneFOneB, 4, s, 8, 1), 4 - s);
    EXPECT_EQ(dist::pipeline_in_flight_bound(dist::PipelineSchedule::GPipe, 4, s, 8, 1), 8);
  }
  // Every microbatch runs forward and backward once per chunk, forward first.
  for (auto sched : {dist::PipelineSchedule::GPipe, dist::PipelineSchedule::OneFOneB, dist::PipelineSchedule::Interleaved}) {
    const int V = sched == dist::PipelineSchedule::Interleaved ? 2 : 1;
    for (int s = 0; s < 4; ++s) {
      std::map<std::pair<int64_t, int>, int> seen;
      for (const auto& a : dist::pipeline_actions(sched, 4, s, 8, V)) {
        int& state = seen[{a.microbatch, a.chunk}];
        EXPECT_EQ(state, a.forward ? 0 : 1) << dist::pipeline_schedule_name(sched) << " stage " << s;
        state++;
      }
      EXPECT_EQ(seen.size(), static_cast<size_t>(8 * V));
    }
  }
}

// The stages' blocking rules, played out on every rank's action list at once: an action
// posts its own receive and the next one's; a forward waits for its activation, a
// backward for its gradient, and a backward that sends a gradient back first waits until
// the previous one it sent has its receive posted. Sends never block otherwise. Every
// schedule must run to the end, for any P, V and N it accepts.
namespace {
using StageActions = std::vector<std::vector<dist::PipelineAction>>;  // per pipeline rank

StageActions schedule_of(dist::PipelineSchedule schedule, int P, int64_t N, int V) {
  StageActions acts;
  for (int s = 0; s < P; ++s) acts.push_back(dist::pipeline_actions(schedule, P, s, N, V));
  return acts;
}

bool runs_to_the_end(const StageActions& acts, int V) {
  const int P = static_cast<int>(acts.size()), S = P * V;
  using Msg = std::tuple<bool, int, int64_t>;  // (gradient?, receiving global stage, microbatch)
  std::set<Msg> sent, posted;
  std::vector<size_t> pc(static_cast<size_t>(P), 0);
  std::vector<std::optional<Msg>> last_gradient(static_cast<size_t>(P));
  auto receive_of = [&](int r, size_t i) -> std::optional<Msg> {
    const auto& a = acts[static_cast<size_t>(r)][i];
    const int g = a.chunk * P + r;
    if (a.forward && g > 0) return Msg{false, g, a.microbatch};
    if (!a.forward && g < S - 1) return Msg{true, g, a.microbatch};
    return std::nullopt;
  };
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r) {
      const size_t i = pc[static_cast<size_t>(r)];
      if (i >= acts[static_cast<size_t>(r)].size()) continue;
      for (size_t j : {i, i + 1})
        if (j < acts[static_cast<size_t>(r)].size())
          if (auto m = receive_of(r, j)) posted.insert(*m);
      const auto& a = acts[static_cast<size_t>(r)][i];
      const int g = a.chunk * P + r;
      if (auto m = receive_of(r, i); m && !sent.count(*m)) continue;
      if (!a.forward && g > 0) {
        auto& prev = last_gradient[static_cast<size_t>(r)];
        if (prev && !posted.count(*prev)) continue;
        prev = Msg{true, g - 1, a.microbatch};
        sent.insert(*prev);
      }
      if (a.forward && g < S - 1) sent.insert(Msg{false, g + 1, a.microbatch});
      ++pc[static_cast<size_t>(r)];
      progress = true;
    }
  }
  for (int r = 0; r < P; ++r)
    if (pc[static_cast<size_t>(r)] < acts[static_cast<size_t>(r)].size()) return false;
  return true;
}
}  // namespace

TEST(Schedule, NoScheduleDeadlocksUnderTheStagesBlockingRules) {
  using PS = dist::PipelineSchedule;
  for (PS sched : {PS::GPipe, PS::OneFOneB, PS::Interleaved})
    for (int P : {2, 3, 4, 8})
      for (int V : sched == PS::Interleaved ? std::vector<int>{2, 3, 4} : std::vector<int>{1})
        for (int64_t N = 1; N <= 16; ++N) {
          if ((sched == PS::OneFOneB && N < P) || (sched == PS::Interleaved && N % P != 0)) continue;
          EXPECT_TRUE(runs_to_the_end(schedule_of(sched, P, N, V), V))
              << dist::pipeline_schedule_name(sched) << " P=" << P << " V=" << V << " N=" << N;
        }
  // The check can fail: a first stage that runs its backwards in reverse order waits for
  // the last microbatch's gradient, which the second stage sends only after the first
  // microbatch's, whose receive the first stage has not posted.
  StageActions broken = schedule_of(PS::OneFOneB, 2, 4, 1);
  std::stable_partition(broken[0].begin(), broken[0].end(), [](const dist::PipelineAction& a) { return a.forward; });
  std::reverse(std::find_if(broken[0].begin(), broken[0].end(), [](const auto& a) { return !a.forward; }), broken[0].end());
  EXPECT_FALSE(runs_to_the_end(broken, 1));
}

TEST(Schedule, LayersThatDoNotDivideGoToTheFirstStagesAndBadSchedulesAreNamed) {
  const auto r = dist::split_layers(10, 4);
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0], (std::pair<int64_t, int64_t>{0, 3}));
  EXPECT_EQ(r[1], (std::pair<int64_t, int64_t>{3, 6}));
  EXPECT_EQ(r[2], (std::pair<int64_t, int64_t>{6, 8}));
  EXPECT_EQ(r[3], (std::pair<int64_t, int64_t>{8, 10}));
  // Megatron's uneven split: a given last stage, the rest even.
  EXPECT_EQ(dist::split_layers(12, 2, 3), (std::vector<std::pair<int64_t, int64_t>>{{0, 9}, {9, 12}}));
  EXPECT_EQ(dist::split_layers(11, 4, 1), (std::vector<std::pair<int64_t, int64_t>>{{0, 4}, {4, 7}, {7, 10}, {10, 11}}));
  std::string m = test::message_of<Error>([] { dist::check_pipeline(dist::PipelineSchedule::OneFOneB, 2, 1, 2, 4, 4); });
  EXPECT_NE(m.find("--pp-last-stage-layers 4"), std::string::npos) << m;
  m = test::message_of<Error>([] { dist::check_pipeline(dist::PipelineSchedule::OneFOneB, 4, 1, 2, 8); });
  EXPECT_NE(m.find("--grad-accum"), std::string::npos) << m;
  m = test::message_of<Error>([] { dist::check_pipeline(dist::PipelineSchedule::Interleaved, 2, 2, 3, 8); });
  EXPECT_NE(m.find("multiple of --pp"), std::string::npos) << m;
  m = test::message_of<Error>([] { dist::check_pipeline(dist::PipelineSchedule::OneFOneB, 4, 1, 4, 3); });
  EXPECT_NE(m.find("only 3 layers"), std::string::npos) << m;
}

// ------------------------------------------------------------------ checkpoints
namespace {
// A directory every rank agrees on, new to this run of the suite (test::shared_run_id).
std::string shared_dir(const std::string& name) {
  static const std::string job = test::shared_run_id(*g_world);  // new to this run of the suite
  return ::testing::TempDir() + "/tally_parallel_" + job + "_" + name;
}
}  // namespace

namespace {
// `family` in layout `l` for 10 steps, saving at step 5 into shared_dir(`out_name`): resuming
// that checkpoint in the same layout repeats steps 6-10 bit-exactly, and one process with
// the same global batch resumes it within fp32 rounding of the uninterrupted run.
void expect_resumes_exactly_and_in_one_process(const Layout& l, Family family, const std::string& out_name) {
  const std::string what = family_of(family) + " " + l.name();
  std::unique_ptr<dist::World> world = dist::World::create({l.dp, l.tp, l.pp, l.cp, l.ep});
  train::TrainConfig c = l.apply(base_config(family));
  c.batch.grad_accum = l.pp > 1 ? 2 : 1;
  c.checkpoint.save_every = 5;
  c.checkpoint.out_dir = shared_dir(out_name);
  const train::TrainResult full = train::run_training(c, *world);
  ASSERT_EQ(full.history.size(), 10u) << what;
  train::TrainConfig r = c;
  r.checkpoint.resume = c.checkpoint.out_dir + "/step_00000005";
  r.checkpoint.save_every = 0;
  const train::TrainResult resumed = train::run_training(r, *world);
  ASSERT_EQ(resumed.history.size(), 5u) << what;
  for (size_t s = 0; s < 5; ++s)
    EXPECT_EQ(resumed.history[s].loss, full.history[s + 5].loss) << what << ": resumed step " << s + 6;
  // One process, the same global batch, from the same checkpoint.
  train::TrainConfig one = r;
  one.parallel.dp = one.parallel.tp = one.parallel.pp = one.parallel.ep = 1;
  one.parallel.sequence_parallel = false;
  one.parallel.zero = 0;
  one.batch.grad_accum = c.batch.grad_accum * l.dp;
  one.checkpoint.out_dir = test::temp_path("one_process_resume_rank" + std::to_string(g_world->rank()));
  std::unique_ptr<dist::World> self = dist::World::self();
  const train::TrainResult alone = train::run_training(one, *self);
  ASSERT_EQ(alone.history.size(), 5u) << what;
  for (size_t s = 0; s < 5; ++s)
    EXPECT_NEAR(alone.history[s].loss, full.history[s + 5].loss, 1e-5 * std::abs(full.history[s + 5].loss))
        << what << ": one process resumed, step " << s + 6;
  world->world().barrier();  // rank 0 reads nothing more before the others are done
}
}  // namespace

// A sharded run's checkpoint holds the whole model: resuming it in the same layout
// continues bit-exactly, and one process resumes it too (within fp32 rounding of the
// uninterrupted sharded run).
TEST(ParallelCheckpoints, ASavedShardedRunResumesExactlyAndInOneProcess) {
  const std::vector<Layout> layouts = {{1, 1, 2, "1f1b"}, {1, 2, 1, "1f1b", 1, true}, {2, 2, 1, "1f1b", 1, false, 1},
                                       {2, 2, 2, "1f1b", 1, false, 1}};
  for (const Layout& l : layouts) {
    if (l.world() != world_size()) continue;
    for (Family family : {Family::Gpt2, Family::Llama3})
      expect_resumes_exactly_and_in_one_process(
          l, family, family_of(family) + "_" + std::to_string(l.dp) + std::to_string(l.tp) + std::to_string(l.pp));
  }
}

// Expert parallel: the ranks of an expert-parallel group each send rank 0 their own
// experts (and their moments), which it writes into the whole model's files: resuming in
// the same layout continues bit-exactly, and one process resumes it too. Under ZeRO-1
// (dp4 ep2) each expert's moments are gathered from the two ranks that hold that expert;
// under tp2 x ep2 each expert's slices from the two tensor-parallel ranks of its holder.
TEST(ParallelCheckpoints, ASavedExpertParallelRunResumesExactlyAndInOneProcess) {
  const std::vector<Layout> layouts = {with_ep({2, 1, 1}, 2), with_ep({4, 1, 1}, 4), with_ep({2, 1, 2, "1f1b"}, 2),
                                       with_ep({4, 1, 1, "1f1b", 1, false, 1}, 2), with_ep({2, 2, 1}, 2)};
  for (const Layout& l : layouts) {
    if (l.world() != world_size()) continue;
    expect_resumes_exactly_and_in_one_process(l, Family::Qwen3Moe,
                                              "moe_" + std::to_string(l.dp) + std::to_string(l.tp) + std::to_string(l.pp) +
                                                  std::to_string(l.ep) +
                                                  "_zero" + std::to_string(l.zero));
  }
}

// --init-from reads HuggingFace files into each rank's shard, and the ranks compare what
// they read parameter by parameter (a pipeline stage reads only its own): every layout
// must load without a false alarm and start from the one-process model's loss.
TEST(ParallelInit, HuggingFaceWeightsLoadIntoEveryShardAsIntoOneProcess) {
  const std::vector<Layout> layouts = {{1, 1, 2}, {1, 2, 1}, {2, 1, 1, "1f1b", 1, false, 3}, {1, 2, 2}, {2, 2, 2}};
  for (const Layout& l : layouts) {
    if (l.world() != world_size()) continue;
    for (Family family : {Family::Gpt2, Family::Llama3, Family::Qwen2, Family::Qwen3}) {
      const std::string what = family_of(family) + " " + l.name();
      const std::string hf = test::temp_path(family_of(family) + "_hf_rank" + std::to_string(g_world->rank()));
      {
        nn::Transformer m(io::read_llmc_config(tiny_model_file(family)));
        io::load_llmc(tiny_model_file(family), m);
        io::save_hf(hf, m);
      }
      const int64_t N = l.pp > 1 ? 4 : 2;
      std::unique_ptr<dist::World> world = dist::World::create({l.dp, l.tp, l.pp});
      train::TrainConfig c = l.apply(base_config(family));
      c.model.file.clear();
      c.model.init_from = hf;
      c.batch.grad_accum = N;
      c.batch.steps = 1;
      const train::TrainResult got = train::run_training(c, *world);
      ASSERT_EQ(got.history.size(), 1u) << what;
      const double want = one_process(family, N * l.dp).history[0].loss;
      EXPECT_NEAR(got.history[0].loss, want, 1e-6 * std::abs(want)) << what;
    }
  }
}

// Rank 0 writes a sharded run's checkpoint from pieces streamed to it: the files are the
// whole model's (parameters and both moments, every piece in its place), and while it
// writes it holds at most one whole parameter and one unit of moments beside its own
// shard, never the whole model (it held 16 P bytes: the whole model with gradients, and
// both moments).
TEST(ParallelCheckpoints, RankZeroWritesTheWholeModelOnePieceAtATime) {
  // Interleaved stages hold chunks that are not next to each other; a tied LLaMA's wte is
  // in the file twice (and a pipeline's last stage holds a copy rank 0 must not take).
  const std::vector<Layout> layouts = {{1, 2, 1, "1f1b"}, {1, 1, 2, "1f1b"}, {1, 1, 2, "interleaved", 2},
                                       {1, 2, 2, "1f1b"}, {2, 2, 1, "1f1b"}, {1, 2, 2, "interleaved", 2}};
  for (const Layout& l : layouts) {
    if (l.world() != world_size()) continue;
    for (int family = 0; family < 3; ++family) {
      const bool llama = family > 0;
      nn::TransformerConfig config = tiny_model(llama ? Family::Llama3 : Family::Gpt2);
      config.tie_embeddings = family != 1;  // GPT-2 tied, LLaMA untied, LLaMA tied
      const std::string what = (llama ? "llama " : "gpt2 ") + std::string(config.tie_embeddings ? "tied " : "untied ") + l.name();
      std::unique_ptr<dist::World> world = dist::World::create({l.dp, l.tp, l.pp});
      auto layout = [&](int pp_rank, int tp_rank, int) {
        return dist::pipeline_shard(config.n_layer, l.pp, pp_rank, l.virtual_stages, l.tp, tp_rank, 0);
      };
      nn::Transformer shard(config, layout(world->pp_rank(), world->tp_rank(), 0));
      nn::init_weights(shard, 7);
      // Moments the checkpoint can be checked by: m = the parameters, v = twice them.
      optim::AdamW opt(shard.params(), {});
      const Tensor& flat = shard.params().flat_params();
      for (size_t u = 0; u < shard.params().num_units(); ++u) {
        const nn::ParameterUnit& unit = shard.params().unit(u);
        Tensor twice = Tensor::empty({unit.numel()}, DType::F32);
        for (int64_t j = 0; j < unit.numel(); ++j) twice.data<float>()[j] = 2 * flat.data<float>()[unit.begin + j];
        opt.set_moment_unit(0, u, flat.slice(0, unit.begin, unit.end));
        opt.set_moment_unit(1, u, twice);
      }
      io::TrainingState st;
      st.step = 3;
      const std::string out = shared_dir("gather_" + std::to_string(family) + "_" + std::to_string(l.dp) +
                                         std::to_string(l.tp) + std::to_string(l.pp) + std::to_string(l.virtual_stages));
      auto& ledger = runtime::ledger();
      ledger.reset_peaks();
      const int64_t before = ledger.stats().allocated;
      const std::string dir = io::save_checkpoint(out, shard, opt, st, *world, layout);
      const int64_t held = ledger.stats().peak_allocated - before;
      if (world->is_root()) {
        nn::Transformer whole(config);
        nn::init_weights(whole, 7);
        int64_t largest_parameter = 0, largest_unit = 0;
        for (size_t i = 0; i < whole.params().size(); ++i)
          largest_parameter = std::max(largest_parameter, whole.params()[i].numel());
        for (size_t u = 0; u < whole.params().num_units(); ++u)
          largest_unit = std::max(largest_unit, whole.params().unit(u).numel());
        // The model file: a whole parameter and one received piece (at most as large);
        // the moments: a whole unit, and one piece.
        const int64_t bound = 4 * std::max(2 * largest_parameter, largest_unit + largest_parameter);
        EXPECT_LE(held, bound) << what << ": rank 0 held " << held << " bytes more while writing";
        EXPECT_LT(bound, 4 * whole.num_parameters()) << what << ": the bound must be below one whole model";
        nn::Transformer read(config);
        optim::AdamW read_opt(read.params(), {});
        io::load_checkpoint_model(dir, read);
        io::load_checkpoint_state(dir, read, read_opt);
        EXPECT_EQ(test::compare(read.params().flat_params(), whole.params().flat_params()).max_abs, 0.0) << what;
        for (size_t u = 0; u < read.params().num_units(); ++u) {
          const nn::ParameterUnit& unit = read.params().unit(u);
          const Tensor p = whole.params().flat_params().slice(0, unit.begin, unit.end);
          const Tensor m = read_opt.moment_unit(0, u), v = read_opt.moment_unit(1, u);
          for (int64_t j = 0; j < unit.numel(); ++j) {
            ASSERT_EQ(m.data<float>()[j], p.data<float>()[j]) << what << ": m of unit " << unit.name << " element " << j;
            ASSERT_EQ(v.data<float>()[j], 2 * p.data<float>()[j]) << what << ": v of unit " << unit.name << " element " << j;
          }
        }
      }
      world->world().barrier();
    }
  }
}

// ------------------------------------------------------------------ memory per stage
// What the schedules hold: under GPipe stage s keeps the activations of all N
// microbatches at its peak, under 1F1B of P - s. Everything else at the peak (model
// states, the backward's transients) is the same in both, so the difference of the two
// peaks is (N - (P - s)) microbatches of the stage's activations, A_s, which the memory
// plan's per-layer formulas give (docs/memory-plan.md): the stage's share of the layers' saved
// tensors, plus on the first stage the tokens its embedding saves and the output it
// keeps for its backward, and on the last the head's saved tensors and the targets.
TEST(PipelineMemory, EachStageHoldsWhatItsScheduleNeedsWithinFivePercent) {
  if (world_size() != 2) GTEST_SKIP();
  const int P = 2;
  const int64_t N = 8;
  std::map<std::string, std::vector<int64_t>> peaks;
  for (const char* schedule : {"gpipe", "1f1b", "1f1b half"}) {
    std::unique_ptr<dist::World> world = dist::World::create({1, 1, P});
    train::TrainConfig c = base_config(Family::Gpt2);
    c.parallel.pp = P;
    c.parallel.pp_schedule = std::string(schedule).substr(0, 5) == "gpipe" ? dist::PipelineSchedule::GPipe
                                                                          : dist::PipelineSchedule::OneFOneB;
    c.batch.grad_accum = std::string(schedule) == "1f1b half" ? N / 2 : N;
    c.batch.steps = 3;
    peaks[schedule] = train::run_training(c, *world).history.back().rank_peak_bytes;
  }
  // 1F1B holds P - s microbatches whatever N is: its peaks do not move with N (a buffer
  // kept per microbatch, such as a gradient on its way back, would show here).
  EXPECT_EQ(peaks["1f1b"], peaks["1f1b half"]);
  // docs/memory-plan.md's formulas, per token, in floats: a GPT-2 layer saves 16C + 4 + H,
  // the head 2C + 2 + Vp + 1.
  train::TrainConfig c = base_config(Family::Gpt2);
  const nn::TransformerConfig m = tiny_model(Family::Gpt2);
  const int64_t BT = c.batch.batch_size * c.batch.seq_len, C = m.n_embd, L = m.n_layer;
  const int64_t layers = L * BT * (16 * C + 4 + m.n_head) * 4;
  const int64_t head = BT * (2 * C + 2 + m.padded_vocab_size + 1) * 4;
  const int64_t per_stage_layers = layers / L * (L / P);
  const std::vector<int64_t> activations = {per_stage_layers + BT * 4 + BT * C * 4, per_stage_layers + head + BT * 4};
  for (int s = 0; s < P; ++s) {
    const int64_t measured = peaks["gpipe"][static_cast<size_t>(s)] - peaks["1f1b"][static_cast<size_t>(s)];
    const int64_t predicted = (N - (P - s)) * activations[static_cast<size_t>(s)];
    EXPECT_NEAR(static_cast<double>(measured), static_cast<double>(predicted), 0.05 * static_cast<double>(predicted))
        << "stage " << s << ": gpipe peak " << peaks["gpipe"][static_cast<size_t>(s)] << ", 1f1b peak "
        << peaks["1f1b"][static_cast<size_t>(s)] << ", one microbatch's activations " << activations[static_cast<size_t>(s)];
  }
}

// ------------------------------------------------------------------ the seed bug in a real pipeline
namespace {
// What a stage does with a received activation, as the seed bugs did it.
// KeepReceived keeps every received input (a leaf, and its gradient) past its backward.
struct KeepReceived final : dist::ReceivedInputs {
  std::vector<Tensor> kept;
  void done(const Tensor& input) override { kept.push_back(input); }
};
// InfiniTrain's receive (seed 000): the received tensor is an op's output, then made a leaf.
struct LeafAndOutput final : dist::ReceivedInputs {
  Tensor input(const Tensor& received) override {
    Tensor source = Tensor::zeros(received.shape(), received.dtype(), Device::cpu());
    source.set_requires_grad(true);
    Tensor output = ops::add(source, received);
    output.set_requires_grad(true);  // R1 refuses this
    return output;
  }
};

// A two-stage pipeline of the tiny GPT-2 run directly (stage, sanitizer, one step).
struct TwoStages {
  std::unique_ptr<dist::World> world = dist::World::create({1, 1, 2});
  std::unique_ptr<nn::Transformer> model;
  std::unique_ptr<dist::PipelineStage> stage;
  explicit TwoStages(dist::ReceivedInputs* received = nullptr) {
    nn::Transformer full(tiny_model(Family::Gpt2));
    nn::init_weights(full, 7);
    model = std::make_unique<nn::Transformer>(full.config(), dist::pipeline_shard(4, 2, world->pp_rank(), 1, 1, 0));
    nn::load_shard_from(*model, full);
    stage = std::make_unique<dist::PipelineStage>(*model, world->pp_group(), dist::PipelineSchedule::GPipe, 1, received);
  }
  std::pair<Tensor, Tensor> batch(int64_t mb) const {
    Tensor t = Tensor::empty({1, 8}, DType::I32);
    for (int64_t i = 0; i < 8; ++i) t.data<int32_t>()[i] = static_cast<int32_t>((mb * 8 + i * 5) % 97);
    return {t, t};
  }
};
}  // namespace

TEST(PipelineSeed, AReceivedActivationKeptPastItsBackwardIsCaughtAndNamed) {
  if (world_size() != 2) GTEST_SKIP();
  KeepReceived keep;
  TwoStages p(&keep);
  sanitizer::Sanitizer san(sanitizer::SanitizeMode::Warn);
  san.set_printer([](const sanitizer::Issue&) {});
  san.begin_step(0);
  p.stage->run(2, [&](int64_t mb) { return p.batch(mb); }, 0.5, san);
  keep.kept.clear();
  san.end_step();
  if (p.world->pp_rank() == 1) {
    ASSERT_FALSE(san.issues().empty()) << "the kept receive went unnoticed";
    bool named = false;
    for (const auto& i : san.issues()) named |= i.message.find("pp_recv") != std::string::npos;
    EXPECT_TRUE(named) << san.issues()[0].message;
  } else {
    EXPECT_TRUE(san.issues().empty()) << san.issues()[0].message;  // stage 0 receives nothing
  }
  // With the stage's own rule the same step is clean on both stages.
  TwoStages own;
  sanitizer::Sanitizer clean(sanitizer::SanitizeMode::Strict);
  clean.begin_step(1);
  own.stage->run(2, [&](int64_t mb) { return own.batch(mb); }, 0.5, clean);
  clean.end_step();
}

TEST(PipelineSeed, AReceiveThatIsBothAnOpOutputAndALeafIsRefused) {
  if (world_size() != 2) GTEST_SKIP();
  LeafAndOutput leaf_and_output;
  TwoStages p(&leaf_and_output);
  sanitizer::Sanitizer san(sanitizer::SanitizeMode::Off);
  san.begin_step(0);
  if (p.world->pp_rank() == 1) {
    const std::string m = test::message_of<Error>([&] { p.stage->run(1, [&](int64_t mb) { return p.batch(mb); }, 1.0, san); });
    EXPECT_NE(m.find("memory contract R1"), std::string::npos) << m;
    // Stage 0 waits for its microbatch's gradient: answer it so the job goes on.
    Tensor grad = Tensor::zeros({1, 8, 32});
    p.world->pp_group().send(grad, 0, 1);
  } else {
    p.stage->run(1, [&](int64_t mb) { return p.batch(mb); }, 1.0, san);
  }
}

int main(int argc, char** argv) { return test::run_tests_under_mpi(argc, argv, &g_world); }
