#include "autograd/engine.h"

#include <algorithm>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "autograd/observer.h"
#include "runtime/backend.h"

namespace tally::autograd {

// ---------------------------------------------------------------- observers

namespace {
struct Observers {
  std::mutex mutex;
  std::vector<EngineObserver*> list;
};
Observers& observers() {
  static auto* o = new Observers();  // never destroyed
  return *o;
}
}  // namespace

ObserverRegistration::ObserverRegistration(EngineObserver& observer) : observer_(&observer) {
  std::lock_guard<std::mutex> lock(observers().mutex);
  observers().list.push_back(observer_);
}

ObserverRegistration::~ObserverRegistration() {
  std::lock_guard<std::mutex> lock(observers().mutex);
  std::erase(observers().list, observer_);
}

std::vector<EngineObserver*> engine_observers() {
  std::lock_guard<std::mutex> lock(observers().mutex);
  return observers().list;
}

// ---------------------------------------------------------------- the engine

namespace {

// Per-node gradient buffer: one slot per forward output of the node.
struct InputBuffer {
  std::vector<Tensor> grads;
};

// Adds `grad` into slot `slot` (out of place: the slot may alias a tensor the user holds).
void accumulate_into(InputBuffer& buf, uint32_t slot, const Tensor& grad) {
  Tensor& cur = buf.grads[slot];
  if (!cur.defined()) {
    cur = grad;
    return;
  }
  Tensor sum = Tensor::empty(cur.shape(), cur.dtype(), cur.device(), current_owner("grad_sum"));
  runtime::backend(cur.device()).binary(runtime::BinaryOp::Add, sum, cur, grad);
  cur = sum;
}

std::string describe(const TensorMeta& m) {
  return std::string(dtype_name(m.dtype)) + shape_str(m.shape) + " on " + m.device.str();
}

// A gradient must match the input it is for exactly: no silent broadcasting.
void validate(const Node& node, size_t input, const Tensor& grad, const TensorMeta& meta) {
  if (grad.shape() == meta.shape && grad.dtype() == meta.dtype && grad.device() == meta.device) return;
  TALLY_FAIL("the backward of '", node.name(), "'",
             node.module_path().empty() ? std::string() : " [" + node.module_path() + "]", " returned a gradient ",
             dtype_name(grad.dtype()), shape_str(grad.shape()), " on ", grad.device().str(), " for its input ", input,
             ", which is ", describe(meta), " (a Function's gradient must have its input's shape, dtype and device)");
}

// Tells the observers the backward ended, however it ends.
struct EndNotice {
  const std::vector<EngineObserver*>& observers;
  ~EndNotice() {
    for (EngineObserver* o : observers) o->backward_ends();
  }
};

}  // namespace

namespace {
// Where a backward may go: everywhere, or (for a recomputation) only to nodes recorded
// from `first_sequence_nr` on and to leaves' accumulators.
struct Boundary {
  uint64_t first_sequence_nr = 0;
  const char* region = nullptr;
};

void check_within(const Node& n, const Boundary& boundary) {
  if (n.sequence_nr() >= boundary.first_sequence_nr || dynamic_cast<const AccumulateGrad*>(&n)) return;
  TALLY_FAIL(boundary.region, ": the recomputed region reads a tensor made by '", n.name(), "'",
             n.module_path().empty() ? std::string() : " [" + n.module_path() + "]",
             " outside the region, with a graph of its own; pass that tensor in the region's inputs, so that its "
             "gradient reaches the enclosing graph once, with the rest of its gradient");
}

void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads, bool retain_graph,
                  const Boundary& boundary);
}  // namespace

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads, bool retain_graph) {
  run_backward(roots, root_grads, retain_graph, Boundary{});
}

void backward_within(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads,
                     uint64_t first_sequence_nr, const char* region) {
  run_backward(roots, root_grads, /*retain_graph=*/false, Boundary{first_sequence_nr, region});
}

namespace {
void run_backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads, bool retain_graph,
                  const Boundary& boundary) {
  TALLY_CHECK(root_grads.empty() || root_grads.size() == roots.size(), "backward: ", roots.size(), " roots but ",
              root_grads.size(), " gradients");
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    TALLY_CHECK(r.defined() && r.requires_grad(), "backward: root ", i, " (", r.defined() ? r.str() : "undefined",
                ") does not require grad; nothing to differentiate");
  }
  const std::vector<EngineObserver*> watching = engine_observers();
  for (EngineObserver* o : watching) o->backward_begins(roots);
  EndNotice end_notice{watching};
  NoGradGuard no_grad;  // backward formulas never record graphs (no double backward)

  // Seed the root edges.
  std::unordered_map<Node*, InputBuffer> buffers;
  std::vector<std::shared_ptr<Node>> root_nodes;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    Tensor g = i < root_grads.size() && root_grads[i].defined() ? root_grads[i] : Tensor();
    if (!g.defined()) {
      TALLY_CHECK(r.numel() == 1, "backward: root ", r.str(), " is not a scalar; pass its gradient explicitly");
      g = Tensor::empty(r.shape(), r.dtype(), r.device(), current_owner("backward:root_grad"));
      g.fill_(1.0);
    }
    TALLY_CHECK(g.shape() == r.shape() && g.dtype() == r.dtype() && g.device() == r.device(), "backward: gradient ",
                g.str(), " on ", g.device().str(), " for root ", r.str(), " on ", r.device().str(),
                " (it must have the root's shape, dtype and device)");
    Edge e = gradient_edge(r);
    auto& buf = buffers[e.node.get()];
    buf.grads.resize(e.node->num_outputs());
    accumulate_into(buf, e.input_nr, g);
    root_nodes.push_back(e.node);
  }

  // Dependencies: how many edges from the reachable graph point at each node.
  std::unordered_map<Node*, int> dependencies;
  {
    std::unordered_set<Node*> seen;
    std::vector<Node*> stack;
    for (auto& n : root_nodes)
      if (seen.insert(n.get()).second) stack.push_back(n.get());
    while (!stack.empty()) {
      Node* n = stack.back();
      stack.pop_back();
      check_within(*n, boundary);
      for (const Edge& e : n->next_edges()) {
        if (!e.node) continue;
        dependencies[e.node.get()]++;
        if (seen.insert(e.node.get()).second) stack.push_back(e.node.get());
      }
    }
  }

  // Ready queue ordered by sequence number, newest first: the reverse of the forward
  // order, which frees activations in the order they were made and keeps runs reproducible.
  auto later_first = [](const std::shared_ptr<Node>& a, const std::shared_ptr<Node>& b) {
    return a->sequence_nr() < b->sequence_nr();
  };
  std::priority_queue<std::shared_ptr<Node>, std::vector<std::shared_ptr<Node>>, decltype(later_first)> ready(
      later_first);
  {
    std::unordered_set<Node*> queued;
    for (auto& n : root_nodes)
      if (dependencies[n.get()] == 0 && queued.insert(n.get()).second) ready.push(n);
  }
  root_nodes.clear();

  while (!ready.empty()) {
    std::shared_ptr<Node> node = ready.top();
    ready.pop();
    std::vector<Tensor> grads;
    {
      auto it = buffers.find(node.get());
      if (it != buffers.end()) {
        grads = std::move(it->second.grads);
        buffers.erase(it);
      }
    }
    grads.resize(node->num_outputs());
    for (const auto& entry : node->pre_hooks()) {
      const uint32_t slot = entry->output_nr;
      if (!entry->hook || slot >= grads.size() || !grads[slot].defined()) continue;
      Tensor replaced = (*entry->hook)(grads[slot]);
      if (!replaced.defined()) continue;
      TALLY_CHECK(replaced.shape() == grads[slot].shape() && replaced.dtype() == grads[slot].dtype() &&
                      replaced.device() == grads[slot].device(),
                  "a hook on output ", slot, " of '", node->name(), "' returned ", replaced.str(), " for a gradient ",
                  grads[slot].str());
      grads[slot] = replaced;
    }
    std::vector<Tensor> input_grads;
    bool any_grad = false;
    for (const Tensor& g : grads) any_grad = any_grad || g.defined();
    if (any_grad) {  // a node no gradient reached contributes nothing; skip its backward
      // The node's own path, absolute: a recomputation's inner backward runs inside the
      // checkpoint node's, and must not nest its nodes' paths under that one's.
      ModulePathScope scope(node->module_path().empty() ? std::string_view("backward") : node->module_path());
      input_grads = node->apply(std::move(grads), /*will_release=*/!retain_graph);
    }
    if (!retain_graph) node->release_state();  // R3: the context dies here

    const std::vector<Edge>& edges = node->next_edges();
    TALLY_CHECK(input_grads.size() <= edges.size(), "the backward of '", node->name(), "' returned ",
                input_grads.size(), " gradients for its ", edges.size(), " inputs");
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        validate(*node, i, input_grads[i], e.meta);
        auto& buf = buffers[e.node.get()];
        if (buf.grads.empty()) buf.grads.resize(e.node->num_outputs());
        accumulate_into(buf, e.input_nr, input_grads[i]);
      }
      if (--dependencies[e.node.get()] == 0) ready.push(e.node);
    }
    input_grads.clear();
    // A processed accumulator means its leaf gets nothing more in this backward.
    if (auto* acc = dynamic_cast<AccumulateGrad*>(node.get())) acc->finished();
    // Cut the traversed edges: a root kept alive after backward then holds only its own
    // emptied node, never the graph behind it.
    if (!retain_graph) {
      node->clear_edges();
      node->clear_hooks();  // hooks are backward state too (R3): a hook capturing a tensor must not outlive it
    }
  }
}
}  // namespace

}  // namespace tally::autograd
