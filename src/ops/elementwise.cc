// Differentiable elementwise ops and reductions.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "ops/op_common.h"

namespace tally::ops {

using detail::materialize;
using detail::new_output;
using detail::on;

namespace {

struct BinaryFn {
  struct Context : autograd::Context {
    runtime::BinaryOp op;
    Shape a_shape, b_shape;
  };
};


#define TALLY_BINARY_FN(Name, str)                                                         \
  struct Name {                                                                            \
    static constexpr const char* kName = str;                                              \
    using Context = BinaryFn::Context;                                                     \
    static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads);         \
  };
TALLY_BINARY_FN(AddFn, "add")
TALLY_BINARY_FN(SubFn, "sub")
TALLY_BINARY_FN(MulFn, "mul")
TALLY_BINARY_FN(DivFn, "div")
#undef TALLY_BINARY_FN

std::vector<Tensor> AddFn::backward(Context& ctx, std::vector<Tensor>& grads) {
  const Tensor& g = grads[0];
  return {ctx.needs_input_grad(0) ? sum_to(g, ctx.a_shape) : Tensor(),
          ctx.needs_input_grad(1) ? sum_to(g, ctx.b_shape) : Tensor()};
}
std::vector<Tensor> SubFn::backward(Context& ctx, std::vector<Tensor>& grads) {
  const Tensor& g = grads[0];
  return {ctx.needs_input_grad(0) ? sum_to(g, ctx.a_shape) : Tensor(),
          ctx.needs_input_grad(1) ? neg(sum_to(g, ctx.b_shape)) : Tensor()};
}
// d(a*b) = g*b, g*a
std::vector<Tensor> MulFn::backward(Context& ctx, std::vector<Tensor>& grads) {
  const Tensor& g = grads[0];
  Tensor a = ctx.saved(0), b = ctx.saved(1);
  return {ctx.needs_input_grad(0) ? sum_to(mul(g, b), ctx.a_shape) : Tensor(),
          ctx.needs_input_grad(1) ? sum_to(mul(g, a), ctx.b_shape) : Tensor()};
}
// d(a/b) = g/b, -g*a/b^2
std::vector<Tensor> DivFn::backward(Context& ctx, std::vector<Tensor>& grads) {
  const Tensor& g = grads[0];
  Tensor a = ctx.saved(0), b = ctx.saved(1);
  Tensor ga = div(g, b);
  return {ctx.needs_input_grad(0) ? sum_to(ga, ctx.a_shape) : Tensor(),
          ctx.needs_input_grad(1) ? neg(sum_to(div(mul(ga, a), b), ctx.b_shape)) : Tensor()};
}

template <class Fn> Tensor binary_op(runtime::BinaryOp op, const Tensor& a, const Tensor& b, bool save_inputs) {
  detail::require_same_device(Fn::kName, {&a, &b});
  detail::require_same_dtype(Fn::kName, a, b);
  Shape shape = broadcast_shapes(a.shape(), b.shape(), Fn::kName);
  Tensor out = new_output(shape, a.dtype(), a.device(), Fn::kName);
  on(out).binary(op, out, a, b);
  if (autograd::needs_graph({a, b})) {
    auto ctx = std::make_unique<BinaryFn::Context>();
    ctx->op = op;
    ctx->a_shape = a.shape();
    ctx->b_shape = b.shape();
    if (save_inputs) ctx->save_for_backward({a, b});
    autograd::record<Fn>(std::move(ctx), {a, b}, {out});
  }
  return out;
}

// out = alpha * x + beta; gradient alpha * g.
struct AffineFn {
  static constexpr const char* kName = "affine";
  struct Context : autograd::Context {
    double alpha;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {ctx.alpha == 1.0 ? grads[0] : scale(grads[0], ctx.alpha)};
  }
};

Tensor affine_op(const Tensor& x, double alpha, double beta) {
  detail::require_same_device("scale", {&x});
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "scale");
  on(out).affine(out, x, alpha, beta);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<AffineFn::Context>();
    ctx->alpha = alpha;
    autograd::record<AffineFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) { return binary_op<AddFn>(runtime::BinaryOp::Add, a, b, false); }
Tensor sub(const Tensor& a, const Tensor& b) { return binary_op<SubFn>(runtime::BinaryOp::Sub, a, b, false); }
Tensor mul(const Tensor& a, const Tensor& b) { return binary_op<MulFn>(runtime::BinaryOp::Mul, a, b, true); }
Tensor div(const Tensor& a, const Tensor& b) { return binary_op<DivFn>(runtime::BinaryOp::Div, a, b, true); }
Tensor scale(const Tensor& x, double factor) { return affine_op(x, factor, 0.0); }
Tensor add_scalar(const Tensor& x, double value) { return affine_op(x, 1.0, value); }
Tensor neg(const Tensor& x) { return affine_op(x, -1.0, 0.0); }
Tensor clone(const Tensor& x) { return affine_op(x, 1.0, 0.0); }

void add_(const Tensor& dst, const Tensor& src) {
  detail::require_same_device("add_", {&dst, &src});
  on(dst).add_inplace(dst, src);
}

// ---------------------------------------------------------------- reductions

namespace {
std::vector<int64_t> normalize_dims(std::vector<int64_t> dims, int64_t ndim) {
  for (int64_t& d : dims) d = wrap_dim(d, ndim);
  std::sort(dims.begin(), dims.end());
  dims.erase(std::unique(dims.begin(), dims.end()), dims.end());
  return dims;
}

Shape keepdim_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape s = shape;
  for (int64_t d : dims) s[d] = 1;
  return s;
}

Shape dropdim_shape(const Shape& shape, const std::vector<int64_t>& dims) {
  Shape s;
  for (int64_t d = 0; d < static_cast<int64_t>(shape.size()); ++d)
    if (!std::binary_search(dims.begin(), dims.end(), d)) s.push_back(shape[d]);
  return s;
}

// sum over dims: gradient broadcasts g back over the reduced dims, times `factor`
// (1 for sum, 1/count for mean).
struct SumFn {
  static constexpr const char* kName = "sum";
  struct Context : autograd::Context {
    Shape input_shape, keep_shape;
    double factor;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = materialize(grads[0]).view(ctx.keep_shape);
    Tensor out = Tensor::empty(ctx.input_shape, g.dtype(), g.device(), current_owner("sum_backward"));
    on(out).affine(out, g, ctx.factor, 0.0);
    return {out};
  }
};

Tensor reduce_sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim, double factor, const char* name) {
  detail::require_same_device(name, {&x});
  dims = normalize_dims(std::move(dims), x.dim());
  Shape keep = keepdim_shape(x.shape(), dims);
  Tensor out = new_output(keep, x.dtype(), x.device(), name);
  on(out).sum_into(out, x);
  if (factor != 1.0) on(out).affine(out, out, factor, 0.0);
  if (!keepdim) out = make_view(out, dropdim_shape(x.shape(), dims), contiguous_strides(dropdim_shape(x.shape(), dims)), 0);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<SumFn::Context>();
    ctx->input_shape = x.shape();
    ctx->keep_shape = keep;
    ctx->factor = factor;
    autograd::record<SumFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

std::vector<int64_t> all_dims(int64_t n) {
  std::vector<int64_t> d(static_cast<size_t>(n));
  std::iota(d.begin(), d.end(), 0);
  return d;
}

struct MaxFn {
  static constexpr const char* kName = "max";
  struct Context : autograd::Context {
    Shape input_shape, keep_shape;
    int64_t dim;
  };
  // The gradient goes to the argmax position (the first one on ties), like torch.max(dim).
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor indices = ctx.saved(0);
    Tensor g = materialize(grads[0]).view(ctx.keep_shape);
    Tensor dx = Tensor::zeros(ctx.input_shape, g.dtype(), g.device());
    on(dx).scatter_add(dx, ctx.dim, indices.view(ctx.keep_shape), g);
    return {dx};
  }
};
}  // namespace

Tensor sum(const Tensor& x) { return reduce_sum(x, all_dims(x.dim()), false, 1.0, "sum"); }
Tensor sum(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  return reduce_sum(x, std::move(dims), keepdim, 1.0, "sum");
}
Tensor mean(const Tensor& x) {
  return reduce_sum(x, all_dims(x.dim()), false, 1.0 / static_cast<double>(std::max<int64_t>(x.numel(), 1)), "mean");
}
Tensor mean(const Tensor& x, std::vector<int64_t> dims, bool keepdim) {
  auto nd = normalize_dims(dims, x.dim());
  int64_t count = 1;
  for (int64_t d : nd) count *= x.shape()[d];
  return reduce_sum(x, nd, keepdim, 1.0 / static_cast<double>(std::max<int64_t>(count, 1)), "mean");
}

Tensor max(const Tensor& x, int64_t dim, bool keepdim) {
  detail::require_same_device("max", {&x});
  dim = wrap_dim(dim, x.dim());
  Shape keep = keepdim_shape(x.shape(), {dim});
  Tensor values = new_output(keep, x.dtype(), x.device(), "max");
  Tensor indices = new_output(keep, DType::I64, x.device(), "max_indices");
  on(values).max_dim(values, indices, x, dim);
  if (!keepdim) values = make_view(values, dropdim_shape(x.shape(), {dim}), contiguous_strides(dropdim_shape(x.shape(), {dim})), 0);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<MaxFn::Context>();
    ctx->input_shape = x.shape();
    ctx->keep_shape = keep;
    ctx->dim = dim;
    ctx->save_for_backward({indices});
    autograd::record<MaxFn>(std::move(ctx), {x}, {values});
  }
  return values;
}

Tensor sum_to(const Tensor& x, const Shape& shape) {
  if (x.shape() == shape) return x;
  const int64_t lead = x.dim() - static_cast<int64_t>(shape.size());
  TALLY_CHECK(lead >= 0, "sum_to: cannot reduce ", x.str(), " to ", shape_str(shape));
  std::vector<int64_t> dims;
  for (int64_t d = 0; d < x.dim(); ++d)
    if (d < lead || (shape[d - lead] == 1 && x.shape()[d] != 1)) dims.push_back(d);
  Tensor s = reduce_sum(x, dims, true, 1.0, "sum_to");
  return reshape(s, shape);
}

Tensor argmax(const Tensor& x) {
  Shape s = x.shape();
  s.back() = 1;
  Tensor out = new_output(s, DType::I64, x.device(), "argmax");
  on(out).argmax_last(out, x);
  s.pop_back();
  return make_view(out, s, contiguous_strides(s), 0);
}

double global_norm(const std::vector<Tensor>& tensors) {
  double total = 0;
  for (const Tensor& t : tensors)
    if (t.defined()) total += on(t).sum_squares(t);
  return std::sqrt(total);
}

}  // namespace tally::ops
