#include "autograd/engine.h"

#include <algorithm>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "memory/sanitizer.h"
#include "ops/ops.h"

namespace tally::autograd {

const Tensor& saved_with_graph(const SavedTensor& s);  // function.cc

namespace {
bool g_cycle_check = false;
thread_local bool t_retaining = false;

// Per-node gradient buffer: one slot per forward output of the node.
struct InputBuffer {
  std::vector<Tensor> grads;
};

void accumulate_into(InputBuffer& buf, uint32_t slot, const Tensor& grad) {
  Tensor& cur = buf.grads[slot];
  if (!cur.defined()) {
    cur = grad;
  } else {
    cur = ops::add(cur, grad);  // out of place: `cur` may alias a tensor the user holds
  }
}

// The nodes a node links to: its next edges, plus (only in the buggy pattern the
// testing hook reintroduces) the grad_fn of a tensor its context saved with its graph.
std::vector<Node*> successors(Node* n) {
  std::vector<Node*> out;
  for (const Edge& e : n->next_edges())
    if (e.node) out.push_back(e.node.get());
  if (const Context* ctx = n->context()) {
    for (const SavedTensor& s : ctx->saved_tensors()) {
      const Tensor& t = saved_with_graph(s);
      if (t.defined())
        if (auto fn = t.grad_fn()) out.push_back(fn.get());
    }
  }
  return out;
}
}  // namespace

void set_cycle_check(bool enabled) { g_cycle_check = enabled; }
bool graph_retained() { return t_retaining; }
bool cycle_check_enabled() { return g_cycle_check; }

std::vector<std::string> find_cycles(const std::vector<Tensor>& roots) {
  // Iterative three-colour DFS; a grey successor closes a cycle.
  enum Colour { White, Grey, Black };
  std::unordered_map<Node*, Colour> colour;
  std::vector<std::string> cycles;
  for (const Tensor& r : roots) {
    if (!r.defined() || !r.grad_fn()) continue;
    Node* start = r.grad_fn().get();
    if (colour[start] != White) continue;
    struct Frame {
      Node* node;
      std::vector<Node*> succ;
      size_t next = 0;
    };
    std::vector<Frame> stack;
    stack.push_back({start, successors(start)});
    colour[start] = Grey;
    while (!stack.empty()) {
      Frame& f = stack.back();
      if (f.next == f.succ.size()) {
        colour[f.node] = Black;
        stack.pop_back();
        continue;
      }
      Node* s = f.succ[f.next++];
      Colour c = colour[s];
      if (c == Grey) {
        std::string line;
        bool in_cycle = false;
        for (const Frame& g : stack) {
          if (g.node == s) in_cycle = true;
          if (in_cycle) {
            line += g.node->name();
            if (!g.node->module_path().empty()) line += "[" + g.node->module_path() + "]";
            line += " -> ";
          }
        }
        line += s->name();
        cycles.push_back(line);
      } else if (c == White) {
        colour[s] = Grey;
        stack.push_back({s, successors(s)});
      }
    }
  }
  return cycles;
}

void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads, bool retain_graph) {
  TALLY_CHECK(root_grads.empty() || root_grads.size() == roots.size(), "backward: ", roots.size(), " roots but ",
              root_grads.size(), " gradients");
  if (g_cycle_check) {
    for (const std::string& c : find_cycles(roots))
      memory::report_issue(memory::IssueKind::Cycle, "reference cycle in the autograd graph: " + c);
  }
  NoGradGuard no_grad;  // backward formulas never record graphs (no double backward)
  struct Retaining {
    bool previous = t_retaining;
    explicit Retaining(bool r) { t_retaining = r; }
    ~Retaining() { t_retaining = previous; }
  } retaining(retain_graph);

  // Seed the root edges.
  std::unordered_map<Node*, InputBuffer> buffers;
  std::vector<std::shared_ptr<Node>> root_nodes;
  for (size_t i = 0; i < roots.size(); ++i) {
    const Tensor& r = roots[i];
    TALLY_CHECK(r.defined() && r.requires_grad(), "backward: root ", i, " (", r.defined() ? r.str() : "undefined",
                ") does not require grad; nothing to differentiate");
    Tensor g = i < root_grads.size() && root_grads[i].defined() ? root_grads[i] : Tensor();
    if (!g.defined()) {
      TALLY_CHECK(r.numel() == 1, "backward: root ", r.str(),
                  " is not a scalar; pass its gradient explicitly");
      g = Tensor::ones(r.shape(), r.dtype(), r.device());
    }
    TALLY_CHECK(g.shape() == r.shape(), "backward: gradient for root ", r.str(), " has shape ", shape_str(g.shape()));
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
    for (const auto& [slot, hook] : node->pre_hooks()) {
      if (!grads[slot].defined()) continue;
      Tensor replaced = hook(grads[slot]);
      if (!replaced.defined()) continue;
      TALLY_CHECK(replaced.shape() == grads[slot].shape() && replaced.dtype() == grads[slot].dtype(),
                  "a hook on output ", slot, " of '", node->name(), "' returned ", replaced.str(), " for a gradient ",
                  grads[slot].str());
      grads[slot] = replaced;
    }
    std::vector<Tensor> input_grads;
    bool any_grad = false;
    for (const Tensor& g : grads) any_grad = any_grad || g.defined();
    if (any_grad) {  // a node no gradient reached contributes nothing; skip its backward
      memory::OwnerScope scope(node->module_path().empty() ? std::string("backward") : node->module_path());
      input_grads = node->apply(std::move(grads));
    }
    if (!retain_graph) node->release_state();  // R3: the context dies here

    const std::vector<Edge>& edges = node->next_edges();
    for (size_t i = 0; i < edges.size(); ++i) {
      const Edge& e = edges[i];
      if (!e.node) continue;
      if (i < input_grads.size() && input_grads[i].defined()) {
        auto& buf = buffers[e.node.get()];
        if (buf.grads.empty()) buf.grads.resize(e.node->num_outputs());
        accumulate_into(buf, e.input_nr, input_grads[i]);
      }
      if (--dependencies[e.node.get()] == 0) ready.push(e.node);
    }
    input_grads.clear();
    // Cut the traversed edges: a root kept alive after backward then holds only its own
    // emptied node, never the graph behind it.
    if (!retain_graph) {
      node->clear_edges();
      node->clear_hooks();  // hooks are backward state too (R3): a hook capturing a tensor must not outlive it
    }
  }
}

}  // namespace tally::autograd
