// Graph nodes. A Node is the backward of one forward op: it receives the gradients of
// the op's outputs and returns the gradients of its inputs, which the engine routes
// along `next_edges` to the nodes that produced those inputs.
//
// Ownership (R2): edges own the next node (the graph is a DAG of shared_ptrs pointing
// from outputs toward inputs); nothing in the graph owns a tensor except the Context's
// saved tensors, which are saved without autograd state.
//
// Every edge records what the input it leads to looked like (shape, dtype, device): the
// engine checks every gradient a node returns against it, as PyTorch's validate_outputs
// does, so a Function that returns a wrongly shaped gradient is named instead of read
// out of bounds or silently broadcast.
//
// Every live Node is registered in a census (sanitizer S2) with the op, module path and
// step/microbatch that made it.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::autograd {

class Node;
class Context;

// What a tensor looked like when it became an op's input.
struct TensorMeta {
  Shape shape;
  DType dtype = DType::F32;
  Device device;
  static TensorMeta of(const Tensor& t) { return {t.shape(), t.dtype(), t.device()}; }
};

struct Edge {
  std::shared_ptr<Node> node;  // owning: the consumer keeps its producers alive
  uint32_t input_nr = 0;       // which of node's outputs this gradient belongs to
  TensorMeta meta;             // the input this edge carries a gradient to
  bool valid() const { return node != nullptr; }
};

class Node : public std::enable_shared_from_this<Node> {
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
  // `will_release`: the engine destroys this node's state right after (no retain_graph).
  virtual std::vector<Tensor> apply(std::vector<Tensor>&& grads, bool will_release) = 0;
  // Destroys all backward state (R3). Called by the engine right after apply() unless
  // the graph is retained. A node whose state was released cannot run again.
  virtual void release_state() {}
  // The node's context, if it has one (saved tensors; census and cycle check).
  virtual const Context* context() const { return nullptr; }
  // The context object's own bytes: the cycle check (S3) scans them for tensors a
  // Function kept as plain members.
  virtual std::span<const std::byte> context_bytes() const { return {}; }

  uint32_t num_outputs() const { return num_outputs_; }
  std::vector<Edge>& next_edges() { return next_edges_; }
  const std::vector<Edge>& next_edges() const { return next_edges_; }
  void clear_edges() { next_edges_.clear(); }

  uint64_t sequence_nr() const { return sequence_nr_; }
  int64_t birth_step() const { return birth_.step; }
  int64_t birth_microbatch() const { return birth_.microbatch; }
  const std::string& module_path() const { return name_of(module_path_); }

  // Hooks on the gradient of forward output `entry->output_nr` (an interior tensor's
  // hooks). They are backward state: cleared with the node's other state.
  void add_pre_hook(std::shared_ptr<HookEntry> entry) { pre_hooks_.push_back(std::move(entry)); }
  const std::vector<std::shared_ptr<HookEntry>>& pre_hooks() const { return pre_hooks_; }
  void clear_hooks() { pre_hooks_.clear(); }

 private:
  friend struct Census;
  uint32_t num_outputs_;
  std::vector<Edge> next_edges_;
  uint64_t sequence_nr_;
  Clock::Reading birth_;
  NameId module_path_;
  std::vector<std::shared_ptr<HookEntry>> pre_hooks_;  // owning
  // The census is an intrusive list: registering a node allocates nothing.
  Node* census_prev_ = nullptr;
  Node* census_next_ = nullptr;
  bool registered_ = false;
};

// Accumulates incoming gradients into a leaf's .grad. Holds the leaf weakly (R2): a
// graph never keeps a parameter alive, and a leaf never keeps a graph alive.
class AccumulateGrad final : public Node {
 public:
  explicit AccumulateGrad(const std::shared_ptr<TensorImpl>& leaf);
  ~AccumulateGrad() override { unregister(); }
  const char* name() const override { return "AccumulateGrad"; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads, bool will_release) override;
  std::shared_ptr<TensorImpl> leaf() const { return leaf_.lock(); }
  // The backward gave the leaf its last contribution: runs its post-accumulate hooks.
  void finished() const;

 private:
  std::weak_ptr<TensorImpl> leaf_;  // non-owning
};

// The edge through which a gradient for `t` reaches the graph: its grad_fn for an
// interior tensor, its (possibly new) accumulator for a leaf that requires grad.
Edge gradient_edge(const Tensor& t);

// ---- census (S2)
struct NodeInfo {
  std::shared_ptr<const Node> node;  // kept alive while the caller holds the info
  uint64_t sequence_nr;
  const char* op;
  std::string module_path;
  int64_t step;
  int64_t microbatch;
  size_t saved_tensors;
  int64_t saved_bytes;
  bool accumulator;  // an AccumulateGrad: it belongs to its leaf, shared by every graph using it
};
std::vector<NodeInfo> live_nodes();
// The sequence number the next node will get.
uint64_t next_sequence_nr();
size_t live_node_count();

// Wires `node` to `inputs` (next edges, each with the input's metadata) and marks
// `outputs` interior tensors of it (declared here, where StateAccess names it a friend).
void connect(Node& node, const std::shared_ptr<Node>& self, const std::vector<Tensor>& inputs,
             const std::vector<Tensor>& outputs);

namespace detail {
// The only code that changes a tensor's autograd state (R1 is enforced here and in
// Tensor's own leaf methods). Its accessors are private to the autograd code named below,
// so user code cannot reset a tensor's state (`state(t) = LeafState{}` does not compile).
struct StateAccess {
 private:
  friend class tally::autograd::AccumulateGrad;
  friend class tally::autograd::Context;
  friend Edge tally::autograd::gradient_edge(const Tensor& t);
  friend void tally::autograd::connect(Node& node, const std::shared_ptr<Node>& self,
                                       const std::vector<Tensor>& inputs, const std::vector<Tensor>& outputs);
  static AutogradState& state(const Tensor& t) { return t.impl()->autograd_; }
  static AutogradState& state(TensorImpl& impl) { return impl.autograd_; }
};
}  // namespace detail

}  // namespace tally::autograd
