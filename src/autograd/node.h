// Graph nodes. A Node is the backward of one forward op: it receives the gradients of
// the op's outputs and returns the gradients of its inputs, which the engine routes
// along `next_edges` to the nodes that produced those inputs.
//
// Ownership (R2): edges own the next node (the graph is a DAG of shared_ptrs pointing
// from outputs toward inputs); nothing in the graph owns a tensor except the Context's
// saved tensors, which are saved without autograd state.
//
// Every live Node is registered in a census (sanitizer S2) with the op, module path and
// step/microbatch that made it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::autograd {

class Node;
class Context;

struct Edge {
  std::shared_ptr<Node> node;  // owning: the consumer keeps its producers alive
  uint32_t input_nr = 0;       // which of node's outputs this gradient belongs to
  bool valid() const { return node != nullptr; }
};

class Node {
 public:
  explicit Node(uint32_t num_outputs);
  virtual ~Node();
  // Leaves the census; the most-derived destructor calls it first, so a concurrent census
  // never sees a half-destroyed node. Idempotent.
  void unregister();
  Node(const Node&) = delete;
  Node& operator=(const Node&) = delete;

  virtual const char* name() const = 0;
  // grads[i] is the gradient of forward output i (undefined if none flowed there: treat
  // it as zero). Returns one gradient per next edge (undefined where none is needed).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grads) = 0;
  // Destroys all backward state (R3). Called by the engine right after apply() unless
  // the graph is retained. A node whose state was released cannot run again.
  virtual void release_state() {}
  // The node's context, if it has one (saved tensors; census and cycle check).
  virtual const Context* context() const { return nullptr; }

  uint32_t num_outputs() const { return num_outputs_; }
  std::vector<Edge>& next_edges() { return next_edges_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void clear_edges() { next_edges_.clear(); }
  void clear_hooks() { pre_hooks_.clear(); }

  uint64_t sequence_nr() const { return sequence_nr_; }
  int64_t birth_step() const { return birth_step_; }
  int64_t birth_microbatch() const { return birth_microbatch_; }
  const std::string& module_path() const { return module_path_; }

  // Hooks on the gradient of forward output `output_nr` (tensor hooks of interior tensors).
  void add_pre_hook(uint32_t output_nr, TensorHook hook);
  const std::vector<std::pair<uint32_t, TensorHook>>& pre_hooks() const { return pre_hooks_; }

 private:
  uint32_t num_outputs_;
  std::vector<Edge> next_edges_;
  uint64_t sequence_nr_;
  int64_t birth_step_;
  int64_t birth_microbatch_;
  std::string module_path_;
  std::vector<std::pair<uint32_t, TensorHook>> pre_hooks_;
  bool registered_ = true;
};

// Accumulates incoming gradients into a leaf's .grad. Holds the leaf weakly (R2): a
// graph never keeps a parameter alive, and a leaf never keeps a graph alive.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf);
  ~AccumulateGrad() override { unregister(); }
  const char* name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override;
  std::shared_ptr<TensorImpl> leaf() const { return leaf_.lock(); }

 private:
  std::weak_ptr<TensorImpl> leaf_;  // non-owning
};

// The edge through which a gradient for `t` reaches the graph: its grad_fn for an
// interior tensor, its (possibly new) accumulator for a leaf that requires grad.
Edge gradient_edge(const Tensor& t);

// ---- census (S2)
struct NodeInfo {
  const Node* node;
  uint64_t sequence_nr;
  std::string op;
  std::string module_path;
  int64_t step;
  int64_t microbatch;
  size_t saved_tensors;
  int64_t saved_bytes;
};
std::vector<NodeInfo> live_nodes();
// The sequence number the next node will get: a mark to ask "born since".
uint64_t next_sequence_nr();
size_t live_node_count();

}  // namespace tally::autograd
