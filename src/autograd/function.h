// The Function API: how every differentiable op (built-in or user-written) records
// its backward.
//
//   struct Scale {
//     static constexpr const char* kName = "scale";
//     struct Context : autograd::Context { double factor; };   // all backward state
//     static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads);
//   };
//   Tensor scale(const Tensor& x, double f) {
//     Tensor out = ...;                                          // compute
//     if (autograd::needs_graph({x})) {
//       auto ctx = std::make_unique<Scale::Context>();
//       ctx->factor = f;                                         // or ctx->save_for_backward({x})
//       autograd::record<Scale>(std::move(ctx), {x}, {out});
//     }
//     return out;
//   }
//
// R3 by construction: the Context is the only object a Function has, it is owned by its
// node, and the engine destroys it (saved tensors and every other member) right after
// the node's backward runs unless the graph is retained. Storing extra tensors on the
// context (the TransformerEngine bug) therefore cannot outlive the backward.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "autograd/grad_mode.h"
#include "autograd/node.h"
#include "core/tensor.h"

namespace tally::autograd {

// A tensor kept for backward. It keeps the data alive but never the autograd state
// (R2): saving an op's own output can't form a cycle. It remembers the storage version
// to detect in-place modification between forward and backward.
class SavedTensor {
 public:
  SavedTensor() = default;
  explicit SavedTensor(const Tensor& t);
  ~SavedTensor();
  SavedTensor(SavedTensor&& other) noexcept;
  SavedTensor& operator=(SavedTensor&&) = delete;
  SavedTensor(const SavedTensor&) = delete;
  Tensor unpack(const char* op) const;
  const Tensor& data() const { return data_; }
  bool defined() const { return data_.defined(); }

 private:
  friend struct testing_access;
  Tensor data_;
  uint64_t version_ = 0;
  Tensor with_graph_;  // only set by testing::save_keeping_graph (reintroduces seed 000)
};

class Context {
 public:
  Context();
  virtual ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  void save_for_backward(const std::vector<Tensor>& tensors);
  Tensor saved(size_t i) const;
  size_t num_saved() const { return saved_.size(); }
  const std::vector<SavedTensor>& saved_tensors() const { return saved_; }
  int64_t saved_bytes() const;

  // needs_input_grad(i): whether forward input i needs a gradient; backward may skip
  // computing the others (and return undefined tensors for them).
  bool needs_input_grad(size_t i) const { return i < needs_input_grad_.size() && needs_input_grad_[i]; }

  const char* op_name() const { return op_name_; }

  // The gradient buffer of forward input i when that input is a leaf whose .grad is
  // already allocated (and has no hooks): backward may accumulate into it directly
  // (GEMM with beta=1, scatter-add) and return an undefined tensor for that input,
  // saving a temporary and an extra pass, as llm.c does. Undefined otherwise.
  Tensor grad_sink(size_t i) const;

  // Called by record(): names the op and notes which inputs need gradients.
  void bind(const char* op_name, const std::vector<Tensor>& inputs);

 private:
  friend struct testing_access;
  template <class Fn> friend class FunctionNode;
  std::vector<SavedTensor> saved_;
  std::vector<bool> needs_input_grad_;
  const char* op_name_ = "";
  const std::vector<Edge>* edges_ = nullptr;  // non-owning: set by the node during backward
};

// True when grad mode is on and some input requires grad: only then is a graph recorded
// (and only then should an op save anything).
bool needs_graph(const std::vector<Tensor>& inputs);

// Wires `node` to `inputs` (next edges) and marks `outputs` interior tensors of it.
void connect(Node& node, const std::shared_ptr<Node>& self, const std::vector<Tensor>& inputs,
             const std::vector<Tensor>& outputs);

template <class Fn> class FunctionNode final : public Node {
 public:
  FunctionNode(std::unique_ptr<typename Fn::Context> ctx, uint32_t num_outputs)
      : Node(num_outputs), ctx_(std::move(ctx)) {}
  ~FunctionNode() override { unregister(); }
  const char* name() const override { return Fn::kName; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads) override {
    TALLY_CHECK(ctx_, "backward through '", Fn::kName,
                "' a second time: its saved state was freed after the first backward "
                "(pass retain_graph=true to the first backward to keep it)");
    ctx_->edges_ = &next_edges();
    return Fn::backward(*ctx_, grads);
  }
  void release_state() override { ctx_.reset(); }
  const Context* context() const override { return ctx_.get(); }

 private:
  std::unique_ptr<typename Fn::Context> ctx_;  // owning: all of this node's backward state
};

// Records a node for Fn if needs_graph(inputs): the context moves into the node, the
// outputs become its interior tensors. Returns the node (null when nothing was recorded).
template <class Fn>
std::shared_ptr<Node> record(std::unique_ptr<typename Fn::Context> ctx, const std::vector<Tensor>& inputs,
                             const std::vector<Tensor>& outputs) {
  if (!needs_graph(inputs)) return nullptr;
  ctx->bind(Fn::kName, inputs);
  auto node = std::make_shared<FunctionNode<Fn>>(std::move(ctx), static_cast<uint32_t>(outputs.size()));
  connect(*node, node, inputs, outputs);
  return node;
}

// Records a node with no differentiable inputs whose outputs still need gradients:
// a pipeline receive, whose backward sends the gradient back to the previous stage.
// The outputs are interior tensors of the node (R1: never leaves with a grad_fn).
template <class Fn>
std::shared_ptr<Node> record_source(std::unique_ptr<typename Fn::Context> ctx, const std::vector<Tensor>& outputs) {
  if (!grad_enabled()) return nullptr;
  ctx->bind(Fn::kName, {});
  auto node = std::make_shared<FunctionNode<Fn>>(std::move(ctx), static_cast<uint32_t>(outputs.size()));
  connect(*node, node, {}, outputs);
  return node;
}

namespace testing {
// Saves `t` WITH its autograd state, the way a buggy framework would. Exists only so
// tests can reintroduce a reference cycle (seed 000) and see the cycle check report it.
void save_keeping_graph(Context& ctx, const Tensor& t);
}  // namespace testing

}  // namespace tally::autograd
