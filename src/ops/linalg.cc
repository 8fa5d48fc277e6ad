// matmul and linear. Batched matmul flattens batch dims into one GEMM when the right
// operand is a shared 2-D matrix (the common case: activations @ weights).
#include "ops/op_common.h"

namespace tally::ops {

using detail::materialize;
using detail::new_output;
using detail::on;
using detail::to_bf16;

namespace {
// The rows a linear layer maps: the product of every dimension but the last (the features).
// Not numel / features, which divides by zero when a layer has no features.
int64_t leading_rows(const Tensor& t) {
  int64_t rows = 1;
  for (int64_t d = 0; d + 1 < t.dim(); ++d) rows *= t.shape()[d];
  return rows;
}

// out = x @ W^T (+ b in every row): a linear layer's forward GEMM, x (rows, in), W
// (out, in), out (rows, out). The device adds the bias inside the GEMM where it can.
void project(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& out) {
  if (b.defined()) on(x).gemm_bias(x, false, w, true, out, materialize(b));
  else on(x).gemm(x, false, w, true, out, 1.f, 0.f);
}

// 2-D view of batch element i of a (..., R, C) tensor (no graph).
Tensor batch_matrix(const Tensor& t, int64_t i) {
  const int64_t nd = t.dim();
  int64_t offset = t.offset();
  int64_t rem = i;
  for (int64_t d = nd - 3; d >= 0; --d) {
    offset += (rem % t.shape()[d]) * t.strides()[d];
    rem /= t.shape()[d];
  }
  return make_view(t, {t.shape()[nd - 2], t.shape()[nd - 1]}, {t.strides()[nd - 2], t.strides()[nd - 1]}, offset);
}

// Flattens (..., R, C) to (prod, C) when that is a plain view.
bool flatten_rows(const Tensor& t, Tensor* out) {
  if (!t.is_contiguous()) return false;
  const int64_t C = t.shape().back();
  *out = make_view(t, {t.numel() / std::max<int64_t>(C, 1), C}, {C, 1}, t.offset());
  return true;
}

int64_t batch_count(const Tensor& t) {
  int64_t n = 1;
  for (int64_t d = 0; d + 2 < t.dim(); ++d) n *= t.shape()[d];
  return n;
}

// C = op(A) op(B) for the batched operands (b may be 2-D and shared). accumulate: C += ...
void batched_gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c, bool accumulate_over_batch) {
  const float beta0 = 0.f;
  if (b.dim() == 2 && a.dim() > 2 && !ta) {
    Tensor a2, c2;
    if (flatten_rows(a, &a2) && flatten_rows(c, &c2)) {
      on(a2).gemm(a2, false, b, tb, c2, 1.f, beta0);
      return;
    }
  }
  const int64_t n = batch_count(c.dim() >= 3 ? c : a);
  for (int64_t i = 0; i < n; ++i) {
    Tensor ai = a.dim() == 2 ? a : batch_matrix(a, i);
    Tensor bi = b.dim() == 2 ? b : batch_matrix(b, i);
    Tensor ci = c.dim() == 2 ? c : batch_matrix(c, i);
    on(ai).gemm(ai, ta, bi, tb, ci, 1.f, (accumulate_over_batch && i > 0) ? 1.f : beta0);
  }
}

struct MatmulFn {
  static constexpr const char* kName = "matmul";
  struct Context : autograd::Context {
    bool ta, tb;
  };
  // C = op(A) op(B):  dA = G op(B)^T (or op(B) G^T when A is read transposed),
  //                   dB = op(A)^T G (or G^T op(A) when B is read transposed).
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor a = ctx.saved(0), b = ctx.saved(1);
    Tensor g = materialize(grads[0]);
    Tensor da, db;
    if (ctx.needs_input_grad(0)) {
      da = Tensor::empty(a.shape(), a.dtype(), a.device(), current_owner("matmul_da"));
      if (!ctx.ta) batched_gemm(g, false, b, !ctx.tb, da, false);
      else batched_gemm(b, ctx.tb, g, true, da, false);
    }
    if (ctx.needs_input_grad(1)) {
      db = Tensor::empty(b.shape(), b.dtype(), b.device(), current_owner("matmul_db"));
      if (b.dim() == 2 && a.dim() > 2) {
        // Shared right operand: its gradient sums over the batch; one GEMM over flattened rows.
        Tensor a2 = materialize(a), g2;
        a2 = make_view(a2, {a2.numel() / a2.shape().back(), a2.shape().back()}, {a2.shape().back(), 1}, a2.offset());
        g2 = make_view(g, {g.numel() / g.shape().back(), g.shape().back()}, {g.shape().back(), 1}, g.offset());
        TALLY_CHECK(!ctx.ta, "matmul: transposed batched left operand with a shared right operand is not supported");
        if (!ctx.tb) on(a2).gemm(a2, true, g2, false, db);
        else on(g2).gemm(g2, true, a2, false, db);
      } else if (!ctx.tb) {
        batched_gemm(a, !ctx.ta, g, false, db, false);
      } else {
        batched_gemm(g, true, a, ctx.ta, db, false);
      }
    }
    return {da, db};
  }
};

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool ta, bool tb) {
  detail::require_same_device("matmul", {&a, &b});
  detail::require_same_dtype("matmul", a, b);
  TALLY_CHECK(a.dim() >= 2 && b.dim() >= 2, "matmul: operands must have at least 2 dimensions, got ", a.str(), " and ",
              b.str());
  TALLY_CHECK(b.dim() == 2 || b.dim() == a.dim(), "matmul: right operand ", b.str(),
              " must be 2-D or have the same batch dimensions as ", a.str());
  if (b.dim() > 2)
    for (int64_t d = 0; d + 2 < a.dim(); ++d)
      TALLY_CHECK(a.shape()[d] == b.shape()[d], "matmul: batch dimensions differ: ", a.str(), " and ", b.str());
  TALLY_CHECK(!(ta && a.dim() > 2 && b.dim() == 2), "matmul: a transposed batched left operand needs a batched right operand");
  const int64_t M = ta ? a.size(-1) : a.size(-2), K = ta ? a.size(-2) : a.size(-1);
  const int64_t Kb = tb ? b.size(-1) : b.size(-2), N = tb ? b.size(-2) : b.size(-1);
  TALLY_CHECK(K == Kb, "matmul: inner dimensions differ: ", a.str(), ta ? "^T" : "", " @ ", b.str(), tb ? "^T" : "");
  Shape shape(a.shape().begin(), a.shape().end() - 2);
  shape.push_back(M);
  shape.push_back(N);
  Tensor out = new_output(shape, a.dtype(), a.device(), "matmul");
  batched_gemm(a, ta, b, tb, out, false);
  if (autograd::needs_graph({a, b})) {
    auto ctx = std::make_unique<MatmulFn::Context>();
    ctx->ta = ta;
    ctx->tb = tb;
    ctx->save_for_backward({a, b});
    autograd::record<MatmulFn>(std::move(ctx), {a, b}, {out});
  }
  return out;
}

namespace {
// db = the sum over rows of g2 (rows, out), written or added in place to the bias's
// gradient buffer when backward may (then undefined is returned), as linear and
// linear_bf16 both do.
Tensor bias_gradient(const autograd::Context& ctx, const Tensor& g2) {
  const int64_t out_f = g2.shape()[1];
  // A bf16 gradient (a bf16 output's) sums into fp32, the bias's dtype.
  const DType dtype = g2.dtype() == DType::BF16 ? DType::F32 : g2.dtype();
  const autograd::GradSink sink = ctx.grad_sink(2, dtype);
  Tensor db = sink && sink.overwrite ? sink.buffer : Tensor::empty({out_f}, dtype, g2.device(), current_owner("linear_db"));
  on(db).sum_into(make_view(db, {1, out_f}, {out_f, 1}, db.offset()), g2);
  if (!sink) return db;
  if (!sink.overwrite) on(db).add_inplace(sink.buffer, db);
  return Tensor();
}

// y = x W^T + b over the flattened rows of x.
//   dx = g W,  dW = g^T x,  db = sum over rows of g.
struct LinearFn {
  static constexpr const char* kName = "linear";
  using Context = autograd::Context;
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x = ctx.saved(0), w = ctx.saved(1);
    Tensor g = materialize(grads[0]);
    const int64_t out_f = w.shape()[0], in_f = w.shape()[1], rows = leading_rows(g);
    Tensor g2 = make_view(g, {rows, out_f}, {out_f, 1}, g.offset());
    Tensor dx, dw, db;
    if (ctx.needs_input_grad(0)) {
      dx = Tensor::empty(x.shape(), x.dtype(), x.device(), current_owner("linear_dx"));
      on(g2).gemm(g2, false, w, false, make_view(dx, {rows, in_f}, {in_f, 1}, 0));
    }
    if (ctx.needs_input_grad(1)) {
      Tensor x2 = make_view(x, {rows, in_f}, {in_f, 1}, x.offset());
      if (const autograd::GradSink sink = ctx.grad_sink(1, w.dtype())) {
        on(g2).gemm(g2, true, x2, false, sink.buffer, 1.f, sink.beta());  // dW written or accumulated in place
      } else {
        dw = Tensor::empty(w.shape(), w.dtype(), w.device(), current_owner("linear_dw"));
        on(g2).gemm(g2, true, x2, false, dw);
      }
    }
    if (ctx.needs_input_grad(2)) db = bias_gradient(ctx, g2);
    return {dx, dw, db};
  }
};
}  // namespace

Tensor linear(const Tensor& x_in, const Tensor& w, const Tensor& b) {
  detail::require_same_device("linear", {&x_in, &w, &b});
  detail::require_same_dtype("linear", x_in, w);
  TALLY_CHECK(w.dim() == 2, "linear: weight ", w.str(), " must be 2-D (out_features, in_features)");
  TALLY_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w.shape()[1], "linear: input ", x_in.str(), " has ",
              x_in.dim() ? x_in.size(-1) : 0, " features but weight ", w.str(), " expects ", w.shape()[1]);
  TALLY_CHECK(!b.defined() || (b.dim() == 1 && b.shape()[0] == w.shape()[0] && b.dtype() == w.dtype()),
              "linear: bias ", b.str(), " must be (", w.shape()[0], ") of the weight's dtype, ", dtype_name(w.dtype()));
  Tensor x = materialize(x_in);
  const int64_t out_f = w.shape()[0], in_f = w.shape()[1], rows = leading_rows(x);
  Shape shape = x.shape();
  shape.back() = out_f;
  Tensor out = new_output(shape, x.dtype(), x.device(), "linear");
  Tensor out2 = make_view(out, {rows, out_f}, {out_f, 1}, 0);
  Tensor w_c = materialize(w);
  project(make_view(x, {rows, in_f}, {in_f, 1}, x.offset()), w_c, b, out2);
  if (autograd::needs_graph({x_in, w, b})) {
    auto ctx = std::make_unique<LinearFn::Context>();
    ctx->save_for_backward({x, w_c});
    autograd::record<LinearFn>(std::move(ctx), {x_in, w, b}, {out});
  }
  return out;
}

namespace {
// y = x W^T + b with bf16 GEMM operands and fp32 accumulation; y fp32, or bf16 (see ops.h).
//   dx = bf16(g) W_bf16,  dW += bf16(g)^T bf16(x),  db = sum over rows of g (fp32).
// dx has x's dtype: fp32, or bf16 for a bf16 input (the GEMM rounds it as it writes).
struct LinearBf16Fn {
  static constexpr const char* kName = "linear_bf16";
  struct Context : autograd::Context {  // saved: x in bf16, W's bf16 copy
    DType input_dtype = DType::F32;      // x's, and so dx's
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x_bf16 = ctx.saved(0), w_bf16 = ctx.saved(1);
    Tensor g = materialize(grads[0]);
    const int64_t out_f = w_bf16.shape()[0], in_f = w_bf16.shape()[1], rows = leading_rows(g);
    Tensor g2 = make_view(g, {rows, out_f}, {out_f, 1}, g.offset());
    // A bf16 output's gradient is bf16 already (the GEMMs' operand as it is).
    Tensor g_bf16 = !(ctx.needs_input_grad(0) || ctx.needs_input_grad(1)) ? Tensor()
                    : g2.dtype() == DType::BF16                          ? g2
                                                                         : to_bf16(g2, "linear_bf16_dy");
    Tensor dx, dw, db;
    if (ctx.needs_input_grad(0)) {
      dx = Tensor::empty(x_bf16.shape(), ctx.input_dtype, g.device(), current_owner("linear_dx"));
      on(g2).gemm(g_bf16, false, w_bf16, false, make_view(dx, {rows, in_f}, {in_f, 1}, 0));
    }
    if (ctx.needs_input_grad(1)) {
      Tensor x2 = make_view(x_bf16, {rows, in_f}, {in_f, 1}, x_bf16.offset());
      if (const autograd::GradSink sink = ctx.grad_sink(1, DType::F32)) {
        on(g2).gemm(g_bf16, true, x2, false, sink.buffer, 1.f, sink.beta());  // dW written or accumulated in place, in fp32
      } else {
        dw = Tensor::empty({out_f, in_f}, DType::F32, g.device(), current_owner("linear_dw"));
        on(g2).gemm(g_bf16, true, x2, false, dw);
      }
    }
    g_bf16 = Tensor();
    if (ctx.needs_input_grad(2)) db = bias_gradient(ctx, g2);
    return {dx, dw, db};
  }
};
}  // namespace

Tensor linear_bf16(const Tensor& x_in, const Tensor& w, const Tensor& w_bf16, const Tensor& b, DType out_dtype) {
  detail::require_same_device("linear_bf16", {&x_in, &w, &w_bf16, &b});
  TALLY_CHECK((x_in.dtype() == DType::F32 || x_in.dtype() == DType::BF16) && w.dtype() == DType::F32 &&
                  w_bf16.dtype() == DType::BF16 && (!b.defined() || b.dtype() == DType::F32),
              "linear_bf16: expected an fp32 or bf16 input, fp32 weight and bias and a bfloat16 weight copy, got ",
              x_in.str(), ", ", w.str(), ", ", w_bf16.str(), (b.defined() ? ", " + b.str() : std::string()));
  TALLY_CHECK(w.dim() == 2 && w_bf16.shape() == w.shape(), "linear_bf16: weight ", w.str(), " and its copy ",
              w_bf16.str(), " must be the same (out_features, in_features)");
  TALLY_CHECK(x_in.dim() >= 1 && x_in.size(-1) == w.shape()[1], "linear_bf16: input ", x_in.str(), " has ",
              x_in.dim() ? x_in.size(-1) : 0, " features but weight ", w.str(), " expects ", w.shape()[1]);
  TALLY_CHECK(!b.defined() || (b.dim() == 1 && b.shape()[0] == w.shape()[0]), "linear_bf16: bias ", b.str(),
              " must be (", w.shape()[0], ")");
  TALLY_CHECK(out_dtype == DType::F32 || out_dtype == DType::BF16, "linear_bf16: the output must be float32 or ",
              "bfloat16, got ", dtype_name(out_dtype));
  const int64_t out_f = w.shape()[0], in_f = w.shape()[1], rows = leading_rows(x_in);
  // The GEMM's operand: a bf16 input as it is (contiguous), an fp32 one rounded.
  Tensor x_bf16 = x_in.dtype() == DType::BF16 ? materialize(x_in) : to_bf16(x_in, "linear_x_bf16");
  Tensor wb = materialize(w_bf16);
  Shape shape = x_in.shape();
  shape.back() = out_f;
  Tensor out = new_output(shape, out_dtype, x_in.device(), "linear");
  Tensor out2 = make_view(out, {rows, out_f}, {out_f, 1}, 0);
  project(make_view(x_bf16, {rows, in_f}, {in_f, 1}, x_bf16.offset()), wb, b, out2);
  if (autograd::needs_graph({x_in, w, b})) {
    auto ctx = std::make_unique<LinearBf16Fn::Context>();
    ctx->input_dtype = x_in.dtype();
    ctx->save_for_backward({x_bf16, wb});
    autograd::record<LinearBf16Fn>(std::move(ctx), {x_in, w, b}, {out});
  }
  return out;
}

}  // namespace tally::ops
