// GEMM layout questions behind choices in runtime/cpu/matmul.cc and attention.cc, measured
// on oneDNN directly (no tally code in the loop), each pair alternating in one process:
//
//   1. A weight gradient dW (M x N) = dy^T x over K tokens, dy stored (K, M): oneDNN's
//      matmul primitive with dy^T as a transposed view, against a dense dy^T (plus the cost
//      of a blocked transpose making it). bf16, as --dtype bf16 runs them.
//   2. The same GEMM accumulating into dW (a sum post-op, how gradients are accumulated)
//      against writing it (beta 0, as a first microbatch could), bf16 and fp32.
//   3. Attention's fp32 tile products at W3 (T = 1024, 12 heads of 64 in the (T, 3C) qkv
//      projection), on one thread as the attention runs them: sgemm against the primitive.
//
//   4. The same weight gradient written (beta 0) by the matmul primitive (dy^T a transposed
//      view) against oneDNN's inner-product backward-weights primitive, which may also write
//      the bias gradient (the sum of dy over tokens) in the same pass. bf16, plain layouts.
//
//   5. A bf16 linear layer's three GEMMs (forward, dx, dW) at W1's and W3's token counts,
//      with the bias and output dtypes of a --dtype bf16 step: the matmul primitive (brgemm)
//      against the inner-product primitives (their gemm:jit in oneDNN 2.6).
//
//   bench_gemm_layouts [reps_scale=1] [sections, e.g. 14]    (OMP_NUM_THREADS=2 for 1 and 2; 3 uses one thread)
#include <oneapi/dnnl/dnnl.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <oneapi/dnnl/dnnl.hpp>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

using dnnl::memory;
using DataType = memory::data_type;

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double median_ms(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2] * 1e3;
}

// Rounds for a GEMM with `rows` output rows: fewer for the head's 50k-row ones.
int rounds_for(int64_t rows, int scale) { return (rows > 10000 ? 6 : 30) * scale; }

// Each of `runs` once to warm up (JIT, first touch), then once per round in order for
// `rounds` rounds, so a neighbour's burst slows them alike; each one's median in ms.
std::vector<double> alternating_medians(int rounds, const std::vector<std::function<void()>>& runs) {
  for (const auto& f : runs) f();
  std::vector<std::vector<double>> seconds(runs.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < runs.size(); ++i) {
      const double t0 = seconds_now();
      runs[i]();
      seconds[i].push_back(seconds_now() - t0);
    }
  std::vector<double> medians;
  for (const auto& t : seconds) medians.push_back(median_ms(t));
  return medians;
}

// A row-major (rows, cols) descriptor, or its transpose read through swapped strides.
memory::desc matrix(int64_t rows, int64_t cols, DataType type, bool transposed, int64_t ld) {
  return memory::desc({rows, cols}, type, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

struct Gemm {
  dnnl::matmul primitive;
  memory::desc a, b, c;
};

Gemm make_gemm(const dnnl::engine& engine, const memory::desc& a, const memory::desc& b, const memory::desc& c,
               float beta) {
  dnnl::primitive_attr attr;
  if (beta != 0.f) {
    dnnl::post_ops post;
    post.append_sum(beta);
    attr.set_post_ops(post);
  }
  return {dnnl::matmul(dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine)), a, b, c};
}

void run(const Gemm& g, const dnnl::engine& engine, dnnl::stream& stream, void* a, void* b, void* c) {
  g.primitive.execute(stream, {{DNNL_ARG_SRC, memory(g.a, engine, a)},
                               {DNNL_ARG_WEIGHTS, memory(g.b, engine, b)},
                               {DNNL_ARG_DST, memory(g.c, engine, c)}});
  stream.wait();
}

struct WeightGradient {
  const char* name;
  int64_t M, N, K;  // dW (M, N), K tokens
};

// GPT-2 124M's projections: W1 (B x T = 256 tokens) and two at W3 (1024).
const std::vector<WeightGradient> kWeightGradients = {
    {"qkv", 2304, 768, 256},           {"attention out", 768, 768, 256}, {"MLP up", 3072, 768, 256},
    {"MLP down", 768, 3072, 256},      {"head", 50304, 768, 256},        {"MLP up (W3)", 3072, 768, 1024},
    {"qkv (W3)", 2304, 768, 1024}};

void transposed_against_dense(const dnnl::engine& engine, dnnl::stream& stream, int scale) {
  std::printf("1. bf16 dW = dy^T x: dy^T as a transposed view | dense dy^T + the transpose making it (ms, median)\n");
  for (const WeightGradient& s : kWeightGradients) {
    std::vector<uint16_t> dy(s.K * s.M, 0x3f80), dy_t(s.M * s.K), x(s.K * s.N, 0x3f80);  // bf16 1.0
    std::vector<float> dw(s.M * s.N, 0.f);
    const memory::desc x_desc = matrix(s.K, s.N, DataType::bf16, false, s.N);
    const memory::desc dw_desc = matrix(s.M, s.N, DataType::f32, false, s.N);
    const Gemm view = make_gemm(engine, matrix(s.M, s.K, DataType::bf16, true, s.M), x_desc, dw_desc, 1.f);
    const Gemm dense = make_gemm(engine, matrix(s.M, s.K, DataType::bf16, false, s.K), x_desc, dw_desc, 1.f);
    auto transpose = [&] {
#pragma omp parallel for collapse(2)
      for (int64_t i0 = 0; i0 < s.M; i0 += 32)
        for (int64_t k0 = 0; k0 < s.K; k0 += 32)
          for (int64_t i = i0; i < std::min(s.M, i0 + 32); ++i)
            for (int64_t k = k0; k < std::min(s.K, k0 + 32); ++k) dy_t[i * s.K + k] = dy[k * s.M + i];
    };
    const std::vector<double> ms =
        alternating_medians(rounds_for(s.M, scale), {[&] { run(view, engine, stream, dy.data(), x.data(), dw.data()); },
                                                     transpose,
                                                     [&] { run(dense, engine, stream, dy_t.data(), x.data(), dw.data()); }});
    std::printf("   %-14s M %5lld N %4lld K %4lld: view %7.3f | dense %7.3f + transpose %6.3f\n", s.name,
                static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), ms[0], ms[2],
                ms[1]);
  }
}

void accumulate_against_write(const dnnl::engine& engine, dnnl::stream& stream, int scale) {
  std::printf("2. dW = dy^T x accumulated (sum post-op) | written (beta 0) (ms, median)\n");
  for (DataType type : {DataType::bf16, DataType::f32}) {
    for (const WeightGradient& s : kWeightGradients) {
      if (type == DataType::f32 && s.K != 256) continue;
      std::vector<float> dy(s.K * s.M, 1.f), x(s.K * s.N, 1.f), dw(s.M * s.N, 0.f);  // big enough for bf16 too
      const memory::desc a = matrix(s.M, s.K, type, true, s.M), b = matrix(s.K, s.N, type, false, s.N);
      const memory::desc c = matrix(s.M, s.N, DataType::f32, false, s.N);
      const Gemm accumulate = make_gemm(engine, a, b, c, 1.f), write = make_gemm(engine, a, b, c, 0.f);
      const std::vector<double> ms =
          alternating_medians(rounds_for(s.M, scale), {[&] { run(accumulate, engine, stream, dy.data(), x.data(), dw.data()); },
                                                       [&] { run(write, engine, stream, dy.data(), x.data(), dw.data()); }});
      std::printf("   %-4s %-14s K %4lld: accumulate %7.3f | write %7.3f (%+.0f%%)\n",
                  type == DataType::bf16 ? "bf16" : "fp32", s.name, static_cast<long long>(s.K), ms[0], ms[1],
                  100.0 * (ms[0] / ms[1] - 1.0));
    }
  }
}

void inner_product_against_matmul(const dnnl::engine& engine, dnnl::stream& stream, int scale) {
  std::printf("4. bf16 dW = dy^T x written: matmul (transposed view) | inner product bwd-weights | with bias (ms, median)\n");
  for (const WeightGradient& s : kWeightGradients) {
    std::vector<uint16_t> dy(s.K * s.M, 0x3f80), x(s.K * s.N, 0x3f80);
    std::vector<float> dw(s.M * s.N, 0.f), db(s.M, 0.f);
    const Gemm view = make_gemm(engine, matrix(s.M, s.K, DataType::bf16, true, s.M),
                                matrix(s.K, s.N, DataType::bf16, false, s.N), matrix(s.M, s.N, DataType::f32, false, s.N),
                                0.f);
    // Inner product: src (tokens, in) = x, diff_dst (tokens, out) = dy, diff_weights (out, in).
    using tag = memory::format_tag;
    const memory::desc src({s.K, s.N}, DataType::bf16, tag::ab), diff_dst({s.K, s.M}, DataType::bf16, tag::ab);
    const memory::desc diff_w({s.M, s.N}, DataType::f32, tag::ab), diff_b({s.M}, DataType::f32, tag::a);
    const memory::desc w_bf16({s.M, s.N}, DataType::bf16, tag::ab);
    const auto forward_hint = dnnl::inner_product_forward::primitive_desc(
        dnnl::inner_product_forward::desc(dnnl::prop_kind::forward_training, src, w_bf16, diff_dst), engine);
    const auto ip_pd = dnnl::inner_product_backward_weights::primitive_desc(
        dnnl::inner_product_backward_weights::desc(src, diff_w, diff_dst), engine, forward_hint);
    const auto ip_bias_pd = dnnl::inner_product_backward_weights::primitive_desc(
        dnnl::inner_product_backward_weights::desc(src, diff_w, diff_b, diff_dst), engine, forward_hint);
    const dnnl::inner_product_backward_weights ip(ip_pd), ip_bias(ip_bias_pd);
    const memory m_src(src, engine, x.data()), m_dy(diff_dst, engine, dy.data()), m_dw(diff_w, engine, dw.data()),
        m_db(diff_b, engine, db.data());
    auto run_ip = [&](bool bias) {
      if (bias)
        ip_bias.execute(stream, {{DNNL_ARG_SRC, m_src}, {DNNL_ARG_DIFF_DST, m_dy}, {DNNL_ARG_DIFF_WEIGHTS, m_dw},
                                 {DNNL_ARG_DIFF_BIAS, m_db}});
      else
        ip.execute(stream, {{DNNL_ARG_SRC, m_src}, {DNNL_ARG_DIFF_DST, m_dy}, {DNNL_ARG_DIFF_WEIGHTS, m_dw}});
      stream.wait();
    };
    const std::vector<double> ms =
        alternating_medians(rounds_for(s.M, scale), {[&] { run(view, engine, stream, dy.data(), x.data(), dw.data()); },
                                                     [&] { run_ip(false); }, [&] { run_ip(true); }});
    std::printf("   %-14s M %5lld N %4lld K %4lld: matmul %7.3f | inner product %7.3f (%s) | with bias %7.3f\n",
                s.name, static_cast<long long>(s.M), static_cast<long long>(s.N), static_cast<long long>(s.K), ms[0],
                ms[1], ip_pd.impl_info_str(), ms[2]);
  }
}

// One step of a linear layer, y (tokens, out) = x (tokens, in) W^T + b with W (out, in), as
// the matmul primitive runs it (brgemm in oneDNN 2.6) and as the inner-product primitives
// do (with plain layouts, 2.6 picks its gemm:jit implementation for them). Each GEMM with
// the bias and output dtypes GPT-2's step under --dtype bf16 gives it: the MLP's hidden
// layer and the head's logits are written in bf16, and so is the MLP down projection's dx
// (GELU's backward takes it); every dW is fp32.
void matmul_against_inner_product(const dnnl::engine& engine, dnnl::stream& stream, int scale) {
  std::printf("5. bf16 linear layers: matmul | inner product (ms, median; GFLOP/s)\n");
  struct Layer {
    const char* name;
    int64_t out, in, tokens;
    bool bias;
    DataType y_type, dx_type;
  };
  const DataType f32 = DataType::f32, bf16 = DataType::bf16;
  const std::vector<Layer> layers = {
      {"qkv", 2304, 768, 256, true, f32, f32},          {"attention out", 768, 768, 256, true, f32, f32},
      {"MLP up", 3072, 768, 256, true, bf16, f32},      {"MLP down", 768, 3072, 256, true, f32, bf16},
      {"head", 50304, 768, 256, false, bf16, f32},      {"qkv (W3)", 2304, 768, 1024, true, f32, f32},
      {"MLP up (W3)", 3072, 768, 1024, true, bf16, f32}, {"MLP down (W3)", 768, 3072, 1024, true, f32, bf16}};
  using tag = memory::format_tag;
  for (const Layer& l : layers) {
    std::vector<uint16_t> x(l.tokens * l.in, 0x3f80), w(l.out * l.in, 0x3f80), dy(l.tokens * l.out, 0x3f80);
    std::vector<float> y(l.tokens * l.out), dx(l.tokens * l.in), dw(l.out * l.in), bias(l.out, 0.5f);
    const memory::desc x_desc({l.tokens, l.in}, bf16, tag::ab), w_desc({l.out, l.in}, bf16, tag::ab);
    const memory::desc dy_desc({l.tokens, l.out}, bf16, tag::ab), y_desc({l.tokens, l.out}, l.y_type, tag::ab);
    const memory::desc dx_desc({l.tokens, l.in}, l.dx_type, tag::ab), dw_desc({l.out, l.in}, f32, tag::ab);
    const memory::desc bias_desc({l.out}, f32, tag::a), bias_row({1, l.out}, f32, tag::ab);
    // matmul forms: y = x W^T (W^T a transposed view) + b, dx = dy W, dW = dy^T x (dy^T a view).
    const memory::desc w_t = matrix(l.in, l.out, bf16, true, l.in);
    const dnnl::matmul forward(l.bias ? dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_desc, w_t, bias_row, y_desc), engine)
                                      : dnnl::matmul::primitive_desc(dnnl::matmul::desc(x_desc, w_t, y_desc), engine));
    const Gemm backward_data = make_gemm(engine, dy_desc, w_desc, dx_desc, 0.f);
    const Gemm backward_weights = make_gemm(engine, matrix(l.out, l.tokens, bf16, true, l.out), x_desc, dw_desc, 0.f);
    using Forward = dnnl::inner_product_forward;
    const auto hint = l.bias ? Forward::primitive_desc(
                                   Forward::desc(dnnl::prop_kind::forward_training, x_desc, w_desc, bias_desc, y_desc), engine)
                             : Forward::primitive_desc(
                                   Forward::desc(dnnl::prop_kind::forward_training, x_desc, w_desc, y_desc), engine);
    const Forward ip_forward(hint);
    const dnnl::inner_product_backward_data ip_data(dnnl::inner_product_backward_data::primitive_desc(
        dnnl::inner_product_backward_data::desc(dx_desc, w_desc, dy_desc), engine, hint));
    const dnnl::inner_product_backward_weights ip_weights(dnnl::inner_product_backward_weights::primitive_desc(
        dnnl::inner_product_backward_weights::desc(x_desc, dw_desc, dy_desc), engine, hint));
    const memory mx(x_desc, engine, x.data()), mw(w_desc, engine, w.data()), mw_t(w_t, engine, w.data()),
        mdy(dy_desc, engine, dy.data()), my(y_desc, engine, y.data()), mdx(dx_desc, engine, dx.data()),
        mdw(dw_desc, engine, dw.data()), mb(bias_desc, engine, bias.data()), mb_row(bias_row, engine, bias.data());
    std::unordered_map<int, memory> matmul_forward_args = {{DNNL_ARG_SRC, mx}, {DNNL_ARG_WEIGHTS, mw_t}, {DNNL_ARG_DST, my}},
                                    ip_forward_args = {{DNNL_ARG_SRC, mx}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DST, my}};
    if (l.bias) matmul_forward_args.emplace(DNNL_ARG_BIAS, mb_row), ip_forward_args.emplace(DNNL_ARG_BIAS, mb);
    std::vector<std::function<void()>> matmuls = {
        [&] {
          forward.execute(stream, matmul_forward_args);
          stream.wait();
        },
        [&] { run(backward_data, engine, stream, dy.data(), w.data(), dx.data()); },
        [&] { run(backward_weights, engine, stream, dy.data(), x.data(), dw.data()); }};
    std::vector<std::function<void()>> inner_products = {
        [&] {
          ip_forward.execute(stream, ip_forward_args);
          stream.wait();
        },
        [&] {
          ip_data.execute(stream, {{DNNL_ARG_DIFF_DST, mdy}, {DNNL_ARG_WEIGHTS, mw}, {DNNL_ARG_DIFF_SRC, mdx}});
          stream.wait();
        },
        [&] {
          ip_weights.execute(stream, {{DNNL_ARG_SRC, mx}, {DNNL_ARG_DIFF_DST, mdy}, {DNNL_ARG_DIFF_WEIGHTS, mdw}});
          stream.wait();
        }};
    const double gflop = 2.0 * l.out * l.in * l.tokens / 1e9;
    const std::string passes[] = {std::string("forward, ") + (l.y_type == bf16 ? "bf16" : "fp32") + " y",
                                  std::string("dx, ") + (l.dx_type == bf16 ? "bf16" : "fp32"), "dW, fp32"};
    for (int pass = 0; pass < 3; ++pass) {
      const std::vector<double> ms = alternating_medians(rounds_for(l.out, scale), {matmuls[pass], inner_products[pass]});
      std::printf("   %-14s %4lld tokens %-16s: matmul %7.3f (%3.0f) | inner product %7.3f (%3.0f)\n", l.name,
                  static_cast<long long>(l.tokens), passes[pass].c_str(), ms[0], gflop / ms[0] * 1e3, ms[1],
                  gflop / ms[1] * 1e3);
    }
  }
}

void attention_tiles(const dnnl::engine& engine, int scale) {
  std::printf("3. attention's fp32 tiles at W3, one thread: sgemm | matmul primitive (us, best of 5 means; GFLOP/s)\n");
  struct Tile {
    const char* name;
    bool ta, tb;
    int64_t m, n, k, lda, ldb, ldc;
    float beta;
  };
  const std::vector<Tile> tiles = {
      {"forward S = Q K^T", false, true, 128, 512, 64, 2304, 2304, 512, 0.f},
      {"forward O += P V", false, false, 128, 64, 512, 512, 2304, 64, 1.f},
      {"backward P = Q K^T", false, true, 128, 256, 64, 2304, 2304, 256, 0.f},
      {"backward dV += P^T dO", true, false, 256, 64, 128, 256, 768, 768, 1.f},
      {"backward dP = dO V^T", false, true, 128, 256, 64, 768, 2304, 256, 0.f},
      {"backward dQ += dS K", false, false, 128, 64, 256, 256, 2304, 768, 1.f},
      {"backward dK += dS^T Q", true, false, 256, 64, 128, 256, 2304, 768, 1.f}};
  const int saved_threads = omp_get_max_threads();
  omp_set_num_threads(1);  // the attention runs each tile on its own thread
  dnnl::stream stream(engine);
  std::vector<float> a(1 << 22, 0.01f), b(1 << 22, 0.02f), c(1 << 22, 0.f);
  for (const Tile& t : tiles) {
    const Gemm primitive = make_gemm(engine, matrix(t.m, t.k, DataType::f32, t.ta, t.lda),
                                     matrix(t.k, t.n, DataType::f32, t.tb, t.ldb),
                                     matrix(t.m, t.n, DataType::f32, false, t.ldc), t.beta);
    std::unordered_map<int, memory> args = {{DNNL_ARG_SRC, memory(primitive.a, engine, a.data())},
                                            {DNNL_ARG_WEIGHTS, memory(primitive.b, engine, b.data())},
                                            {DNNL_ARG_DST, memory(primitive.c, engine, c.data())}};
    auto sgemm = [&] {
      dnnl_sgemm(t.ta ? 'T' : 'N', t.tb ? 'T' : 'N', t.m, t.n, t.k, 1.f, a.data(), t.lda, b.data(), t.ldb, t.beta,
                 c.data(), t.ldc);
    };
    auto matmul = [&] {
      primitive.primitive.execute(stream, args);
      stream.wait();
    };
    sgemm(), matmul();
    double best_sgemm = 1e30, best_primitive = 1e30;
    const int calls = 400 * scale;
    for (int round = 0; round < 5; ++round) {
      const double t0 = seconds_now();
      for (int i = 0; i < calls; ++i) sgemm();
      const double t1 = seconds_now();
      for (int i = 0; i < calls; ++i) matmul();
      best_sgemm = std::min(best_sgemm, (t1 - t0) / calls);
      best_primitive = std::min(best_primitive, (seconds_now() - t1) / calls);
    }
    const double flops = 2.0 * t.m * t.n * t.k;
    std::printf("   %-22s %4lld x %4lld x %4lld: sgemm %6.1f (%3.0f) | primitive %6.1f (%3.0f)\n", t.name,
                static_cast<long long>(t.m), static_cast<long long>(t.n), static_cast<long long>(t.k),
                best_sgemm * 1e6, flops / best_sgemm / 1e9, best_primitive * 1e6, flops / best_primitive / 1e9);
  }
  omp_set_num_threads(saved_threads);
}

}  // namespace

int main(int argc, char** argv) {
  const int scale = argc > 1 ? std::max(1, std::atoi(argv[1])) : 1;
  const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  dnnl::stream stream(engine);
  std::printf("oneDNN %d.%d, %d threads\n", dnnl_version()->major, dnnl_version()->minor, omp_get_max_threads());
  const std::string sections = argc > 2 ? argv[2] : "12345";
  auto wanted = [&](char section) { return sections.find(section) != std::string::npos; };
  if (wanted('1')) transposed_against_dense(engine, stream, scale);
  if (wanted('2')) accumulate_against_write(engine, stream, scale);
  if (wanted('3')) attention_tiles(engine, scale);
  if (wanted('4')) inner_product_against_matmul(engine, stream, scale);
  if (wanted('5')) matmul_against_inner_product(engine, stream, scale);
  return 0;
}
