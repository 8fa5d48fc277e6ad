// The autograd engine: graph shapes, retain_graph, hooks, grad modes, the Function API,
// and the structural rules R1-R3 of the memory contract.
#include <gtest/gtest.h>

#include "autograd/checkpoint.h"
#include "autograd/cycles.h"
#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/node.h"
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
