#include "autograd/node.h"

#include <atomic>
#include <mutex>
#include <unordered_set>

#include "autograd/function.h"
#include "memory/owner.h"
#include "ops/ops.h"

namespace tally::autograd {

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};

// The census: every live node. Guarded by a mutex; nodes are created on the training
// thread, but a graph may be destroyed from another (e.g. a pipeline thread).
struct Census {
  std::mutex mutex;
  std::unordered_set<const Node*> nodes;
};
Census& census() {
  static auto* c = new Census();  // never destroyed: nodes may die during static destruction
  return *c;
}
}  // namespace

Node::Node(uint32_t num_outputs)
    : num_outputs_(num_outputs),
      sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)),
      birth_step_(memory::Clock::step()),
      birth_microbatch_(memory::Clock::microbatch()),
      module_path_(memory::current_module_path()) {
  std::lock_guard<std::mutex> lock(census().mutex);
  census().nodes.insert(this);
}

Node::~Node() {
  // Destroying a long chain of nodes recursively (node -> edge -> node -> ...) would
  // overflow the stack for deep graphs; move the edges of uniquely owned successors
  // onto an explicit stack first so each node dies with no edges left.
  std::vector<std::shared_ptr<Node>> pending;
  for (Edge& e : next_edges_)
    if (e.node && e.node.use_count() == 1) pending.push_back(std::move(e.node));
  next_edges_.clear();
  while (!pending.empty()) {
    std::shared_ptr<Node> n = std::move(pending.back());
    pending.pop_back();
    for (Edge& e : n->next_edges_)
      if (e.node && e.node.use_count() == 1) pending.push_back(std::move(e.node));
    n->next_edges_.clear();
  }
  unregister();
}

void Node::unregister() {
  std::lock_guard<std::mutex> lock(census().mutex);
  if (!registered_) return;
  census().nodes.erase(this);
  registered_ = false;
}

void Node::add_pre_hook(uint32_t output_nr, TensorHook hook) { pre_hooks_.emplace_back(output_nr, std::move(hook)); }

AccumulateGrad::AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf) : Node(1), leaf_(leaf) {}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads) {
  std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl || !grads[0].defined()) return {};  // the leaf died: nothing to accumulate into
  Tensor leaf(impl);
  Tensor grad = grads[0];
  auto* state = std::get_if<LeafState>(&impl->autograd());
  TALLY_CHECK(state, "internal: AccumulateGrad for tensor ", leaf.str(), " which is no longer a leaf");
  for (const TensorHook& hook : state->hooks) {
    Tensor replaced = hook(grad);
    if (!replaced.defined()) continue;
    TALLY_CHECK(replaced.shape() == grad.shape() && replaced.dtype() == grad.dtype(), "a hook on ", leaf.str(),
                " returned ", replaced.str(), " for a gradient ", grad.str());
    grad = replaced;
  }
  TALLY_CHECK(grad.shape() == leaf.shape(), "gradient for ", leaf.str(), " has shape ", shape_str(grad.shape()),
              ", expected ", shape_str(leaf.shape()));
  NoGradGuard no_grad;
  if (!state->grad.defined()) {
    // The gradient lives as long as the leaf: a persistent allocation owned by it.
    // A parameter's gradient lives as long as the parameter (persistent); the gradient of
    // any other leaf (a detached input, a test tensor) is an ordinary activation.
    std::string name = leaf.name().empty() ? "grad" : leaf.name() + ".grad";
    const bool of_parameter = leaf.storage().owner().category == memory::Category::Parameter;
    Tensor g = Tensor::empty(leaf.shape(), leaf.dtype(), leaf.device(),
                             memory::make_owner(of_parameter ? memory::Category::Gradient : memory::Category::Activation, name));
    g.copy_(grad);
    state->grad = g;
  } else {
    ops::add_(state->grad, grad);
  }
  return {};
}

Edge gradient_edge(const Tensor& t) {
  TensorImpl* impl = t.impl();
  if (auto* interior = std::get_if<InteriorState>(&impl->autograd())) return {interior->grad_fn, interior->output_nr};
  if (auto* leaf = std::get_if<LeafState>(&impl->autograd())) {
    std::shared_ptr<AccumulateGrad> acc = leaf->accumulator.lock();
    if (!acc) {
      acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
      leaf->accumulator = acc;
    }
    return {acc, 0};
  }
  return {};
}

std::vector<NodeInfo> live_nodes() {
  std::lock_guard<std::mutex> lock(census().mutex);
  std::vector<NodeInfo> out;
  out.reserve(census().nodes.size());
  for (const Node* n : census().nodes) {
    const Context* ctx = n->context();
    out.push_back({n, n->sequence_nr(), n->name(), n->module_path(), n->birth_step(), n->birth_microbatch(),
                   ctx ? ctx->num_saved() : 0, ctx ? ctx->saved_bytes() : 0});
  }
  return out;
}

uint64_t next_sequence_nr() { return g_next_sequence_nr.load(std::memory_order_relaxed); }

size_t live_node_count() {
  std::lock_guard<std::mutex> lock(census().mutex);
  return census().nodes.size();
}

}  // namespace tally::autograd
