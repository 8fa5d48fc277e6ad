// Every op against PyTorch (fixtures from scripts/gen_op_fixtures.py, fp64) and against
// finite differences (fp64 gradcheck).
//
// Tolerances: both sides compute in fp64, so results agree to rounding of differently
// ordered sums: rtol 1e-9 / atol 1e-12 leaves ~1e6 ulps of headroom and still catches
// any formula error (those show up at 1e-3 or worse). The gradcheck uses central
// differences with eps 1e-6: truncation error ~eps^2 and rounding ~1e-16/eps, so a
// relative error above 1e-6 means a wrong gradient.
#include <cmath>
#include <limits>

#include <gtest/gtest.h>
#include <omp.h>

#include "autograd/engine.h"
#include "io/safetensors.h"
#include "memory/ledger.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "support.h"

using namespace tally;
using test::expect_close;

namespace {

const io::SafetensorsFile& fx() {
  static io::SafetensorsFile f = io::read_safetensors(test::fixture_path("ops.safetensors"));
  return f;
}

Tensor input(const std::string& name) {
  Tensor t = fx().at(name).clone();  // a fresh leaf per test
  if (is_floating(t.dtype())) t.set_requires_grad(true);
  return t;
}

constexpr double kRtol = 1e-9, kAtol = 1e-12;

// Runs backward from `out` with the fixture's upstream gradient and checks out and
// the gradients of the named inputs.
void check_case(const std::string& c, const Tensor& out, const std::vector<std::pair<std::string, Tensor>>& inputs) {
  expect_close(out, fx().at(c + ".out"), kRtol, kAtol, c + ".out");
  autograd::backward({out}, {fx().at(c + ".dout")});
  for (const auto& [name, t] : inputs) expect_close(t.grad(), fx().at(c + ".d" + name), kRtol, kAtol, c + ".d" + name);
}

}  // namespace

TEST(OpsVsTorch, Matmul) {
  Tensor a = input("matmul.a"), b = input("matmul.b");
  check_case("matmul", ops::matmul(a, b), {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, MatmulTransposedRight) {
  Tensor a = input("matmul_bt.a"), b = input("matmul_bt.b");
  check_case("matmul_bt", ops::matmul(a, b, false, true), {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, Linear) {
  Tensor x = input("linear.x"), w = input("linear.w"), b = input("linear.b");
  check_case("linear", ops::linear(x, w, b), {{"x", x}, {"w", w}, {"b", b}});
}
TEST(OpsVsTorch, BroadcastAdd) {
  Tensor a = input("add_bcast.a"), b = input("add_bcast.b");
  check_case("add_bcast", a + b, {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, BroadcastSub) {
  Tensor a = input("sub_bcast.a"), b = input("sub_bcast.b");
  check_case("sub_bcast", a - b, {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, BroadcastMul) {
  Tensor a = input("mul_bcast.a"), b = input("mul_bcast.b");
  check_case("mul_bcast", a * b, {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, BroadcastDiv) {
  Tensor a = input("div_bcast.a"), b = input("div_bcast.b");
  check_case("div_bcast", a / b, {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, Scale) {
  Tensor x = input("scale.x");
  check_case("scale", 2.5 * x, {{"x", x}});
}
TEST(OpsVsTorch, SumOverDim) {
  Tensor x = input("sum_dim.x");
  check_case("sum_dim", ops::sum(x, {1}), {{"x", x}});
}
TEST(Ops, SumOverRowsIsRoundedOnceAndTheSameOnAnyThreadCount) {
  // The bias gradient's reduction, (rows, C) -> (C): fp64 partials over blocks of rows, in
  // a fixed order, rounded to fp32 once. So each fp32 sum is the fp64 sum of the values
  // rounded (within an fp32 ulp: 1.2e-7 relative); and one thread or two give the same
  // bits, shown on fp64 input, whose sums keep every change of order in their last bits.
  // 1030 rows (not a multiple of the 64-row blocks or of the 4-row passes), enough to run
  // threaded, and a width (97) no vector length divides.
  Tensor x64 = test::random_tensor({1030, 97}, 90);
  Tensor x = x64.to(DType::F32);
  const auto xs = x.to_vector<float>();
  std::vector<double> exact(97, 0.0);
  for (size_t i = 0; i < xs.size(); ++i) exact[i % 97] += xs[i];
  const auto sum32 = ops::sum(x, {0}).to_vector<float>();
  for (size_t j = 0; j < exact.size(); ++j)
    EXPECT_NEAR(sum32[j], exact[j], 1.2e-7 * std::abs(exact[j]) + 1e-12) << "column " << j;
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const auto one = ops::sum(x64, {0}).to_vector<double>();
  omp_set_num_threads(2);
  const auto two = ops::sum(x64, {0}).to_vector<double>();
  omp_set_num_threads(threads);
  for (size_t j = 0; j < exact.size(); ++j)
    EXPECT_EQ(one[j], two[j]) << "column " << j << ": the thread count changed the sum";
}

TEST(Ops, SumOverAnyRunOfDimsMatchesTheSumOfEachElement) {
  // Leading, middle and trailing runs of reduced dims (a sparse layer's (N, k, C) ->
  // (N, 1, C) and its weights' (R, C) -> (R, 1) among them), a size-1 dim inside a run,
  // nothing reduced, and two runs apart, threaded (the tensor has 2 x 2^15 elements) and
  // not; on fp64, each output against its elements summed in order.
  const Shape shape{8, 16, 1, 32, 16};
  const Tensor x = test::random_tensor(shape, 91);
  const std::vector<double> xs = x.to_vector<double>();
  for (const std::vector<int64_t>& dims : std::vector<std::vector<int64_t>>{
           {0}, {0, 1}, {1}, {1, 2, 3}, {3, 4}, {4}, {2}, {1, 3}, {0, 4}, {0, 1, 2, 3, 4}}) {
    Shape keep = shape;
    int64_t outputs = 1;
    for (int64_t d : dims) keep[static_cast<size_t>(d)] = 1;
    for (int64_t n : keep) outputs *= n;
    std::vector<double> exact(static_cast<size_t>(outputs), 0.0);
    for (int64_t i = 0; i < x.numel(); ++i) {
      int64_t rest = i, o = 0, stride = 1;
      for (int64_t d = x.dim() - 1; d >= 0; --d) {
        const int64_t at = rest % shape[d];
        rest /= shape[d];
        o += (keep[d] == 1 ? 0 : at) * stride;
        stride *= keep[d];
      }
      exact[static_cast<size_t>(o)] += xs[static_cast<size_t>(i)];
    }
    const std::vector<double> got = ops::sum(x, dims, true).to_vector<double>();
    ASSERT_EQ(got.size(), exact.size());
    for (size_t j = 0; j < exact.size(); ++j)
      ASSERT_NEAR(got[j], exact[j], 1e-12 * (1 + std::abs(exact[j]))) << "dims " << ::testing::PrintToString(dims) << ", output " << j;
  }
}

TEST(OpsVsTorch, SumAll) {
  Tensor x = input("sum_all.x");
  check_case("sum_all", ops::sum(x), {{"x", x}});
}
TEST(OpsVsTorch, MeanKeepdim) {
  Tensor x = input("mean_dim.x");
  check_case("mean_dim", ops::mean(x, {-1}, true), {{"x", x}});
}
TEST(OpsVsTorch, MaxOverDim) {
  Tensor x = input("max_dim.x");
  check_case("max_dim", ops::max(x, 2), {{"x", x}});
}
TEST(OpsVsTorch, Embedding) {
  Tensor w = input("embedding.weight");
  check_case("embedding", ops::embedding(w, fx().at("embedding.idx")), {{"weight", w}});
}
TEST(OpsVsTorch, LayerNorm) {
  Tensor x = input("layernorm.x"), w = input("layernorm.w"), b = input("layernorm.b");
  check_case("layernorm", ops::layernorm(x, w, b, 1e-5), {{"x", x}, {"w", w}, {"b", b}});
}
TEST(OpsVsTorch, GeluTanh) {
  Tensor x = input("gelu.x");
  check_case("gelu", ops::gelu(x), {{"x", x}});
}
TEST(OpsVsTorch, Softmax) {
  Tensor x = input("softmax.x");
  check_case("softmax", ops::softmax(x), {{"x", x}});
}
TEST(OpsVsTorch, CausalAttention) {
  Tensor q = input("attention.q"), k = input("attention.k"), v = input("attention.v");
  check_case("attention", ops::causal_attention(q, k, v), {{"q", q}, {"k", k}, {"v", v}});
}
TEST(OpsVsTorch, GroupedQueryAttention) {
  Tensor q = input("attention_gqa.q"), k = input("attention_gqa.k"), v = input("attention_gqa.v");
  check_case("attention_gqa", ops::causal_attention(q, k, v), {{"q", q}, {"k", k}, {"v", v}});
}
TEST(OpsVsTorch, AttentionOfTheLastQueriesOverALongerKvCache) {
  Tensor q = input("attention_kv_offset.q"), k = input("attention_kv_offset.k"), v = input("attention_kv_offset.v");
  check_case("attention_kv_offset", ops::causal_attention(q, k, v), {{"q", q}, {"k", k}, {"v", v}});
}
TEST(OpsVsTorch, RmsNorm) {
  Tensor x = input("rmsnorm.x"), w = input("rmsnorm.w");
  check_case("rmsnorm", ops::rmsnorm(x, w, 1e-5), {{"x", x}, {"w", w}});
}
TEST(OpsVsTorch, SwiGlu) {
  Tensor gate = input("swiglu.gate"), up = input("swiglu.up");
  check_case("swiglu", ops::swiglu(gate, up), {{"gate", gate}, {"up", up}});
}
TEST(OpsVsTorch, RotaryWithLlama31FrequencyScaling) {
  // The fixture's frequencies come from Meta's apply_scaling in Python; the model's own
  // computation of them is checked against the same numbers in test_llama.
  Tensor inv_freq = fx().at("rotary.inv_freq");
  Tensor x = input("rotary.x");
  check_case("rotary", ops::rotary(x, inv_freq), {{"x", x}});
  Tensor y = input("rotary_offset.x");
  check_case("rotary_offset", ops::rotary(y, inv_freq, 7), {{"x", y}});
}
TEST(OpsVsTorch, CrossEntropyOverPaddedVocab) {
  Tensor logits = input("cross_entropy.logits");
  int64_t V = fx().at("cross_entropy.valid_vocab").to_vector<int64_t>()[0];
  check_case("cross_entropy", ops::cross_entropy(logits, fx().at("cross_entropy.targets"), V), {{"logits", logits}});
}
TEST(OpsVsTorch, Cat) {
  Tensor a = input("cat.a"), b = input("cat.b");
  check_case("cat", ops::cat({a, b}, 1), {{"a", a}, {"b", b}});
}
TEST(OpsVsTorch, Split) {
  Tensor x = input("split.x");
  auto outs = ops::split(x, {2, 3, 4}, 1);
  for (int i = 0; i < 3; ++i) expect_close(outs[i], fx().at("split.out" + std::to_string(i)), kRtol, kAtol, "split.out");
  autograd::backward(outs, {fx().at("split.dout0"), fx().at("split.dout1"), fx().at("split.dout2")});
  expect_close(x.grad(), fx().at("split.dx"), kRtol, kAtol, "split.dx");
}
TEST(OpsVsTorch, Slice) {
  Tensor x = input("slice.x");
  check_case("slice", x.slice(0, 1, 3).slice(1, 2, 5), {{"x", x}});
}
TEST(OpsVsTorch, Gather) {
  Tensor x = input("gather.x");
  check_case("gather", ops::gather(x, 1, fx().at("gather.index")), {{"x", x}});
}
TEST(OpsVsTorch, Permute) {
  Tensor x = input("permute.x");
  check_case("permute", x.permute({2, 0, 1}).contiguous(), {{"x", x}});
}

// ---------------------------------------------------------------- finite differences

namespace {
using Fn = std::function<Tensor(const std::vector<Tensor>&)>;
constexpr double kGradTol = 1e-6;
}  // namespace

TEST(Gradcheck, ElementwiseWithBroadcast) {
  Fn f = [](auto& in) { return ops::div(ops::mul(ops::sub(ops::add(in[0], in[1]), in[1]), in[0]), ops::add_scalar(in[1], 3.0)); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({2, 3, 4}, 1), test::random_tensor({3, 1}, 2)}), kGradTol);
}
TEST(Gradcheck, Reductions) {
  Fn f = [](auto& in) { return ops::add(ops::sum(in[0], {0, 2}, true), ops::mean(in[0], {0, 2}, true)); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({2, 3, 4}, 3)}), kGradTol);
  Fn g = [](auto& in) { return ops::max(in[0], 1); };
  EXPECT_LT(test::gradcheck(g, {test::random_tensor({3, 5}, 4)}), kGradTol);
}
// A NaN is the maximum of any row holding one, at its first position, as in PyTorch: the
// comparison alone skipped a NaN after the first element (max 3, argmax 2 for the first row)
// and kept one in the first place (argmax 0 for a row whose maximum is elsewhere).
TEST(Ops, MaxAndArgmaxPropagateTheFirstNaN) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (DType dt : {DType::F64, DType::F32}) {
    const Tensor x = Tensor::from_vector(std::vector<double>{1, nan, 3, 2, nan, 1, 0, -1, 4, 7, 7, 5, 2, nan, 1, nan}, {4, 4}).to(dt);
    const std::vector<double> values = ops::max(x, 1).to(DType::F64).to_vector<double>();
    EXPECT_TRUE(std::isnan(values[0]) && std::isnan(values[1]) && std::isnan(values[3])) << dtype_name(dt);
    EXPECT_EQ(values[2], 7) << dtype_name(dt);
    EXPECT_EQ(ops::argmax(x).to_vector<int64_t>(), (std::vector<int64_t>{1, 0, 1, 1})) << dtype_name(dt);
    // Along a leading dimension (strided rows): column 1 holds NaN at row 0, column 3 at row 3.
    const std::vector<double> columns = ops::max(x, 0).to(DType::F64).to_vector<double>();
    EXPECT_TRUE(std::isnan(columns[1]) && std::isnan(columns[3]) && std::isnan(columns[0])) << dtype_name(dt);
  }
}

TEST(Gradcheck, MatmulWithTransposes) {
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      Fn f = [=](auto& in) { return ops::matmul(in[0], in[1], ta, tb); };
      Tensor a = ta ? test::random_tensor({2, 4, 3}, 5) : test::random_tensor({2, 3, 4}, 5);
      Tensor b = tb ? test::random_tensor({2, 5, 4}, 6) : test::random_tensor({2, 4, 5}, 6);
      EXPECT_LT(test::gradcheck(f, {a, b}), kGradTol) << "ta=" << ta << " tb=" << tb;
    }
}
TEST(Gradcheck, MatmulOfStridedViews) {
  Fn f = [](auto& in) { return ops::matmul(in[0].transpose(0, 1), in[1].slice(1, 1, 4)); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({4, 3}, 7), test::random_tensor({4, 5}, 8)}), kGradTol);
}
TEST(Gradcheck, LinearLayerNormGelu) {
  Fn f = [](auto& in) { return ops::gelu(ops::layernorm(ops::linear(in[0], in[1], in[2]), in[3], in[4])); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({2, 3, 5}, 9), test::random_tensor({6, 5}, 10),
                                test::random_tensor({6}, 11), test::random_tensor({6}, 12), test::random_tensor({6}, 13)}),
            kGradTol);
}
TEST(Gradcheck, SoftmaxAndEmbedding) {
  Tensor idx = Tensor::from_vector<int64_t>({1, 3, 1, 0}, {2, 2});
  Fn f = [&](auto& in) { return ops::softmax(ops::embedding(in[0], idx)); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({4, 6}, 14)}), kGradTol);
}
TEST(Gradcheck, AttentionOnSlicesOfFusedQkv) {
  // q, k, v as strided slices of one (B,T,3*H*D) projection, the way GPT-2 uses it.
  Fn f = [](auto& in) {
    auto parts = ops::split(in[0], {6, 6, 6}, 2);
    auto heads = [](const Tensor& t) { return t.view({2, 4, 3, 2}); };
    return ops::causal_attention(heads(parts[0].contiguous()), parts[1].view({2, 4, 3, 2}), parts[2].view({2, 4, 3, 2}));
  };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({2, 4, 18}, 15)}), kGradTol);
}
TEST(Gradcheck, GroupedQueryAttention) {
  Fn f = [](auto& in) { return ops::causal_attention(in[0], in[1], in[2]); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({1, 4, 4, 3}, 16), test::random_tensor({1, 4, 2, 3}, 17),
                                test::random_tensor({1, 4, 2, 3}, 18)}),
            kGradTol);
}
TEST(Gradcheck, RmsNormSwiGluRotary) {
  Tensor inv_freq = Tensor::from_vector<double>({1.0, 0.3, 0.05}, {3});
  Fn f = [&](auto& in) {
    Tensor h = ops::rmsnorm(in[0], in[1]);                                    // (2,3,12)
    Tensor g = ops::swiglu(h, in[2]);
    return ops::rotary(g.view({2, 3, 2, 6}), inv_freq, 2);
  };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({2, 3, 12}, 23), test::random_tensor({12}, 24),
                                test::random_tensor({2, 3, 12}, 25)}),
            kGradTol);
}
TEST(Gradcheck, AttentionOverALongerKvCache) {
  Fn f = [](auto& in) { return ops::causal_attention(in[0], in[1], in[2]); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({1, 2, 4, 3}, 26), test::random_tensor({1, 5, 2, 3}, 27),
                                test::random_tensor({1, 5, 2, 3}, 28)}),
            kGradTol);
}
TEST(Gradcheck, CrossEntropyIgnoresPaddingAndNegativeTargets) {
  Tensor targets = Tensor::from_vector<int32_t>({2, -1, 0, 4}, {4});
  Fn f = [&](auto& in) { return ops::cross_entropy(in[0], targets, 5); };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({4, 7}, 19)}), kGradTol);
}
TEST(Gradcheck, ShapeOps) {
  Tensor index = Tensor::from_vector<int64_t>({0, 2, 2, 1, 0, 0}, {3, 2});
  Fn f = [&](auto& in) {
    Tensor c = ops::cat({in[0], in[1].transpose(0, 1)}, 1);                 // (3, 6)
    Tensor g = ops::gather(c, 1, index);                                     // (3, 2)
    Tensor e = in[0].slice(1, 0, 1).expand({3, 2});                          // (3, 2)
    return ops::add(ops::mul(g, e), c.reshape({2, 9}).slice(0, 0, 1).view({3, 3}).slice(1, 0, 2));
  };
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({3, 2}, 20), test::random_tensor({4, 3}, 21)}), kGradTol);
}
TEST(Gradcheck, DtypeConversionRoundTrip) {
  Fn f = [](auto& in) { return ops::to_dtype(ops::scale(ops::to_dtype(in[0], DType::F32), 2.0), DType::F64); };
  // fp32 in the middle: the finite difference sees fp32 rounding, so compare loosely.
  EXPECT_LT(test::gradcheck(f, {test::random_tensor({5}, 22)}, 1e-3), 1e-3);
}

TEST(Ops, Fp32MatmulMatchesFp64WithinSinglePrecision) {
  // oneDNN sgemm vs the fp64 reference loop: relative error bounded by ~K * 2^-24.
  Tensor a = test::random_tensor({64, 300}, 30), b = test::random_tensor({300, 50}, 31);
  Tensor ref = ops::matmul(a, b);
  Tensor got = ops::matmul(a.to(DType::F32), b.to(DType::F32));
  expect_close(got, ref, 0, 300 * 6e-8 * 4, "sgemm vs fp64");
}

TEST(Ops, Fp32MatmulMatchesFp64InEveryLayoutAndThroughBothOneDnnPaths) {
  // 96 output rows: the NT case (x @ W^T) runs through oneDNN's matmul primitive, the
  // others through sgemm (runtime/cpu/matmul.cc). Each layout, contiguous and as a
  // column slice of a wider tensor (row stride > columns), against the fp64 loop.
  const int64_t M = 96, K = 300, N = 70;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (bool sliced : {false, true}) {
        // Returns the fp64 operand and its fp32 twin, each sliced from its own wide tensor.
        auto operand = [&](int64_t rows, int64_t cols, uint64_t seed) {
          Tensor wide = test::random_tensor({rows, cols + (sliced ? 9 : 0)}, seed);
          Tensor wide32 = wide.to(DType::F32);
          if (!sliced) return std::pair{wide, wide32};
          return std::pair{wide.slice(1, 4, 4 + cols), wide32.slice(1, 4, 4 + cols)};
        };
        auto [a, a32] = ta ? operand(K, M, 50) : operand(M, K, 50);
        auto [b, b32] = tb ? operand(N, K, 51) : operand(K, N, 51);
        if (sliced) {
          ASSERT_FALSE(a32.is_contiguous());
        }
        Tensor ref = ops::matmul(a, b, ta, tb);
        Tensor got = ops::matmul(a32, b32, ta, tb);
        ASSERT_EQ(got.shape(), (Shape{M, N}));
        expect_close(got, ref, 0, K * 6e-8 * 4,
                     std::string("layout ") + (ta ? "T" : "N") + (tb ? "T" : "N") + (sliced ? " sliced" : ""));
      }
}

TEST(Ops, Fp32LinearAddsItsBiasOnEitherGemmPath) {
  // 96 rows: oneDNN's matmul primitive adds the bias as it writes the output; 8 rows:
  // sgemm accumulates onto the bias written first. Both against the fp64 linear, whose
  // values differ from the bias-free product by the bias (so a dropped bias fails).
  const int64_t K = 200, N = 40;
  for (int64_t M : {96, 8}) {
    Tensor x = test::random_tensor({M, K}, 60), w = test::random_tensor({N, K}, 61), b = test::random_tensor({N}, 62);
    Tensor ref = ops::linear(x, w, b);
    Tensor got = ops::linear(x.to(DType::F32), w.to(DType::F32), b.to(DType::F32));
    expect_close(got, ref, 0, K * 6e-8 * 4, "linear with bias, " + std::to_string(M) + " rows");
  }
}

TEST(Ops, ShapeErrorsNameTheOperands) {
  try {
    ops::add(Tensor::zeros({2, 3}), Tensor::zeros({4}));
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("[2,3] and [4]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(ops::matmul(Tensor::zeros({2, 3}), Tensor::zeros({4, 5})), Error);
  EXPECT_THROW(ops::linear(Tensor::zeros({2, 3}), Tensor::zeros({5, 4})), Error);
}

TEST(Ops, Bf16MatmulThroughOneDnnMatchesFp32WithinBf16Rounding) {
  // bf16 inputs are exact in fp32, so the only differences are the bf16 output rounding
  // (relative 2^-8) and accumulation order: compare at 1/128 relative to the scale.
  Tensor a = test::random_tensor({32, 64}, 40).to(DType::BF16), b = test::random_tensor({48, 64}, 41).to(DType::BF16);
  Tensor ref = ops::matmul(a.to(DType::F32), b.to(DType::F32), false, true);
  Tensor got = ops::matmul(a, b, false, true);
  EXPECT_EQ(got.dtype(), DType::BF16);
  test::Diff d = test::compare(got.to(DType::F32), ref);
  EXPECT_LT(d.max_abs, d.ref_scale / 128) << d.max_abs << " vs scale " << d.ref_scale;
}

TEST(Ops, Bf16MatmulOfStridedAndBroadcastOperandsIsTheDenseMatmul) {
  // oneDNN's matmul primitive (every bf16 GEMM) took any view's strides as they were: a
  // column-strided slice, a broadcast row (stride 0), a view whose rows overlap. Each is
  // copied dense first, as fp32's sgemm path does, and gives the dense operand's product.
  Tensor wide = test::random_tensor({24, 64}, 42).to(DType::BF16);
  Tensor row = test::random_tensor({1, 32}, 43).to(DType::BF16);
  Tensor b = test::random_tensor({32, 16}, 44).to(DType::BF16);
  const std::vector<std::pair<std::string, Tensor>> views = {
      {"every other column", wide.slice(1, 0, 64, 2)},
      {"a broadcast row", row.expand({24, 32})},
      {"overlapping rows", make_view(wide, {24, 32}, {1, 1}, 0)}};
  for (const auto& [what, a] : views) {
    Tensor got = ops::matmul(a, b);
    Tensor want = ops::matmul(a.contiguous(), b);
    ASSERT_EQ(got.dtype(), DType::BF16) << what;
    EXPECT_EQ(test::compare(got.to(DType::F32), want.to(DType::F32)).max_abs, 0.0) << what;
  }
  // A single row or column whose other stride is anything (0, or larger than the matrix):
  // dense in the sense that matters, but its strides are not a row-major matrix's.
  Tensor col = test::random_tensor({32, 1}, 45).to(DType::BF16);
  const std::vector<std::tuple<std::string, Tensor, Tensor>> degenerate = {
      {"one row, row stride 0", make_view(row, {1, 32}, {0, 1}, 0), b},
      {"one row, row stride 1000", make_view(wide, {1, 32}, {1000, 1}, 0), b},
      {"one column of a wide matrix", wide.slice(1, 0, 1), make_view(row, {1, 32}, {0, 1}, 0)},
      {"B one column, column stride 0", test::random_tensor({8, 32}, 46).to(DType::BF16), make_view(col, {32, 1}, {1, 0}, 0)},
      {"B one column, column stride 7", test::random_tensor({8, 32}, 47).to(DType::BF16), make_view(col, {32, 1}, {1, 7}, 0)}};
  for (const auto& [what, a, bb] : degenerate) {
    Tensor got = ops::matmul(a, bb);
    Tensor want = ops::matmul(a.contiguous(), bb.contiguous());
    EXPECT_EQ(test::compare(got.to(DType::F32), want.to(DType::F32)).max_abs, 0.0) << what;
  }
}

TEST(Ops, LinearBf16IsAnFp32LinearOfBf16RoundedOperands) {
  // The exact math: y = bf16(x) bf16(W)^T + b, dx = bf16(dy) bf16(W), dW = bf16(dy)^T bf16(x),
  // db = sum dy, with fp32 accumulation. The reference computes it in fp64 from the same
  // rounded operands, so the only difference is fp32 accumulation over K <= 48 products of
  // magnitude <= 1: |err| <= K * 2^-24 * K ~ 1.4e-4.
  Tensor x = test::random_tensor({2, 3, 64}, 60).to(DType::F32).transpose(0, 1);  // a strided input
  Tensor w = test::random_tensor({48, 64}, 61).to(DType::F32), b = test::random_tensor({48}, 62).to(DType::F32);
  for (Tensor* t : {&x, &w, &b}) t->set_requires_grad(true);
  Tensor w_bf16 = w.detach().to(DType::BF16);
  Tensor y = ops::linear_bf16(x, w, w_bf16, b);
  ASSERT_EQ(y.dtype(), DType::F32);
  ASSERT_EQ(y.shape(), (Shape{3, 2, 48}));
  Tensor dy = test::random_tensor({3, 2, 48}, 63).to(DType::F32);
  autograd::backward({y}, {dy});

  auto rounded = [](const Tensor& t) { return t.detach().to(DType::BF16).to(DType::F64); };
  Tensor xr = rounded(x).reshape({6, 64}), wr = rounded(w), dyr = rounded(dy).reshape({6, 48});
  Tensor y_ref = ops::add(ops::matmul(xr, wr, false, true), b.detach().to(DType::F64));
  expect_close(y.reshape({6, 48}), y_ref, 0, 1.5e-4, "y");
  expect_close(x.grad().reshape({6, 64}), ops::matmul(dyr, wr), 0, 1.5e-4, "dx");
  expect_close(w.grad(), ops::matmul(dyr, xr, true, false), 0, 1.5e-4, "dW");
  expect_close(b.grad(), ops::sum(dy.to(DType::F64).reshape({6, 48}), {0}), 0, 1e-5, "db");
  EXPECT_EQ(w.grad().dtype(), DType::F32);
  EXPECT_FALSE(w_bf16.grad().defined()) << "gradients flow to the fp32 weight, never to its copy";
  // And the rounding is real: the fp32 linear differs by far more than the tolerance.
  test::Diff d = test::compare(ops::linear(x.detach(), w.detach(), b.detach()).reshape({6, 48}), y_ref);
  EXPECT_GT(d.max_abs, 1e-3);
  // Mismatched dtypes are refused, naming what was expected.
  try {
    ops::linear_bf16(x, w, w.detach(), b);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("bfloat16 weight copy"), std::string::npos) << e.what();
  }
}

namespace {
// Causal attention and its gradients by the definition, in fp64, one query row at a time:
// the reference for the blocked kernel on shapes that span many tiles.
struct AttentionReference {
  std::vector<double> out, dq, dk, dv;
};
AttentionReference attention_by_definition(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout) {
  const int64_t B = q.shape()[0], Tq = q.shape()[1], H = q.shape()[2], D = q.shape()[3], Tk = k.shape()[1],
                KV = k.shape()[2], offset = Tk - Tq;
  auto Q = q.to_vector<double>(), K = k.to_vector<double>(), V = v.to_vector<double>(), dO = dout.to_vector<double>();
  AttentionReference r{std::vector<double>(Q.size()), std::vector<double>(Q.size()), std::vector<double>(K.size()),
                       std::vector<double>(V.size())};
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  auto qi = [&](int64_t b, int64_t t, int64_t h) { return ((b * Tq + t) * H + h) * D; };
  auto ki = [&](int64_t b, int64_t t, int64_t h) { return ((b * Tk + t) * KV + h) * D; };
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < Tq; ++t) {
        const int64_t kvh = h / (H / KV), n = t + offset + 1;
        std::vector<double> p(static_cast<size_t>(n));
        double mx = -1e300, sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t d = 0; d < D; ++d) s += Q[qi(b, t, h) + d] * K[ki(b, j, kvh) + d];
          mx = std::max(mx, p[j] = s * scale);
        }
        for (double& x : p) sum += (x = std::exp(x - mx));
        for (double& x : p) x /= sum;
        double delta = 0;
        for (int64_t d = 0; d < D; ++d) {
          double o = 0;
          for (int64_t j = 0; j < n; ++j) o += p[j] * V[ki(b, j, kvh) + d];
          r.out[qi(b, t, h) + d] = o;
          delta += o * dO[qi(b, t, h) + d];
        }
        for (int64_t j = 0; j < n; ++j) {
          double dp = 0;
          for (int64_t d = 0; d < D; ++d) dp += dO[qi(b, t, h) + d] * V[ki(b, j, kvh) + d];
          const double ds = p[j] * (dp - delta) * scale;
          for (int64_t d = 0; d < D; ++d) {
            r.dq[qi(b, t, h) + d] += ds * K[ki(b, j, kvh) + d];
            r.dk[ki(b, j, kvh) + d] += ds * Q[qi(b, t, h) + d];
            r.dv[ki(b, j, kvh) + d] += p[j] * dO[qi(b, t, h) + d];
          }
        }
      }
  return r;
}
}  // namespace

TEST(Ops, BlockedAttentionMatchesTheDefinitionAcrossManyTiles) {
  // Keys span several tiles, the last one partial: 300 keys are two 256-key backward tiles,
  // 1100 keys three 512-key forward tiles (so forward's online softmax rescales) and five
  // backward ones. GQA (4 query heads over 2 kv heads); and query blocks shorter than the
  // keys (decoding with a cache), whose tiles start mid-sequence. fp32 against fp64: scores
  // of 16-dim dot products and sums over at most 1100 keys, so 2e-5 absolute on outputs
  // and gradients of magnitude ~1 is a few hundred fp32 ulps of headroom, while a masking
  // or rescaling error shows at 1e-2.
  struct Case {
    int64_t Tq, Tk;
  };
  for (const Case c : {Case{300, 300}, Case{130, 300}, Case{1, 257}, Case{600, 1100}}) {
    const int64_t B = 2, H = 4, KV = 2, D = 16;
    Tensor q = test::random_tensor({B, c.Tq, H, D}, 70).to(DType::F32);
    Tensor k = test::random_tensor({B, c.Tk, KV, D}, 71).to(DType::F32);
    Tensor v = test::random_tensor({B, c.Tk, KV, D}, 72).to(DType::F32);
    Tensor dout = test::random_tensor({B, c.Tq, H, D}, 73).to(DType::F32);
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
    Tensor out = ops::causal_attention(q, k, v);
    autograd::backward({out}, {dout});
    const AttentionReference r = attention_by_definition(q.detach(), k.detach(), v.detach(), dout);
    const std::string tag = "Tq " + std::to_string(c.Tq) + " Tk " + std::to_string(c.Tk);
    expect_close(out, Tensor::from_vector(r.out, out.shape()), 0, 2e-5, tag + " out");
    expect_close(q.grad(), Tensor::from_vector(r.dq, q.shape()), 0, 2e-5, tag + " dq");
    expect_close(k.grad(), Tensor::from_vector(r.dk, k.shape()), 0, 2e-5, tag + " dk");
    expect_close(v.grad(), Tensor::from_vector(r.dv, v.shape()), 0, 2e-5, tag + " dv");
  }
}

TEST(Ops, Bf16AttentionIsTheDefinitionOverBf16RoundedOperands) {
  // Mixed precision's attention: q, k, v rounded to bf16, tile products with bf16 operands
  // and fp32 accumulation, P and dS rounded to bf16 for the products they feed, the output
  // rounded to bf16 once (so its gradient dO is bf16 too), D = dO . o from that output.
  // Against the fp64 definition over the bf16-rounded q, k, v (and dO), what remains is
  // the rounding of P, dS and the output, 2^-9 relative per entry, summed over keys or
  // queries: each result's largest error stays within 1e-2 of its largest value (2.5 bf16
  // ulps; measured at most 3.5e-3, dK's, with q scaled by 3 so the softmax is far from
  // uniform). A masking or rescaling error is of the order of the values; and the
  // fp32 kernel on the unrounded inputs differs from this reference by more than 1e-3 of
  // its largest output (measured 2.9e-3 to 3.4e-3), so the rounding of q, k, v is real;
  // each result also differs from the reference by more than 1e-5 of its largest value
  // (fp32 accumulation alone would be ~1e-6), so P, dS and dO are rounded too. Shapes as in the fp32 test: several key tiles (the last partial),
  // GQA, query blocks shorter than the keys; k and v are strided slices of one fused
  // projection (q a scaled copy of its slice).
  struct Case {
    int64_t Tq, Tk;
  };
  for (const Case c : {Case{300, 300}, Case{130, 300}, Case{1, 257}, Case{600, 1100}}) {
    const int64_t B = 2, H = 4, KV = 2, D = 16;
    Tensor qkv = test::random_tensor({B, c.Tk, H + 2 * KV, D}, 74).to(DType::F32);
    Tensor q = ops::scale(qkv.slice(2, 0, H).slice(1, c.Tk - c.Tq, c.Tk), 3.0).detach();
    Tensor k = qkv.slice(2, H, H + KV), v = qkv.slice(2, H + KV, H + 2 * KV);
    Tensor dout = test::random_tensor({B, c.Tq, H, D}, 75).to(DType::F32);
    ASSERT_FALSE(k.is_contiguous());
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
    Tensor out = ops::causal_attention_bf16(q, k, v);
    ASSERT_EQ(out.dtype(), DType::BF16);
    autograd::backward({out}, {dout.to(DType::BF16)});
    auto rounded = [](const Tensor& t) { return t.detach().to(DType::BF16).to(DType::F64); };
    const AttentionReference r = attention_by_definition(rounded(q), rounded(k), rounded(v), rounded(dout));
    const std::string tag = "Tq " + std::to_string(c.Tq) + " Tk " + std::to_string(c.Tk);
    const std::vector<std::pair<const char*, test::Diff>> diffs = {
        {"out", test::compare(out, Tensor::from_vector(r.out, out.shape()))},
        {"dq", test::compare(q.grad(), Tensor::from_vector(r.dq, q.shape()))},
        {"dk", test::compare(k.grad(), Tensor::from_vector(r.dk, k.shape()))},
        {"dv", test::compare(v.grad(), Tensor::from_vector(r.dv, v.shape()))}};
    for (const auto& [name, d] : diffs) {
      std::printf("%s %s: largest error %.2g, largest value %.2g\n", tag.c_str(), name, d.max_abs, d.ref_scale);
      EXPECT_LE(d.max_abs, 1e-2 * d.ref_scale) << tag << " " << name;
      EXPECT_GE(d.max_abs, 1e-5 * d.ref_scale) << tag << " " << name << ": no bf16 rounding of P, dS or dO?";
    }
    for (Tensor* t : {&q, &k, &v}) EXPECT_EQ(t->grad().dtype(), DType::F32) << tag;
    if (c.Tq > 1) {
      const test::Diff fp32 = test::compare(ops::causal_attention(q.detach(), k.detach(), v.detach()),
                                            Tensor::from_vector(r.out, out.shape()));
      EXPECT_GT(fp32.max_abs, 1e-3 * fp32.ref_scale) << tag << ": the fp32 kernel should differ from the rounded reference";
    }
  }
  // Softmax is shift-invariant, so a query that sees one key has dq = 0 and gives that key
  // dk = 0 (dS = P (dP - D) with P = 1 and D = dO . o = dO . v = dP). Under bf16 that
  // holds only if D is made from the same rounded dO as dP; with D from the fp32 dO (as
  // once) dq of the first query was 3.7e-3 of dq's scale at T = 256. Only fp32 summation
  // order is left: 1e-5 of the largest gradient. T = 1: dq and dk; T = 256: the first
  // query's dq (its key gets dk from the later queries too).
  for (const int64_t T : {1, 256}) {
    const int64_t B = 2, H = 2, D = 64;
    Tensor q = test::random_tensor({B, T, H, D}, 77).to(DType::F32), k = test::random_tensor({B, T, H, D}, 78).to(DType::F32);
    Tensor v = test::random_tensor({B, T, H, D}, 79).to(DType::F32);
    for (Tensor* t : {&q, &k, &v}) t->set_requires_grad(true);
    Tensor out = ops::causal_attention_bf16(q, k, v);
    autograd::backward({out}, {test::random_tensor({B, T, H, D}, 80).to(DType::BF16)});
    auto largest_at = [&](const Tensor& g, bool first_position_only) {
      std::vector<float> all = g.to_vector<float>();
      float m = 0;
      for (size_t i = 0; i < all.size(); ++i)
        if (!first_position_only || (static_cast<int64_t>(i) / (H * D)) % T == 0) m = std::max(m, std::abs(all[i]));
      return m;
    };
    const float dq_scale = largest_at(q.grad(), false), dk_scale = largest_at(k.grad(), false);
    // At T = 1 every dq is 0 by the same invariance, and may come out exactly 0 (the ASan
    // build on an AMX machine summed D and dP in the same order); at T = 256 the later
    // queries' dq are what the first query's is compared with, so they must not be 0.
    if (T > 1) {
      EXPECT_GT(dq_scale, 0.f);
    }
    EXPECT_LE(largest_at(q.grad(), true), 1e-5 * (T == 1 ? 1.0 : dq_scale)) << "T " << T << ": dq of the first query";
    if (T == 1) {
      EXPECT_LE(dk_scale, 1e-5) << "T 1: dk";
    }
  }
  // bf16 inputs to the fp32 op are refused with the dtypes named.
  Tensor qb = test::random_tensor({1, 4, 2, 8}, 76).to(DType::BF16);
  try {
    ops::causal_attention(qb, qb, qb);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("causal_attention_bf16"), std::string::npos) << e.what();
  }
}

// Attention never holds a (B, H, T, T) tensor: the bytes its forward and backward add to
// the ledger's peak (outputs, saved statistics, bf16 operand copies, gradients) are
// proportional to T, exactly, from 256 to 2048 tokens, and at 2048 less than a sixteenth of
// what one fp32 score matrix would take. Causal, on q, k, v sliced from a fused (B, T, 3C)
// projection as the models call it; fp32 and mixed precision.
TEST(Ops, AttentionMemoryIsLinearInTheSequenceLength) {
  const int64_t B = 1, H = 4, D = 16, C = H * D;
  auto& ledger = runtime::ledger();
  for (const bool bf16 : {false, true}) {
    std::vector<int64_t> growth;
    const std::vector<int64_t> lengths = {256, 512, 1024, 2048};
    for (const int64_t T : lengths) {
      Tensor qkv = test::random_tensor({B, T, 3 * C}, 90).to(DType::F32);
      qkv.set_requires_grad(true);
      Tensor dout = test::random_tensor({B, T, H, D}, 91).to(bf16 ? DType::BF16 : DType::F32);
      const int64_t before = ledger.stats().allocated;
      ledger.reset_peaks();
      {
        std::vector<Tensor> parts = ops::split(qkv, {C, C, C}, 2);
        Tensor q = parts[0].view({B, T, H, D}), k = parts[1].view({B, T, H, D}), v = parts[2].view({B, T, H, D});
        Tensor out = bf16 ? ops::causal_attention_bf16(q, k, v) : ops::causal_attention(q, k, v);
        autograd::backward({out}, {dout});
      }
      qkv.discard_grad();
      growth.push_back(ledger.stats().peak_allocated - before);
    }
    const std::string tag = bf16 ? "bf16" : "fp32";
    ASSERT_GT(growth[0], 0) << tag;
    for (size_t i = 1; i < lengths.size(); ++i)
      EXPECT_EQ(growth[i] * lengths[0], growth[0] * lengths[i]) << tag << ": T " << lengths[i] << " added " << growth[i]
                                                               << " bytes, T " << lengths[0] << " " << growth[0];
    const int64_t T = lengths.back();
    EXPECT_LT(growth.back(), B * H * T * T * 4 / 16) << tag;
  }
}

TEST(Ops, ChunkedLinearCrossEntropyEqualsTheHeadThenTheLoss) {
  // The same math as cross_entropy(linear(x, W)), only in chunks of rows: the chunks change
  // nothing but GEMM blocking, so fp32 results agree to accumulation order (1e-6 on values
  // of order 1). Under bf16 both sides round the logits to bf16 (the head's bf16 output). Chunks of 1 row, a size that leaves a partial last chunk, all rows and
  // more; a padded vocabulary (13 of 16 columns valid) and an ignored target (-1).
  const int64_t N = 10, C = 24, Vp = 16, V = 13;
  std::vector<int32_t> t = {0, 5, 12, -1, 3, 3, 7, 11, 1, 2};
  Tensor targets = Tensor::from_vector(t, {N});
  for (bool bf16 : {false, true})
    for (int64_t chunk : {1, 3, 10, 64}) {
      Tensor x = test::random_tensor({N, C}, 80).to(DType::F32), w = test::random_tensor({Vp, C}, 81).to(DType::F32);
      Tensor x2 = x.clone(), w2 = w.clone();
      for (Tensor* p : {&x, &w, &x2, &w2}) p->set_requires_grad(true);
      Tensor w_bf16 = w.detach().to(DType::BF16);
      Tensor expected = ops::cross_entropy(
          bf16 ? ops::linear_bf16(x2, w2, w_bf16, Tensor(), DType::BF16) : ops::linear(x2, w2), targets, V);
      Tensor got = ops::linear_cross_entropy(x, w, targets, V, chunk, bf16 ? w_bf16 : Tensor());
      const std::string tag = std::string(bf16 ? "bf16" : "fp32") + " chunk " + std::to_string(chunk);
      EXPECT_NEAR(got.item(), expected.item(), 1e-6) << tag;
      ops::scale(got, 0.5).backward();
      ops::scale(expected, 0.5).backward();
      expect_close(x.grad(), x2.grad(), 0, 1e-6, tag + " dx");
      expect_close(w.grad(), w2.grad(), 0, 1e-6, tag + " dW");
    }
}

TEST(Ops, CrossEntropyOfBf16LogitsIsTheFp32MathOnTheirValues) {
  // bf16 logits (mixed precision's head) are read as their exact fp32 values and the math
  // runs in fp32: the loss equals fp32's on the widened logits to summation order (1e-6),
  // and the gradient, bf16 like the logits, is fp32's rounded once: equal exactly. Padded
  // columns (13 of 16 valid) get 0, an ignored row (-1) all 0.
  const int64_t N = 6, Vp = 16, V = 13;
  Tensor targets = Tensor::from_vector(std::vector<int32_t>{0, 12, -1, 7, 3, 3}, {N});
  Tensor logits = ops::scale(test::random_tensor({N, Vp}, 95).to(DType::F32), 4.0).to(DType::BF16);
  Tensor wide = logits.to(DType::F32);
  logits.set_requires_grad(true);
  wide.set_requires_grad(true);
  Tensor got = ops::cross_entropy(logits, targets, V), want = ops::cross_entropy(wide, targets, V);
  EXPECT_EQ(got.dtype(), DType::F32);
  EXPECT_NEAR(got.item(), want.item(), 1e-6);
  ops::scale(got, 0.5).backward();
  ops::scale(want, 0.5).backward();
  ASSERT_EQ(logits.grad().dtype(), DType::BF16);
  expect_close(logits.grad().to(DType::F32), wide.grad().to(DType::BF16).to(DType::F32), 0, 0, "dlogits");
  EXPECT_NE(logits.grad().to(DType::F32).to_vector<float>()[0], 0.f);
}

TEST(Ops, CrossEntropyOverManyVocabularyBlocksWithAMaskedPrefix) {
  // The loss's kernels walk the vocabulary in blocks of 1024 (an online softmax). 2500 valid
  // columns of 2560 span three blocks, the last partial; row 1's first 1100 logits are -inf
  // (a masked prefix: a whole block of -inf once made the running sum NaN); row 2's target
  // sits in the last block; row 3 is ignored (-1). The logits are made by an op, so the
  // loss owns them alone and writes their gradient in place. Against fp64 by definition
  // over the same (under bf16, rounded) values: the loss to 1e-6 relative, each gradient
  // element to 1e-6 of the largest (fp32 sums of 2500 terms), or under bf16 to one bf16
  // ulp of it (the gradient is rounded to bf16 once).
  const int64_t N = 4, Vp = 2560, V = 2500;
  const std::vector<int32_t> t = {17, 1500, 2400, -1};
  const std::vector<float> base = ops::scale(test::random_tensor({N, Vp}, 93).to(DType::F32), 3.0).to_vector<float>();
  for (DType dt : {DType::F32, DType::BF16}) {
    std::vector<float> values = base;
    for (int64_t j = 0; j < 1100; ++j) values[static_cast<size_t>(Vp + j)] = -std::numeric_limits<float>::infinity();
    Tensor x = Tensor::from_vector(values, {N, Vp});
    x.set_requires_grad(true);
    Tensor logits = dt == DType::F32 ? ops::scale(x, 1.0) : x.to(DType::BF16);
    const std::vector<float> seen = logits.detach().to(DType::F32).to_vector<float>();  // rounded under bf16
    Tensor loss = ops::cross_entropy(logits, Tensor::from_vector(t, {N}), V);
    logits = Tensor();
    // By definition, in fp64.
    double want_loss = 0, largest = 0;
    std::vector<double> want_grad(static_cast<size_t>(N * Vp), 0.0);
    for (int64_t n = 0; n < 3; ++n) {
      const float* row = seen.data() + n * Vp;
      double m = -std::numeric_limits<double>::infinity(), s = 0;
      for (int64_t j = 0; j < V; ++j) m = std::max(m, static_cast<double>(row[j]));
      for (int64_t j = 0; j < V; ++j) s += std::exp(static_cast<double>(row[j]) - m);
      want_loss += (m + std::log(s) - row[t[static_cast<size_t>(n)]]) / 3;
      for (int64_t j = 0; j < V; ++j)
        want_grad[static_cast<size_t>(n * Vp + j)] = (std::exp(row[j] - m) / s - (j == t[static_cast<size_t>(n)])) / 3;
    }
    for (double g : want_grad) largest = std::max(largest, std::abs(g));
    const std::string tag = dtype_name(dt);
    ASSERT_TRUE(std::isfinite(loss.item())) << tag;
    EXPECT_NEAR(loss.item(), want_loss, 1e-6 * want_loss) << tag;
    loss.backward();
    const std::vector<float> got = x.grad().to_vector<float>();
    for (size_t i = 0; i < got.size(); ++i) {
      const double tol = dt == DType::F32 ? 1e-6 * largest : std::abs(want_grad[i]) / 128 + 1e-12;
      ASSERT_NEAR(got[i], want_grad[i], tol) << tag << " row " << i / Vp << " column " << i % Vp;
    }
  }
}

TEST(Ops, Bf16TensorsAddAndTheirGradientsSum) {
  // Elementwise arithmetic on bf16 tensors runs in fp32 and rounds once. The engine sums
  // two gradients of one tensor with the same kernel: under --dtype bf16 the logits are
  // bf16, and a loss that reaches them twice (the cross-entropy, and a term on the logits
  // the model returns) needs bf16 gradients summed.
  Tensor x = test::random_tensor({4, 5}, 99).to(DType::BF16);
  x.set_requires_grad(true);
  Tensor y = ops::add(x, x);
  ASSERT_EQ(y.dtype(), DType::BF16);
  expect_close(y.to(DType::F32), ops::scale(x.detach().to(DType::F32), 2.0), 0, 0, "x + x (doubling is exact)");
  y.backward(Tensor::full({4, 5}, 0.375).to(DType::BF16));
  ASSERT_EQ(x.grad().dtype(), DType::BF16);
  expect_close(x.grad().to(DType::F32), Tensor::full({4, 5}, 0.75).to(DType::F32), 0, 0, "the two gradients summed");
}

TEST(Ops, Bf16LinearWithABf16OutputRoundsTheFp32ResultAndTakesABf16Gradient) {
  // out = BF16: the same GEMM (bf16 operands, fp32 accumulation) with its result rounded
  // once, so within half a bf16 ulp (at most 2^-8 relative) of the fp32 output, plus one ulp for
  // another blocking of the sum. Backward takes the bf16 gradient as its GEMM operand: dx
  // and dW equal the fp32-output linear's given that same gradient (its rounding is then
  // the identity), to accumulation order.
  Tensor x = test::random_tensor({5, 24}, 96).to(DType::F32), w = test::random_tensor({16, 24}, 97).to(DType::F32);
  Tensor x2 = x.clone(), w2 = w.clone();
  for (Tensor* p : {&x, &w, &x2, &w2}) p->set_requires_grad(true);
  Tensor w_bf16 = w.detach().to(DType::BF16);
  Tensor y = ops::linear_bf16(x, w, w_bf16, Tensor(), DType::BF16), y32 = ops::linear_bf16(x2, w2, w_bf16);
  ASSERT_EQ(y.dtype(), DType::BF16);
  const std::vector<float> a = y.to(DType::F32).to_vector<float>(), b = y32.to_vector<float>();
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], std::abs(b[i]) * (1.0 / 512 + 1.0 / 256) + 1e-7) << i;
  Tensor g = test::random_tensor({5, 16}, 98).to(DType::BF16);
  y.backward(g);
  y32.backward(g.to(DType::F32));
  expect_close(x.grad(), x2.grad(), 0, 1e-6, "dx");
  expect_close(w.grad(), w2.grad(), 0, 1e-6, "dW");
  // With a bias (the MLP's first projection under --dtype bf16): the bias is added to the
  // fp32 accumulator before the one rounding, and its gradient sums the bf16 gradient's
  // values in fp32.
  Tensor bias = test::random_tensor({16}, 95).to(DType::F32), bias2 = bias.clone();
  Tensor x3 = x.detach().clone(), w3 = w.detach().clone(), x4 = x3.clone(), w4 = w3.clone();
  for (Tensor* p : {&bias, &bias2, &x3, &w3, &x4, &w4}) p->set_requires_grad(true);
  Tensor yb = ops::linear_bf16(x3, w3, w_bf16, bias, DType::BF16), yb32 = ops::linear_bf16(x4, w4, w_bf16, bias2);
  ASSERT_EQ(yb.dtype(), DType::BF16);
  const std::vector<float> yc = yb.to(DType::F32).to_vector<float>(), yd = yb32.to_vector<float>();
  for (size_t i = 0; i < yc.size(); ++i) EXPECT_NEAR(yc[i], yd[i], std::abs(yd[i]) * (1.0 / 512 + 1.0 / 256) + 1e-7) << i;
  yb.backward(g);
  yb32.backward(g.to(DType::F32));
  expect_close(bias.grad(), bias2.grad(), 0, 1e-6, "db from a bf16 gradient");
  EXPECT_EQ(bias.grad().dtype(), DType::F32);
  expect_close(x3.grad(), x4.grad(), 0, 1e-6, "dx with a bias");
}

TEST(Ops, Bf16LinearTakesABf16InputAsItIsAndGivesItABf16Gradient) {
  // A bf16 input (the MLP's GELU output under --dtype bf16) is the GEMM's operand as it is,
  // with no rounded copy: the output equals the fp32 input's path on the same values (their
  // rounding to bf16 is the identity), and the saved operand is the input itself. Its
  // gradient is bf16, as every gradient has its tensor's dtype: the fp32 path's dx rounded
  // once (half an ulp: bf16 keeps 8 significant bits, so at most 2^-8 relative), plus
  // accumulation order.
  Tensor x = test::random_tensor({6, 40}, 92).to(DType::BF16), w = test::random_tensor({24, 40}, 93).to(DType::F32);
  Tensor b = test::random_tensor({24}, 94).to(DType::F32);
  Tensor x2 = x.to(DType::F32), w2 = w.clone(), b2 = b.clone();
  for (Tensor* p : {&x, &w, &b, &x2, &w2, &b2}) p->set_requires_grad(true);
  Tensor w_bf16 = w.detach().to(DType::BF16);
  Tensor y = ops::linear_bf16(x, w, w_bf16, b), y2 = ops::linear_bf16(x2, w2, w_bf16, b2);
  ASSERT_EQ(y.dtype(), DType::F32);
  expect_close(y, y2, 0, 1e-6, "y");
  Tensor dy = test::random_tensor({6, 24}, 89).to(DType::F32);
  y.backward(dy);
  y2.backward(dy);
  ASSERT_EQ(x.grad().dtype(), DType::BF16);
  const std::vector<float> got = x.grad().to(DType::F32).to_vector<float>(), want = x2.grad().to_vector<float>();
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], want[i], std::abs(want[i]) * (1.0 / 256 + 1.0 / 4096) + 1e-7) << i;
  expect_close(w.grad(), w2.grad(), 0, 1e-6, "dW");
  expect_close(b.grad(), b2.grad(), 0, 1e-6, "db");
}

TEST(Ops, GeluIsZeroFarLeftAndTheIdentityFarRightWithFiniteGradients) {
  // Far left, down to -1e13 (whose cube overflows fp32), the value and slope are 0 to any
  // tolerance and never NaN (a logistic form with a capped exponent left sigma ~1e-35
  // there, which the slope's v^3 made 3900); far right the value is v and the slope 1.
  // At |v| = 1e20 and beyond, 1 - t^2 is 0 while the slope's 1 + 0.134 v^2 overflows to
  // inf: the slope's second term must be 0 there, not 0 * inf = NaN.
  const std::vector<double> v = {-3e38, -1e20, -1e13, -1e4, -50, -9.5, 9.5, 50, 1e4, 1e13, 1e20, 3e38};
  const int64_t n = static_cast<int64_t>(v.size());
  for (DType dtype : {DType::F32, DType::BF16}) {
    Tensor x = Tensor::from_vector(v, {n}).to(dtype);
    x.set_requires_grad(true);
    Tensor y = ops::gelu(x);
    y.backward(Tensor::ones({n}, dtype));
    const std::vector<float> got = y.to(DType::F32).to_vector<float>(), slope = x.grad().to(DType::F32).to_vector<float>();
    const std::vector<float> xs = x.detach().to(DType::F32).to_vector<float>();
    for (size_t i = 0; i < v.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i]) && std::isfinite(slope[i])) << v[i] << " " << dtype_name(dtype);
      if (v[i] < 0) {
        EXPECT_LT(std::abs(got[i]), 1e-30) << v[i];  // -9.5 sigma(2u) ~ 1e-32, and 0 beyond
        EXPECT_LT(std::abs(slope[i]), 1e-28) << v[i];
      } else {
        EXPECT_NEAR(got[i], xs[i], std::abs(xs[i]) * 1e-6) << v[i];
        EXPECT_NEAR(slope[i], 1.0, 1e-2) << v[i];
      }
    }
  }
}

TEST(Ops, SwiGluIsZeroFarLeftAndTheGateFarRightWithFiniteGradients) {
  // silu(g) = g sigmoid(g): far left the value and both slopes are 0, far right the value
  // is g u. vexp stops at 88.38 (2.4e38, finite), so g / (1 + vexp(-g)) was g / 2.4e38
  // there: silu(-1e38) read -0.42 and silu(-3e38) -1.25, growing with |g|, and so did the
  // slopes. 20 copies of each value: the vector loop and its tail alike.
  const std::vector<double> values = {-3e38, -1e38, -1e30, -1e4, -100, -89, 89, 1e4, 1e30};
  std::vector<double> gate;
  for (double v : values) gate.insert(gate.end(), 20, v);
  const int64_t n = static_cast<int64_t>(gate.size());
  for (DType dtype : {DType::F32, DType::BF16}) {
    Tensor g = Tensor::from_vector(gate, {n}).to(dtype), u = Tensor::full({n}, 0.5).to(dtype);
    for (Tensor* t : {&g, &u}) t->set_requires_grad(true);
    Tensor y = ops::swiglu(g, u);
    y.backward(Tensor::ones({n}, dtype));
    const std::vector<float> got = y.to(DType::F32).to_vector<float>(), dg = g.grad().to(DType::F32).to_vector<float>(),
                             du = u.grad().to(DType::F32).to_vector<float>();
    const std::vector<float> gs = g.detach().to(DType::F32).to_vector<float>();
    for (size_t i = 0; i < gate.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i]) && std::isfinite(dg[i]) && std::isfinite(du[i])) << gate[i] << " " << dtype_name(dtype);
      if (gate[i] < 0) {  // |g| e^g: 89 e^-89 = 2e-37 at most, 0 in fp32 beyond
        EXPECT_LT(std::abs(got[i]), 1e-30) << gate[i] << " " << dtype_name(dtype);
        EXPECT_LT(std::abs(dg[i]), 1e-30) << gate[i] << " " << dtype_name(dtype);
        EXPECT_LT(std::abs(du[i]), 1e-30) << gate[i] << " " << dtype_name(dtype);
      } else {
        EXPECT_NEAR(got[i], 0.5 * gs[i], 0.5 * gs[i] * 1e-2) << gate[i];  // bf16 rounds the product
        EXPECT_NEAR(dg[i], 0.5, 1e-2) << gate[i];
        EXPECT_NEAR(du[i], gs[i], gs[i] * 1e-2) << gate[i];
      }
    }
  }
}

TEST(Ops, NormsOfAnInputWithoutGradientStillGiveTheirParametersGradients) {
  // A norm over an input that needs no gradient (a frozen embedding's output, or data):
  // only the weight and bias get gradients. layernorm's backward dispatched on dx, which
  // is then undefined, and crashed. db is the sum of the rows of g, dw that of g x-hat
  // (RMSNorm: g x rstd), against the same op with the input's gradient taken too.
  Tensor x = test::random_tensor({5, 8}, 93).to(DType::F32), g = test::random_tensor({5, 8}, 94).to(DType::F32);
  for (bool rms : {false, true}) {
    auto run = [&](bool input_grad) {
      Tensor w = test::random_tensor({8}, 95).to(DType::F32), b = test::random_tensor({8}, 96).to(DType::F32);
      w.set_requires_grad(true);
      b.set_requires_grad(true);
      Tensor xi = x.detach();
      xi.set_requires_grad(input_grad);
      Tensor y = rms ? ops::rmsnorm(xi, w, 1e-5) : ops::layernorm(xi, w, b, 1e-5);
      y.backward(g);
      EXPECT_EQ(xi.grad().defined(), input_grad);
      return std::make_pair(w.grad(), rms ? Tensor() : b.grad());
    };
    const auto [dw, db] = run(false);
    const auto [dw_ref, db_ref] = run(true);
    expect_close(dw, dw_ref, 0, 0, rms ? "rmsnorm dw" : "layernorm dw");
    if (!rms) expect_close(db, db_ref, 0, 0, "layernorm db");
  }
}

TEST(Ops, NormsOverNoFeaturesAndMismatchedBiasesFailInForwardNamingTheOp) {
  // A norm over zero features divided the element count by 0 (SIGFPE); a linear with a
  // bias of another dtype than its weight ran forward (converting the bias) and failed
  // only in backward, whose bias gradient has the output's dtype. PyTorch refuses it too.
  auto expect_error = [](const std::function<void()>& f, const std::string& part) {
    try {
      f();
      ADD_FAILURE() << "no error, expected one naming " << part;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
    }
  };
  Tensor empty_rows = Tensor::zeros({4, 0}), none = Tensor::zeros({0});
  expect_error([&] { ops::layernorm(empty_rows, none, none, 1e-5); }, "layernorm: input float32[4,0] has no features");
  expect_error([&] { ops::rmsnorm(empty_rows, none, 1e-5); }, "rmsnorm: input float32[4,0] has no features");
  Tensor x = test::random_tensor({2, 3}, 97).to(DType::F32), w = test::random_tensor({4, 3}, 98).to(DType::F32);
  expect_error([&] { ops::linear(x, w, test::random_tensor({4}, 99)); }, "linear: bias");
}

TEST(Ops, Bf16BiasGradientOverManyRowsSumsInFp32) {
  // A bf16 output's bias gradient at a training size (96 x 1024 values: sum_into's threaded
  // row-block path) is the fp32 sum of the bf16 gradient's values: against fp64, fp32's
  // rounding of a 96-term sum of values below 4 (~1e-5).
  Tensor x = test::random_tensor({96, 32}, 84).to(DType::F32), w = test::random_tensor({1024, 32}, 85).to(DType::F32);
  Tensor b = Tensor::zeros({1024});
  b.set_requires_grad(true);
  Tensor y = ops::linear_bf16(x, w, w.to(DType::BF16), b, DType::BF16);
  Tensor g = ops::scale(test::random_tensor({96, 1024}, 86), 4.0).to(DType::BF16);
  y.backward(g);
  ASSERT_EQ(b.grad().dtype(), DType::F32);
  expect_close(b.grad().to(DType::F64), ops::sum(g.to(DType::F64), {0}), 0, 1e-5, "db");
}

namespace {
// A bf16 result of fp32 math rounded once, against fp64 on the same bf16 inputs: half a
// bf16 ulp (at most 2^-8 relative) plus fp32's own error (~1e-6), value by value.
void expect_bf16_rounded_once(const Tensor& got_bf16, const Tensor& want64, const char* what) {
  ASSERT_EQ(got_bf16.dtype(), DType::BF16) << what;
  const std::vector<float> got = got_bf16.to(DType::F32).to_vector<float>();
  const std::vector<double> want = want64.detach().to_vector<double>();
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], std::abs(want[i]) / 256 + 2e-6) << what << " " << i;
}
}  // namespace

TEST(Ops, GeluOfBf16IsTheFp32MathRoundedOnce) {
  // Under --dtype bf16 GPT-2's MLP runs GELU on its bf16 projection, as autocast does: each
  // value is read as fp32, the tanh form computed in fp32 and rounded once to bf16, and so
  // is the gradient (dout * gelu'(x)). Against fp64 on the same bf16 values: half a bf16 ulp
  // (at most 2^-8 relative) plus fp32's own error in the tanh form (~1e-6).
  // 3 x 20000 values: the threaded path and many 512-value blocks, one of them partial.
  Tensor x = ops::scale(test::random_tensor({3, 20000}, 88), 4.0).to(DType::BF16);  // through GELU's bend
  x.set_requires_grad(true);
  Tensor y = ops::gelu(x);
  ASSERT_EQ(y.dtype(), DType::BF16);
  Tensor x64 = x.detach().to(DType::F64);
  x64.set_requires_grad(true);
  Tensor y64 = ops::gelu(x64);
  expect_bf16_rounded_once(y, y64, "out");
  Tensor g = test::random_tensor({3, 20000}, 87).to(DType::BF16);
  y.backward(g);
  y64.backward(g.to(DType::F64));
  expect_bf16_rounded_once(x.grad(), x64.grad(), "dx");
  // And the rounding is real: some outputs are not their fp32 values.
  Tensor y32 = ops::gelu(x.detach().to(DType::F32));
  EXPECT_GT(test::compare(y.to(DType::F32), y32).max_abs, 1e-4);
}

TEST(Ops, GeluOfFp32IsWithinTheTanhFormsFp32ErrorOfFp64) {
  // fp32 GELU against fp64 on the same values. tanh as 1 - 2 / (exp(2|u|) + 1) carries an
  // absolute error of a few 1e-8 (fp32's ulp of 1, exp's 2 ulp), so the value 0.5 v (1 + t)
  // is off by ~|v| 3e-8 plus its own rounding, and the slope's 0.5 v (1 - t^2) s (1 + 0.134
  // v^2) by ~|v| (1 + 0.134 v^2) 6e-8: bounded here by 2e-7 (1 + |v|) and 4e-7 (1 + |v|^3),
  // 4 to 8 times the worst seen (an eighth of both bounds fails on thousands of values).
  // Every length from 1 to 40 (a vector loop's partial tails) and 60017 values (the
  // threaded path).
  std::vector<int64_t> lengths;
  for (int64_t n = 1; n <= 40; ++n) lengths.push_back(n);
  lengths.push_back(60017);
  for (int64_t n : lengths) {
    Tensor x = ops::scale(test::random_tensor({n}, 90 + n), 4.0);  // through GELU's bend
    x.set_requires_grad(true);
    Tensor y = ops::gelu(x);
    Tensor x64 = x.detach().to(DType::F64);
    x64.set_requires_grad(true);
    Tensor y64 = ops::gelu(x64);
    Tensor g = test::random_tensor({n}, 89);
    y.backward(g);
    y64.backward(g.to(DType::F64));
    const std::vector<float> xs = x.detach().to_vector<float>(), got = y.to_vector<float>();
    const std::vector<float> gs = g.to_vector<float>(), dx = x.grad().to_vector<float>();
    const std::vector<double> want = y64.detach().to_vector<double>(), want_dx = x64.grad().to_vector<double>();
    for (int64_t i = 0; i < n; ++i) {
      const double v = std::abs(xs[i]);
      ASSERT_NEAR(got[i], want[i], 2e-7 * (1 + v)) << "n " << n << " x " << xs[i];
      // dx = g gelu'(x): gelu's slope error scaled by |g|, and dx's own rounding.
      ASSERT_NEAR(dx[i], want_dx[i], 4e-7 * (1 + v * v * v) * std::abs(gs[i]) + 6e-8 * std::abs(want_dx[i]))
          << "n " << n << " x " << xs[i];
    }
  }
}

TEST(Ops, SwiGluOfBf16IsTheFp32MathRoundedOnce) {
  // Under --dtype bf16 LLaMA's MLP runs SwiGLU on its bf16 gate and up projections, as
  // autocast does: read as fp32, silu(g) u computed in fp32 and rounded once to bf16, and
  // so are both gradients (dout u s (1 + g (1 - s)) and dout g s). Against fp64 on the same
  // bf16 values: half a bf16 ulp (2^-8 relative at most) plus fp32's own error (~1e-6).
  // 3 x 20000 values: the threaded path and many 512-value blocks, one of them partial.
  Tensor gate = ops::scale(test::random_tensor({3, 20000}, 100), 6.0).to(DType::BF16);  // through silu's bend
  Tensor up = ops::scale(test::random_tensor({3, 20000}, 101), 2.0).to(DType::BF16);
  for (Tensor* t : {&gate, &up}) t->set_requires_grad(true);
  Tensor y = ops::swiglu(gate, up);
  ASSERT_EQ(y.dtype(), DType::BF16);
  Tensor gate64 = gate.detach().to(DType::F64), up64 = up.detach().to(DType::F64);
  for (Tensor* t : {&gate64, &up64}) t->set_requires_grad(true);
  Tensor y64 = ops::swiglu(gate64, up64);
  expect_bf16_rounded_once(y, y64, "out");
  Tensor g = test::random_tensor({3, 20000}, 102).to(DType::BF16);
  y.backward(g);
  y64.backward(g.to(DType::F64));
  expect_bf16_rounded_once(gate.grad(), gate64.grad(), "dgate");
  expect_bf16_rounded_once(up.grad(), up64.grad(), "dup");
  // And the rounding is real: some outputs are not their fp32 values.
  Tensor y32 = ops::swiglu(gate.detach().to(DType::F32), up.detach().to(DType::F32));
  EXPECT_GT(test::compare(y.to(DType::F32), y32).max_abs, 1e-4);
}

TEST(Ops, EmptyRowsAndFeaturesGiveZeroGradientsNotGarbageOrACrash) {
  // No rows (an empty batch): the fused head's weight gradient was an uninitialized buffer
  // that no chunk wrote (its loop never ran). No input features: the rows were counted as
  // numel / in_features, a division by zero. Both are sums over nothing: zero.
  for (bool bf16 : {false, true}) {
    Tensor x = Tensor::zeros({0, 4}), w = test::random_tensor({8, 4}, 90).to(DType::F32);
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    Tensor loss = ops::linear_cross_entropy(x, w, Tensor::from_vector(std::vector<int32_t>{}, {0}), 8, 4,
                                            bf16 ? w.detach().to(DType::BF16) : Tensor());
    loss.backward();
    expect_close(w.grad(), Tensor::zeros({8, 4}), 0, 0, bf16 ? "bf16 dW" : "fp32 dW");
  }
  for (bool bf16 : {false, true}) {
    Tensor x = Tensor::zeros({2, 0}), w = Tensor::zeros({3, 0}), b = test::random_tensor({3}, 91).to(DType::F32);
    for (Tensor* p : {&x, &w, &b}) p->set_requires_grad(true);
    Tensor y = bf16 ? ops::linear_bf16(x, w, w.detach().to(DType::BF16), b) : ops::linear(x, w, b);
    ASSERT_EQ(y.shape(), (Shape{2, 3}));
    expect_close(y, ops::add(Tensor::zeros({2, 3}), b.detach()), 0, 0, "y = b");
    ops::sum(y).backward();
    expect_close(b.grad(), Tensor::full({3}, 2.0).to(DType::F32), 0, 0, "db");
    EXPECT_EQ(x.grad().numel(), 0);
  }
}

TEST(Ops, CrossEntropyWithRetainedGraphGivesTheSameGradientTwice) {
  // The in-place gradient reuse of the logits must not happen when the graph is retained.
  Tensor logits = test::random_tensor({4, 7}, 50);
  logits.set_requires_grad(true);
  Tensor targets = Tensor::from_vector<int64_t>({1, 2, 3, 4}, {4});
  Tensor loss = ops::cross_entropy(ops::scale(logits, 1.0), targets);
  loss.backward({}, true);
  Tensor first = logits.grad().clone();
  logits.zero_grad();
  loss.backward();
  test::expect_close(logits.grad(), first, 0, 0, "second backward");
}

TEST(Ops, GatherRejectsAnIndexLargerThanTheInput) {
  Tensor x = test::random_tensor({2, 3}, 51);
  Tensor index = Tensor::zeros({3, 1}, DType::I64);  // 3 rows > 2
  EXPECT_THROW(ops::gather(x, 1, index), Error);
}
