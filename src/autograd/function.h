// The Function API: how every differentiable op (built-in or user-written) records
// its backward.
//
//   struct Scale {
//     static constexpr const char* kName = "scale";
//     struct Context : autograd::Context { double factor; };   // plain values only
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
// The lifetime rules are structural:
//  - R3: the Context is the only object a Function has; its node owns it and the engine
//    destroys it (saved tensors and every other member) right after the node's backward
//    runs, unless the graph is retained.
//  - A context holds tensors only through save_for_backward() and keep(), which store
//    them detached (without their graph) and count their bytes. A plain Tensor member is
//    not part of the API: a context holding its own node's output that way is a
//    reference cycle (node -> context -> output -> node), and record() refuses it on the
//    spot; the cycle check (S3) scans contexts for any other tensor held that way.
//  - Backward asks its context, not engine globals, whether its state is about to be
//    destroyed (will_release()) and whether an input's gradient buffer may be written in
//    place (grad_sink()).
#pragma once
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
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
  SavedTensor(const Tensor& t, bool check_version);
  ~SavedTensor();
  SavedTensor(SavedTensor&& other) noexcept;
  SavedTensor& operator=(SavedTensor&&) = delete;
  SavedTensor(const SavedTensor&) = delete;
  Tensor unpack(const char* op) const;
  const Tensor& data() const { return data_; }
  bool defined() const { return data_.defined(); }

 private:
  Tensor data_;
  uint64_t version_ = 0;
  bool check_version_ = true;
};

// A leaf's gradient buffer that backward writes in place: see Context::grad_sink.
struct GradSink {
  Tensor buffer;           // undefined: no sink
  bool overwrite = false;  // the buffer holds no gradient yet (discarded): write, don't add
  explicit operator bool() const { return buffer.defined(); }
  // The GEMM beta that writes or accumulates a product into the buffer.
  float beta() const { return overwrite ? 0.f : 1.f; }
};

class Context {
 public:
  Context();
  virtual ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  // Tensors backward reads: inputs or outputs, stored detached and version-checked.
  void save_for_backward(const std::vector<Tensor>& tensors);
  // Keeps any other tensor for backward (a workspace, a quantized copy): stored detached
  // and counted with the saved bytes, not version-checked. Returns its index for saved().
  size_t keep(const Tensor& t);
  Tensor saved(size_t i) const;
  size_t num_saved() const { return saved_.size(); }
  const std::vector<SavedTensor>& saved_tensors() const { return saved_; }
  int64_t saved_bytes() const;

  // needs_input_grad(i): whether forward input i needs a gradient; backward may skip
  // computing the others (and return undefined tensors for them).
  bool needs_input_grad(size_t i) const;

  const char* op_name() const { return op_name_; }

  // Whether the engine destroys this context right after the running backward (no
  // retain_graph). Only then may backward overwrite what it saved, since nothing will
  // read it again.
  bool will_release() const { return will_release_; }

  // The gradient buffer of forward input i when that input is a leaf whose .grad is
  // already allocated, contiguous, of `dtype` and of the input's shape and device, and
  // has no hooks: backward writes its gradient there directly (a GEMM's C, a scatter's
  // target) and returns an undefined tensor for that input, saving a temporary and a
  // pass, as llm.c does. The engine still reports that leaf's gradient as final. An empty
  // sink otherwise, and then backward returns the gradient as usual.
  //
  // A defined sink is a promise: backward must then write the whole gradient into it,
  // overwriting the buffer when `overwrite` is set (the leaf's gradient was discarded,
  // so its bytes are stale: GEMM beta 0, or zeros before a scatter) and adding to it
  // otherwise. Ask for it only once the op knows it will write it.
  GradSink grad_sink(size_t i, DType dtype) const;

  // Called by record(): names the op and notes which inputs need gradients.
  void bind(const char* op_name, const std::vector<Tensor>& inputs);

 private:
  template <class Fn> friend class FunctionNode;
  std::vector<SavedTensor> saved_;
  uint64_t needs_input_grad_mask_ = 0;  // inputs 0..63
  std::vector<bool> needs_input_grad_more_;  // inputs 64.. (cat of many tensors)
  const char* op_name_ = "";
  const std::vector<Edge>* edges_ = nullptr;  // non-owning: set by the node during backward
  bool will_release_ = false;
};

// True when grad mode is on and some input requires grad: only then is a graph recorded
// (and only then should an op save anything).
bool needs_graph(const std::vector<Tensor>& inputs);

// Refuses a context whose own bytes hold one of its node's outputs (a plain Tensor
// member): the reference cycle node -> context -> output -> node.
void check_context_holds_no_output(std::span<const std::byte> context, const char* op,
                                   const std::vector<Tensor>& outputs);

// The bytes of a Function's own context members, after the Context base: the base holds
// only saved tensors, stored detached (they cannot form a cycle). A member that can hold
// a tensor handle is pointer-aligned, so it starts at or past sizeof(Context).
template <class C> std::span<const std::byte> own_members(const C& ctx) {
  static_assert(std::is_base_of_v<Context, C>);
  return std::span<const std::byte>(reinterpret_cast<const std::byte*>(&ctx), sizeof(C)).subspan(sizeof(Context));
}

template <class Fn> class FunctionNode final : public Node {
 public:
  FunctionNode(std::unique_ptr<typename Fn::Context> ctx, uint32_t num_outputs)
      : Node(num_outputs), ctx_(std::move(ctx)) {}
  ~FunctionNode() override { unregister(); }
  const char* name() const override { return Fn::kName; }
  std::vector<Tensor> apply(std::vector<Tensor>&& grads, bool will_release) override {
    TALLY_CHECK(ctx_, "backward through '", Fn::kName,
                "' a second time: its saved state was freed after the first backward "
                "(pass retain_graph=true to the first backward to keep it)");
    ctx_->edges_ = &next_edges();
    ctx_->will_release_ = will_release;
    std::vector<Tensor> out = Fn::backward(*ctx_, grads);
    ctx_->edges_ = nullptr;
    return out;
  }
  void release_state() override { ctx_.reset(); }
  const Context* context() const override { return ctx_.get(); }
  std::span<const std::byte> context_bytes() const override {
    if (!ctx_) return {};
    return own_members(*ctx_);
  }

 private:
  std::unique_ptr<typename Fn::Context> ctx_;  // owning: all of this node's backward state
};

// Records a node for Fn if needs_graph(inputs): the context moves into the node, the
// outputs become its interior tensors. Returns the node (null when nothing was recorded).
template <class Fn>
std::shared_ptr<Node> record(std::unique_ptr<typename Fn::Context> ctx, const std::vector<Tensor>& inputs,
                             const std::vector<Tensor>& outputs) {
  if (!needs_graph(inputs)) return nullptr;
  check_context_holds_no_output(own_members(*ctx), Fn::kName, outputs);
  ctx->bind(Fn::kName, inputs);
  auto node = std::make_shared<FunctionNode<Fn>>(std::move(ctx), static_cast<uint32_t>(outputs.size()));
  connect(*node, node, inputs, outputs);
  return node;
}

// Records a node with no differentiable inputs whose outputs still need gradients
// (activation recomputation whose region holds parameters). The outputs are interior
// tensors of the node (R1: never leaves with a grad_fn).
template <class Fn>
std::shared_ptr<Node> record_source(std::unique_ptr<typename Fn::Context> ctx, const std::vector<Tensor>& outputs) {
  if (!grad_enabled()) return nullptr;
  check_context_holds_no_output(own_members(*ctx), Fn::kName, outputs);
  ctx->bind(Fn::kName, {});
  auto node = std::make_shared<FunctionNode<Fn>>(std::move(ctx), static_cast<uint32_t>(outputs.size()));
  connect(*node, node, {}, outputs);
  return node;
}

}  // namespace tally::autograd
