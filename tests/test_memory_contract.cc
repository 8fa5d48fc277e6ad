// The five real leaks of docs/memory-contract.md (InfiniTrain, Fast-LLM, TransformerEngine,
// verl/Megatron, DeepSpeed), written with tally's public
// API. Each scenario runs several steps and checks that memory is flat (exact bytes and
// an empty graph census at every boundary); where the buggy pattern can still be
// written, the sanitizer must report it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <thread>

#include "autograd/checkpoint.h"
#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/node.h"
#include "sanitizer/sanitizer.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "support.h"

using namespace tally;
using sanitizer::IssueKind;
using sanitizer::Sanitizer;
using sanitizer::SanitizeMode;

namespace {

// A two-layer MLP with persistent, owner-tagged parameters and an SGD step.
struct TinyMlp {
  Tensor w1, w2;
  explicit TinyMlp(int64_t width = 32) {
    w1 = param("mlp.w1", {width, width}, 1);
    w2 = param("mlp.w2", {1, width}, 2);
  }
  static Tensor param(const std::string& name, const Shape& shape, uint64_t seed) {
    Tensor t = Tensor::empty(shape, DType::F32, Device::cpu(), make_owner(Category::Parameter, name));
    t.copy_(test::random_tensor(shape, seed));
    t.set_name(name).set_parameter();
    return t;
  }
  Tensor forward(const Tensor& x) const {
    OwnerScope scope("mlp");
    return ops::linear(ops::gelu(ops::linear(x, w1)), w2);
  }
  void sgd(double lr) const {
    autograd::NoGradGuard ng;
    for (const Tensor& p : {w1, w2}) {
      ops::add_(p, ops::scale(p.grad(), -lr));
      p.zero_grad();
    }
  }
};

Tensor batch(int64_t rows, int64_t width, uint64_t seed) { return test::random_tensor({rows, width}, seed, DType::F32); }

// Flat: every boundary has the live bytes of the same boundary (same microbatch id, or the
// step's end) in the first step, no graph survives any boundary, and from step 1 on every
// step ends with the same allocated and peak bytes. (With several microbatches in flight,
// different boundaries of one step legitimately differ: at the end of microbatch 0 of
// F0 F1 B0 B1, microbatch 1's activations are alive.)
void expect_flat(const Sanitizer& s) {
  const auto& b = s.boundaries();
  ASSERT_GE(b.size(), 3u);
  std::map<int64_t, int64_t> first_live;  // microbatch id (-1: step end) -> live bytes
  for (size_t i = 0; i < b.size(); ++i) {
    auto [it, inserted] = first_live.emplace(b[i].microbatch, b[i].live_non_persistent);
    if (!inserted) {
      EXPECT_EQ(b[i].live_non_persistent, it->second) << "boundary " << i;
    }
    EXPECT_EQ(b[i].live_nodes, 0u) << "boundary " << i;
    EXPECT_EQ(b[i].live_saved, 0u) << "boundary " << i;
  }
  int64_t allocated = -1, peak = -1;
  for (const auto& x : b) {
    if (x.microbatch >= 0 || x.step < 1) continue;
    if (allocated < 0) allocated = x.allocated, peak = x.peak_allocated;
    EXPECT_EQ(x.allocated, allocated) << "step " << x.step;
    EXPECT_EQ(x.peak_allocated, peak) << "step " << x.step;
  }
  EXPECT_TRUE(s.issues().empty()) << s.issues().front().message;
}

bool reported(const Sanitizer& s, IssueKind kind, const std::string& needle) {
  for (const auto& i : s.issues())
    if (i.kind == kind && i.message.find(needle) != std::string::npos) return true;
  return false;
}

// A quiet Warn-mode sanitizer that records issues without printing.
struct Recorder : Sanitizer {
  Recorder() : Sanitizer(SanitizeMode::Warn) {
    set_printer([](const sanitizer::Issue&) {});
  }
};

}  // namespace

// ------------------------------------------------------------------ seed 000
// Pipeline receive: the received activation must carry a gradient back to the previous
// stage. InfiniTrain made it a leaf *and* IRecv's output: tensor -> IRecv -> accumulator
// -> tensor, a cycle per step. In tally the receive is a source node and its output is
// interior (R1); the accumulator never owns a tensor (R2).
namespace {
struct Recv {
  static constexpr const char* kName = "pipeline_recv";
  struct Context : autograd::Context {
    Tensor* send_back = nullptr;  // where the gradient goes (the previous stage's buffer)
    Tensor received;              // only the buggy receive sets it: its own output, graph and all
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    ctx.send_back->copy_(grads[0]);
    return {};
  }
};

Tensor recv(const Tensor& wire, Tensor* send_back, bool reintroduce_cycle = false) {
  Tensor buf = Tensor::empty(wire.shape(), wire.dtype(), Device::cpu(), make_owner(Category::Communication, "recv_buffer"));
  buf.copy_(wire);
  auto ctx = std::make_unique<Recv::Context>();
  ctx->send_back = send_back;
  Recv::Context* raw = ctx.get();
  autograd::record_source<Recv>(std::move(ctx), {buf});
  if (reintroduce_cycle) raw->received = buf;  // the seed-000 back-edge, kept after recording as a plain member
  return buf;
}
}  // namespace

TEST(Seed000PipelineRecv, RecvOutputIsInteriorAndMemoryIsFlat) {
  TinyMlp mlp;
  Tensor grad_to_prev = Tensor::zeros({8, 32}, DType::F32, Device::cpu(), make_owner(Category::Communication, "send_buffer", true));
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 6; ++step) {
    s.begin_step(step);
    {
      Tensor x = recv(batch(8, 32, step), &grad_to_prev);
      EXPECT_FALSE(x.is_leaf());
      EXPECT_THROW(x.set_requires_grad(true), Error);  // R1: cannot also be a leaf
      ops::mean(mlp.forward(x)).backward();
      mlp.sgd(0.01);
    }
    s.end_step();
  }
  expect_flat(s);
  EXPECT_GT(ops::global_norm({grad_to_prev}), 0.0);  // the gradient did reach the previous stage
}

TEST(Seed000PipelineRecv, ReintroducedCycleIsReportedByTheCycleCheckAndTheBoundaryCheck) {
  TinyMlp mlp;
  Tensor grad_to_prev = Tensor::zeros({8, 32}, DType::F32, Device::cpu(), make_owner(Category::Communication, "send_buffer", true));
  Recorder s;
  // With backward: the cycle check names it when the graph is about to be released.
  s.begin_step(0);
  {
    Tensor x = recv(batch(8, 32, 0), &grad_to_prev, true);
    ops::mean(mlp.forward(x)).backward();
  }
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::Cycle, "pipeline_recv -> (context member) tensor float32[8,32] -> pipeline_recv")) << (s.issues().empty() ? "" : s.issues()[0].message);
  // Without a backward through it (an evaluation step with grad on), the cycle leaks
  // the receive buffer: the boundary check reports the growth and the surviving node.
  std::shared_ptr<autograd::Node> leaked;  // only so the test can break the cycle afterwards
  s.begin_step(1);
  {
    Tensor x = recv(batch(8, 32, 1), &grad_to_prev, true);
    leaked = x.grad_fn();
  }
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::Growth, "recv_buffer"));
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "pipeline_recv"));
  leaked->release_state();
}

// ------------------------------------------------------------------ seed 001
// Fast-LLM kept each microbatch's loss tensor for logging; each held its graph, +164 MiB
// per microbatch. In tally the trainer's metrics take numbers (R4); and even a kept loss
// tensor holds only its own emptied node (edges cut, context released after backward).
TEST(Seed001KeptLosses, LossValuesAcross4096MicrobatchesKeepMemoryFlat) {
  TinyMlp mlp(16);
  Sanitizer s(SanitizeMode::Strict);
  std::vector<double> losses;  // what the trainer's metrics keep: values (R4)
  s.begin_step(0);
  for (int mb = 0; mb < 4096; ++mb) {
    s.begin_microbatch(mb);
    {
      Tensor loss = ops::mean(mlp.forward(batch(4, 16, mb % 7)));
      loss.backward();
      losses.push_back(loss.item());
    }
    s.end_microbatch();
  }
  s.end_step();
  EXPECT_EQ(losses.size(), 4096u);
  const auto& b = s.boundaries();
  for (size_t i = 1; i < b.size(); ++i) ASSERT_EQ(b[i].live_non_persistent, b[0].live_non_persistent) << i;
  EXPECT_TRUE(s.issues().empty());
}

TEST(Seed001KeptLosses, KeepingLossTensorsIsReportedWithTheirHolder) {
  TinyMlp mlp(16);
  Recorder s;
  std::vector<Tensor> kept;  // the buggy pattern: graph-carrying tensors kept across microbatches
  s.begin_step(0);
  for (int mb = 0; mb < 64; ++mb) {
    s.begin_microbatch(mb);
    Tensor loss = ops::mean(mlp.forward(batch(4, 16, mb)));
    loss.set_name("loss");
    loss.backward();
    kept.push_back(loss);
    loss = Tensor();
    s.end_microbatch();
  }
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "held by tensor 'loss'"));
  EXPECT_TRUE(reported(s, IssueKind::Growth, "loss"));
  // The damage is bounded by construction: one scalar per kept loss, not its graph.
  const auto& b = s.boundaries();
  EXPECT_EQ(b[63].live_non_persistent - b[0].live_non_persistent, 63 * 4);
}

// ------------------------------------------------------------------ seed 002
// TransformerEngine's fused op hung tensors on the autograd ctx outside
// save_for_backward; they lived until the next iteration. In tally the context is the
// only place backward state can live and it is destroyed right after backward (R3).
namespace {
struct FusedLinear {
  static constexpr const char* kName = "fused_linear";
  struct Context : autograd::Context {
    Tensor x, w;            // held as plain members, not via save_for_backward
    Tensor quantized_copy;  // and an extra buffer, like TE's tensor_objects
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = grads[0];
    return {ops::matmul(g, ctx.w), ops::matmul(g, ctx.x, true, false)};
  }
};
Tensor fused_linear(const Tensor& x, const Tensor& w) {
  Tensor out = ops::matmul(x.detach(), w.detach(), false, true);
  if (autograd::needs_graph({x, w})) {
    auto ctx = std::make_unique<FusedLinear::Context>();
    ctx->x = x.detach();
    ctx->w = w.detach();
    ctx->quantized_copy = Tensor::empty(w.shape(), DType::BF16, Device::cpu(), current_owner("quantized_w"));
    autograd::record<FusedLinear>(std::move(ctx), {x, w}, {out});
  }
  return out;
}
}  // namespace

TEST(Seed002FusedContextState, ExtraContextStateDiesWithBackwardAndMemoryIsFlat) {
  Tensor w = TinyMlp::param("fused.w", {32, 32}, 3);
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 6; ++step) {
    s.begin_step(step);
    {
      Tensor loss = ops::mean(fused_linear(batch(8, 32, step), w));
      int64_t before = runtime::ledger().stats().live_non_persistent;
      loss.backward();
      // The loss is still alive here (TE's ctx lived until the next iteration).
      int64_t after = runtime::ledger().stats().live_non_persistent;
      EXPECT_LE(after, before - 8 * 32 * 4 - 32 * 32 * 2) << "context state survived backward";
      autograd::NoGradGuard ng;
      w.zero_grad();
    }
    s.end_step();
  }
  expect_flat(s);
}

TEST(Seed002FusedContextState, RetainedGraphStateIsReportedAtTheBoundary) {
  Tensor w = TinyMlp::param("fused.w", {32, 32}, 3);
  Recorder s;
  s.begin_step(0);
  Tensor loss = ops::mean(fused_linear(batch(8, 32, 0), w));
  loss.set_name("loss");
  loss.backward({}, /*retain_graph=*/true);
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "fused_linear"));
  EXPECT_TRUE(reported(s, IssueKind::Growth, "quantized_w"));
}

// ------------------------------------------------------------------ seed 003
// verl/Megatron's checkpoint function kept its inputs and their grads after backward.
// tally's checkpoint saves only the inputs, recomputes, and drops everything (R5).
TEST(Seed003Recompute, CheckpointedRegionFreesWhatItSavedAndMemoryIsFlat) {
  TinyMlp mlp;
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 6; ++step) {
    s.begin_step(step);
    {
      Tensor x = batch(8, 32, step);
      x.set_requires_grad(true);  // an input that needs its gradient (as in a pipeline stage)
      Tensor h = autograd::checkpoint([&](const std::vector<Tensor>& in) { return mlp.forward(in[0]); }, {x});
      ops::mean(h).backward();
      EXPECT_TRUE(x.grad().defined());
      mlp.sgd(0.01);
    }
    s.end_step();
  }
  expect_flat(s);
}

TEST(Seed003Recompute, CheckpointSavesLessThanTheFullRegion) {
  TinyMlp mlp(256);
  auto peak_of = [&](bool use_checkpoint) {
    Tensor x = batch(64, 256, 1);
    runtime::ledger().reset_peaks();
    int64_t base = runtime::ledger().stats().allocated;
    Tensor h = use_checkpoint ? autograd::checkpoint([&](const std::vector<Tensor>& in) { return mlp.forward(in[0]); }, {x})
                              : mlp.forward(x);
    int64_t held = runtime::ledger().stats().allocated - base;
    ops::mean(h).backward();
    return held;
  };
  int64_t full = peak_of(false), ckpt = peak_of(true);
  EXPECT_LT(ckpt, full / 2) << "checkpointed forward kept " << ckpt << " bytes vs " << full;
}

TEST(Seed003Recompute, KeepingDetachedInputGradsOutsideIsReported) {
  TinyMlp mlp;
  Recorder s;
  std::vector<Tensor> leaked;  // the buggy pattern: a recompute helper that stashes its inputs' grads
  s.begin_step(0);
  {
    Tensor x = batch(8, 32, 0).set_name("ckpt_input");
    Tensor d = x.detach();
    d.set_requires_grad(true);
    ops::mean(mlp.forward(d)).backward();
    leaked.push_back(d);
  }
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::Growth, "ckpt_input"));
}

// ------------------------------------------------------------------ seed 004
// DeepSpeed's ZeRO-3 release emptied the registry tensor, but a view of the padded
// gathered buffer kept the storage alive. In tally, release() frees the storage itself,
// views included, and a stale view fails naming the releaser (R6). These tests write the
// pattern by hand; real ZeRO-3 over MPI does the same in
// tests/test_dist.cc (Zero.Stage3ReleasesAGatheredLayersStorageWhileItsParameterViewsLive).
namespace {
Tensor gather_padded(const std::string& name, int64_t n, int64_t padded) {
  Tensor buf = Tensor::zeros({padded}, DType::F32, Device::cpu(), make_owner(Category::Communication, name + ".gathered"));
  return buf;
}
}  // namespace

TEST(Seed004ReleasedStorage, ReleaseFreesThePaddedBufferDespiteLiveViewsAndMemoryIsFlat) {
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 6; ++step) {
    s.begin_step(step);
    Tensor registry = gather_padded("h.0.w", 1000, 1024);
    Tensor param_view = registry.slice(0, 0, 1000).set_name("h.0.w");  // what the graph uses
    EXPECT_EQ(sanitizer::storage_holders(registry.storage()).size(), 2u);   // S4
    int64_t before = runtime::ledger().stats().allocated;
    registry.storage().release("zero3.release_param(h.0.w)");
    EXPECT_EQ(before - runtime::ledger().stats().allocated, 4096);  // freed now, view alive
    try {
      ops::sum(param_view);
      ADD_FAILURE() << "stale view was readable";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("zero3.release_param(h.0.w)"), std::string::npos) << e.what();
    }
    s.end_step();
  }
  expect_flat(s);
}

TEST(Seed004ReleasedStorage, DroppingOnlyTheRegistryHandleIsReportedWithTheViewHoldingIt) {
  Recorder s;
  Tensor survivor;
  s.begin_step(0);
  {
    Tensor registry = gather_padded("h.0.w", 1000, 1024);
    survivor = registry.slice(0, 0, 1000).set_name("h.0.w(view)");
    registry = Tensor();  // the buggy release: the registry forgets, the view keeps the storage
  }
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::Growth, "held by 'h.0.w(view)'"));
}

// ZeRO-3 through the public API: a parameter is released after its forward and
// re-gathered before its backward. copy_ into it bumps its version, so the backward's
// saved weight refuses it; restore_ is the re-gather the engine itself uses.
TEST(Seed004ReleasedStorage, AParameterReleasedAndRestoredThroughTheApiRunsItsBackward) {
  TinyMlp mlp(16);
  const std::vector<float> values = mlp.w1.to_vector<float>();
  const Tensor shards = Tensor::from_vector(values, mlp.w1.shape());
  const Tensor x = test::random_tensor({4, 16}, 3, DType::F32);
  const auto gathered = [] { return make_owner(Category::Communication, "zero3.gathered(mlp.w1)"); };
  const auto forward = [&] { return ops::sum(ops::matmul(x, ops::transpose(mlp.w1, 0, 1))); };
  {
    Tensor loss = forward();
    mlp.w1.storage().release("zero3.release(mlp.w1)");
    EXPECT_THROW(mlp.w1.copy_(shards), Error) << "a released storage has no bytes to copy into";
    mlp.w1.storage().reacquire(gathered());
    mlp.w1.copy_(shards);
    EXPECT_THROW(loss.backward(), Error) << "copy_ is a modification: the saved weight refuses it";
  }
  mlp.w1.set_grad(Tensor());
  Sanitizer s(SanitizeMode::Strict);
  for (int64_t step = 0; step < 4; ++step) {
    s.begin_step(step);
    s.begin_microbatch(0);
    if (mlp.w1.storage().released()) mlp.w1.restore_(shards, gathered());
    Tensor loss = forward();
    mlp.w1.storage().release("zero3.release(mlp.w1)");
    mlp.w1.restore_(shards, gathered());
    EXPECT_EQ(mlp.w1.to_vector<float>(), values);
    loss.backward();
    loss = Tensor();
    mlp.w1.storage().release("zero3.release(mlp.w1)");
    s.end_microbatch(0);
    mlp.w1.set_grad(Tensor());
    s.end_step();
  }
  mlp.w1.restore_(shards, gathered());
  EXPECT_THROW(mlp.w1.restore_(shards, gathered()), Error) << "restore_ is for a released storage";
  Tensor flat = Tensor::zeros({32});
  Tensor half = flat.slice(0, 0, 16);
  flat.storage().release("zero3.release(flat)");
  EXPECT_THROW(half.restore_(Tensor::zeros({16}), gathered()), Error) << "a slice cannot re-gather the whole storage";
}

// ------------------------------------------------------------------ sanitizer mechanics
TEST(Sanitizer, StrictModeThrowsOnGrowth) {
  Sanitizer s(SanitizeMode::Strict);
  std::vector<Tensor> leak;
  s.begin_step(0);
  leak.push_back(Tensor::zeros({100}));
  EXPECT_THROW(s.end_step(), Error);
}

// An exponential moving average written out of place under no-grad re-makes a buffer of
// the same size every step while memory stays flat: it was reported as S1 growth every
// step ("held by '<unnamed>' ... no grad"). Replacing a buffer is not growth; keeping the
// old one as well is.
TEST(Sanitizer, ABufferReplacedEachStepByOneOfTheSameSizeIsNotGrowth) {
  const Tensor weight = Tensor::ones({64});
  Tensor ema = Tensor::zeros({64});
  Sanitizer s(SanitizeMode::Strict);
  for (int64_t step = 0; step < 4; ++step) {
    s.begin_step(step);
    autograd::NoGradGuard no_grad;
    ema = ops::add(ops::scale(ema, 0.9), ops::scale(weight, 0.1));
    EXPECT_NO_THROW(s.end_step()) << "step " << step;
  }
  std::vector<Tensor> history;
  sanitizer::Sanitizer kept(SanitizeMode::Strict);
  kept.begin_step(0);
  history.push_back(ema);
  ema = ops::add(ops::scale(ema, 0.9), ops::scale(weight, 0.1));
  EXPECT_THROW(kept.end_step(), Error) << "every step's average kept is growth";
}

TEST(Sanitizer, PersistentAllocationsAreNotGrowth) {
  Sanitizer s(SanitizeMode::Strict);
  std::vector<Tensor> states;
  s.begin_step(0);
  states.push_back(Tensor::zeros({100}, DType::F32, Device::cpu(), make_owner(Category::OptimizerState, "adamw.m")));
  states.push_back(Tensor::zeros({100}, DType::F32, Device::cpu(), make_owner(Category::Data, "loader", true)));
  EXPECT_NO_THROW(s.end_step());
}

TEST(Sanitizer, GrowthReportNamesOwnerSizeAndBirth) {
  Recorder s;
  std::vector<Tensor> leak;
  s.begin_step(3);
  s.begin_microbatch(5);
  {
    OwnerScope scope("h.7.mlp");
    leak.push_back(Tensor::zeros({256}));
  }
  s.end_microbatch();
  EXPECT_TRUE(s.issues().empty()) << "a plain value may outlive its microbatch, until the step ends (R4)";
  s.end_step();
  ASSERT_FALSE(s.issues().empty());
  const std::string& m = s.issues()[0].message;
  EXPECT_NE(m.find("h.7.mlp"), std::string::npos) << m;
  EXPECT_NE(m.find("1.0 KiB"), std::string::npos) << m;
  EXPECT_NE(m.find("born step 3 microbatch 5"), std::string::npos) << m;
}

// ------------------------------------------------------------------ microbatches in flight
// Real schedules keep several microbatch graphs alive at once. Each microbatch carries an
// explicit id; ending it declares its backward has run.
TEST(SanitizerSchedules, PipelineOrderF0F1B0B1PassesStrict) {
  TinyMlp mlp;
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 4; ++step) {
    s.begin_step(step);
    Tensor loss0, loss1;
    s.begin_microbatch(0);
    loss0 = ops::mean(mlp.forward(batch(8, 32, 2 * step)));
    s.begin_microbatch(1);
    loss1 = ops::mean(mlp.forward(batch(8, 32, 2 * step + 1)));
    EXPECT_EQ(s.in_flight().size(), 2u);
    s.begin_microbatch(0);
    loss0.backward();
    loss0 = Tensor();
    s.end_microbatch(0);
    s.begin_microbatch(1);
    loss1.backward();
    loss1 = Tensor();
    s.end_microbatch(1);
    mlp.sgd(0.01);
    s.end_step();
  }
  expect_flat(s);
}

TEST(SanitizerSchedules, SummedLossesOfSeveralMicrobatchesWithOneBackwardPassStrict) {
  TinyMlp mlp;
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 4; ++step) {
    s.begin_step(step);
    {
      Tensor total;
      for (int mb = 0; mb < 4; ++mb) {
        s.begin_microbatch(mb);
        Tensor loss = ops::mean(mlp.forward(batch(8, 32, mb)));
        total = total.defined() ? total + loss : loss;
      }
      total.backward();
    }
    for (int mb = 0; mb < 4; ++mb) s.end_microbatch(mb);
    mlp.sgd(0.01);
    s.end_step();
  }
  expect_flat(s);
}

TEST(SanitizerSchedules, AGraphKeptAfterItsOwnBackwardFailsWhileAnotherIsInFlight) {
  TinyMlp mlp;
  Recorder s;
  s.begin_step(0);
  s.begin_microbatch(0);
  Tensor loss0 = ops::mean(mlp.forward(batch(8, 32, 0))).set_name("loss0");
  s.begin_microbatch(1);
  Tensor loss1 = ops::mean(mlp.forward(batch(8, 32, 1)));
  s.begin_microbatch(0);
  loss0.backward();  // loss0 is kept (with its node) after its backward
  s.end_microbatch(0);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "held by tensor 'loss0'"));
  EXPECT_FALSE(reported(s, IssueKind::LiveGraph, "microbatch 1")) << "microbatch 1 is legitimately in flight";
  loss1.backward();
  loss1 = Tensor();
  s.end_microbatch(1);
}

TEST(SanitizerSchedules, EndingAMicrobatchThatWasNotBegunIsAnError) {
  Sanitizer s(SanitizeMode::Strict);
  s.begin_step(0);
  s.begin_microbatch(0);
  s.end_microbatch(0);
  EXPECT_THROW(s.end_microbatch(0), Error);
  EXPECT_THROW(s.end_microbatch(5), Error);
}

// ------------------------------------------------------------------ what may outlive a microbatch
// The Fast-LLM fix (R4): keep each microbatch's loss as a detached value for logging.
TEST(SanitizerKeptValues, DetachedLossesKeptForTheStepPassStrict) {
  TinyMlp mlp(16);
  Sanitizer s(SanitizeMode::Strict);
  for (int step = 0; step < 3; ++step) {
    s.begin_step(step);
    std::vector<Tensor> logged;
    for (int mb = 0; mb < 8; ++mb) {
      s.begin_microbatch(mb);
      {
        Tensor loss = ops::mean(mlp.forward(batch(4, 16, mb)));
        loss.backward();
        logged.push_back(loss.detach());  // a value, no graph
      }
      s.end_microbatch();
    }
    EXPECT_EQ(logged.size(), 8u);
    logged.clear();  // logged by the end of the step
    mlp.sgd(0.01);
    s.end_step();
  }
  EXPECT_TRUE(s.issues().empty());
  int64_t live = -1;
  for (const auto& b : s.boundaries()) {
    EXPECT_EQ(b.live_nodes, 0u);
    if (b.microbatch >= 0) {
      EXPECT_EQ(b.live_non_persistent, 4 * (b.microbatch + 1)) << "one detached scalar per microbatch so far";
      continue;
    }
    if (live < 0) live = b.live_non_persistent;
    EXPECT_EQ(b.live_non_persistent, live) << "step " << b.step;
  }
}

TEST(SanitizerKeptValues, KeepingTheLossWithItsGraphFailsStrict) {
  TinyMlp mlp(16);
  Sanitizer s(SanitizeMode::Strict);
  std::vector<Tensor> kept;
  s.begin_step(0);
  s.begin_microbatch(0);
  Tensor loss = ops::mean(mlp.forward(batch(4, 16, 0)));
  loss.backward();
  kept.push_back(loss);
  loss = Tensor();
  EXPECT_THROW(s.end_microbatch(), Error);
}

TEST(SanitizerKeptValues, KeepingAnActivationFailsStrict) {
  TinyMlp mlp(16);
  Sanitizer s(SanitizeMode::Strict);
  std::vector<Tensor> kept;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor h = mlp.forward(batch(4, 16, 0));
    ops::mean(h).backward();
    kept.push_back(h);
  }
  EXPECT_THROW(s.end_microbatch(), Error);
}

TEST(SanitizerKeptValues, KeepingAnInputsGradFailsStrict) {
  TinyMlp mlp(16);
  Sanitizer s(SanitizeMode::Strict);
  std::vector<Tensor> kept;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor x = batch(4, 16, 0);
    x.set_requires_grad(true);  // an input (a received activation, say), not a parameter
    ops::mean(mlp.forward(x)).backward();
    kept.push_back(x.grad());
  }
  std::string m = test::message_of<Error>([&] { s.end_microbatch(); });
  EXPECT_NE(m.find("gradient"), std::string::npos) << m;
}

// Whether a .grad is persistent is decided by the leaf being a registered parameter: an
// alias of a weight (w.detach() made to require grad) shares the weight's storage but is
// not a parameter, and its gradients growing every microbatch are caught.
TEST(SanitizerParameters, AGrowingGradientOfAnAliasOfAWeightIsCaught) {
  TinyMlp mlp;
  Recorder s;
  std::vector<Tensor> aliases;
  s.begin_step(0);
  for (int mb = 0; mb < 4; ++mb) {
    s.begin_microbatch(mb);
    Tensor w = mlp.w1.detach();  // same storage as the parameter, a new leaf
    w.set_requires_grad(true);
    ops::mean(ops::linear(batch(8, 32, mb), w)).backward();
    EXPECT_FALSE(runtime::ledger().find(w.grad().storage().allocation_id()).owner.is_persistent());
    aliases.push_back(w);
    s.end_microbatch();
  }
  size_t growth = 0;
  for (const auto& i : s.issues()) growth += i.kind == IssueKind::Growth && i.message.find("mlp.w1.grad") != std::string::npos;
  EXPECT_EQ(growth, 4u) << "one report per microbatch";
  EXPECT_FALSE(mlp.w1.grad().defined()) << "the parameter itself received nothing";
}

// A parameter's gradient is tagged persistent when it is made. Dropped from the parameter
// (set_grad(None), a set-to-none zero_grad) and kept by the caller, each step's gradient
// stayed "persistent" and the sanitizer saw no growth at all (256 KiB a step here).
TEST(SanitizerParameters, GradientsSetAsideAndKeptAreCaughtAsPersistentGrowth) {
  TinyMlp mlp(256);
  Recorder s;
  std::vector<Tensor> kept;
  for (int step = 0; step < 4; ++step) {
    s.begin_step(step);
    s.begin_microbatch(0);
    ops::mean(mlp.forward(batch(8, 256, step))).backward();
    s.end_microbatch();
    kept.push_back(mlp.w1.grad());
    mlp.w1.set_grad(Tensor());
    mlp.w2.set_grad(Tensor());
    s.end_step();
  }
  size_t growth = 0;
  for (const auto& i : s.issues())
    growth += i.kind == IssueKind::Growth && i.message.find("mlp.w1.grad") != std::string::npos &&
              i.message.find("persistent memory went") != std::string::npos;
  EXPECT_EQ(growth, 3u) << "one report a step from the second on";
  // The same steps with the gradient dropped and not kept: flat, nothing to report.
  kept.clear();
  Recorder flat;
  for (int step = 0; step < 4; ++step) {
    flat.begin_step(step);
    flat.begin_microbatch(0);
    ops::mean(mlp.forward(batch(8, 256, step))).backward();
    flat.end_microbatch();
    mlp.w1.set_grad(Tensor());
    mlp.w2.set_grad(Tensor());
    flat.end_step();
  }
  EXPECT_TRUE(flat.issues().empty()) << flat.issues().front().message;
}

// ------------------------------------------------------------------ cycles (S3) named by S2
namespace {
// A hook registered on h by `hook_on` captures h (hook -> h -> its node -> hook), and no
// backward runs: only the cycle holds the graph, and S2 names it as that cycle.
template <class HookOn> void expect_hook_cycle_named(HookOn hook_on) {
  TinyMlp mlp;
  Recorder s;
  HookHandle handle;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor h = mlp.forward(batch(8, 32, 0)).set_name("h");
    handle = hook_on(h);
  }  // no backward: only the cycle holds the graph now
  s.end_microbatch();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "kept alive by a reference cycle"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "(hook capture) tensor 'h'"));
  EXPECT_FALSE(reported(s, IssueKind::LiveGraph, "keep a number or a detached copy"))
      << "a cycle is named, not answered with advice to detach";
  handle.remove();  // breaks the cycle: the graph goes
  EXPECT_EQ(autograd::live_node_count(), 0u);
}
}  // namespace

TEST(SanitizerCycles, AHookCapturingItsOwnTensorIsNamedAsTheCycleThatKeepsItsGraphAlive) {
  expect_hook_cycle_named([](const Tensor& h) { return h.register_hook([h](const Tensor& g) { return g; }); });
}

TEST(SanitizerCycles, AHookCapturingItsOwnTensorIsReportedWhenBackwardBegins) {
  TinyMlp mlp;
  Recorder s;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor h = mlp.forward(batch(8, 32, 0)).set_name("h");
    h.register_hook([h](const Tensor& g) { return g; });
    ops::mean(h).backward();  // backward clears the hook (R3), which also ends the cycle
  }
  s.end_microbatch();
  EXPECT_TRUE(reported(s, IssueKind::Cycle, "(hook capture) tensor 'h'"));
  EXPECT_FALSE(reported(s, IssueKind::LiveGraph, "")) << "the graph itself was freed";
}

TEST(SanitizerCycles, ALeafHookCapturingItsOwnLeafIsNamed) {
  Recorder s;
  HookHandle handle;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor x = Tensor::zeros({64}).set_name("stage_input");
    x.set_requires_grad(true);
    handle = x.register_hook([x](const Tensor& g) { return g; });  // the leaf holds a hook that holds the leaf
  }
  s.end_microbatch();
  EXPECT_TRUE(reported(s, IssueKind::Growth, "tensor 'stage_input' -> (hook capture) tensor 'stage_input'"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  handle.remove();
  s.end_step();
  EXPECT_EQ(s.issues().size(), 1u) << "gone once the hook is removed";
}

// A std::function keeps its captures on the heap, out of the hook's bytes: the cycle was
// reported as S2 "held by tensor 'h'" with advice to detach, which cannot fix a cycle.
TEST(SanitizerCycles, AStdFunctionHookCapturingItsOwnTensorIsNamedAsTheCycle) {
  expect_hook_cycle_named([](const Tensor& h) {
    const std::function<Tensor(const Tensor&)> keep_h = [h](const Tensor& g) { return g; };
    return h.register_hook(keep_h);
  });
}

// An op whose output sits in a std::vector<Tensor> member of its own context: record()
// refuses it when the vector holds the output by then; put there later, the cycle check
// names it (it was S2 "held by tensor ...", the vector's bytes being on the heap).
namespace {
struct KeepsOutputs {
  static constexpr const char* kName = "keeps_outputs";
  struct Context : autograd::Context {
    std::vector<Tensor> outputs;
  };
  static std::vector<Tensor> backward(Context&, std::vector<Tensor>& grads) { return {grads[0]}; }
};
Tensor keeps_outputs(const Tensor& x, bool before_recording) {
  Tensor out = ops::scale(x, 1.0).detach();
  auto ctx = std::make_unique<KeepsOutputs::Context>();
  KeepsOutputs::Context* raw = ctx.get();
  if (before_recording) ctx->outputs.push_back(out);
  autograd::record<KeepsOutputs>(std::move(ctx), {x}, {out});
  if (!before_recording) raw->outputs.push_back(out);
  return out;
}
}  // namespace

TEST(SanitizerCycles, AnOpKeepingItsOutputInAVectorMemberIsRefusedOrNamedAsTheCycle) {
  TinyMlp mlp;
  try {
    keeps_outputs(mlp.forward(batch(8, 32, 0)), true);
    ADD_FAILURE() << "record() accepted a context holding its output in a vector";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("container member"), std::string::npos) << e.what();
  }
  Recorder s;
  s.begin_step(0);
  s.begin_microbatch(0);
  std::shared_ptr<autograd::Node> node;  // only so the test can break the cycle afterwards
  {
    Tensor y = keeps_outputs(mlp.forward(batch(8, 32, 0)), false).set_name("y");
    node = y.grad_fn();
  }
  s.end_microbatch();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "keeps_outputs -> (context member) tensor 'y' -> keeps_outputs"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_FALSE(reported(s, IssueKind::LiveGraph, "keep a number or a detached copy"));
  node->release_state();
  node.reset();
  EXPECT_EQ(autograd::live_node_count(), 0u);
}

// A hook on a parameter that captures an activation keeps the activation's graph: the
// report named the activation ('batch', 'wq') as the holder, never the hook.
TEST(SanitizerCycles, AGraphKeptByAHookOnAParameterNamesTheHook) {
  TinyMlp mlp;
  Recorder s;
  HookHandle handle;
  s.begin_step(0);
  s.begin_microbatch(0);
  {
    Tensor h = mlp.forward(batch(8, 32, 0)).set_name("h");
    handle = mlp.w1.register_hook([h](const Tensor&) { return Tensor(); });
  }
  s.end_microbatch();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "captured by a gradient hook registered on float32[32,32] 'mlp.w1'"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "remove it with the HookHandle"));
  handle.remove();
  EXPECT_EQ(autograd::live_node_count(), 0u);
}

// Allocations and graph nodes made on a worker thread carried step -1 and no owner: only
// the byte count caught them. The process's clock and the thread's own name reach them.
TEST(SanitizerThreads, AWorkersGraphKeptPastItsMicrobatchIsNamedWithItsThreadAndBirth) {
  TinyMlp mlp;
  Recorder s;
  Tensor kept, scaled;
  s.begin_step(0);
  s.begin_microbatch(0);
  std::thread worker([&] {
    kept = mlp.forward(batch(8, 32, 0)).set_name("from_worker");
    scaled = ops::scale(mlp.w1, 2.0);
  });
  worker.join();
  s.end_microbatch(0);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "[mlp] born step 0 microbatch 0"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::Growth, "'from_worker'"));
  bool thread_named = false;
  for (const memory::LiveAllocation& a : runtime::ledger().live())
    thread_named = thread_named || (a.owner.name_str().rfind("thread ", 0) == 0 && a.owner.step == 0 &&
                                    a.owner.microbatch == 0);
  EXPECT_TRUE(thread_named) << "outside an owner scope, a worker names what it allocates for itself";
  kept = scaled = Tensor();
  s.end_step();
}

// Permanent cycles left at exit went unreported: LeakSanitizer sees them reachable
// through the graph census. The exit check (on in sanitizer builds) names them.
TEST(SanitizerExit, AReferenceCycleLeftAtExitEndsTheProcessNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        setenv("TALLY_EXIT_GRAPH_CHECK", "1", 1);
        TinyMlp mlp;
        Tensor h = mlp.forward(batch(8, 32, 0)).set_name("h");
        h.register_hook([h](const Tensor& g) { return g; });
        h = Tensor();
        std::exit(0);
      },
      testing::ExitedWithCode(23), "alive at exit.*\\(hook capture\\) tensor 'h'");
  EXPECT_EXIT(
      {
        setenv("TALLY_EXIT_GRAPH_CHECK", "1", 1);
        TinyMlp mlp;
        const Tensor held = mlp.forward(batch(8, 32, 0));  // std::exit does not unwind: alive at exit
        std::exit(0);
      },
      testing::ExitedWithCode(0), "")
      << "a graph something still holds is not a cycle (LeakSanitizer judges what holds it)";
}

// A hook registered on a parameter every microbatch and never removed piled up (3, 6, 9
// hooks) with 0 issues: its bytes are small and made before the step. The count of live
// hooks is growth too, named with the tensor they are on; removing them is clean.
TEST(SanitizerParameters, HooksRegisteredEveryMicrobatchAndNeverRemovedAreGrowth) {
  TinyMlp mlp;
  Recorder s;
  std::vector<HookHandle> handles;
  for (int64_t step = 0; step < 3; ++step) {
    s.begin_step(step);
    for (int64_t mb = 0; mb < 3; ++mb) {
      s.begin_microbatch(mb);
      handles.push_back(mlp.w1.register_hook([](const Tensor& g) { return g; }));
      ops::mean(mlp.forward(batch(4, 32, static_cast<uint64_t>(mb)))).backward();
      s.end_microbatch();
    }
    mlp.sgd(0.01);
    s.end_step();
  }
  EXPECT_TRUE(reported(s, IssueKind::Growth, "gradient hooks alive went")) << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::Growth, "on float32[32,32] 'mlp.w1'"));
  Recorder clean;
  for (int64_t step = 0; step < 3; ++step) {
    clean.begin_step(step);
    for (HookHandle& h : handles) h.remove();
    handles.push_back(mlp.w1.register_hook([](const Tensor& g) { return g; }));
    ops::mean(mlp.forward(batch(4, 32, 0))).backward();
    mlp.sgd(0.01);
    clean.end_step();
  }
  EXPECT_TRUE(clean.issues().empty()) << clean.issues()[0].message;
}

// ------------------------------------------------------------------ boundaries
TEST(SanitizerBoundaries, NodesRecordedBetweenStepsAreChecked) {
  TinyMlp mlp;
  Recorder s;
  s.begin_step(0);
  s.end_step();
  Tensor kept_eval = ops::mean(mlp.forward(batch(8, 32, 0))).set_name("eval_loss");  // grad mode on, kept
  s.begin_step(1);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "recorded between steps"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "held by tensor 'eval_loss'"));
}

// An evaluation with gradients on after the last training step kept its graph (73,732 B)
// with 0 issues: no later step start checked it. The run's end does.
TEST(SanitizerBoundaries, AGraphKeptAfterTheLastStepIsCheckedAtTheRunsEnd) {
  TinyMlp mlp;
  Recorder s;
  s.begin_step(0);
  s.end_step();
  Tensor kept_eval = ops::mean(mlp.forward(batch(8, 32, 0))).set_name("final_eval_loss");
  s.end_run();
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "recorded after its last step"))
      << (s.issues().empty() ? "" : s.issues()[0].message);
  EXPECT_TRUE(reported(s, IssueKind::LiveGraph, "held by tensor 'final_eval_loss'"));
  Recorder clean;
  clean.begin_step(0);
  clean.end_step();
  {
    autograd::NoGradGuard no_grad;
    kept_eval = ops::mean(mlp.forward(batch(8, 32, 0)));
  }
  clean.end_run();
  EXPECT_TRUE(clean.issues().empty()) << clean.issues()[0].message;
}

TEST(SanitizerBoundaries, TheFirstBoundaryListsOnlyWhatWasBornAfterTheSanitizerStarted) {
  Tensor before = Tensor::zeros({1000}).set_name("made_before");
  Recorder s;
  std::vector<Tensor> leak;
  s.begin_step(0);
  leak.push_back(Tensor::zeros({10}).set_name("made_in_step_0"));
  s.end_step();
  EXPECT_TRUE(reported(s, IssueKind::Growth, "made_in_step_0"));
  EXPECT_FALSE(reported(s, IssueKind::Growth, "made_before"));
}

TEST(SanitizerBoundaries, WarmUpIsExplicit) {
  auto run = [](int64_t warmup) {
    Recorder s;
    s.set_warmup_steps(warmup);
    std::vector<Tensor> cache;  // filled lazily on the first step, then reused
    for (int step = 0; step < 3; ++step) {
      s.begin_step(step);
      if (cache.empty()) cache.push_back(Tensor::zeros({100}).set_name("lazy_cache"));
      s.end_step();
    }
    return s.issues().size();
  };
  EXPECT_EQ(run(0), 1u) << "without warm-up the lazily filled cache is growth";
  EXPECT_EQ(run(1), 0u) << "declared warm-up makes it the baseline";
}

// ------------------------------------------------------------------ no raw pointers outlive their lock
TEST(LedgerRecords, ReferToStoragesWeakly) {
  Tensor t = Tensor::zeros({16}).set_name("short_lived");
  const uint64_t id = t.storage().allocation_id();
  memory::LiveAllocation rec = runtime::ledger().find(id);
  ASSERT_EQ(rec.id, id);
  EXPECT_FALSE(rec.storage.expired());
  t = Tensor();
  EXPECT_TRUE(rec.storage.expired()) << "a record copied out of the ledger cannot reach a dead storage";
}

TEST(LedgerRecords, HoldersCanBeListedWhileAnotherThreadMakesAndDropsTensors) {
  // Under AddressSanitizer a raw pointer that outlived its lock here is a use-after-free.
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop) {
      Tensor t = Tensor::zeros({64});
      Tensor v = t.slice(0, 0, 32).set_name("churning_view");
    }
  });
  size_t seen = 0;
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (seen < 200 && std::chrono::steady_clock::now() < until) {
    for (const memory::LiveAllocation& a : runtime::ledger().live())
      if (auto st = a.storage.lock())
        for (const std::string& h : sanitizer::storage_holders(*st)) seen += h.find("churning_view") != std::string::npos;
  }
  stop = true;
  churn.join();
  EXPECT_GE(seen, 200u) << "the other thread's views were seen while it made and dropped them";
}
