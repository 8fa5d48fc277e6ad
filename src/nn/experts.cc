// A sparse layer's MLP (Qwen3-MoE, as HuggingFace's Qwen3MoeSparseMoeBlock computes it):
//   probs   = softmax(h W_router^T)              (N, E), fp32
//   top-k   = the k largest probabilities of each token, their experts e_1..e_k
//   weights = those k probabilities, renormalized to sum to 1 when norm_topk_prob
//   out     = sum_j weights_j * expert_{e_j}(h),  expert(x) = W_down (silu(W_gate x) * W_up x)
// Tensor parallel splits each expert as a dense MLP (gate and up by rows, down by
// columns): every rank routes the same tokens, its slices' outputs are partial sums, and
// the layer's output is summed over the group once, after the weighted combine (linear in
// them). The routing weights' gradient is then a partial sum too, so the router's gradient
// is summed over the group as Qwen3's q/k norms' are (TpSplit::SharedBySlices).
// Dropless: every token reaches its k experts. The N*k (token, slot) pairs are grouped by
// expert, so each expert runs one GEMM over its tokens' rows (a grouped GEMM as a loop over
// the experts), and the outputs return to their tokens by the inverse grouping. At a
// capacity (set_expert_capacity_factor) every expert has the same rows, padded, and the
// pairs past it are dropped. Under expert parallel the grouped rows travel to the rank that
// holds their expert and back (expert_parallel_mlps; nn/expert_parallel.h). The
// gradient reaches h through the experts and through the routing weights (the router); the
// choice of experts itself has none, as in HuggingFace's.
//
// Routing reads the probabilities on the host. On the meta device (the dry run) there are
// none: tokens are routed round-robin, every expert taking N*k/E of them (the balanced
// bound). The saved activations are N*k rows whatever the routing; a skewed one makes the
// busiest expert's GEMMs, and the transients of its backward, larger than this bound's.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "nn/transformer.h"
#include "ops/ops.h"

namespace tally::nn {
namespace {

// Where each (token, slot) pair goes: `expert` (N, k), the pairs grouped by expert
// (`grouped`: pair indices n*k + j, each expert's in token order), and each expert's rows.
// Dropless, an expert's rows are its pairs. With a capacity of c rows, every expert has c
// rows: its first c pairs in token order, then padding rows (token 0 at weight 0: they add
// exact zeros and take no gradient); pairs past c are dropped (their slot adds zero).
// Padding row index N*k stands for the zero weight, and grouped row `rows` for the zero
// output a dropped pair reads.
struct Routing {
  Tensor expert;        // (N, k) int64, for gathering the routing weights
  Tensor grouped_token;  // (rows) int64: the token of each grouped row
  Tensor grouped_pair;   // (rows) int64: the pair each grouped row is (N*k: padding)
  Tensor pair_position;  // (N*k) int64: where pair n*k + j sits among the grouped rows
  std::vector<int64_t> count;  // (E): each expert's rows
  std::vector<int64_t> load;   // (E): each expert's pairs (count, dropless)
  int64_t dropped = 0;         // pairs past their expert's capacity
};

Tensor index_tensor(const std::vector<int64_t>& values, const Shape& shape, Device device) {
  Tensor t = Tensor::empty(shape, DType::I64, device, make_owner(Category::Activation, "moe.routing"));
  if (!device.is_meta()) std::copy(values.begin(), values.end(), t.data<int64_t>());
  return t;
}

// Each token's k most probable experts, largest first (ties to the lower index, as
// torch.topk on the CPU), or on the meta device the balanced round-robin.
std::vector<int64_t> top_k_experts(const Tensor& probs, int64_t k) {
  const int64_t N = probs.shape()[0], E = probs.shape()[1];
  std::vector<int64_t> chosen(static_cast<size_t>(N * k));
  if (probs.device().is_meta()) {
    for (int64_t i = 0; i < N * k; ++i) chosen[static_cast<size_t>(i)] = i % E;
    return chosen;
  }
  TALLY_CHECK(probs.device().is_cpu() && probs.dtype() == DType::F32 && probs.is_contiguous(),
              "experts: routing runs on the CPU's fp32 probabilities; got ", probs.str());
  const float* p = probs.data<float>();
  std::vector<int64_t> order(static_cast<size_t>(E));
  for (int64_t n = 0; n < N; ++n) {
    const float* row = p + n * E;
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); });
    std::copy(order.begin(), order.begin() + k, chosen.begin() + n * k);
  }
  return chosen;
}

// `capacity`: rows an expert takes (0: dropless).
Routing route(const Tensor& probs, int64_t k, int64_t capacity) {
  const int64_t N = probs.shape()[0], E = probs.shape()[1];
  const std::vector<int64_t> chosen = top_k_experts(probs, k);
  Routing r;
  r.load.assign(static_cast<size_t>(E), 0);
  for (int64_t e : chosen) ++r.load[static_cast<size_t>(e)];
  r.count = r.load;
  if (capacity > 0) r.count.assign(static_cast<size_t>(E), capacity);
  std::vector<int64_t> offset(static_cast<size_t>(E), 0), end(static_cast<size_t>(E));
  for (int64_t e = 1; e < E; ++e) offset[e] = offset[e - 1] + r.count[e - 1];
  for (int64_t e = 0; e < E; ++e) end[e] = offset[e] + r.count[e];
  const int64_t rows = offset[E - 1] + r.count[E - 1];
  std::vector<int64_t> token(static_cast<size_t>(rows), 0), pair(static_cast<size_t>(rows), N * k),
      position(static_cast<size_t>(N * k));
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t e = chosen[i];
    if (offset[e] == end[e]) {  // past its expert's capacity
      position[i] = rows;
      ++r.dropped;
      continue;
    }
    const int64_t at = offset[e]++;
    token[at] = i / k;
    pair[at] = i;
    position[i] = at;
  }
  const Device d = probs.device();
  r.expert = index_tensor(chosen, {N, k}, d);
  r.grouped_token = index_tensor(token, {rows}, d);
  r.grouped_pair = index_tensor(pair, {rows}, d);
  r.pair_position = index_tensor(position, {N * k}, d);
  return r;
}

// Each expert's choices (E) as fp32, a factor of the balance losses (no values on the meta
// device).
Tensor choice_counts(const std::vector<int64_t>& count, Device device) {
  Tensor t = Tensor::empty({static_cast<int64_t>(count.size())}, DType::F32, device,
                           make_owner(Category::Activation, "moe.router_counts"));
  if (!device.is_meta()) std::copy(count.begin(), count.end(), t.data<float>());
  return t;
}

// A zero row appended to `t` (n, w): what padding rows and dropped pairs read.
Tensor with_zero_row(const Tensor& t) {
  const Tensor zero = Tensor::zeros({1, t.shape()[1]}, t.dtype(), t.device(), make_owner(Category::Activation, "moe.capacity"));
  return ops::cat({t, zero}, 0);
}

}  // namespace

Tensor Transformer::experts(const Tensor& h, int64_t l) const {
  const auto& c = config_;
  const Layer& p = layers_[static_cast<size_t>(l)];
  const int64_t C = c.n_embd, k = c.experts_per_token;
  TALLY_CHECK(shard_.ep == 1 || ep_ops_, "internal: a shard of ", local_experts(), " of ", c.n_experts,
              " experts runs without its expert-parallel group");
  TALLY_CHECK(!h.device().is_cuda(), "experts: Qwen3-MoE's sparse layers run on the CPU only so far (got ", h.str(), ")");
  // Tensor parallel: every rank routes the same tokens (all of them, under sequence
  // parallel) and holds a slice of every expert, as of a dense MLP; what it returns is its
  // slices' part of the output, summed over the group at the end (tensor_parallel.h).
  const Tensor whole = tp_ops_ ? tp_ops_->into_column_parallel(h) : h;
  const int64_t B = whole.shape()[0], T = whole.shape()[1], N = B * T;
  const Tensor x = ops::reshape(whole, {N, C});
  Tensor logits, probs;
  {
    OwnerScope scope("router");
    logits = linear(x, p.routerw, kAbsent);
    probs = ops::softmax(logits);  // (N, E)
  }
  const int64_t capacity = expert_capacity(N);
  const Routing r = route(probs, k, capacity);
  if (autograd::grad_enabled()) count_expert_load(r.load, r.dropped, l);
  if (c.router_aux_loss_coef > 0 && autograd::grad_enabled()) {
    // The loss spans every sparse layer's tokens at once, so it is made at the head, in
    // the forward that runs them all (not a pipeline's chunks, nor a recomputed layer).
    TALLY_CHECK(shard_.chunks.size() == 1 && shard_.chunks[0].embed && shard_.chunks[0].head,
                "the router's load-balancing loss (output_router_logits) is not supported under --pp yet");
    TALLY_CHECK(recompute_ != Recompute::Full,
                "the router's load-balancing loss (output_router_logits) is not supported under --recompute full yet");
    TALLY_CHECK(!tp_ops_, "the router's load-balancing loss (output_router_logits) is not supported under --tp yet");
    router_records_.push_back({ops::sum(probs, {0}), r.load, N});
  }
  Tensor weights = ops::gather(probs, 1, r.expert);  // (N, k)
  if (c.norm_topk_prob) weights = ops::div(weights, ops::sum(weights, {1}, true));
  const Tensor rows = ops::embedding(x, r.grouped_token);  // (rows, C), grouped by expert
  const Tensor outputs = ep_ops_ ? expert_parallel_mlps(rows, r.count, l) : local_mlps(rows, r.count, l);
  // Weighted by their routing weights, back in (token, slot) order, summed over the slots.
  const Tensor pair_weights = ops::reshape(weights, {N * k, 1});
  const Tensor grouped_weight = ops::embedding(capacity ? with_zero_row(pair_weights) : pair_weights, r.grouped_pair);
  const Tensor weighted = ops::mul(outputs, grouped_weight);
  const Tensor by_pair = ops::embedding(capacity ? with_zero_row(weighted) : weighted, r.pair_position);  // (N*k, C)
  Tensor out = ops::reshape(ops::sum(ops::reshape(by_pair, {N, k, C}), {1}), {B, T, C});
  if ((router_losses_.balance > 0 || router_losses_.z > 0) && autograd::grad_enabled())
    out = with_router_losses(out, logits, probs, r.load);
  return tp_ops_ ? tp_ops_->out_of_row_parallel(out) : out;
}

namespace {

// z = 1/N sum_n lse_n^2 over logits (N, E), lse_n = log sum_e exp z_ne;
// dz/dz_ne = 2 lse_n softmax(z)_ne / N.
struct RouterZLoss {
  static constexpr const char* kName = "router_z_loss";
  struct Context : autograd::Context {};  // saved: logits; kept: lse (f64)
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    const Tensor logits = ctx.saved(0), lse = ctx.saved(1);
    const int64_t N = logits.shape()[0], E = logits.shape()[1];
    Tensor d = Tensor::empty({N, E}, DType::F32, logits.device(), current_owner("router_z_loss_grad"));
    if (logits.device().is_meta()) return {d};
    const double g = grads[0].item();
    const float* z = logits.data<float>();
    const double* l = lse.data<double>();
    float* dp = d.data<float>();
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e)
        dp[n * E + e] = static_cast<float>(g * 2 * l[n] * std::exp(z[n * E + e] - l[n]) / static_cast<double>(N));
    return {d};
  }
};

Tensor router_z_loss(const Tensor& logits_in) {
  const Tensor logits = logits_in.contiguous();
  const int64_t N = logits.shape()[0], E = logits.shape()[1];
  TALLY_CHECK(logits.dtype() == DType::F32, "experts: the router z-loss reads fp32 logits, got ", logits.str());
  Tensor loss = Tensor::empty({}, DType::F32, logits.device(), current_owner("router_z_loss"));
  Tensor lse = Tensor::empty({N}, DType::F64, logits.device(), current_owner("router_z_loss_lse"));
  if (!logits.device().is_meta()) {
    const float* z = logits.data<float>();
    double* l = lse.data<double>();
    double total = 0;
    for (int64_t n = 0; n < N; ++n) {
      const float* row = z + n * E;
      const double m = *std::max_element(row, row + E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(row[e] - m);
      l[n] = m + std::log(sum);
      total += l[n] * l[n];
    }
    loss.data<float>()[0] = static_cast<float>(total / static_cast<double>(N));
  }
  if (autograd::needs_graph({logits_in})) {
    auto ctx = std::make_unique<RouterZLoss::Context>();
    ctx->save_for_backward({logits});
    ctx->keep(lse);
    autograd::record<RouterZLoss>(std::move(ctx), {logits}, {loss});
  }
  return loss;
}

// An identity on x whose backward also seeds `loss` with `weight` (d objective / d loss):
// a loss made inside the model joins the objective where the model runs.
struct SeedLoss {
  static constexpr const char* kName = "seed_router_loss";
  struct Context : autograd::Context {
    double weight = 0;
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    return {grads[0], Tensor::full({}, ctx.weight, DType::F32, grads[0].device())};
  }
};

Tensor seeded(const Tensor& x, const Tensor& loss, double weight) {
  if (!autograd::needs_graph({x, loss})) return x;
  Tensor out = x.detach();  // the same values, a fresh tensor for the seed's output
  auto ctx = std::make_unique<SeedLoss::Context>();
  ctx->weight = weight;
  autograd::record<SeedLoss>(std::move(ctx), {x, loss}, {out});
  return out;
}

}  // namespace

// Under tensor parallel every rank routes the same tokens and computes the same losses,
// and their gradients are summed over the group (the router's, and the layer input's in
// the column-parallel input's backward): each rank seeds 1 / T of them.
Tensor Transformer::with_router_losses(const Tensor& out, const Tensor& logits, const Tensor& probs,
                                       const std::vector<int64_t>& load) const {
  const int64_t N = probs.shape()[0], E = config_.n_experts, k = config_.experts_per_token;
  const double share = 1.0 / (tp_ops_ ? tp_ops_->size() : 1);
  Tensor x = out;
  OwnerScope scope("router_loss");
  if (router_losses_.balance > 0) {
    const Tensor counts = choice_counts(load, probs.device());
    const double n = static_cast<double>(N);
    const Tensor balance = ops::scale(ops::sum(ops::mul(ops::sum(probs, {0}), counts)),
                                      static_cast<double>(E) / (n * n * static_cast<double>(k)));
    if (!balance.device().is_meta()) router_loss_values_.balance += balance.item();
    x = seeded(x, balance, router_losses_.balance * share);
  }
  if (router_losses_.z > 0) {
    const Tensor z = router_z_loss(logits);
    if (!z.device().is_meta()) router_loss_values_.z += z.item();
    x = seeded(x, z, router_losses_.z * share);
  }
  return x;
}

Transformer::RouterLosses Transformer::take_router_loss_values() const {
  const RouterLosses values = router_loss_values_;
  router_loss_values_ = {};
  return values;
}

// This shard's experts over their blocks of `rows` (count[j] rows for local expert j, one
// block after another), each its SwiGLU MLP: one GEMM per expert and projection. The
// blocks are one split, whose backward writes the rows' gradient once, block by block.
Tensor Transformer::local_mlps(const Tensor& rows, const std::vector<int64_t>& count, int64_t l) const {
  const Layer& p = layers_[static_cast<size_t>(l)];
  const std::vector<Tensor> blocks = ops::split(rows, count, 0);
  std::vector<Tensor> outputs;
  for (size_t j = 0; j < count.size(); ++j) {
    if (count[j] == 0) continue;
    OwnerScope scope("experts." + std::to_string(first_expert() + static_cast<int64_t>(j)));
    const Tensor gate = linear(blocks[j], p.expert_gate[j], kAbsent, matmul_dtype_);
    const Tensor up = linear(blocks[j], p.expert_up[j], kAbsent, matmul_dtype_);
    outputs.push_back(linear(ops::swiglu(gate, up), p.expert_down[j], kAbsent));
  }
  // A shard whose experts took no rows returns the empty rows themselves, with their graph.
  return outputs.empty() ? rows : outputs.size() == 1 ? outputs[0] : ops::cat(outputs, 0);
}

// Expert parallel (nn/expert_parallel.h): the rows, grouped by expert and so by the rank
// that holds it, go to their ranks; each rank regroups what it received (source by
// source, each source's by expert) by expert, runs its experts, and sends the outputs
// back the way they came. On the meta device (a dry run) every rank routes the balanced
// bound alike, so each receives from every rank what it sends itself.
Tensor Transformer::expert_parallel_mlps(const Tensor& rows, const std::vector<int64_t>& count, int64_t l) const {
  const int S = ep_ops_->size();
  const int64_t El = local_experts(), first = first_expert();
  std::vector<int64_t> send_rows(static_cast<size_t>(S), 0);
  for (int s = 0; s < S; ++s)
    for (int64_t j = 0; j < El; ++j) send_rows[static_cast<size_t>(s)] += count[static_cast<size_t>(s * El + j)];
  std::vector<int64_t> received(static_cast<size_t>(S * El));  // [source][local expert]
  if (rows.device().is_meta()) {
    for (int s = 0; s < S; ++s)
      std::copy(count.begin() + first, count.begin() + first + El, received.begin() + s * El);
  } else {
    received = ep_ops_->exchange_counts(count);
  }
  std::vector<int64_t> recv_rows(static_cast<size_t>(S), 0), per_expert(static_cast<size_t>(El), 0);
  for (int s = 0; s < S; ++s)
    for (int64_t j = 0; j < El; ++j) {
      recv_rows[static_cast<size_t>(s)] += received[static_cast<size_t>(s * El + j)];
      per_expert[static_cast<size_t>(j)] += received[static_cast<size_t>(s * El + j)];
    }
  // Where each received row (source-major) goes among the rows grouped by expert.
  int64_t total = 0;
  for (int64_t n : recv_rows) total += n;
  std::vector<int64_t> expert_start(static_cast<size_t>(El), 0);
  for (int64_t j = 1; j < El; ++j) expert_start[j] = expert_start[j - 1] + per_expert[j - 1];
  std::vector<int64_t> by_expert(static_cast<size_t>(total)), by_source(static_cast<size_t>(total));
  int64_t at = 0;
  for (int s = 0; s < S; ++s)
    for (int64_t j = 0; j < El; ++j)
      for (int64_t i = 0; i < received[static_cast<size_t>(s * El + j)]; ++i, ++at) {
        const int64_t to = expert_start[j]++;
        by_expert[to] = at;  // row `to` of the expert grouping is received row `at`
        by_source[at] = to;
      }
  const Device d = rows.device();
  const Tensor arrived = ep_ops_->exchange(rows, send_rows, recv_rows);
  const Tensor grouped = S == 1 ? arrived : ops::embedding(arrived, index_tensor(by_expert, {total}, d));
  const Tensor out = local_mlps(grouped, per_expert, l);
  const Tensor back = S == 1 ? out : ops::embedding(out, index_tensor(by_source, {total}, d));
  return ep_ops_->exchange(back, recv_rows, send_rows);
}

std::vector<int64_t> Transformer::take_expert_load() const {
  std::vector<int64_t> load;
  load.swap(expert_load_);
  return load;
}

int64_t Transformer::expert_capacity(int64_t tokens) const {
  if (capacity_factor_ <= 0) return 0;
  const double pairs = static_cast<double>(tokens * config_.experts_per_token);
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(capacity_factor_ * pairs / static_cast<double>(config_.n_experts))));
}

void Transformer::set_expert_capacity_factor(double factor) {
  TALLY_CHECK(factor == 0 || factor > 0, "--moe-capacity-factor must be 0 (dropless) or positive, got ", factor);
  capacity_factor_ = factor;
}

int64_t Transformer::take_dropped_pairs() const {
  const int64_t dropped = dropped_pairs_;
  dropped_pairs_ = 0;
  return dropped;
}

void Transformer::count_expert_load(const std::vector<int64_t>& count, int64_t dropped, int64_t l) const {
  const auto& c = config_;
  dropped_pairs_ += dropped;
  const int64_t sparse_before = c.sparse_layers_before(l);
  expert_load_.resize(static_cast<size_t>(c.sparse_layer_count() * c.n_experts), 0);
  for (int64_t e = 0; e < c.n_experts; ++e) expert_load_[static_cast<size_t>(sparse_before * c.n_experts + e)] += count[e];
}

Tensor Transformer::take_router_loss() const {
  if (router_records_.empty()) return Tensor();
  // aux = E / R^2 * sum_e C_e S_e: C_e the choices of e, S_e the sum of its probabilities,
  // both over all R rows of all sparse layers.
  const int64_t E = config_.n_experts;
  std::vector<int64_t> count(static_cast<size_t>(E), 0);
  int64_t rows = 0;
  Tensor sum;
  for (const RouterRecord& record : router_records_) {
    for (int64_t e = 0; e < E; ++e) count[static_cast<size_t>(e)] += record.count[static_cast<size_t>(e)];
    rows += record.tokens;
    sum = sum.defined() ? ops::add(sum, record.probability_sum) : record.probability_sum;
  }
  router_records_.clear();
  const Tensor counts = choice_counts(count, sum.device());
  const double R = static_cast<double>(rows);
  return ops::scale(ops::sum(ops::mul(sum, counts)), static_cast<double>(E) / (R * R));
}

}  // namespace tally::nn
