#include "dist/zero.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "optim/grad_norm.h"
#include "runtime/backend.h"
#include "runtime/profiler.h"

namespace tally::dist {

namespace {
// A plain (non-differentiable) view of `count` elements of a 1-D tensor from `start`.
Tensor range(const Tensor& t, int64_t start, int64_t count) { return make_view(t, {count}, {1}, t.offset() + start); }
}  // namespace

ZeroOptimizer::ZeroOptimizer(nn::ParameterStore& params, optim::AdamWConfig config, Communicator& group, int stage,
                             Communicator* expert_group, const std::vector<bool>& expert)
    : params_(params), config_(config), group_(group), stage_(stage) {
  TALLY_CHECK(stage >= 1 && stage <= 3, "--zero must be 0, 1, 2 or 3, got ", stage);
  TALLY_CHECK(!expert_group || stage == 1, "--zero ", stage, " with --ep: ZeRO-2/3 over expert-parallel ranks is not "
              "supported yet (their gradient shards would need a norm over two groups); use --zero 1");
  // Stage 1 reduces into the model's gradient block; stages 2 and 3 keep gradient shards of
  // their own, so a model built for them needs none (set-up then never holds one).
  // Stage 3 may start from no blocks at all: its values come later, through store().
  const bool from_block = params_.flat_params().defined();
  TALLY_CHECK((from_block || stage == 3) && (stage >= 2 || params_.has_grad_block()),
              "ZeRO shards a model whose parameter block (and, for stage 1, gradient block) exists (shard it once, "
              "after loading; stage 3 also takes a model built without blocks)");
  for (size_t u = 0; u < params_.num_units(); ++u) {
    const nn::ParameterUnit& unit = params_.unit(u);
    Piece p;
    p.group = &group_;
    if (expert_group && unit.numel() > 0 && expert.at(unit.first)) {
      for (size_t i = unit.first; i < unit.last; ++i)
        TALLY_CHECK(expert.at(i), "internal: ZeRO unit '", unit.name, "' mixes experts with other parameters");
      p.group = expert_group;
    }
    const int64_t D = p.group->size(), r = p.group->rank();
    p.unit_begin = unit.begin;
    p.unit_numel = unit.numel();
    p.size = (unit.numel() + D - 1) / D;
    p.own_begin = unit.begin + std::min(r * p.size, unit.numel());
    p.own = std::clamp<int64_t>(unit.numel() - r * p.size, 0, p.size);
    p.local = local_numel_;
    local_numel_ += p.size;
    pieces_.push_back(p);
  }
  const DType dt = params_.dtype();
  const Device dev = params_.device();
  // The order keeps the set-up peak low: the full gradient block goes before any shard is
  // allocated, the full parameter block after the parameter shard is filled from it.
  if (stage_ >= 2 && from_block) params_.release_grads();
  m_ = Tensor::zeros({local_numel_}, dt, dev, make_owner(Category::OptimizerState, "zero.adamw.m"));
  v_ = Tensor::zeros({local_numel_}, dt, dev, make_owner(Category::OptimizerState, "zero.adamw.v"));
  staging_.resize(pieces_.size());
  next_unit_ = staging_.size();
  if (stage_ >= 2)
    grad_shard_ = Tensor::zeros({local_numel_}, dt, dev, make_owner(Category::Gradient, "zero.gradients", true));
  if (stage_ == 3) {
    param_shard_ = Tensor::zeros({local_numel_}, dt, dev, make_owner(Category::Parameter, "zero.parameters"));
    for (size_t u = 0; u < pieces_.size() && from_block; ++u) {
      const Piece& p = pieces_[u];
      if (p.own > 0) piece_of(param_shard_, u).slice(0, 0, p.own).copy_(range(params_.flat_params(), p.own_begin, p.own));
    }
    // Each unit's parameters become views of one storage that holds bytes only while the
    // unit is gathered.
    for (size_t u = 0; u < pieces_.size(); ++u) {
      const nn::ParameterUnit& unit = params_.unit(u);
      const int64_t n = group_of(u).size() * pieces_[u].size;
      auto storage = Storage::create_released(n * static_cast<int64_t>(dtype_size(dt)), dev,
                                              "zero3: unit '" + unit.name + "' is not gathered");
      Tensor whole(std::make_shared<TensorImpl>(storage, Shape{n}, Shape{1}, 0, dt));
      whole.set_name("zero3.gathered(" + unit.name + ")");
      for (size_t i = unit.first; i < unit.last; ++i) {
        const Shape& shape = params_.spec(i).shape;
        params_.rebind(i, make_view(whole, shape, contiguous_strides(shape), params_.offset(i) - unit.begin));
      }
      gathered_.push_back(whole);
    }
    gathering_.resize(pieces_.size());
    params_.release_params();
  }
  // The full blocks freed above are sizes nothing will ask for again: give them back to
  // the system rather than keep them cached.
  if (stage_ >= 2) runtime::backend(dev).caching_allocator().empty_cache();
  // On the parameters as they are now (stage 3 rebound them above).
  if (stage_ >= 2)
    for (size_t i = 0; i < params_.size(); ++i)
      hooks_.push_back(params_[i].register_post_accumulate_hook([this, i](const Tensor&) { gradient_final(i); }));
}

ZeroOptimizer::~ZeroOptimizer() {
  for (HookHandle& h : hooks_) h.remove();
}

Tensor ZeroOptimizer::piece_of(const Tensor& shard, size_t u) const {
  return range(shard, pieces_[u].local, pieces_[u].size);
}

ZeroOptimizer::Footprint ZeroOptimizer::footprint() const {
  const int64_t w = static_cast<int64_t>(dtype_size(m_.dtype()));
  Footprint f;
  f.optimizer = 2 * local_numel_ * w;
  f.gradients = (stage_ >= 2 ? local_numel_ : params_.numel()) * w;
  f.parameters = (stage_ == 3 ? local_numel_ : params_.numel()) * w;
  return f;
}

int64_t ZeroOptimizer::unit_bytes(size_t unit) const {
  return group_of(unit).size() * pieces_[unit].size * static_cast<int64_t>(dtype_size(m_.dtype()));
}

// ---------------------------------------------------------------- parameters (stage 3)

void ZeroOptimizer::gather(size_t u, bool async) {
  Tensor& whole = gathered_[u];
  if (!whole.storage().released() || gathering_[u]) return;
  whole.storage().reacquire(make_owner(Category::Communication, "zero3.gathered(" + params_.unit(u).name + ")"));
  gathering_[u] = group_of(u).all_gather_async(whole, piece_of(param_shard_, u));
  if (!async) wait_gather(u);
}

void ZeroOptimizer::wait_gather(size_t u) {
  if (!gathering_[u]) return;
  gathering_[u]->wait();
  gathering_[u] = nullptr;
}

void ZeroOptimizer::prefetch(size_t unit) {
  if (stage_ == 3 && unit < pieces_.size()) gather(unit, /*async=*/true);
}

void ZeroOptimizer::acquire(size_t unit, bool backward) {
  if (stage_ == 3) {
    gather(unit, /*async=*/false);
    wait_gather(unit);
    // Backward runs the units in reverse: start gathering the one before this one.
    if (backward && unit > 0) prefetch(unit - 1);
  }
  if (backward && stage_ >= 2) stage_gradients(unit);
}

void ZeroOptimizer::release(size_t unit, bool) {
  if (stage_ != 3) return;
  wait_gather(unit);
  Storage& s = gathered_[unit].storage();
  if (!s.released()) s.release("zero3.release(" + params_.unit(unit).name + ")");
}

std::pair<int64_t, int64_t> ZeroOptimizer::overlap(size_t param, int64_t r) const {
  const Piece& p = pieces_[params_.spec(param).unit];
  const int64_t begin = params_.offset(param), end = begin + params_[param].numel();
  // Rank r owns the unit's elements [r c, (r + 1) c), cut at the unit's end (padding is no
  // parameter's).
  const int64_t own_begin = p.unit_begin + std::min(r * p.size, p.unit_numel);
  const int64_t own_end = p.unit_begin + std::min((r + 1) * p.size, p.unit_numel);
  const int64_t lo = std::max(begin, own_begin), hi = std::min(end, own_end);
  return {lo, std::max(lo, hi)};
}

Tensor ZeroOptimizer::own_values(size_t param, int64_t lo, int64_t hi) const {
  const Piece& p = pieces_[params_.spec(param).unit];
  return range(param_shard_, p.local + (lo - p.own_begin), hi - lo);
}

void ZeroOptimizer::store(size_t param, const Tensor& value) {
  TALLY_CHECK(stage_ == 3, "internal: ZeRO-", stage_, " keeps no parameter values of its own");
  TALLY_CHECK(value.is_contiguous() && value.numel() == params_[param].numel() && value.dtype() == param_shard_.dtype(),
              "internal: a value for '", params_.spec(param).name, "' must be its whole shape, contiguous");
  const auto [lo, hi] = overlap(param, group_.rank());
  if (hi == lo) return;
  own_values(param, lo, hi).copy_(make_view(value, {hi - lo}, {1}, value.offset() + lo - params_.offset(param)));
  param_shard_.storage().bump_version();
}

Tensor ZeroOptimizer::value_at_root(size_t param) {
  TALLY_CHECK(stage_ == 3, "internal: ZeRO-", stage_, " keeps no parameter values of its own");
  constexpr int kTag = 0x2e03;  // this exchange's messages, apart from any other between the same ranks
  const int64_t begin = params_.offset(param);
  if (group_.rank() != 0) {
    const auto [lo, hi] = overlap(param, group_.rank());
    if (hi > lo) group_.send(own_values(param, lo, hi), 0, kTag);
    return Tensor();
  }
  const Shape& shape = params_.spec(param).shape;
  Tensor whole = Tensor::empty(shape, param_shard_.dtype(), param_shard_.device(),
                               make_owner(Category::Communication, "zero3.parameter_value"));
  for (int64_t r = 0; r < group_.size(); ++r) {
    const auto [lo, hi] = overlap(param, r);
    if (hi == lo) continue;
    const Tensor to = make_view(whole, {hi - lo}, {1}, lo - begin);
    if (r == 0) to.copy_(own_values(param, lo, hi));
    else group_.recv(to, static_cast<int>(r), kTag);
  }
  return whole;
}

// ---------------------------------------------------------------- gradients (stages 2 and 3)

void ZeroOptimizer::stage_gradients(size_t u) {
  Staging& st = staging_[u];
  if (st.active || st.reduced) return;
  const nn::ParameterUnit& unit = params_.unit(u);
  // No zeroing pass: each parameter's gradient starts discarded, so the first gradient
  // backward brings is written, not added (a weight gradient's GEMM runs with beta 0), and
  // start_reduce fills any that none reached. Only the padding past the unit is zeroed.
  const int64_t padded = group_of(u).size() * pieces_[u].size;
  st.buffer = Tensor::empty({padded}, m_.dtype(), m_.device(),
                            make_owner(Category::Gradient, "zero.gradients(" + unit.name + ")"));
  if (padded > unit.numel()) st.buffer.slice(0, unit.numel(), padded).zero_();
  for (size_t i = unit.first; i < unit.last; ++i) {
    const Shape& shape = params_.spec(i).shape;
    params_[i].set_grad(make_view(st.buffer, shape, contiguous_strides(shape), params_.offset(i) - unit.begin));
    params_[i].discard_grad();
  }
  st.pending = static_cast<int>(unit.last - unit.first);
  st.active = true;
}

void ZeroOptimizer::gradient_final(size_t param) {
  const size_t u = params_.spec(param).unit;
  Staging& st = staging_[u];
  if (!st.active) {
    // A gradient made without the model saying the unit's backward began: adopt it.
    Tensor g = params_[param].grad();
    stage_gradients(u);
    if (g.defined()) params_[param].grad().copy_(g);
  }
  if (--st.pending == 0) mark_final(u);
}

// Units start in descending order only (the order backward finishes them): unit u once
// every unit after it started. Which gradients a backward reaches can differ between ranks
// (an expert no token of one rank chose), and the group's collectives must come in one
// order on all of them.
void ZeroOptimizer::mark_final(size_t u) {
  staging_[u].final = true;
  while (next_unit_ > 0 && staging_[next_unit_ - 1].final) start_reduce(--next_unit_);
}

void ZeroOptimizer::start_reduce(size_t u) {
  // At most one reduce-scatter in flight besides this one: the previous is absorbed (and
  // its staging freed) now, while this unit's starts. Memory is then freed at the same
  // points every step, whatever the wire's timing, and each reduction still overlaps the
  // backward of the next unit.
  if (in_flight_ != SIZE_MAX) absorb(in_flight_);
  in_flight_ = u;
  Staging& st = staging_[u];
  if (!st.active) stage_gradients(u);  // nothing reached it: reduce zeros, as every rank does
  const nn::ParameterUnit& unit = params_.unit(u);
  for (size_t i = unit.first; i < unit.last; ++i) {
    params_[i].grad();  // a gradient no backward reached reads (and is reduced) as zeros
    params_[i].set_grad(Tensor());
  }
  st.piece = Tensor::empty({pieces_[u].size}, m_.dtype(), m_.device(),
                           make_owner(Category::Communication, "comm:zero.reduce_scatter(" + unit.name + ")"));
  st.work = group_of(u).reduce_scatter_async(st.piece, st.buffer, ReduceOp::Sum);
  st.active = false;
  st.reduced = true;
}

void ZeroOptimizer::absorb(size_t u) {
  Staging& st = staging_[u];
  if (!st.work) return;
  st.work->wait();
  runtime::backend(m_.device()).add_inplace(piece_of(grad_shard_, u), st.piece);
  st.work = nullptr;
  st.buffer = Tensor();
  st.piece = Tensor();
}

void ZeroOptimizer::finish_microbatch() {
  if (stage_ < 2) return;
  // Every rank reduces every unit exactly once per microbatch, in the same order: the
  // units not started yet (backward did not reach all of them) are reduced now, in the
  // same descending order.
  while (next_unit_ > 0) start_reduce(--next_unit_);
  for (size_t u = 0; u < staging_.size(); ++u) {
    absorb(u);
    staging_[u].reduced = false;
    staging_[u].final = false;
  }
  next_unit_ = staging_.size();
  in_flight_ = SIZE_MAX;
  if (stage_ == 3)
    for (size_t u = 0; u < gathered_.size(); ++u) release(u, false);
}

// ---------------------------------------------------------------- the update

double ZeroOptimizer::gradient_norm() {
  runtime::Backend& backend = runtime::backend(m_.device());
  // Stage 1 holds the full all-reduced gradients, as plain data parallel does: the same
  // per-parameter sum, so the two modes clip by the same bits.
  if (stage_ == 1) return optim::gradient_norm(params_);
  return std::sqrt(group_.all_reduce_scalar(backend.sum_squares(grad_shard_), ReduceOp::Sum));
}

void ZeroOptimizer::step(double lr, double grad_scale) {
  ++t_;
  const optim::AdamWCoefficients k = optim::adamw_coefficients(config_, t_, lr, grad_scale);
  // On the meta device (a dry run) there are no values to update: the unit loop still
  // makes the gathers' buffers the real step makes.
  const bool values = !m_.device().is_meta();
  float* m = values ? m_.data<float>() : nullptr;
  float* v = values ? v_.data<float>() : nullptr;
  float* p_full = values && stage_ < 3 ? params_.flat_params().data<float>() : nullptr;
  float* p_shard = values && stage_ == 3 ? param_shard_.data<float>() : nullptr;
  float* g_full = values && stage_ == 1 ? params_.flat_grads().data<float>() : nullptr;
  float* g_shard = values && stage_ >= 2 ? grad_shard_.data<float>() : nullptr;
  // Unit by unit: this rank's pieces of the unit's parameters updated, then (stages 1 and
  // 2) the unit's all-gather started, so the wire carries unit u while AdamW updates unit
  // u + 1.
  struct Span {
    int64_t begin, n, local;  // block offset, length, offset in the shard buffers
    bool decay;
  };
  std::vector<Span> spans;
  std::vector<std::shared_ptr<Work>> gathers;
  constexpr int64_t kChunk = 1 << 14;
  for (size_t u = 0; u < pieces_.size(); ++u) {
    const Piece& piece = pieces_[u];
    const nn::ParameterUnit& unit = params_.unit(u);
    spans.clear();
    for (size_t i = unit.first; i < unit.last; ++i) {
      const int64_t a = std::max(params_.offset(i), piece.own_begin);
      const int64_t b = std::min(params_.offset(i) + params_[i].numel(), piece.own_begin + piece.own);
      const bool decay = config_.decay_all || params_.spec(i).decay;
      for (int64_t c = a; c < b; c += kChunk)
        spans.push_back({c, std::min(kChunk, b - c), piece.local + (c - piece.own_begin), decay});
    }
    if (values) {
      runtime::profiler::KernelScope scope("adamw");
#pragma omp parallel for schedule(static)
      for (size_t s = 0; s < spans.size(); ++s) {
        const Span& sp = spans[s];
        float* p = p_shard ? p_shard + sp.local : p_full + sp.begin;
        float* g = g_shard ? g_shard + sp.local : g_full + sp.begin;
        optim::adamw_update(p, g, m + sp.local, v + sp.local, sp.n, k, sp.decay, /*zero_grad=*/g_shard != nullptr);
      }
    }
    if (stage_ < 3) gathers.push_back(gather_parameters(u));
  }
  for (const auto& work : gathers)
    if (work) work->wait();
  m_.storage().bump_version();
  v_.storage().bump_version();
  if (stage_ == 1) params_.discard_grads();  // the next backward writes them afresh
  if (stage_ >= 2) grad_shard_.storage().bump_version();
  if (stage_ == 3) param_shard_.storage().bump_version();
  if (stage_ < 3) params_.flat_params().storage().bump_version();  // new values: a bf16 copy of them is stale
}

std::shared_ptr<Work> ZeroOptimizer::gather_parameters(size_t u) {
  const Tensor& flat = params_.flat_params();
  const Piece& p = pieces_[u];
  // A unit of D equal pieces is gathered in place: each rank's piece already sits where
  // the gathered unit puts it, so no buffer and no copy (NCCL's in-place all-gather has
  // the same layout). It runs while AdamW updates the next unit.
  Communicator& g = group_of(u);
  if (g.size() * p.size == p.unit_numel)
    return g.all_gather_async(range(flat, p.unit_begin, p.unit_numel), range(flat, p.own_begin, p.size));
  // Otherwise the last pieces are padded: through a send piece and a receive buffer of
  // D equal pieces, and the unit's elements copied back.
  const std::string& name = params_.unit(u).name;
  Tensor send = Tensor::empty({p.size}, flat.dtype(), flat.device(),
                              make_owner(Category::Communication, "comm:zero.all_gather(" + name + ").send"));
  if (p.own > 0) send.slice(0, 0, p.own).copy_(range(flat, p.own_begin, p.own));
  if (p.own < p.size) send.slice(0, p.own, p.size).zero_();
  Tensor recv = Tensor::empty({g.size() * p.size}, flat.dtype(), flat.device(),
                              make_owner(Category::Communication, "comm:zero.all_gather(" + name + ")"));
  g.all_gather(recv, send);
  range(flat, p.unit_begin, p.unit_numel).copy_(recv.slice(0, 0, p.unit_numel));
  return nullptr;
}

// ---------------------------------------------------------------- checkpoints

Tensor ZeroOptimizer::moment_unit(int which, size_t u) {
  const Tensor& moment = which == 0 ? m_ : v_;
  const Piece& p = pieces_[u];
  Tensor whole = Tensor::empty({group_of(u).size() * p.size}, moment.dtype(), moment.device(),
                               make_owner(Category::Communication, "comm:zero.gather_moment(" + params_.unit(u).name + ")"));
  group_of(u).all_gather(whole, piece_of(moment, u));
  return whole.slice(0, 0, p.unit_numel);
}

void ZeroOptimizer::set_moment_unit(int which, size_t u, const Tensor& values) {
  const Piece& p = pieces_[u];
  TALLY_CHECK(values.numel() == p.unit_numel, "ZeRO: ", values.numel(), " moment values for unit '",
              params_.unit(u).name, "' of ", p.unit_numel, " parameters");
  Tensor dst = piece_of(which == 0 ? m_ : v_, u);
  dst.zero_();
  const int64_t start = p.own_begin - p.unit_begin;
  if (p.own > 0) dst.slice(0, 0, p.own).copy_(values.reshape({-1}).slice(0, start, start + p.own));
}

}  // namespace tally::dist
