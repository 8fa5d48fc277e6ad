// View ops (no copy: new geometry over the same storage) and cat/split/gather/dtype
// conversion, each differentiable.
#include <numeric>

#include "ops/op_common.h"

namespace tally::ops {

using detail::materialize;
using detail::new_output;
using detail::on;

namespace {

Shape infer_shape(const Shape& requested, int64_t numel, const Tensor& x) {
  Shape s = requested;
  int64_t known = 1, infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      TALLY_CHECK(infer < 0, "view: more than one -1 in ", shape_str(requested));
      infer = static_cast<int64_t>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TALLY_CHECK(known > 0 && numel % known == 0, "view: cannot infer -1 in ", shape_str(requested), " for ", x.str());
    s[infer] = numel / known;
  }
  TALLY_CHECK(shape_numel(s) == numel, "view: shape ", shape_str(requested), " has ", shape_numel(s),
              " elements but ", x.str(), " has ", numel);
  return s;
}

// Strides for viewing x as `shape` without copying, if possible (PyTorch's rule:
// each group of new dims must map onto a run of old dims that is contiguous in memory).
bool view_strides(const Tensor& x, const Shape& shape, Shape* out) {
  if (x.is_contiguous()) {
    *out = contiguous_strides(shape);
    return true;
  }
  const Shape& os = x.shape();
  const Shape& ost = x.strides();
  Shape st(shape.size());
  int64_t view_d = static_cast<int64_t>(shape.size()) - 1;
  int64_t chunk_base_stride = ost.empty() ? 1 : ost.back();
  int64_t tensor_numel = 1, view_numel = 1;
  for (int64_t d = static_cast<int64_t>(os.size()) - 1; d >= 0; --d) {
    tensor_numel *= os[d];
    if (d == 0 || (os[d - 1] != 1 && ost[d - 1] != tensor_numel * chunk_base_stride)) {
      while (view_d >= 0 && (view_numel < tensor_numel || shape[view_d] == 1)) {
        st[view_d] = view_numel * chunk_base_stride;
        view_numel *= shape[view_d];
        view_d--;
      }
      if (view_numel != tensor_numel) return false;
      if (d > 0) {
        chunk_base_stride = ost[d - 1];
        tensor_numel = 1;
        view_numel = 1;
      }
    }
  }
  if (view_d != -1) return false;
  *out = st;
  return true;
}

// Gradient of any view: reshape the incoming gradient back to the input's shape.
struct ViewFn {
  static constexpr const char* kName = "view";
  struct Context : autograd::Context {
    Shape input_shape;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = materialize(grads[0]);
    return {make_view(g, ctx.input_shape, contiguous_strides(ctx.input_shape), g.offset())};
  }
};

struct PermuteFn {
  static constexpr const char* kName = "permute";
  struct Context : autograd::Context {
    std::vector<int64_t> inverse;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {ops::permute(grads[0], ctx.inverse)};
  }
};

struct SliceFn {
  static constexpr const char* kName = "slice";
  struct Context : autograd::Context {
    Shape input_shape;
    int64_t dim, start, end, step;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor dx = Tensor::zeros(ctx.input_shape, grads[0].dtype(), grads[0].device());
    on(dx).copy(ops::slice(dx, ctx.dim, ctx.start, ctx.end, ctx.step), grads[0]);
    return {dx};
  }
};

struct ExpandFn {
  static constexpr const char* kName = "expand";
  struct Context : autograd::Context {
    Shape input_shape;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {sum_to(grads[0], ctx.input_shape)};
  }
};

struct CopyFn {  // contiguous(): identity gradient
  static constexpr const char* kName = "contiguous";
  using Context = autograd::Context;
  static std::vector<Tensor> backward(Context&, std::vector<Tensor>& grads) { return {grads[0]}; }
};

struct ToDtypeFn {
  static constexpr const char* kName = "to_dtype";
  struct Context : autograd::Context {
    DType input_dtype;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = Tensor::empty(grads[0].shape(), ctx.input_dtype, grads[0].device(), current_owner("to_dtype_grad"));
    on(g).copy(g, grads[0]);
    return {g};
  }
};

struct ToDeviceFn {
  static constexpr const char* kName = "to_device";
  struct Context : autograd::Context {
    Device input_device;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = Tensor::empty(grads[0].shape(), grads[0].dtype(), ctx.input_device, current_owner("to_device_grad"));
    g.copy_(grads[0]);
    return {g};
  }
};

struct CatFn {
  static constexpr const char* kName = "cat";
  struct Context : autograd::Context {
    int64_t dim;
    std::vector<int64_t> sizes;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    std::vector<Tensor> out;
    int64_t offset = 0;
    for (int64_t s : ctx.sizes) {
      out.push_back(ops::slice(grads[0], ctx.dim, offset, offset + s));
      offset += s;
    }
    return out;
  }
};

struct SplitFn {
  static constexpr const char* kName = "split";
  struct Context : autograd::Context {
    Shape input_shape;
    int64_t dim;
    std::vector<int64_t> sizes;
  };
  // The gradient of a split is the cat of the output gradients (zeros where none came).
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    DType dt = DType::F32;
    Device dev = Device::cpu();
    for (const Tensor& g : grads)
      if (g.defined()) dt = g.dtype(), dev = g.device();
    Tensor dx = Tensor::empty(ctx.input_shape, dt, dev, current_owner("split_dx"));
    int64_t offset = 0;
    for (size_t i = 0; i < ctx.sizes.size(); ++i) {
      Tensor part = ops::slice(dx, ctx.dim, offset, offset + ctx.sizes[i]);
      if (grads[i].defined()) on(part).copy(part, grads[i]);
      else on(part).fill(part, 0.0);
      offset += ctx.sizes[i];
    }
    return {dx};
  }
};

struct GatherFn {
  static constexpr const char* kName = "gather";
  struct Context : autograd::Context {
    Shape input_shape;
    int64_t dim;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor index = ctx.saved(0);
    Tensor dx = Tensor::zeros(ctx.input_shape, grads[0].dtype(), grads[0].device());
    on(dx).scatter_add(dx, ctx.dim, index, grads[0]);
    return {dx, Tensor()};
  }
};

Tensor record_view(const Tensor& x, Tensor out) {
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<ViewFn::Context>();
    ctx->input_shape = x.shape();
    autograd::record<ViewFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

}  // namespace

Tensor view(const Tensor& x, const Shape& requested) {
  Shape shape = infer_shape(requested, x.numel(), x);
  Shape strides;
  TALLY_CHECK(view_strides(x, shape, &strides), "view: ", x.str(), " with strides ", shape_str(x.strides()),
              " cannot be viewed as ", shape_str(shape), " without a copy; use reshape()");
  return record_view(x, make_view(x, shape, strides, x.offset()));
}

Tensor reshape(const Tensor& x, const Shape& requested) {
  Shape shape = infer_shape(requested, x.numel(), x);
  Shape strides;
  if (view_strides(x, shape, &strides)) return record_view(x, make_view(x, shape, strides, x.offset()));
  return view(contiguous(x), shape);
}

Tensor permute(const Tensor& x, const std::vector<int64_t>& dims_in) {
  TALLY_CHECK(static_cast<int64_t>(dims_in.size()) == x.dim(), "permute: ", dims_in.size(), " dims for ", x.str());
  std::vector<int64_t> dims(dims_in.size()), inverse(dims_in.size(), -1);
  Shape shape(dims.size()), strides(dims.size());
  for (size_t i = 0; i < dims.size(); ++i) {
    dims[i] = wrap_dim(dims_in[i], x.dim());
    TALLY_CHECK(inverse[dims[i]] < 0, "permute: dimension ", dims[i], " repeated");
    inverse[dims[i]] = static_cast<int64_t>(i);
    shape[i] = x.shape()[dims[i]];
    strides[i] = x.strides()[dims[i]];
  }
  Tensor out = make_view(x, shape, strides, x.offset());
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<PermuteFn::Context>();
    ctx->inverse = inverse;
    autograd::record<PermuteFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor transpose(const Tensor& x, int64_t d0, int64_t d1) {
  std::vector<int64_t> dims(static_cast<size_t>(x.dim()));
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[wrap_dim(d0, x.dim())], dims[wrap_dim(d1, x.dim())]);
  return permute(x, dims);
}

Tensor slice(const Tensor& x, int64_t dim, int64_t start, int64_t end, int64_t step) {
  dim = wrap_dim(dim, x.dim());
  const int64_t n = x.shape()[dim];
  TALLY_CHECK(step > 0, "slice: step must be positive, got ", step);
  if (start < 0) start += n;
  if (end < 0) end += n;
  start = std::clamp<int64_t>(start, 0, n);
  end = std::clamp<int64_t>(end, start, n);
  Shape shape = x.shape(), strides = x.strides();
  shape[dim] = (end - start + step - 1) / step;
  strides[dim] *= step;
  Tensor out = make_view(x, shape, strides, x.offset() + start * x.strides()[dim]);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<SliceFn::Context>();
    ctx->input_shape = x.shape();
    ctx->dim = dim;
    ctx->start = start;
    ctx->end = end;
    ctx->step = step;
    autograd::record<SliceFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor expand(const Tensor& x, const Shape& shape) {
  TALLY_CHECK(static_cast<int64_t>(shape.size()) >= x.dim(), "expand: ", x.str(), " to ", shape_str(shape));
  const int64_t lead = static_cast<int64_t>(shape.size()) - x.dim();
  Shape strides(shape.size(), 0);
  Shape s = shape;
  for (int64_t d = 0; d < x.dim(); ++d) {
    int64_t want = shape[d + lead] == -1 ? x.shape()[d] : shape[d + lead];
    TALLY_CHECK(x.shape()[d] == want || x.shape()[d] == 1, "expand: ", x.str(), " cannot expand to ", shape_str(shape));
    s[d + lead] = want;
    strides[d + lead] = x.shape()[d] == want ? x.strides()[d] : 0;
  }
  Tensor out = make_view(x, s, strides, x.offset());
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<ExpandFn::Context>();
    ctx->input_shape = x.shape();
    autograd::record<ExpandFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor contiguous(const Tensor& x) {
  if (x.is_contiguous()) return x;
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "contiguous");
  on(out).copy(out, x);
  if (autograd::needs_graph({x})) autograd::record<CopyFn>(std::make_unique<CopyFn::Context>(), {x}, {out});
  return out;
}

Tensor to_device(const Tensor& x, Device device) {
  if (x.device() == device) return x;
  Tensor out = new_output(x.shape(), x.dtype(), device, "to_device");
  out.copy_(x);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<ToDeviceFn::Context>();
    ctx->input_device = x.device();
    autograd::record<ToDeviceFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor to_dtype(const Tensor& x, DType dtype) {
  Tensor out = new_output(x.shape(), dtype, x.device(), "to_dtype");
  on(out).copy(out, x);
  if (is_floating(dtype) && autograd::needs_graph({x})) {
    auto ctx = std::make_unique<ToDtypeFn::Context>();
    ctx->input_dtype = x.dtype();
    autograd::record<ToDtypeFn>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  TALLY_CHECK(!tensors.empty(), "cat: no tensors");
  const Tensor& first = tensors[0];
  dim = wrap_dim(dim, first.dim());
  Shape shape = first.shape();
  shape[dim] = 0;
  std::vector<int64_t> sizes;
  for (const Tensor& t : tensors) {
    TALLY_CHECK(t.dim() == first.dim() && t.dtype() == first.dtype(), "cat: ", t.str(), " does not match ", first.str());
    for (int64_t d = 0; d < t.dim(); ++d)
      TALLY_CHECK(d == dim || t.shape()[d] == first.shape()[d], "cat: ", t.str(), " and ", first.str(),
                  " differ outside dimension ", dim);
    shape[dim] += t.shape()[dim];
    sizes.push_back(t.shape()[dim]);
  }
  Tensor out = new_output(shape, first.dtype(), first.device(), "cat");
  int64_t offset = 0;
  {
    autograd::NoGradGuard no_grad;
    for (const Tensor& t : tensors) {
      on(out).copy(ops::slice(out, dim, offset, offset + t.shape()[dim]), t);
      offset += t.shape()[dim];
    }
  }
  if (autograd::needs_graph(tensors)) {
    auto ctx = std::make_unique<CatFn::Context>();
    ctx->dim = dim;
    ctx->sizes = sizes;
    autograd::record<CatFn>(std::move(ctx), tensors, {out});
  }
  return out;
}

std::vector<Tensor> split(const Tensor& x, const std::vector<int64_t>& sizes, int64_t dim) {
  dim = wrap_dim(dim, x.dim());
  int64_t total = std::accumulate(sizes.begin(), sizes.end(), int64_t{0});
  TALLY_CHECK(total == x.shape()[dim], "split: sizes sum to ", total, " but dimension ", dim, " of ", x.str(), " is ",
              x.shape()[dim]);
  std::vector<Tensor> outs;
  int64_t offset = 0;
  for (int64_t s : sizes) {
    Shape shape = x.shape();
    shape[dim] = s;
    outs.push_back(make_view(x, shape, x.strides(), x.offset() + offset * x.strides()[dim]));
    offset += s;
  }
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<SplitFn::Context>();
    ctx->input_shape = x.shape();
    ctx->dim = dim;
    ctx->sizes = sizes;
    autograd::record<SplitFn>(std::move(ctx), {x}, outs);
  }
  return outs;
}

Tensor gather(const Tensor& x, int64_t dim, const Tensor& index) {
  detail::require_same_device("gather", {&x, &index});
  dim = wrap_dim(dim, x.dim());
  TALLY_CHECK(index.dim() == x.dim(), "gather: index ", index.str(), " must have the rank of ", x.str());
  for (int64_t d = 0; d < x.dim(); ++d)
    TALLY_CHECK(d == dim || index.shape()[d] <= x.shape()[d], "gather: index ", index.str(), " is larger than ", x.str(),
                " in dimension ", d);
  Tensor out = new_output(index.shape(), x.dtype(), x.device(), "gather");
  on(out).gather(out, x, dim, index);
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<GatherFn::Context>();
    ctx->input_shape = x.shape();
    ctx->dim = dim;
    ctx->save_for_backward({index});
    autograd::record<GatherFn>(std::move(ctx), {x, index}, {out});
  }
  return out;
}

}  // namespace tally::ops
