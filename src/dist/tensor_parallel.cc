#include "dist/tensor_parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::dist {

namespace {

// A fresh tensor for a tensor-parallel op's result, owned by the current module path, on
// the device of its input: the CPU, or the meta device of a dry run, where the ops make
// the tensors the real run makes and compute nothing.
Tensor output(const Shape& shape, DType dtype, Device device, const char* what) {
  return Tensor::empty(shape, dtype, device, current_owner(what));
}

// The four mappings share one shape: forward runs one raw collective, backward its
// conjugate. Which is which is fixed per Kind.
enum class Mapping { CopyIn, ReduceOut, GatherIn, ScatterOut };

Tensor run(TensorParallel& tp, Mapping m, const Tensor& x) {
  switch (m) {
    case Mapping::CopyIn: return x;
    case Mapping::ReduceOut: return tp.all_reduced(x);
    case Mapping::GatherIn: return tp.gather_sequence(x);
    case Mapping::ScatterOut: return tp.reduce_scatter_sequence(x);
  }
  return x;
}

Mapping conjugate(Mapping m) {
  switch (m) {
    case Mapping::CopyIn: return Mapping::ReduceOut;    // f: identity / all-reduce
    case Mapping::ReduceOut: return Mapping::CopyIn;    // g: all-reduce / identity
    case Mapping::GatherIn: return Mapping::ScatterOut;
    case Mapping::ScatterOut: return Mapping::GatherIn;
  }
  return m;
}

struct TpMapping {
  static constexpr const char* kName = "tensor_parallel";
  struct Context : autograd::Context {
    TensorParallel* tp = nullptr;  // non-owning: the trainer's, outlives every graph
    Mapping backward_mapping = Mapping::CopyIn;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {run(*ctx.tp, ctx.backward_mapping, grads[0])};
  }
};

Tensor mapped(TensorParallel& tp, Mapping m, const Tensor& x) {
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = run(tp, m, x.detach());
    // The identity still needs a tensor of its own to carry the node.
    if (m == Mapping::CopyIn) out = out.detach();
  }
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<TpMapping::Context>();
    ctx->tp = &tp;
    ctx->backward_mapping = conjugate(m);
    autograd::record<TpMapping>(std::move(ctx), {x}, {out});
  }
  return out;
}

// ---- vocabulary-parallel embedding: rows of this rank's block, zeros for other tokens.
struct VocabEmbedding {
  static constexpr const char* kName = "vocab_parallel_embedding";
  struct Context : autograd::Context {  // saved: the tokens
    int64_t vocab_start = 0, rows = 0, width = 0;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor tokens = ctx.saved(0);
    Tensor g = grads[0].is_contiguous() ? grads[0] : ops::contiguous(grads[0]);
    TALLY_CHECK(g.dtype() == DType::F32 && (g.device().is_cpu() || g.device().is_meta()),
                "vocabulary-parallel embedding: backward takes an fp32 CPU gradient, got ", g.str());
    const autograd::GradSink sink = ctx.grad_sink(0, DType::F32);
    Tensor dw = sink ? sink.buffer : Tensor::zeros({ctx.rows, ctx.width}, g.dtype(), g.device(), current_owner("vocab_embedding_grad"));
    if (sink.overwrite) dw.fill_(0.0);  // the loop adds: rows no token of this block hit must read zero
    if (g.device().is_meta()) return {sink ? Tensor() : dw, Tensor()};
    const int32_t* ids = tokens.data<int32_t>();
    const float* gp = g.data<float>();
    float* dp = dw.data<float>();
    const int64_t n = tokens.numel(), C = ctx.width;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = static_cast<int64_t>(ids[i]) - ctx.vocab_start;
      if (row < 0 || row >= ctx.rows) continue;
      float* d = dp + row * C;
      const float* s = gp + i * C;
      for (int64_t j = 0; j < C; ++j) d[j] += s[j];
    }
    if (sink) {
      dw.storage().bump_version();
      return {Tensor(), Tensor()};
    }
    return {dw, Tensor()};
  }
};

// Runs f on the logits' data as float or, for mixed precision's bf16 logits, BFloat16.
template <class F> void with_logits(const Tensor& logits, F&& f) {
  if (logits.dtype() == DType::BF16) f(logits.data<BFloat16>());
  else f(logits.data<float>());
}
inline double as_double(float v) { return v; }
inline double as_double(BFloat16 v) { return static_cast<float>(v); }

// ---- vocabulary-parallel cross-entropy (Megatron's _VocabParallelCrossEntropy): each
// rank reduces its columns to a row maximum, a sum of exponentials and the target's logit
// when the target is in its block; two all-reduces (max, then the sums) make the
// log-sum-exp of every row from them.
struct VocabCrossEntropy {
  static constexpr const char* kName = "vocab_parallel_cross_entropy";
  struct Context : autograd::Context {  // saved: logits, targets, per-row log-sum-exp (f64)
    int64_t vocab_start = 0, valid = 0, counted = 0;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    Tensor logits = ctx.saved(0), targets = ctx.saved(1), lse = ctx.saved(2);
    const int64_t N = logits.shape()[0], V = logits.shape()[1];
    // The gradient in the logits' dtype: bf16 logits (mixed precision) get a bf16 gradient,
    // each element computed in fp64 and rounded to fp32, then to bf16.
    Tensor dl = Tensor::empty({N, V}, logits.dtype(), logits.device(), current_owner("vocab_cross_entropy_grad"));
    const double scale = grads[0].item() / static_cast<double>(std::max<int64_t>(ctx.counted, 1));
    if (logits.device().is_meta()) return {dl, Tensor()};  // (item() made the host copy a real run makes)
    const int32_t* tp = targets.data<int32_t>();
    const double* lsep = lse.data<double>();
    with_logits(logits, [&](const auto* lp) {
      using Elem = std::remove_const_t<std::remove_pointer_t<decltype(lp)>>;
      Elem* dp = dl.data<Elem>();
#pragma omp parallel for
      for (int64_t i = 0; i < N; ++i) {
        Elem* d = dp + i * V;
        if (tp[i] < 0) {
          for (int64_t j = 0; j < V; ++j) d[j] = Elem(0.f);
          continue;
        }
        const Elem* l = lp + i * V;
        const int64_t t = static_cast<int64_t>(tp[i]) - ctx.vocab_start;
        for (int64_t j = 0; j < ctx.valid; ++j) {
          const double p = std::exp(as_double(l[j]) - lsep[i]) * scale;
          d[j] = Elem(static_cast<float>(j == t ? p - scale : p));
        }
        for (int64_t j = ctx.valid; j < V; ++j) d[j] = Elem(0.f);
      }
    });
    return {dl, Tensor()};
  }
};

}  // namespace

Tensor TensorParallel::all_reduced(const Tensor& x) {
  Tensor out = output(x.shape(), x.dtype(), x.device(), "tp_all_reduce");
  out.copy_(x);
  group_.all_reduce(out);
  return out;
}

Tensor TensorParallel::gather_sequence(const Tensor& x) {
  TALLY_CHECK(x.dim() == 3, "sequence parallel: expected (B, T/tp, C), got ", x.str());
  const int64_t n = size(), B = x.shape()[0], Ts = x.shape()[1], C = x.shape()[2];
  Tensor in = x.is_contiguous() ? x : ops::contiguous(x);
  Tensor blocks = Tensor::empty({n, B, Ts, C}, x.dtype(), x.device(), make_owner(Category::Communication, "comm:sp_all_gather"));
  group_.all_gather(blocks, in);
  // (tp, B, Ts, C) -> (B, tp, Ts, C) = (B, T, C)
  Tensor out = output({B, n * Ts, C}, x.dtype(), x.device(), "sp_all_gather");
  out.view({B, n, Ts, C}).copy_(blocks.permute({1, 0, 2, 3}));
  return out;
}

Tensor TensorParallel::reduce_scatter_sequence(const Tensor& x) {
  TALLY_CHECK(x.dim() == 3, "sequence parallel: expected (B, T, C), got ", x.str());
  const int64_t n = size(), B = x.shape()[0], T = x.shape()[1], C = x.shape()[2];
  TALLY_CHECK(T % n == 0, "sequence parallel: the sequence length ", T, " must divide into ", n, " tensor-parallel ranks");
  const int64_t Ts = T / n;
  // (B, T, C) = (B, tp, Ts, C) -> (tp, B, Ts, C): rank r's block is its slice of every row.
  Tensor blocks = Tensor::empty({n, B, Ts, C}, x.dtype(), x.device(), make_owner(Category::Communication, "comm:sp_reduce_scatter"));
  blocks.copy_(x.reshape({B, n, Ts, C}).permute({1, 0, 2, 3}));
  Tensor out = output({B, Ts, C}, x.dtype(), x.device(), "sp_reduce_scatter");
  group_.reduce_scatter(out, blocks);
  return out;
}

Tensor TensorParallel::into_column_parallel(const Tensor& x) {
  return mapped(*this, sequence_parallel_ ? Mapping::GatherIn : Mapping::CopyIn, x);
}

Tensor TensorParallel::out_of_row_parallel(const Tensor& x) {
  return mapped(*this, sequence_parallel_ ? Mapping::ScatterOut : Mapping::ReduceOut, x);
}

namespace {
// out (n, C): the rows of `weight_shard` (vocabulary ids vocab_start ..) for the ids in
// its block, zeros for the others (the group's size: `ranks`).
void fill_vocab_rows(const Tensor& out, const Tensor& ids, const Tensor& weight_shard, int64_t vocab_start, int ranks) {
  const int64_t rows = weight_shard.shape()[0], C = weight_shard.shape()[1];
  const int32_t* ip = ids.data<int32_t>();
  const float* wp = weight_shard.data<float>();
  float* op = out.data<float>();
  const int64_t n = ids.numel(), vocab = rows * ranks;
  for (int64_t i = 0; i < n; ++i)
    TALLY_CHECK(ip[i] >= 0 && ip[i] < vocab, "vocab-parallel embedding: token ", ip[i], " at position ", i,
                " is outside the vocabulary [0, ", vocab, ")");
#pragma omp parallel for
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row = static_cast<int64_t>(ip[i]) - vocab_start;
    float* d = op + i * C;
    if (row < 0 || row >= rows) {
      for (int64_t j = 0; j < C; ++j) d[j] = 0.f;
    } else {
      const float* s = wp + row * C;
      for (int64_t j = 0; j < C; ++j) d[j] = s[j];
    }
  }
}
}  // namespace

Tensor TensorParallel::vocab_parallel_embedding(const Tensor& weight_shard, const Tensor& tokens, int64_t vocab_start) {
  TALLY_CHECK(weight_shard.dim() == 2 && weight_shard.dtype() == DType::F32 && weight_shard.is_contiguous(),
              "vocab-parallel embedding: weight must be contiguous float32 (V/tp, C), got ", weight_shard.str());
  TALLY_CHECK(tokens.dtype() == DType::I32, "vocab-parallel embedding: tokens must be int32, got ", tokens.str());
  const int64_t rows = weight_shard.shape()[0], C = weight_shard.shape()[1];
  Tensor ids = tokens.is_contiguous() ? tokens : ops::contiguous(tokens);
  Shape shape = tokens.shape();
  shape.push_back(C);
  Tensor out = output(shape, DType::F32, weight_shard.device(), "vocab_parallel_embedding");
  if (!out.device().is_meta()) fill_vocab_rows(out, ids, weight_shard, vocab_start, size());
  if (autograd::needs_graph({weight_shard})) {
    auto ctx = std::make_unique<VocabEmbedding::Context>();
    ctx->vocab_start = vocab_start;
    ctx->rows = rows;
    ctx->width = C;
    ctx->save_for_backward({ids});
    autograd::record<VocabEmbedding>(std::move(ctx), {weight_shard, ids}, {out});
  }
  return out;
}


Tensor TensorParallel::vocab_parallel_cross_entropy(const Tensor& logits_shard, const Tensor& targets,
                                                     int64_t vocab_start, int64_t vocab_size) {
  TALLY_CHECK(logits_shard.dim() == 2 && (logits_shard.dtype() == DType::F32 || logits_shard.dtype() == DType::BF16),
              "vocab-parallel cross-entropy: logits must be float32 or bfloat16 (N, V/tp), got ", logits_shard.str());
  TALLY_CHECK(targets.dim() == 1 && targets.dtype() == DType::I32 && targets.shape()[0] == logits_shard.shape()[0],
              "vocab-parallel cross-entropy: targets must be int32 (N), got ", targets.str(), " for logits ",
              logits_shard.str());
  Tensor logits = logits_shard.is_contiguous() ? logits_shard.detach() : ops::contiguous(logits_shard.detach());
  Tensor tgt = targets.is_contiguous() ? targets : ops::contiguous(targets);
  const int64_t N = logits.shape()[0], V = logits.shape()[1];
  const int64_t valid = std::clamp<int64_t>(vocab_size - vocab_start, 0, V);  // the rest is padding
  const bool values = !logits.device().is_meta();  // a dry run: the same tensors, no arithmetic
  const int32_t* tp = values ? tgt.data<int32_t>() : nullptr;
  for (int64_t i = 0; values && i < N; ++i)
    TALLY_CHECK(tp[i] < vocab_size, "vocab-parallel cross-entropy: target ", tp[i], " in row ", i,
                " is outside the vocabulary [0, ", vocab_size, ") (negative targets are ignored)");
  Tensor row_max = Tensor::empty({N}, DType::F64, logits.device(), current_owner("vocab_ce_stats"));
  Tensor sums = Tensor::empty({2, N}, DType::F64, logits.device(), current_owner("vocab_ce_stats"));
  double* mp = values ? row_max.data<double>() : nullptr;
  double* sp = values ? sums.data<double>() : nullptr;
  if (values) {
    with_logits(logits, [&](const auto* lp) {
#pragma omp parallel for
      for (int64_t i = 0; i < N; ++i) {
        double m = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < valid; ++j) m = std::max(m, as_double(lp[i * V + j]));
        mp[i] = m;
      }
    });
  }
  group_.all_reduce(row_max, ReduceOp::Max);  // row maxima over the group
  if (values) {
    // Sums of exponentials and the target's logit (from the rank that holds it): one all-reduce.
    with_logits(logits, [&](const auto* lp) {
#pragma omp parallel for
      for (int64_t i = 0; i < N; ++i) {
        double s = 0;
        for (int64_t j = 0; j < valid; ++j) s += std::exp(as_double(lp[i * V + j]) - mp[i]);
        sp[i] = s;
        const int64_t t = static_cast<int64_t>(tp[i]) - vocab_start;
        sp[N + i] = tp[i] >= 0 && t >= 0 && t < valid ? as_double(lp[i * V + t]) : 0.0;
      }
    });
  }
  group_.all_reduce(sums);
  Tensor lse = Tensor::empty({N}, DType::F64, logits.device(), current_owner("vocab_ce_lse"));
  Tensor loss = output({}, DType::F32, logits.device(), "vocab_parallel_cross_entropy");
  int64_t counted = 0;
  if (values) {
    double* lsep = lse.data<double>();
    double total = 0;
    for (int64_t i = 0; i < N; ++i) {
      lsep[i] = mp[i] + std::log(sp[i]);
      if (tp[i] < 0) continue;
      total += lsep[i] - sp[N + i];
      ++counted;
    }
    loss.data<float>()[0] = static_cast<float>(total / static_cast<double>(std::max<int64_t>(counted, 1)));
  }
  if (autograd::needs_graph({logits_shard})) {
    auto ctx = std::make_unique<VocabCrossEntropy::Context>();
    ctx->vocab_start = vocab_start;
    ctx->valid = valid;
    ctx->counted = counted;
    ctx->save_for_backward({logits, tgt});
    ctx->keep(lse);
    autograd::record<VocabCrossEntropy>(std::move(ctx), {logits_shard, tgt}, {loss});
  }
  return loss;
}

void sum_replicated_gradients(nn::Transformer& model, Communicator& tp_group, bool sequence_parallel) {
  if (tp_group.size() == 1) return;
  const nn::ParameterStore& params = model.params();
  std::vector<Tensor> grads;
  int64_t total = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    const nn::TpSplit split = model.tp_split(i);
    if (split != nn::TpSplit::SharedBySlices && !(sequence_parallel && split == nn::TpSplit::Replicated)) continue;
    grads.push_back(params[i].grad());
    TALLY_CHECK(grads.back().defined(), "internal: parameter ", params.spec(i).name, " has no gradient");
    total += grads.back().numel();
  }
  if (total == 0) return;
  Tensor packed = Tensor::empty({total}, grads[0].dtype(), grads[0].device(), make_owner(Category::Communication, "comm:sp_grad_sum"));
  int64_t at = 0;
  for (const Tensor& g : grads) {
    packed.slice(0, at, at + g.numel()).copy_(g.reshape({-1}));
    at += g.numel();
  }
  tp_group.all_reduce(packed);
  at = 0;
  for (const Tensor& g : grads) {
    g.copy_(packed.slice(0, at, at + g.numel()).view(g.shape()));
    g.storage().bump_version();
    at += g.numel();
  }
}

double model_parallel_gradient_norm(const nn::Transformer& model, const World& world) {
  const nn::ParameterStore& params = model.params();
  std::vector<Tensor> counted, experts;
  for (size_t i = 0; i < params.size(); ++i) {
    if (model.is_tied_head_copy(i)) continue;
    const nn::TpSplit split = model.tp_split(i);
    if ((split == nn::TpSplit::Replicated || split == nn::TpSplit::SharedBySlices) && world.tp_rank() != 0) continue;
    (model.is_expert(i) ? experts : counted).push_back(params[i].grad());
  }
  auto squares_of = [](const std::vector<Tensor>& grads) {
    const double norm = grads.empty() ? 0.0 : ops::global_norm(grads);
    return norm * norm;
  };
  // Each expert-parallel rank holds its own experts: their squares are summed over the group.
  double squares = squares_of(counted) + world.ep_group().all_reduce_scalar(squares_of(experts), ReduceOp::Sum);
  squares = world.tp_group().all_reduce_scalar(squares, ReduceOp::Sum);
  squares = world.pp_group().all_reduce_scalar(squares, ReduceOp::Sum);
  return std::sqrt(squares);
}

}  // namespace tally::dist
