#include "dist/context_parallel.h"

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::dist {

namespace {

// (B, T, rest...) as (B, 2C, T/2C, rest): the sequence's chunks along dimension 1.
Shape chunked(const Shape& shape, int64_t chunks) {
  Shape s = shape;
  s[1] = shape[1] / chunks;
  s.insert(s.begin() + 1, chunks);
  return s;
}

// Block s of a rank-major tensor (n, ...), as (...).
Tensor block_of(const Tensor& t, int s) {
  Shape rest(t.shape().begin() + 1, t.shape().end());
  return t.slice(0, s, s + 1).view(rest);
}

// Chunk c of a chunked tensor (B, chunks, T', ...), as (B, 1, T', ...).
Tensor chunk(const Tensor& t, int64_t c) { return t.slice(1, c, c + 1); }

// Where rank r's two local chunks sit among the 2C chunks of the whole sequence.
int64_t chunk_of(int rank, int size, int half) { return half == 0 ? rank : 2 * int64_t{size} - 1 - rank; }

struct SequenceGather {
  static constexpr const char* kName = "context_parallel_gather";
  struct Context : autograd::Context {
    ContextParallel* cp = nullptr;  // non-owning: the engine's, outlives every graph
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {ctx.cp->reduce_scattered(grads[0])};
  }
};

}  // namespace

// The all-gather's blocks are rank-major, (C, B, 2, T/2C, rest): rank s's block holds
// chunks s and 2C-1-s. Each is copied to its place in the whole sequence.
Tensor ContextParallel::gathered(const Tensor& x) {
  TALLY_CHECK(x.dim() >= 2 && x.shape()[1] % 2 == 0, "context parallel: expected (B, T/cp, ...) with T/cp even, got ",
              x.str());
  const int n = size();
  Tensor in = x.is_contiguous() ? x : ops::contiguous(x);
  Shape block = x.shape();
  block.insert(block.begin(), n);
  Tensor blocks = Tensor::empty(block, x.dtype(), x.device(), make_owner(Category::Communication, "comm:cp_all_gather"));
  group_.all_gather(blocks, in);
  Shape whole = x.shape();
  whole[1] *= n;
  Tensor out = Tensor::empty(whole, x.dtype(), x.device(), current_owner("cp_all_gather"));
  Tensor out_chunks = out.view(chunked(whole, 2 * n));
  for (int s = 0; s < n; ++s) {
    Tensor local = block_of(blocks, s).view(chunked(x.shape(), 2));
    for (int half = 0; half < 2; ++half) chunk(out_chunks, chunk_of(s, n, half)).copy_(chunk(local, half));
  }
  return out;
}

Tensor ContextParallel::reduce_scattered(const Tensor& g) {
  const int n = size();
  TALLY_CHECK(g.dim() >= 2 && g.shape()[1] % (2 * n) == 0, "context parallel: expected (B, T, ...) with T a multiple of ",
              2 * n, ", got ", g.str());
  Shape local = g.shape();
  local[1] /= n;
  Shape block = local;
  block.insert(block.begin(), n);
  Tensor blocks = Tensor::empty(block, g.dtype(), g.device(), make_owner(Category::Communication, "comm:cp_reduce_scatter"));
  Tensor g_chunks = (g.is_contiguous() ? g : ops::contiguous(g)).view(chunked(g.shape(), 2 * n));
  for (int s = 0; s < n; ++s) {
    Tensor local_chunks = block_of(blocks, s).view(chunked(local, 2));
    for (int half = 0; half < 2; ++half) chunk(local_chunks, half).copy_(chunk(g_chunks, chunk_of(s, n, half)));
  }
  Tensor out = Tensor::empty(local, g.dtype(), g.device(), current_owner("cp_reduce_scatter"));
  group_.reduce_scatter(out, blocks);
  return out;
}

Tensor ContextParallel::gather_sequence(const Tensor& x) {
  Tensor out;
  {
    autograd::NoGradGuard no_grad;
    out = gathered(x.detach());
  }
  if (autograd::needs_graph({x})) {
    auto ctx = std::make_unique<SequenceGather::Context>();
    ctx->cp = this;
    autograd::record<SequenceGather>(std::move(ctx), {x}, {out});
  }
  return out;
}

Tensor ContextParallel::local_tokens(const Tensor& tokens) const {
  const int n = group_.size();
  if (n == 1) return tokens;
  TALLY_CHECK(tokens.dim() == 2 && tokens.shape()[1] % (2 * n) == 0, "--cp ", n, ": each sequence is cut into 2 x ", n,
              " = ", 2 * n, " chunks, so --seq-len must be a multiple of ", 2 * n, "; got tokens ", tokens.str());
  const int64_t B = tokens.shape()[0], width = tokens.shape()[1] / (2 * n);
  Tensor local = Tensor::empty({B, 2 * width}, tokens.dtype(), tokens.device(), current_owner("microbatch_tokens"));
  for (int half = 0; half < 2; ++half) {
    const int64_t first = chunk_of(group_.rank(), n, half) * width;
    local.slice(1, half * width, (half + 1) * width).copy_(tokens.slice(1, first, first + width));
  }
  return local;
}

}  // namespace tally::dist
