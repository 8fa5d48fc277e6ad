// The autograd engine: graph shapes, retain_graph, hooks, grad modes, the Function API,
// and the structural rules R1-R3 of the memory contract.
#include <gtest/gtest.h>

#include <set>

#include "autograd/checkpoint.h"
#include "autograd/cycles.h"
#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/node.h"
#include "autograd/observer.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "support.h"

using namespace tally;

namespace {
Tensor leaf(std::vector<double> v) {
  Tensor t = Tensor::from_vector(v, {static_cast<int64_t>(v.size())});
  t.set_requires_grad(true);
  return t;
}
std::vector<double> grad_of(const Tensor& t) { return t.grad().to_vector<double>(); }
}  // namespace

TEST(Autograd, DiamondAccumulatesBothPaths) {
  // y = x*x + 3x: dy/dx = 2x + 3 (x reaches the output along two paths).
  Tensor x = leaf({1, 2});
  Tensor a = x * x;
  Tensor b = 3.0 * x;
  ops::sum(a + b).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{5, 7}));
}

TEST(Autograd, SharedInputUsedByManyNodes) {
  Tensor x = leaf({2});
  Tensor y = x;
  for (int i = 0; i < 5; ++i) y = y * x;  // x^6
  y.backward(Tensor::ones({1}, DType::F64));
  EXPECT_DOUBLE_EQ(grad_of(x)[0], 6 * 32.0);
}

TEST(Autograd, GradientsAccumulateAcrossBackwards) {
  Tensor x = leaf({1, 1});
  ops::sum(2.0 * x).backward();
  ops::sum(3.0 * x).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{5, 5}));
  x.zero_grad();
  EXPECT_EQ(grad_of(x), (std::vector<double>{0, 0}));
}

TEST(Autograd, SecondBackwardWithoutRetainGraphFailsClearly) {
  Tensor x = leaf({1, 2});
  Tensor loss = ops::sum(x * x);
  loss.backward();
  try {
    loss.backward();
    FAIL() << "second backward did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("retain_graph"), std::string::npos) << e.what();
  }
}

TEST(Autograd, RetainGraphAllowsASecondBackward) {
  Tensor x = leaf({1, 2});
  Tensor loss = ops::sum(x * x);
  loss.backward({}, true);
  loss.backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{4, 8}));
}

TEST(Autograd, NoGradRecordsNothing) {
  Tensor x = leaf({1});
  autograd::NoGradGuard guard;
  Tensor y = x * x;
  EXPECT_FALSE(y.requires_grad());
  EXPECT_EQ(y.grad_fn(), nullptr);
}

TEST(Autograd, InferenceModeDisablesGradAndSaysSo) {
  Tensor x = leaf({1});
  {
    autograd::InferenceModeGuard guard;
    EXPECT_TRUE(autograd::inference_mode());
    EXPECT_FALSE((x * x).requires_grad());
  }
  EXPECT_FALSE(autograd::inference_mode());
  EXPECT_TRUE((x * x).requires_grad());
}

TEST(Autograd, TensorHooksRewriteGradients) {
  Tensor x = leaf({1, 2});
  Tensor y = 2.0 * x;
  y.register_hook([](const Tensor& g) { return 10.0 * g; });    // interior: pre-hook on grad_fn
  x.register_hook([](const Tensor& g) { return ops::add_scalar(g, 1.0); });  // leaf: before accumulation
  ops::sum(y).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{21, 21}));
}

TEST(Autograd, DeepChainNeedsNoRecursion) {
  // 200k nodes: a recursive engine or recursive node destruction would overflow the stack.
  Tensor x = leaf({1});
  Tensor y = x;
  for (int i = 0; i < 200000; ++i) y = ops::add_scalar(y, 0.0);
  ops::sum(y).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{1}));
}

TEST(Autograd, DependenciesAreComputedAtBackwardTime) {
  // A branch created after another backward already ran must still be waited for.
  Tensor x = leaf({3});
  Tensor h = x * x;
  Tensor a = 2.0 * h;
  Tensor b = 5.0 * h;
  autograd::backward({a, b}, {Tensor::ones({1}, DType::F64), Tensor::ones({1}, DType::F64)});
  EXPECT_DOUBLE_EQ(grad_of(x)[0], 7 * 6.0);
}

TEST(Autograd, OnlyBranchesThatReachALeafRun) {
  Tensor x = leaf({1});
  Tensor c = Tensor::from_vector<double>({4}, {1});  // constant
  Tensor y = x * c + c * c;
  ops::sum(y).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{4}));
}

// ---- R1: leaf xor interior
TEST(AutogradContract, InteriorTensorCannotBecomeALeaf) {
  Tensor x = leaf({1});
  Tensor y = x * x;
  EXPECT_FALSE(y.is_leaf());
  try {
    y.set_requires_grad(true);
    FAIL() << "an interior tensor was made a leaf";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("R1"), std::string::npos) << e.what();
  }
}

TEST(AutogradContract, LeafHasNoGradFnAndOwnsItsGrad) {
  // A registered parameter's gradient is a persistent Gradient allocation; any other
  // leaf's is a non-persistent Gradient that must not hide from the boundary checks.
  Tensor w = Tensor::zeros({2}, DType::F64, Device::cpu(), make_owner(Category::Parameter, "w"));
  w.set_name("w").set_parameter();
  Tensor x = leaf({1, 2});
  EXPECT_TRUE(x.is_leaf());
  EXPECT_EQ(x.grad_fn(), nullptr);
  ops::sum(x * w).backward();
  auto wg = runtime::ledger().find(w.grad().storage().allocation_id()).owner;
  EXPECT_EQ(wg.category, Category::Gradient);
  EXPECT_TRUE(wg.is_persistent());
  EXPECT_EQ(wg.name_str(), "w.grad");
  auto xg = runtime::ledger().find(x.grad().storage().allocation_id()).owner;
  EXPECT_EQ(xg.category, Category::Gradient);
  EXPECT_FALSE(xg.is_persistent());
}

// ---- R2: no owning back-edges
TEST(AutogradContract, GraphDoesNotKeepLeavesAlive) {
  std::weak_ptr<TensorImpl> weak;
  Tensor y;
  {
    Tensor x = leaf({1, 2});
    weak = x.impl_ptr();
    y = x * 2.0;  // y -> node -> AccumulateGrad -(weak)-> x
  }
  EXPECT_TRUE(weak.expired());
  y.backward(Tensor::ones({2}, DType::F64));  // the accumulator finds its leaf gone: no crash
}

TEST(AutogradContract, SavingAnOwnOutputMakesNoCycle) {
  Tensor x = leaf({1, 2, 3});
  Tensor y = ops::softmax(x);  // saves its own output
  std::weak_ptr<autograd::Node> node = y.grad_fn();
  EXPECT_TRUE(autograd::find_cycles({y}).empty());
  y = Tensor();
  EXPECT_TRUE(node.expired());
}

// ---- R3: backward state lives only in the context and dies after backward
namespace {
struct FusedScale {
  static constexpr const char* kName = "fused_scale";
  struct Context : autograd::Context {
    double factor = 0;
    Tensor extra;  // state kept outside save_for_backward (the TransformerEngine pattern)
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {ops::scale(grads[0], ctx.factor)};
  }
};

Tensor fused_scale(const Tensor& x, double f, int64_t extra_elems) {
  Tensor out = ops::scale(x.detach(), f);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<FusedScale::Context>();
    ctx->factor = f;
    ctx->extra = Tensor::zeros({extra_elems}, DType::F64, Device::cpu(),
                               make_owner(Category::Workspace, "fused_scale.extra"));
    autograd::record<FusedScale>(std::move(ctx), {x}, {out});
  }
  return out;
}
}  // namespace

TEST(AutogradContract, CustomFunctionRunsItsBackward) {
  Tensor x = leaf({1, 2});
  ops::sum(fused_scale(x, 3.0, 1)).backward();
  EXPECT_EQ(grad_of(x), (std::vector<double>{3, 3}));
}

TEST(AutogradContract, ContextStateIsFreedRightAfterBackwardEvenWhileTheLossLives) {
  auto& L = runtime::ledger();
  Tensor x = leaf({1, 2});
  int64_t before = L.stats().allocated_by_category[static_cast<int>(Category::Workspace)];
  Tensor loss = ops::sum(fused_scale(x, 3.0, 1 << 16));
  EXPECT_EQ(L.stats().allocated_by_category[static_cast<int>(Category::Workspace)] - before, 8 << 16);
  loss.backward();
  // `loss` is still in scope; its graph's context (and the extra tensor) is already gone.
  EXPECT_EQ(L.stats().allocated_by_category[static_cast<int>(Category::Workspace)], before);
}

TEST(AutogradContract, EdgesAreCutAfterBackwardSoAKeptRootHoldsOneNode) {
  Tensor x = leaf({1, 2});
  size_t before = autograd::live_node_count();
  Tensor loss = ops::sum(ops::gelu(x * x));
  EXPECT_GE(autograd::live_node_count(), before + 4);  // mul, gelu, sum, accumulator
  loss.backward();
  EXPECT_EQ(autograd::live_node_count(), before + 1);  // only loss's own (emptied) node
}

// ---- recomputation (R5)
TEST(Checkpoint, GradientsEqualTheUncheckpointedRegion) {
  Tensor w = test::random_tensor({6, 4}, 1);
  w.set_requires_grad(true);
  auto region = [&](const std::vector<Tensor>& in) { return ops::gelu(ops::linear(in[0], w)); };
  Tensor x1 = test::random_tensor({3, 4}, 2), x2 = x1.clone().detach();
  x1.set_requires_grad(true);
  x2.set_requires_grad(true);
  ops::sum(region({x1})).backward();
  Tensor gw = w.grad().clone();
  w.zero_grad();
  ops::sum(autograd::checkpoint(region, {x2})).backward();
  test::expect_close(x2.grad(), x1.grad(), 0, 0, "dx");
  test::expect_close(w.grad(), gw, 0, 0, "dw");
}

// A region that reads a tensor with its own graph, not passed as one of its inputs: the
// inner backward ran that tensor's nodes (the enclosing graph's) with the region's share
// of the gradient alone and released them, so the enclosing backward then failed with
// "backward through 'affine' a second time ... pass retain_graph=true", which names
// neither the region nor the remedy. It is refused, naming the op, before any node runs.
TEST(Checkpoint, ARegionReadingATensorWithAGraphOutsideItsInputsIsRefused) {
  Tensor x = leaf({1.0});
  Tensor y = x * 2.0;  // a graph of its own: MulBackward -> x
  Tensor w = leaf({1.5});
  auto region = [&](const std::vector<Tensor>& in) { return in[0] * y; };
  Tensor loss = ops::sum(autograd::checkpoint(region, {w})) + ops::sum(y);
  try {
    loss.backward();
    FAIL() << "no error; x.grad = " << x.grad().str();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("checkpoint"), std::string::npos) << what;
    EXPECT_NE(what.find("inputs"), std::string::npos) << what;
    EXPECT_NE(what.find("'affine'"), std::string::npos) << what;  // the op that made y
    EXPECT_EQ(what.find("second time"), std::string::npos) << what;
  }
}

// What a recomputed region allocates in backward carries the region's own module path:
// the inner backward names its nodes' paths as they are ("blk.inner:gelu_dx"), not
// appended to the checkpoint node's ("blk.blk.inner:...").
TEST(Checkpoint, BackwardAllocationsKeepTheRegionsModulePath) {
  Tensor w = test::random_tensor({6, 4}, 1);
  w.set_requires_grad(true);
  auto region = [&](const std::vector<Tensor>& in) {
    OwnerScope inner("inner");
    return ops::gelu(ops::linear(in[0], w));
  };
  Tensor x = test::random_tensor({3, 4}, 2);
  x.set_requires_grad(true);
  auto& L = runtime::ledger();
  Tensor loss;
  {
    OwnerScope block("blk");
    loss = ops::sum(autograd::checkpoint(region, {x}));
  }
  L.clear_history();
  L.enable_history(true);
  loss.backward();
  L.enable_history(false);
  std::set<std::string> names;
  for (const memory::MemoryEvent& e : L.history())
    if (e.delta > 0) names.insert(name_of(e.name));
  L.clear_history();
  bool recomputed = false;
  for (const std::string& n : names) {
    EXPECT_EQ(n.find("blk.blk"), std::string::npos) << n;
    recomputed = recomputed || n.rfind("blk.inner:", 0) == 0;
  }
  EXPECT_TRUE(recomputed) << "no allocation named blk.inner:* in the recomputation's backward";
}

TEST(AutogradContract, SavedActivationsAreAccountedAsSavedOnlyWhileSaved) {
  auto& L = runtime::ledger();
  const int saved = static_cast<int>(Category::SavedForBackward);
  int64_t before = L.stats().allocated_by_category[saved];
  Tensor x = leaf({1, 2, 3, 4});
  Tensor h = ops::gelu(x * 2.0);  // gelu saves its input, an activation of 4 doubles
  EXPECT_EQ(L.stats().allocated_by_category[saved] - before, 32);
  ops::sum(h).backward();
  EXPECT_EQ(L.stats().allocated_by_category[saved], before);  // released: an activation again
}

TEST(Autograd, HookReturningAWrongShapeIsAnError) {
  Tensor x = leaf({1, 2});
  Tensor y = 2.0 * x;
  y.register_hook([](const Tensor&) { return Tensor::zeros({3}, DType::F64); });
  EXPECT_THROW(ops::sum(y).backward(), Error);
}

TEST(AutogradContract, HooksAreReleasedWithTheGraph) {
  auto alive = std::make_shared<int>(0);
  std::weak_ptr<int> watch = alive;
  Tensor x = leaf({1, 2});
  Tensor loss = ops::sum(2.0 * x);
  Tensor y = loss;
  y.register_hook([alive](const Tensor& g) { return g; });  // the hook captures state
  alive.reset();
  loss.backward();
  EXPECT_TRUE(watch.expired()) << "a hook outlived the backward that ran it";
}

// ---- the engine validates every gradient against the input it is for
namespace {
// A Function whose backward returns whatever gradient the test asks for.
struct Rogue {
  static constexpr const char* kName = "rogue";
  struct Context : autograd::Context {
    Shape grad_shape;
    DType grad_dtype = DType::F64;
    int extra_grads = 0;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>&) {
    std::vector<Tensor> out{Tensor::zeros(ctx.grad_shape, ctx.grad_dtype)};
    for (int i = 0; i < ctx.extra_grads; ++i) out.push_back(Tensor::zeros({1}, DType::F64));
    return out;
  }
};
Tensor rogue(const Tensor& x, Shape grad_shape, DType grad_dtype = DType::F64, int extra_grads = 0) {
  Tensor out = ops::scale(x.detach(), 1.0);
  auto ctx = std::make_unique<Rogue::Context>();
  ctx->grad_shape = grad_shape;
  ctx->grad_dtype = grad_dtype;
  ctx->extra_grads = extra_grads;
  autograd::record<Rogue>(std::move(ctx), {x}, {out});
  return out;
}
}  // namespace

TEST(EngineValidation, AShorterGradientIsAnErrorNamingTheFunctionAndBothShapes) {
  Tensor x = leaf({1, 2, 3, 4});
  Tensor h = x * 2.0;  // an interior input: its gradient flows on into mul's backward
  std::string m = test::message_of<Error>([&] { ops::sum(rogue(h, {2})).backward(); });
  EXPECT_NE(m.find("'rogue'"), std::string::npos) << m;
  EXPECT_NE(m.find("[2]"), std::string::npos) << m;
  EXPECT_NE(m.find("[4]"), std::string::npos) << m;
  EXPECT_FALSE(x.grad().defined()) << "nothing was accumulated from a bad gradient";
}

TEST(EngineValidation, AOneElementGradientIsNotSilentlyBroadcast) {
  Tensor x = leaf({1, 2, 3, 4});
  Tensor h = x * 2.0;
  std::string m = test::message_of<Error>([&] { ops::sum(rogue(h, {1})).backward(); });
  EXPECT_FALSE(x.grad().defined()) << "nothing was broadcast into x's gradient";
  EXPECT_NE(m.find("float64[1]"), std::string::npos) << m;
  EXPECT_NE(m.find("float64[4]"), std::string::npos) << m;
}

TEST(EngineValidation, AGradientOfTheWrongDtypeIsAnError) {
  Tensor x = leaf({1, 2});
  std::string m = test::message_of<Error>([&] { ops::sum(rogue(x, {2}, DType::F32)).backward(); });
  EXPECT_NE(m.find("float32[2]"), std::string::npos) << m;
  EXPECT_NE(m.find("float64[2]"), std::string::npos) << m;
}

TEST(EngineValidation, MoreGradientsThanInputsIsAnError) {
  Tensor x = leaf({1, 2});
  std::string m = test::message_of<Error>([&] { ops::sum(rogue(x, {2}, DType::F64, 1)).backward(); });
  EXPECT_NE(m.find("2 gradients for its 1 inputs"), std::string::npos) << m;
}

TEST(EngineValidation, ARootGradientMustMatchTheRoot) {
  Tensor x = leaf({1, 2});
  Tensor y = x * 2.0;
  EXPECT_THROW(y.backward(Tensor::ones({2}, DType::F32)), Error);  // dtype
  EXPECT_THROW(y.backward(Tensor::ones({1}, DType::F64)), Error);  // shape
}

// ---- the Function API makes the lifetime rules structural
namespace {
struct KeepsOwnOutput {
  static constexpr const char* kName = "keeps_own_output";
  struct Context : autograd::Context {
    Tensor out;  // the bug: a plain member holding the node's own output
  };
  static std::vector<Tensor> backward(Context&, std::vector<Tensor>& grads) { return {grads[0]}; }
};

struct KeepsAWorkspace {
  static constexpr const char* kName = "keeps_a_workspace";
  struct Context : autograd::Context {
    size_t workspace = 0;  // index into the kept tensors
    bool will_release_seen = false;
  };
  static inline bool last_will_release = false;
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    last_will_release = ctx.will_release();
    EXPECT_EQ(ctx.saved(ctx.workspace).numel(), 1 << 14);
    return {grads[0]};
  }
};
Tensor keeps_a_workspace(const Tensor& x) {
  Tensor out = ops::scale(x.detach(), 1.0);
  auto ctx = std::make_unique<KeepsAWorkspace::Context>();
  ctx->workspace = ctx->keep(Tensor::zeros({1 << 14}, DType::F64, Device::cpu(), make_owner(Category::Workspace, "ws")));
  autograd::record<KeepsAWorkspace>(std::move(ctx), {x}, {out});
  return out;
}
}  // namespace

TEST(FunctionApi, AContextHoldingItsOwnOutputIsRefusedWhenRecorded) {
  Tensor x = leaf({1, 2});
  Tensor out = ops::scale(x.detach(), 1.0);
  auto ctx = std::make_unique<KeepsOwnOutput::Context>();
  ctx->out = out;
  std::string m =
      test::message_of<Error>([&] { autograd::record<KeepsOwnOutput>(std::move(ctx), {x}, {out}); });
  EXPECT_NE(m.find("keeps_own_output"), std::string::npos) << m;
  EXPECT_NE(m.find("reference cycle"), std::string::npos) << m;
  EXPECT_NE(m.find("ctx.keep()"), std::string::npos) << m;
}

TEST(FunctionApi, KeptTensorsAreDetachedCountedAndFreedWithTheContext) {
  auto& L = runtime::ledger();
  const int ws = static_cast<int>(Category::Workspace);
  const int64_t before = L.stats().allocated_by_category[ws];
  Tensor x = leaf({1, 2});
  Tensor y = keeps_a_workspace(x);
  EXPECT_EQ(L.stats().allocated_by_category[ws] - before, 8 << 14);
  const autograd::Context* ctx = y.grad_fn()->context();
  ASSERT_NE(ctx, nullptr);
  EXPECT_EQ(ctx->saved_bytes(), 8 << 14) << "kept bytes are counted with the saved ones";
  EXPECT_FALSE(ctx->saved_tensors()[0].data().requires_grad()) << "kept detached";
  ops::sum(y).backward();
  EXPECT_EQ(L.stats().allocated_by_category[ws], before);
}

TEST(FunctionApi, BackwardSeesWhetherItsContextWillBeReleased) {
  Tensor x = leaf({1, 2});
  Tensor y = ops::sum(keeps_a_workspace(x));
  y.backward({}, /*retain_graph=*/true);
  EXPECT_FALSE(KeepsAWorkspace::last_will_release);
  y.backward();
  EXPECT_TRUE(KeepsAWorkspace::last_will_release);
}

TEST(FunctionApi, CrossEntropyOverwritesItsLogitsOnlyWhenItsContextWillBeReleased) {
  Tensor logits = test::random_tensor({3, 5}, 7);
  logits.set_requires_grad(true);
  Tensor targets = Tensor::from_vector<int64_t>({0, 2, 4}, {3});
  Tensor l = logits * 1.0;  // an interior tensor whose only other holder is the loss's context
  Tensor loss = ops::cross_entropy(l, targets);
  l = Tensor();
  loss.backward({}, true);
  Tensor g1 = logits.grad().clone();
  loss.backward();  // reads the same logits again: the first backward must not have overwritten them
  test::expect_close(logits.grad(), ops::scale(g1, 2.0), 1e-12, 1e-15, "grad after two backwards");
}

// ---- hooks return handles and die with their graph
TEST(Hooks, RemovingAHookStopsItAndDestroysItsCaptures) {
  auto alive = std::make_shared<int>(0);
  std::weak_ptr<int> watch = alive;
  Tensor x = leaf({1, 2});
  int calls = 0;
  HookHandle h = x.register_hook([alive, &calls](const Tensor& g) {
    ++calls;
    return g;
  });
  alive.reset();
  EXPECT_TRUE(h.active());
  ops::sum(2.0 * x).backward();
  EXPECT_EQ(calls, 1);
  h.remove();
  EXPECT_FALSE(h.active());
  EXPECT_TRUE(watch.expired()) << "remove() destroys the hook's captures at once";
  ops::sum(2.0 * x).backward();
  EXPECT_EQ(calls, 1);
  h.remove();  // idempotent
}

TEST(Hooks, AnInteriorHooksHandleOutlivingItsGraphIsHarmless) {
  HookHandle h;
  {
    Tensor x = leaf({1});
    Tensor y = 2.0 * x;
    h = y.register_hook([](const Tensor& g) { return g; });
    EXPECT_TRUE(h.active());
  }
  EXPECT_FALSE(h.active()) << "the hook died with its graph";
  h.remove();
}

// ---- "the gradient of this leaf is final": for every parameter, in backward order
TEST(PostAccumulateHooks, RunOnceForEveryLeafInBackwardOrderIncludingSunkGradients) {
  Tensor w1 = test::random_tensor({4, 3}, 2).set_name("w1");
  Tensor w2 = test::random_tensor({2, 4}, 3).set_name("w2");
  w1.set_parameter();
  w2.set_parameter();
  w1.set_grad(Tensor::zeros({4, 3}, DType::F64));  // preallocated: linear writes dW in place (grad sink)
  w2.set_grad(Tensor::zeros({2, 4}, DType::F64));
  Tensor x = test::random_tensor({5, 3}, 1);
  std::vector<std::string> order;
  std::vector<double> norm_when_final;
  for (const Tensor& w : {w1, w2})
    w.register_post_accumulate_hook([&](const Tensor& leaf) {
      order.push_back(leaf.name());
      norm_when_final.push_back(ops::global_norm({leaf.grad()}));
    });
  Tensor loss = ops::sum(ops::linear(ops::gelu(ops::linear(x, w1)), w2));
  loss.backward();
  EXPECT_EQ(order, (std::vector<std::string>{"w2", "w1"}));
  ASSERT_EQ(norm_when_final.size(), 2u);
  EXPECT_GT(norm_when_final[1], 0.0) << "the sunk gradient had arrived when the hook ran";
  EXPECT_EQ(norm_when_final[1], ops::global_norm({w1.grad()}));
}

TEST(PostAccumulateHooks, TheHandleRemovesOneAndOnlyLeavesTakeThem) {
  Tensor w = leaf({2});
  int calls = 0;
  HookHandle h = w.register_post_accumulate_hook([&](const Tensor&) { ++calls; });
  ops::sum(2.0 * w).backward();
  EXPECT_EQ(calls, 1);
  h.remove();
  ops::sum(2.0 * w).backward();
  EXPECT_EQ(calls, 1) << "removed";
  Tensor interior = 2.0 * w;
  std::string m = test::message_of<Error>([&] { interior.register_post_accumulate_hook([](const Tensor&) {}); });
  EXPECT_NE(m.find("not a leaf"), std::string::npos) << m;
}

// ---- R1 cannot be bypassed: no public mutable access to a tensor's autograd state
namespace {
template <class Impl>
constexpr bool state_assignable = requires(Impl& impl) { impl.autograd() = autograd::AutogradState{}; };
template <class Impl>
constexpr bool state_member_reachable = requires(Impl& impl) { impl.autograd_ = autograd::AutogradState{}; };
template <class Impl> constexpr bool state_readable = requires(const Impl& impl) { impl.autograd().index(); };
}  // namespace

TEST(AutogradContract, AutogradStateHasNoPublicMutableAccessor) {
  EXPECT_FALSE(state_assignable<TensorImpl>) << "autograd() must hand out const access only";
  EXPECT_FALSE(state_member_reachable<TensorImpl>) << "the state itself must be private";
  EXPECT_TRUE(state_readable<TensorImpl>);
}

// ---- discarded gradients: zero without a pass, overwritten by the next gradient
namespace {
// A graph that reaches leaves every way a gradient arrives: a GEMM into the linear
// weight's buffer, a row sum into its bias's, the layernorm's gradients through
// AccumulateGrad, a hooked leaf (hooks must see the gradient: no sink), a position table
// whose scatter is its only gradient (rows no position hits must read zero), and a table
// tied between the embedding and the chunked cross-entropy head (the head's GEMMs write
// it, then the embedding's scatter adds to it). Under bf16 the GEMMs take bf16 copies.
struct EveryGradientPath {
  static constexpr int64_t V = 11, C = 6, N = 10;
  Tensor table = test::random_tensor({V, C}, 1, DType::F32), w = test::random_tensor({C, C}, 2, DType::F32),
         b = test::random_tensor({C}, 3, DType::F32), ln_w = test::random_tensor({C}, 4, DType::F32),
         ln_b = test::random_tensor({C}, 5, DType::F32), gain = test::random_tensor({C}, 6, DType::F32),
         unused = test::random_tensor({3}, 7, DType::F32), positions = test::random_tensor({N + 2, C}, 8, DType::F32);
  std::vector<Tensor> leaves{table, w, b, ln_w, ln_b, gain, unused, positions};
  Tensor idx = Tensor::from_vector(std::vector<int32_t>{0, 3, 3, 7, 1, 10, 3, 2, 0, 5}, {N});
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{4, 4, 9, 0, 2, 6, 1, 1, 8, 3}, {N});
  Tensor pos = Tensor::from_vector(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9}, {N});
  bool bf16 = false;
  HookHandle hook;

  Tensor block;  // the gradients, views of one block as a ParameterStore lays them out

  EveryGradientPath() {
    int64_t total = 0;
    for (const Tensor& t : leaves) total += t.numel();
    block = Tensor::zeros({total}, DType::F32);
    int64_t offset = 0;
    for (const Tensor& t : leaves) {
      t.set_parameter();
      // Allocated: the sinks write into them (at their offsets, not the block's start).
      t.set_grad(make_view(block, t.shape(), contiguous_strides(t.shape()), offset));
      offset += t.numel();
    }
    hook = gain.register_hook([](const Tensor&) { return Tensor(); });
  }
  void backward() const {
    Tensor h = ops::embedding(table, idx) + ops::embedding(positions, pos);
    h = bf16 ? ops::linear_bf16(h, w, w.detach().to(DType::BF16), b) : ops::linear(h, w, b);
    h = ops::layernorm(h, ln_w, ln_b) * gain;
    ops::linear_cross_entropy(h, table, targets, V, /*chunk_rows=*/4, bf16 ? table.detach().to(DType::BF16) : Tensor())
        .backward();
  }
  std::vector<std::vector<float>> grads() const {
    std::vector<std::vector<float>> out;
    for (const Tensor& t : leaves) out.push_back(t.grad().to_vector<float>());
    return out;
  }
};
}  // namespace

TEST(DiscardedGradient, ReadsZeroAndIsOverwrittenByEveryKindOfBackwardThenAccumulates) {
  for (bool bf16 : {false, true}) {
    EveryGradientPath g;
    g.bf16 = bf16;
    const std::string tag = bf16 ? "bf16" : "fp32";
    g.backward();
    const auto once = g.grads();
    g.backward();
    const auto twice = g.grads();
    EXPECT_NE(once[0], twice[0]) << tag;
    EXPECT_EQ(once[6], std::vector<float>(3, 0.f)) << tag << ": the unused leaf got no gradient";

    // Discarded, the buffers keep their bytes: poison them through handles taken before.
    std::vector<Tensor> buffers;
    for (const Tensor& t : g.leaves) buffers.push_back(t.grad());
    for (const Tensor& t : g.leaves) t.discard_grad();
    for (const Tensor& buf : buffers) buf.fill_(std::nan(""));
    g.backward();
    // A NaN anywhere means a backward read the stale bytes (added instead of writing) or
    // left some unwritten; the values are the first backward's, bit for bit.
    EXPECT_EQ(g.grads(), once) << tag;
    g.backward();
    EXPECT_EQ(g.grads(), twice) << tag << ": the second microbatch adds, as before";

    // Read before any gradient arrives, a discarded gradient is zero.
    for (const Tensor& t : g.leaves) t.discard_grad();
    for (const Tensor& buf : buffers) buf.fill_(std::nan(""));
    EXPECT_EQ(g.w.grad().to_vector<float>(), std::vector<float>(36, 0.f)) << tag;
    EXPECT_EQ(g.unused.grad().to_vector<float>(), std::vector<float>(3, 0.f)) << tag;
    // ... and the w that grad() zeroed now accumulates (no longer discarded).
    g.backward();
    EXPECT_EQ(g.grads(), once) << tag;
  }
}
