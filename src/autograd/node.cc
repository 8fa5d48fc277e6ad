#include "autograd/node.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>

#include "autograd/cycles.h"
#include "autograd/function.h"
#include "autograd/grad_mode.h"
#include "runtime/backend.h"

namespace tally::autograd {

namespace {
std::atomic<uint64_t> g_next_sequence_nr{0};
void check_graph_at_exit();
}  // namespace

// The census: every live node, as an intrusive doubly linked list. Guarded by a mutex;
// nodes are created on the training thread, but a graph may be destroyed from another.
struct Census {
  std::mutex mutex;
  Node* head = nullptr;
  size_t count = 0;

  static Census& get() {
    // Never destroyed: nodes may die during static destruction.
    static auto* c = (std::atexit(check_graph_at_exit), new Census());
    return *c;
  }
  void add(Node* n) {
    std::lock_guard<std::mutex> lock(mutex);
    n->census_next_ = head;
    if (head) head->census_prev_ = n;
    head = n;
    n->registered_ = true;
    ++count;
  }
  void remove(Node* n) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!n->registered_) return;
    if (n->census_prev_) n->census_prev_->census_next_ = n->census_next_;
    else head = n->census_next_;
    if (n->census_next_) n->census_next_->census_prev_ = n->census_prev_;
    n->census_prev_ = n->census_next_ = nullptr;
    n->registered_ = false;
    --count;
  }
  // Every live node, as shared_ptrs. A node whose last owner is gone but whose
  // destructor waits for the lock fails to lock and is skipped: never handed out
  // half-destroyed.
  std::vector<std::shared_ptr<const Node>> snapshot() {
    std::lock_guard<std::mutex> lock(mutex);
    std::vector<std::shared_ptr<const Node>> out;
    out.reserve(count);
    for (Node* n = head; n; n = n->census_next_)
      if (auto p = n->weak_from_this().lock()) out.push_back(std::move(p));
    return out;
  }
};

Node::Node(uint32_t num_outputs)
    : num_outputs_(num_outputs),
      sequence_nr_(g_next_sequence_nr.fetch_add(1, std::memory_order_relaxed)),
      birth_(Clock::now()),
      module_path_(current_module_path_id()) {
  Census::get().add(this);
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

namespace {
// Whether graph nodes alive at exit are checked for reference cycles: in sanitizer
// builds, and wherever TALLY_EXIT_GRAPH_CHECK=1 (=0 turns it off).
bool exit_check_enabled() {
  if (const char* v = std::getenv("TALLY_EXIT_GRAPH_CHECK"); v && *v) return std::string(v) != "0";
#if defined(__SANITIZE_ADDRESS__)
  return true;
#else
  return false;
#endif
}

// A cycle left at exit is a leak LeakSanitizer cannot report: the census, and the ledger
// through each storage's views, reach every node and tensor in it. It ends the process
// with LeakSanitizer's exit code, naming the cycles.
void check_graph_at_exit() {
  if (!exit_check_enabled() || live_node_count() == 0) return;
  const std::vector<NodeInfo> nodes = live_nodes();
  std::vector<const Node*> starts;
  for (const NodeInfo& n : nodes) starts.push_back(n.node.get());
  const std::vector<std::string> cycles = find_cycles_from(starts);
  if (cycles.empty()) return;
  std::string report;
  for (size_t i = 0; i < cycles.size() && i < 12; ++i) report += "\n    " + cycles[i];
  if (cycles.size() > 12) report += "\n    ... and " + std::to_string(cycles.size() - 12) + " more";
  std::fprintf(stderr,
               "tally: %zu autograd node(s) are alive at exit, and %zu reference cycle(s) among them keep graphs "
               "that nothing can free (LeakSanitizer cannot report these: tally's census reaches them):%s\n",
               nodes.size(), cycles.size(), report.c_str());
  std::_Exit(23);
}
}  // namespace

void Node::unregister() { Census::get().remove(this); }

AccumulateGrad::AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf) : Node(1), leaf_(leaf) {}

std::vector<Tensor> AccumulateGrad::apply(std::vector<Tensor>&& grads, bool) {
  std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl || !grads[0].defined()) return {};  // the leaf died: nothing to accumulate into
  Tensor leaf(impl);
  Tensor grad = grads[0];
  auto* state = std::get_if<LeafState>(&detail::StateAccess::state(*impl));
  TALLY_CHECK(state, "internal: AccumulateGrad for tensor ", leaf.str(), " which is no longer a leaf");
  for (const auto& entry : state->hooks) {
    if (!entry->hook) continue;  // removed through its handle
    Tensor replaced = (*entry->hook)(grad);
    if (!replaced.defined()) continue;
    TALLY_CHECK(replaced.shape() == grad.shape() && replaced.dtype() == grad.dtype() &&
                    replaced.device() == grad.device(),
                "a hook on ", leaf.str(), " returned ", replaced.str(), " for a gradient ", grad.str());
    grad = replaced;
  }
  NoGradGuard no_grad;
  if (!state->grad.defined()) {
    // The gradient lives as long as the leaf. A registered parameter's gradient is
    // persistent model state; any other leaf's (an input, an alias of a weight) is a
    // non-persistent gradient that the sanitizer holds to its microbatch (S1).
    std::string name = leaf.name().empty() ? "grad" : leaf.name() + ".grad";
    Tensor g = Tensor::empty(leaf.shape(), leaf.dtype(), leaf.device(),
                             make_owner(Category::Gradient, name, /*persistent=*/state->parameter));
    g.copy_(grad);
    state->grad = g;
  } else if (state->grad_discarded) {
    state->grad.copy_(grad);  // the first gradient since discard_grad(): its buffer's old bytes are not a sum
    state->grad_discarded = false;
  } else {
    runtime::backend(grad.device()).add_inplace(state->grad, grad);
  }
  return {};
}

void AccumulateGrad::finished() const {
  std::shared_ptr<TensorImpl> impl = leaf_.lock();
  if (!impl) return;
  const auto* state = std::get_if<LeafState>(&detail::StateAccess::state(*impl));
  if (!state || state->post_accumulate_hooks.empty()) return;
  const Tensor leaf(impl);
  // A copy: a hook may register or remove hooks.
  const std::vector<std::shared_ptr<HookEntry>> hooks = state->post_accumulate_hooks;
  for (const auto& entry : hooks)
    if (entry->hook) (*entry->hook)(leaf);
}

Edge gradient_edge(const Tensor& t) {
  AutogradState& st = detail::StateAccess::state(t);
  if (auto* interior = std::get_if<InteriorState>(&st)) return {interior->grad_fn, interior->output_nr, TensorMeta::of(t)};
  if (auto* leaf = std::get_if<LeafState>(&st)) {
    std::shared_ptr<AccumulateGrad> acc = leaf->accumulator.lock();
    if (!acc) {
      acc = std::make_shared<AccumulateGrad>(t.impl_ptr());
      leaf->accumulator = acc;
    }
    return {acc, 0, TensorMeta::of(t)};
  }
  return {};
}

std::vector<NodeInfo> live_nodes() {
  std::vector<std::shared_ptr<const Node>> nodes = Census::get().snapshot();
  std::vector<NodeInfo> out;
  out.reserve(nodes.size());
  for (auto& n : nodes) {
    const Context* ctx = n->context();
    out.push_back({n, n->sequence_nr(), n->name(), n->module_path(), n->birth_step(), n->birth_microbatch(),
                   ctx ? ctx->num_saved() : 0, ctx ? ctx->saved_bytes() : 0,
                   dynamic_cast<const AccumulateGrad*>(n.get()) != nullptr});
  }
  return out;
}

uint64_t next_sequence_nr() { return g_next_sequence_nr.load(std::memory_order_relaxed); }

size_t live_node_count() {
  Census& c = Census::get();
  std::lock_guard<std::mutex> lock(c.mutex);
  return c.count;
}

}  // namespace tally::autograd
