// Differentiable neural-network ops: embedding, layernorm, RMSNorm, GELU, SwiGLU, rotary
// embeddings, softmax, causal attention and cross-entropy. The math of each is next to its kernel in ops/cpu.
#include "ops/op_common.h"

namespace tally::ops {

using detail::materialize;
using detail::new_output;
using detail::on;

namespace {

struct EmbeddingFn {
  static constexpr const char* kName = "embedding";
  struct Context : autograd::Context {
    Shape weight_shape;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor indices = ctx.saved(0);
    Tensor g = materialize(grads[0]);
    if (const autograd::GradSink sink = ctx.grad_sink(0, g.dtype())) {
      if (sink.overwrite) sink.buffer.fill_(0.0);  // the scatter adds: rows no token hit must read zero
      on(sink.buffer).embedding_backward(sink.buffer, g, indices);  // scatter-add straight into the leaf's grad
      return {Tensor(), Tensor()};
    }
    Tensor dw = Tensor::zeros(ctx.weight_shape, g.dtype(), g.device());
    on(dw).embedding_backward(dw, g, indices);
    return {dw, Tensor()};
  }
};

struct LayerNormFn {
  static constexpr const char* kName = "layernorm";
  using Context = autograd::Context;  // saved: x, weight, mean, rstd
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x = ctx.saved(0), w = ctx.saved(1), m = ctx.saved(2), r = ctx.saved(3);
    Tensor g = materialize(grads[0]);
    Tensor dx = ctx.needs_input_grad(0) ? Tensor::empty(x.shape(), x.dtype(), x.device(), current_owner("layernorm_dx")) : Tensor();
    Tensor dw = Tensor::empty(w.shape(), w.dtype(), w.device(), current_owner("layernorm_dw"));
    Tensor db = ctx.needs_input_grad(2) ? Tensor::empty(w.shape(), w.dtype(), w.device(), current_owner("layernorm_db")) : Tensor();
    on(g).layernorm_backward(dx, dw, db, g, x, w, m, r);  // (dx is undefined when x needs no gradient)
    return {dx, ctx.needs_input_grad(1) ? dw : Tensor(), db};
  }
};

struct RmsNormFn {
  static constexpr const char* kName = "rmsnorm";
  using Context = autograd::Context;  // saved: x, weight, rstd
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x = ctx.saved(0), w = ctx.saved(1), r = ctx.saved(2);
    Tensor g = materialize(grads[0]);
    Tensor dx = ctx.needs_input_grad(0) ? Tensor::empty(x.shape(), x.dtype(), x.device(), current_owner("rmsnorm_dx")) : Tensor();
    Tensor dw = ctx.needs_input_grad(1) ? Tensor::empty(w.shape(), w.dtype(), w.device(), current_owner("rmsnorm_dw")) : Tensor();
    on(g).rmsnorm_backward(dx, dw, g, x, w, r);
    return {dx, dw};
  }
};

struct SwiGluFn {
  static constexpr const char* kName = "swiglu";
  using Context = autograd::Context;  // saved: gate, up
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor gate = ctx.saved(0), up = ctx.saved(1);
    Tensor dgate = Tensor::empty(gate.shape(), gate.dtype(), gate.device(), current_owner("swiglu_dgate"));
    Tensor dup = Tensor::empty(up.shape(), up.dtype(), up.device(), current_owner("swiglu_dup"));
    on(dgate).swiglu_backward(dgate, dup, materialize(grads[0]), gate, up);
    return {dgate, dup};
  }
};

struct RotaryFn {
  static constexpr const char* kName = "rotary";
  struct Context : autograd::Context {  // saved: inv_freq
    int64_t offset = 0;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor g = materialize(grads[0]);
    Tensor dx = Tensor::empty(g.shape(), g.dtype(), g.device(), current_owner("rotary_dx"));
    on(dx).rotary(dx, g, ctx.saved(0), ctx.offset, /*inverse=*/true);
    return {dx, Tensor()};
  }
};

struct GeluFn {
  static constexpr const char* kName = "gelu";
  using Context = autograd::Context;  // saved: x
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x = ctx.saved(0);
    Tensor dx = Tensor::empty(x.shape(), x.dtype(), x.device(), current_owner("gelu_dx"));
    on(dx).gelu_backward(dx, materialize(grads[0]), x);
    return {dx};
  }
};

struct SoftmaxFn {
  static constexpr const char* kName = "softmax";
  using Context = autograd::Context;  // saved: y (the op's own output, saved without its graph)
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor y = ctx.saved(0);
    Tensor dx = Tensor::empty(y.shape(), y.dtype(), y.device(), current_owner("softmax_dx"));
    on(dx).softmax_backward(dx, materialize(grads[0]), y);
    return {dx};
  }
};

// The attention kernel's forward over q, k, v (as the kernel takes them: fp32, fp64, or
// bf16 copies): the output (B,Tq,H,D) and log-sum-exp (B,H,Tq) in `dtype`.
struct AttentionOutputs {
  Tensor out, lse;
};
AttentionOutputs run_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, DType out_dtype,
                                       DType stats_dtype) {
  const int64_t B = q.shape()[0], T = q.shape()[1], H = q.shape()[2], D = q.shape()[3];
  AttentionOutputs r{new_output({B, T, H, D}, out_dtype, q.device(), "attention"),
                     new_output({B, H, T}, stats_dtype, q.device(), "attention_lse")};
  on(r.out).attention_forward(r.out, r.lse, q, k, v);
  return r;
}

struct AttentionFn {
  static constexpr const char* kName = "causal_attention";
  // saved: q, k, v (fp32, or bf16 copies), then out and lse unless they are recomputed
  struct Context : autograd::Context {
    DType out_dtype;    // the output's and its gradient's (bf16 under mixed precision)
    DType stats_dtype;  // lse's, and the gradients' of q, k, v (the inputs' dtype)
    bool recompute;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor q = ctx.saved(0), k = ctx.saved(1), v = ctx.saved(2);
    // Selective recomputation: the forward again, from the saved q, k, v.
    const AttentionOutputs f = ctx.recompute ? run_attention_forward(q, k, v, ctx.out_dtype, ctx.stats_dtype)
                                             : AttentionOutputs{ctx.saved(3), ctx.saved(4)};
    Tensor dq = Tensor::zeros(q.shape(), ctx.stats_dtype, q.device());
    Tensor dk = Tensor::zeros(k.shape(), ctx.stats_dtype, k.device());
    Tensor dv = Tensor::zeros(v.shape(), ctx.stats_dtype, v.device());
    on(dq).attention_backward(dq, dk, dv, materialize(grads[0]), q, k, v, f.out, f.lse);
    return {dq, dk, dv};
  }
};

struct CrossEntropyFn {
  static constexpr const char* kName = "cross_entropy";
  struct Context : autograd::Context {  // saved: logits, lse, targets
    int64_t valid_vocab;
    int64_t count;  // rows with a target (the mean's denominator)
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor logits = ctx.saved(0), lse = ctx.saved(1), targets = ctx.saved(2);
    const double g = grads[0].item();
    // When this context holds the only reference to the logits (the model dropped its
    // own) and is about to be destroyed, the gradient overwrites them in place: one
    // (N, V) buffer instead of two. With a retained graph the logits will be read again.
    const bool sole_owner =
        ctx.will_release() && logits.storage_ptr().use_count() == 1 && logits.storage().num_views() == 1;
    Tensor dlogits = sole_owner ? logits
                                : Tensor::empty(logits.shape(), logits.dtype(), logits.device(),
                                                current_owner("cross_entropy_dlogits"));
    on(dlogits).cross_entropy_backward(dlogits, logits, lse, targets, ctx.valid_vocab,
                                g / static_cast<double>(std::max<int64_t>(ctx.count, 1)));
    dlogits.storage().bump_version();
    return {dlogits, Tensor()};
  }
};

// The mean of the per-row losses over the rows with a target (>= 0), a scalar owned as
// "loss"; `count` gets that number of rows (backward's denominator). cross_entropy and
// linear_cross_entropy both end so.
// Both are read in their own dtypes: on the CPU that makes no converted copy (which would
// be a tensor of its own, live beside the logits at the loss's moment).
Tensor mean_over_targets(const Tensor& losses, const Tensor& targets, int64_t& count) {
  count = 0;
  auto count_targets = [&](auto tag) {
    for (auto t : targets.to_vector<decltype(tag)>()) count += t >= 0;
  };
  switch (targets.dtype()) {
    case DType::I32: count_targets(int32_t{}); break;
    case DType::I64: count_targets(int64_t{}); break;
    case DType::U16: count = targets.numel(); break;  // unsigned: every row has a target
    default: TALLY_FAIL("cross_entropy: targets must be integers, got ", targets.str());
  }
  double total = 0;
  if (losses.dtype() == DType::F32)
    for (float l : losses.to_vector<float>()) total += l;
  else
    for (double l : losses.to_vector<double>()) total += l;
  Tensor loss = new_output({}, losses.dtype(), losses.device(), "loss");
  loss.fill_(total / static_cast<double>(std::max<int64_t>(count, 1)));
  return loss;
}

// linear_cross_entropy: forward keeps x (or its bf16 copy), W (or its copy), lse and the
// targets. Backward, per chunk c of rows: logits_c = x_c W^T again, turned in place into
// dlogits_c = (g / count) (softmax - onehot), then dx_c = dlogits_c W and dW += dlogits_c^T x_c.
// Under bf16 the logits (and so their gradient) are bf16, as linear_bf16's head writes them.
struct LinearCrossEntropyFn {
  static constexpr const char* kName = "linear_cross_entropy";
  struct Context : autograd::Context {  // saved: x (fp32 or bf16), W (fp32 or bf16), lse, targets
    int64_t valid_vocab;
    int64_t count;
    int64_t chunk_rows;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor x = ctx.saved(0), w = ctx.saved(1), lse = ctx.saved(2), targets = ctx.saved(3);
    const double scale = grads[0].item() / static_cast<double>(std::max<int64_t>(ctx.count, 1));
    const int64_t N = x.shape()[0], C = x.shape()[1], Vp = w.shape()[0], chunk = ctx.chunk_rows;
    Tensor dx, dw;
    if (ctx.needs_input_grad(0)) dx = Tensor::empty({N, C}, DType::F32, x.device(), current_owner("linear_cross_entropy_dx"));
    // dW is written into the weight's gradient buffer (or a new one) by the first chunk
    // when that buffer holds no gradient yet, and accumulated by the others.
    const autograd::GradSink sink = ctx.grad_sink(1, DType::F32);
    bool overwrite = true;
    if (sink) {
      dw = sink.buffer;
      overwrite = sink.overwrite;
    } else if (ctx.needs_input_grad(1)) {
      dw = Tensor::empty({Vp, C}, DType::F32, x.device(), current_owner("linear_cross_entropy_dw"));
    }
    if (dw.defined() && overwrite && N == 0) dw.fill_(0.0);  // no chunk writes it: the sum over no rows
    // Under bf16 the chunk's logits are bf16, as the forward's were, and so is their gradient,
    // written in place: what the two GEMMs take.
    Tensor logits = Tensor::empty({std::min(chunk, N), Vp}, w.dtype(), x.device(), current_owner("linear_cross_entropy_logits"));
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t rows = std::min(chunk, N - r0);
      Tensor x_c = make_view(x, {rows, C}, {C, 1}, x.offset() + r0 * C);
      Tensor l_c = make_view(logits, {rows, Vp}, {Vp, 1}, 0);
      on(x).gemm(x_c, false, w, true, l_c);
      on(x).cross_entropy_backward(l_c, l_c, make_view(lse, {rows}, {1}, r0), make_view(targets, {rows}, {1}, targets.offset() + r0),
                                   ctx.valid_vocab, scale);
      const Tensor& d_c = l_c;  // the chunk now holds its logits' gradient
      if (dx.defined()) on(x).gemm(d_c, false, w, false, make_view(dx, {rows, C}, {C, 1}, r0 * C));
      if (dw.defined()) on(x).gemm(d_c, true, x_c, false, dw, 1.f, r0 == 0 && overwrite ? 0.f : 1.f);
    }
    return {dx, sink ? Tensor() : dw, Tensor()};
  }
};

}  // namespace

Tensor embedding(const Tensor& weight, const Tensor& indices_in) {
  detail::require_same_device("embedding", {&weight, &indices_in});
  TALLY_CHECK(weight.dim() == 2, "embedding: weight ", weight.str(), " must be 2-D (vocab, channels)");
  Tensor w = materialize(weight), indices = materialize(indices_in);
  Shape shape = indices.shape();
  shape.push_back(weight.shape()[1]);
  Tensor out = new_output(shape, weight.dtype(), weight.device(), "embedding");
  on(out).embedding_forward(out, w, indices);
  if (autograd::needs_graph({weight})) {
    auto ctx = std::make_unique<EmbeddingFn::Context>();
    ctx->weight_shape = weight.shape();
    ctx->save_for_backward({indices});
    autograd::record<EmbeddingFn>(std::move(ctx), {weight, indices_in}, {out});
  }
  return out;
}

Tensor layernorm(const Tensor& x_in, const Tensor& weight, const Tensor& bias, double eps) {
  detail::require_same_device("layernorm", {&x_in, &weight, &bias});
  const int64_t C = x_in.dim() ? x_in.size(-1) : 0;
  TALLY_CHECK(C > 0, "layernorm: input ", x_in.str(), " has no features to normalize");
  TALLY_CHECK(weight.defined(), "layernorm: a weight of shape (", C, ") is required");
  TALLY_CHECK(weight.dim() == 1 && weight.shape()[0] == C, "layernorm: weight ", weight.str(), " must be (", C, ") for input ", x_in.str());
  TALLY_CHECK(!bias.defined() || (bias.dim() == 1 && bias.shape()[0] == C), "layernorm: bias ", bias.str(), " must be (", C, ")");
  Tensor x = materialize(x_in);
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "layernorm");
  Tensor mean = new_output(rows, x.dtype(), x.device(), "layernorm_mean");
  Tensor rstd = new_output(rows, x.dtype(), x.device(), "layernorm_rstd");
  on(out).layernorm_forward(out, mean, rstd, x, materialize(weight), materialize(bias), eps);
  if (autograd::needs_graph({x_in, weight, bias})) {
    auto ctx = std::make_unique<LayerNormFn::Context>();
    ctx->save_for_backward({x, materialize(weight), mean, rstd});
    autograd::record<LayerNormFn>(std::move(ctx), {x_in, weight, bias}, {out});
  }
  return out;
}

Tensor rmsnorm(const Tensor& x_in, const Tensor& weight, double eps) {
  detail::require_same_device("rmsnorm", {&x_in, &weight});
  const int64_t C = x_in.dim() ? x_in.size(-1) : 0;
  TALLY_CHECK(C > 0, "rmsnorm: input ", x_in.str(), " has no features to normalize");
  TALLY_CHECK(weight.defined() && weight.dim() == 1 && weight.shape()[0] == C, "rmsnorm: weight ", weight.str(),
              " must be (", C, ") for input ", x_in.str());
  Tensor x = materialize(x_in);
  Shape rows(x.shape().begin(), x.shape().end() - 1);
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "rmsnorm");
  Tensor rstd = new_output(rows, x.dtype(), x.device(), "rmsnorm_rstd");
  on(out).rmsnorm_forward(out, rstd, x, materialize(weight), eps);
  if (autograd::needs_graph({x_in, weight})) {
    auto ctx = std::make_unique<RmsNormFn::Context>();
    ctx->save_for_backward({x, materialize(weight), rstd});
    autograd::record<RmsNormFn>(std::move(ctx), {x_in, weight}, {out});
  }
  return out;
}

Tensor swiglu(const Tensor& gate_in, const Tensor& up_in) {
  detail::require_same_device("swiglu", {&gate_in, &up_in});
  TALLY_CHECK(gate_in.shape() == up_in.shape() && gate_in.dtype() == up_in.dtype(), "swiglu: gate ", gate_in.str(),
              " and up ", up_in.str(), " must have one shape and dtype");
  Tensor gate = materialize(gate_in), up = materialize(up_in);
  Tensor out = new_output(gate.shape(), gate.dtype(), gate.device(), "swiglu");
  on(out).swiglu_forward(out, gate, up);
  if (autograd::needs_graph({gate_in, up_in})) {
    auto ctx = std::make_unique<SwiGluFn::Context>();
    ctx->save_for_backward({gate, up});
    autograd::record<SwiGluFn>(std::move(ctx), {gate_in, up_in}, {out});
  }
  return out;
}

Tensor rotary(const Tensor& x_in, const Tensor& inv_freq_in, int64_t offset) {
  detail::require_same_device("rotary", {&x_in, &inv_freq_in});
  TALLY_CHECK(x_in.dim() == 4 && x_in.shape()[3] % 2 == 0, "rotary: x ", x_in.str(), " must be (B,T,heads,D) with D even");
  TALLY_CHECK(inv_freq_in.dim() == 1 && inv_freq_in.shape()[0] == x_in.shape()[3] / 2 && inv_freq_in.dtype() == x_in.dtype(),
              "rotary: inv_freq ", inv_freq_in.str(), " must be (", x_in.shape()[3] / 2, ") of ", dtype_name(x_in.dtype()));
  TALLY_CHECK(offset >= 0, "rotary: negative position offset ", offset);
  Tensor x = materialize(x_in), inv_freq = materialize(inv_freq_in);
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "rotary");
  on(out).rotary(out, x, inv_freq, offset, /*inverse=*/false);
  if (autograd::needs_graph({x_in})) {
    auto ctx = std::make_unique<RotaryFn::Context>();
    ctx->offset = offset;
    ctx->save_for_backward({inv_freq});
    autograd::record<RotaryFn>(std::move(ctx), {x_in, inv_freq_in}, {out});
  }
  return out;
}

Tensor gelu(const Tensor& x_in) {
  detail::require_same_device("gelu", {&x_in});
  Tensor x = materialize(x_in);
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "gelu");
  on(out).gelu_forward(out, x);
  if (autograd::needs_graph({x_in})) {
    auto ctx = std::make_unique<GeluFn::Context>();
    ctx->save_for_backward({x});
    autograd::record<GeluFn>(std::move(ctx), {x_in}, {out});
  }
  return out;
}

Tensor softmax(const Tensor& x_in) {
  detail::require_same_device("softmax", {&x_in});
  Tensor x = materialize(x_in);
  Tensor out = new_output(x.shape(), x.dtype(), x.device(), "softmax");
  on(out).softmax_forward(out, x);
  if (autograd::needs_graph({x_in})) {
    auto ctx = std::make_unique<SoftmaxFn::Context>();
    ctx->save_for_backward({out});
    autograd::record<SoftmaxFn>(std::move(ctx), {x_in}, {out});
  }
  return out;
}

namespace {
// causal_attention's checks, then the kernel over q, k, v in `operand` dtype (fp32 inputs
// rounded to bf16 for mixed precision), the output and statistics in q's.
Tensor attention(const char* op, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, DType operand,
                 bool recompute) {
  detail::require_same_device(op, {&q_in, &k_in, &v_in});
  TALLY_CHECK(q_in.dim() == 4 && k_in.dim() == 4 && v_in.dim() == 4, op, ": q, k, v must be (B,T,heads,D), got ",
              q_in.str(), ", ", k_in.str(), ", ", v_in.str());
  TALLY_CHECK(k_in.shape() == v_in.shape(), op, ": k ", k_in.str(), " and v ", v_in.str(), " differ in shape");
  const int64_t B = q_in.shape()[0], T = q_in.shape()[1], H = q_in.shape()[2], D = q_in.shape()[3];
  TALLY_CHECK(k_in.shape()[0] == B && k_in.shape()[1] >= T && k_in.shape()[3] == D,
              op, ": k ", k_in.str(), " does not match q ", q_in.str(), " (k may be longer, never shorter)");
  const int64_t KV = k_in.shape()[2];
  TALLY_CHECK(KV > 0 && H % KV == 0, op, ": ", H, " query heads are not a multiple of ", KV, " kv heads");
  TALLY_CHECK(q_in.dtype() == k_in.dtype() && q_in.dtype() == v_in.dtype() && is_floating(q_in.dtype()) &&
                  q_in.dtype() != DType::BF16,
              op, ": q, k, v must share an fp32 or fp64 dtype, got ", q_in.str(), ", ", k_in.str(), ", ", v_in.str(),
              " (causal_attention_bf16 takes fp32 q, k, v and rounds them to bf16 itself)");
  Tensor q, k, v;
  if (operand == q_in.dtype()) {
    // Kernels need contiguous head vectors; other strides are read in place.
    auto last_contig = [](const Tensor& t) { return t.strides()[3] == 1 ? t : materialize(t); };
    q = last_contig(q_in), k = last_contig(k_in), v = last_contig(v_in);
  } else {
    TALLY_CHECK(q_in.dtype() == DType::F32, op, ": expected fp32 q, k, v, got ", q_in.str(), ", ", k_in.str(), ", ",
                v_in.str());
    // Rounded into head-major storage (B, heads, T, D), seen as (B, T, heads, D): one
    // head's tile of rows is then dense, which oneDNN's bf16 kernels (AMX, AVX512-BF16)
    // need: with a row stride other than D they fall back to a kernel 10-20x slower.
    auto head_major_bf16 = [](const Tensor& x, const char* owner) {
      const Shape& s = x.shape();
      Tensor storage = Tensor::empty({s[0], s[2], s[1], s[3]}, DType::BF16, x.device(), current_owner(owner));
      Tensor view = storage.transpose(1, 2);
      on(x).copy(view, x);
      return view;
    };
    q = head_major_bf16(q_in, "attention_q_bf16");
    k = head_major_bf16(k_in, "attention_k_bf16");
    v = head_major_bf16(v_in, "attention_v_bf16");
  }
  // Mixed precision writes a bf16 output, as autocast's attention does (the output
  // projection's operand as it is, saved once for both); lse stays in the inputs' dtype.
  const DType stats = q_in.dtype(), out_dtype = operand == DType::BF16 ? DType::BF16 : stats;
  const AttentionOutputs f = run_attention_forward(q, k, v, out_dtype, stats);
  if (autograd::needs_graph({q_in, k_in, v_in})) {
    auto ctx = std::make_unique<AttentionFn::Context>();
    ctx->out_dtype = out_dtype;
    ctx->stats_dtype = stats;
    ctx->recompute = recompute;
    if (recompute) ctx->save_for_backward({q, k, v});
    else ctx->save_for_backward({q, k, v, f.out, f.lse});
    autograd::record<AttentionFn>(std::move(ctx), {q_in, k_in, v_in}, {f.out});
  }
  return f.out;
}
}  // namespace

Tensor causal_attention(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) {
  return attention("causal_attention", q, k, v, q.dtype(), recompute);
}

Tensor causal_attention_bf16(const Tensor& q, const Tensor& k, const Tensor& v, bool recompute) {
  return attention("causal_attention_bf16", q, k, v, DType::BF16, recompute);
}

Tensor cross_entropy(const Tensor& logits_in, const Tensor& targets_in, int64_t valid_vocab) {
  detail::require_same_device("cross_entropy", {&logits_in, &targets_in});
  TALLY_CHECK(logits_in.dim() == 2, "cross_entropy: logits ", logits_in.str(), " must be (N, vocab)");
  TALLY_CHECK(targets_in.numel() == logits_in.shape()[0], "cross_entropy: ", targets_in.numel(), " targets for ",
              logits_in.shape()[0], " rows of logits ", logits_in.str());
  const int64_t V = valid_vocab < 0 ? logits_in.shape()[1] : valid_vocab;
  TALLY_CHECK(V > 0 && V <= logits_in.shape()[1], "cross_entropy: valid_vocab ", V, " outside 1..", logits_in.shape()[1]);
  Tensor logits = materialize(logits_in), targets = materialize(targets_in);
  const int64_t N = logits.shape()[0];
  // bf16 logits (mixed precision's head) are read as fp32: the loss and lse are fp32.
  const DType stats = logits.dtype() == DType::BF16 ? DType::F32 : logits.dtype();
  Tensor losses = new_output({N}, stats, logits.device(), "cross_entropy_rows");
  Tensor lse = new_output({N}, stats, logits.device(), "cross_entropy_lse");
  on(losses).cross_entropy_forward(losses, lse, logits, targets, V);
  int64_t count = 0;
  Tensor loss = mean_over_targets(losses, targets, count);
  if (autograd::needs_graph({logits_in})) {
    auto ctx = std::make_unique<CrossEntropyFn::Context>();
    ctx->valid_vocab = V;
    ctx->count = count;
    ctx->save_for_backward({logits, lse, targets});
    autograd::record<CrossEntropyFn>(std::move(ctx), {logits_in, targets_in}, {loss});
  }
  return loss;
}

Tensor linear_cross_entropy(const Tensor& x_in, const Tensor& w, const Tensor& targets_in, int64_t valid_vocab,
                            int64_t chunk_rows, const Tensor& w_bf16) {
  detail::require_same_device("linear_cross_entropy", {&x_in, &w, &targets_in, &w_bf16});
  TALLY_CHECK(x_in.dim() == 2 && w.dim() == 2 && x_in.shape()[1] == w.shape()[1], "linear_cross_entropy: x ", x_in.str(),
              " and weight ", w.str(), " must be (N, C) and (vocab, C)");
  TALLY_CHECK(x_in.dtype() == DType::F32 && w.dtype() == DType::F32, "linear_cross_entropy: x and weight must be float32, got ",
              x_in.str(), " and ", w.str());
  TALLY_CHECK(!w_bf16.defined() || (w_bf16.dtype() == DType::BF16 && w_bf16.shape() == w.shape()),
              "linear_cross_entropy: the weight's copy ", w_bf16.str(), " must be bfloat16 of shape ", shape_str(w.shape()));
  TALLY_CHECK(targets_in.numel() == x_in.shape()[0], "linear_cross_entropy: ", targets_in.numel(), " targets for ",
              x_in.shape()[0], " rows");
  TALLY_CHECK(chunk_rows > 0, "linear_cross_entropy: chunk_rows must be positive, got ", chunk_rows);
  const int64_t N = x_in.shape()[0], C = x_in.shape()[1], Vp = w.shape()[0];
  const int64_t V = valid_vocab < 0 ? Vp : valid_vocab;
  TALLY_CHECK(V > 0 && V <= Vp, "linear_cross_entropy: valid_vocab ", V, " outside 1..", Vp);
  const bool bf16 = w_bf16.defined();
  Tensor targets = materialize(targets_in).reshape({N});
  Tensor x = bf16 ? detail::to_bf16(x_in, "linear_x_bf16") : materialize(x_in);
  const Tensor& wk = bf16 ? w_bf16 : w;
  Tensor losses = new_output({N}, DType::F32, x.device(), "cross_entropy_rows");
  Tensor lse = new_output({N}, DType::F32, x.device(), "cross_entropy_lse");
  {
    Tensor logits = Tensor::empty({std::min(chunk_rows, N), Vp}, wk.dtype(), x.device(),
                                  current_owner("linear_cross_entropy_logits"));
    for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
      const int64_t rows = std::min(chunk_rows, N - r0);
      Tensor l_c = make_view(logits, {rows, Vp}, {Vp, 1}, 0);
      on(x).gemm(make_view(x, {rows, C}, {C, 1}, x.offset() + r0 * C), false, wk, true, l_c);
      on(x).cross_entropy_forward(make_view(losses, {rows}, {1}, r0), make_view(lse, {rows}, {1}, r0), l_c,
                                  make_view(targets, {rows}, {1}, targets.offset() + r0), V);
    }
  }
  int64_t count = 0;
  Tensor loss = mean_over_targets(losses, targets, count);
  losses = Tensor();
  if (autograd::needs_graph({x_in, w})) {
    auto ctx = std::make_unique<LinearCrossEntropyFn::Context>();
    ctx->valid_vocab = V;
    ctx->count = count;
    ctx->chunk_rows = chunk_rows;
    ctx->save_for_backward({x, wk, lse, targets});
    autograd::record<LinearCrossEntropyFn>(std::move(ctx), {x_in, w, targets_in}, {loss});
  }
  return loss;
}

}  // namespace tally::ops
