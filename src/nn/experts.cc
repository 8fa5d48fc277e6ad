// A sparse layer's MLP (Qwen3-MoE, as HuggingFace's Qwen3MoeSparseMoeBlock computes it):
//   probs   = softmax(h W_router^T)              (N, E), fp32
//   top-k   = the k largest probabilities of each token, their experts e_1..e_k
//   weights = those k probabilities, renormalized to sum to 1 when norm_topk_prob
//   out     = sum_j weights_j * expert_{e_j}(h),  expert(x) = W_down (silu(W_gate x) * W_up x)
// Dropless: every token reaches its k experts. The N*k (token, slot) pairs are grouped by
// expert, so each expert runs one GEMM over its tokens' rows (a grouped GEMM as a loop over
// the experts), and the outputs return to their tokens by the inverse grouping. The
// gradient reaches h through the experts and through the routing weights (the router); the
// choice of experts itself has none, as in HuggingFace's.
//
// Routing reads the probabilities on the host. On the meta device (the dry run) there are
// none: tokens are routed round-robin, every expert taking N*k/E of them (the balanced
// bound). The saved activations are N*k rows whatever the routing; a skewed one makes the
// busiest expert's GEMMs, and the transients of its backward, larger than this bound's.
#include <numeric>

#include "core/error.h"
#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "nn/transformer.h"
#include "ops/ops.h"

namespace tally::nn {
namespace {

// Where each (token, slot) pair goes: `expert` (N, k), the pairs grouped by expert
// (`grouped`: pair indices n*k + j, each expert's in token order), and each expert's count.
struct Routing {
  Tensor expert;        // (N, k) int64, for gathering the routing weights
  Tensor grouped_token;  // (N*k) int64: the token of each grouped pair
  Tensor grouped_pair;   // (N*k) int64: the pair each grouped row is
  Tensor pair_position;  // (N*k) int64: where pair n*k + j sits among the grouped rows
  std::vector<int64_t> count;  // (E)
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

Routing route(const Tensor& probs, int64_t k) {
  const int64_t N = probs.shape()[0], E = probs.shape()[1];
  const std::vector<int64_t> chosen = top_k_experts(probs, k);
  Routing r;
  r.count.assign(static_cast<size_t>(E), 0);
  for (int64_t e : chosen) ++r.count[static_cast<size_t>(e)];
  std::vector<int64_t> offset(static_cast<size_t>(E), 0);
  for (int64_t e = 1; e < E; ++e) offset[e] = offset[e - 1] + r.count[e - 1];
  std::vector<int64_t> token(static_cast<size_t>(N * k)), pair(static_cast<size_t>(N * k)),
      position(static_cast<size_t>(N * k));
  for (int64_t i = 0; i < N * k; ++i) {
    const int64_t at = offset[chosen[i]]++;
    token[at] = i / k;
    pair[at] = i;
    position[i] = at;
  }
  const Device d = probs.device();
  r.expert = index_tensor(chosen, {N, k}, d);
  r.grouped_token = index_tensor(token, {N * k}, d);
  r.grouped_pair = index_tensor(pair, {N * k}, d);
  r.pair_position = index_tensor(position, {N * k}, d);
  return r;
}

}  // namespace

Tensor Transformer::experts(const Tensor& h, int64_t l) const {
  const auto& c = config_;
  const Layer& p = layers_[static_cast<size_t>(l)];
  const int64_t B = h.shape()[0], T = h.shape()[1], C = c.n_embd, k = c.experts_per_token, N = B * T;
  TALLY_CHECK(!h.device().is_cuda(), "experts: Qwen3-MoE's sparse layers run on the CPU only so far (got ", h.str(), ")");
  const Tensor x = ops::reshape(h, {N, C});
  Tensor probs;
  {
    OwnerScope scope("router");
    probs = ops::softmax(linear(x, p.routerw, kAbsent));  // (N, E)
  }
  const Routing r = route(probs, k);
  if (autograd::grad_enabled()) count_expert_load(r.count, l);
  if (c.router_aux_loss_coef > 0 && autograd::grad_enabled()) {
    // The loss spans every sparse layer's tokens at once, so it is made at the head, in
    // the forward that runs them all (not a pipeline's chunks, nor a recomputed layer).
    TALLY_CHECK(shard_.chunks.size() == 1 && shard_.chunks[0].embed && shard_.chunks[0].head,
                "the router's load-balancing loss (output_router_logits) is not supported under --pp yet");
    TALLY_CHECK(recompute_ != Recompute::Full,
                "the router's load-balancing loss (output_router_logits) is not supported under --recompute full yet");
    router_records_.push_back({ops::sum(probs, {0}), r.count, N});
  }
  Tensor weights = ops::gather(probs, 1, r.expert);  // (N, k)
  if (c.norm_topk_prob) weights = ops::div(weights, ops::sum(weights, {1}, true));
  // Each expert's tokens, one block of rows each, through its SwiGLU MLP.
  const Tensor rows = ops::embedding(x, r.grouped_token);  // (N*k, C)
  std::vector<Tensor> outputs;
  int64_t begin = 0;
  for (int64_t e = 0; e < c.n_experts; ++e) {
    const int64_t n = r.count[static_cast<size_t>(e)];
    if (n == 0) continue;
    OwnerScope scope("experts." + std::to_string(e));
    const Tensor in = ops::slice(rows, 0, begin, begin + n);
    const Tensor gate = linear(in, p.expert_gate[static_cast<size_t>(e)], kAbsent, matmul_dtype_);
    const Tensor up = linear(in, p.expert_up[static_cast<size_t>(e)], kAbsent, matmul_dtype_);
    outputs.push_back(linear(ops::swiglu(gate, up), p.expert_down[static_cast<size_t>(e)], kAbsent));
    begin += n;
  }
  // Weighted by their routing weights, back in (token, slot) order, summed over the slots.
  const Tensor grouped_weight = ops::embedding(ops::reshape(weights, {N * k, 1}), r.grouped_pair);  // (N*k, 1)
  const Tensor weighted = ops::mul(ops::cat(outputs, 0), grouped_weight);
  const Tensor by_pair = ops::embedding(weighted, r.pair_position);  // (N*k, C)
  return ops::reshape(ops::sum(ops::reshape(by_pair, {N, k, C}), {1}), {B, T, C});
}

std::vector<int64_t> Transformer::take_expert_load() const {
  std::vector<int64_t> load;
  load.swap(expert_load_);
  return load;
}

void Transformer::count_expert_load(const std::vector<int64_t>& count, int64_t l) const {
  const auto& c = config_;
  const int64_t sparse_before = c.sparse_layers_before(l);
  expert_load_.resize(static_cast<size_t>(c.sparse_layer_count() * c.n_experts), 0);
  for (int64_t e = 0; e < c.n_experts; ++e) expert_load_[static_cast<size_t>(sparse_before * c.n_experts + e)] += count[e];
}

Tensor Transformer::take_router_loss() const {
  if (router_records_.empty()) return Tensor();
  // aux = E / R^2 * sum_e C_e S_e: C_e the choices of e, S_e the sum of its probabilities,
  // both over all R rows of all sparse layers.
  const int64_t E = config_.n_experts;
  std::vector<float> count(static_cast<size_t>(E), 0.f);
  int64_t rows = 0;
  Tensor sum;
  for (const RouterRecord& record : router_records_) {
    for (int64_t e = 0; e < E; ++e) count[static_cast<size_t>(e)] += static_cast<float>(record.count[static_cast<size_t>(e)]);
    rows += record.tokens;
    sum = sum.defined() ? ops::add(sum, record.probability_sum) : record.probability_sum;
  }
  router_records_.clear();
  Tensor counts = Tensor::empty({E}, DType::F32, sum.device(), make_owner(Category::Activation, "moe.router_counts"));
  if (!counts.device().is_meta()) std::copy(count.begin(), count.end(), counts.data<float>());
  const double R = static_cast<double>(rows);
  return ops::scale(ops::sum(ops::mul(sum, counts)), static_cast<double>(E) / (R * R));
}

}  // namespace tally::nn
