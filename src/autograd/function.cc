#include "autograd/function.h"


namespace tally::autograd {

SavedTensor::SavedTensor(const Tensor& t, bool check_version) : check_version_(check_version) {
  if (!t.defined()) return;
  // A detached alias: same storage and geometry, no grad_fn, no leaf state (R2).
  data_ = t.detach();
  version_ = t.storage().version();
  // Activations kept for backward are accounted as such while they are kept.
  data_.storage().add_saver();
}

SavedTensor::SavedTensor(SavedTensor&& other) noexcept
    : data_(std::move(other.data_)),
      version_(other.version_),
      check_version_(other.check_version_) {
  other.data_ = Tensor();
}

SavedTensor::~SavedTensor() {
  if (data_.defined()) data_.storage().remove_saver();
}

Tensor SavedTensor::unpack(const char* op) const {
  if (!data_.defined()) return data_;
  TALLY_CHECK(!check_version_ || data_.storage().version() == version_, "a tensor saved by '", op,
              "' for backward was modified in place after it was saved (version ", version_, " -> ",
              data_.storage().version(), "); clone it before modifying");
  return data_;
}

Context::Context() = default;
Context::~Context() = default;

void Context::bind(const char* op_name, const std::vector<Tensor>& inputs) {
  op_name_ = op_name;
  needs_input_grad_mask_ = 0;
  needs_input_grad_more_.clear();
  for (size_t i = 0; i < inputs.size(); ++i) {
    const bool needs = inputs[i].defined() && inputs[i].requires_grad();
    if (i < 64) {
      if (needs) needs_input_grad_mask_ |= uint64_t{1} << i;
    } else {
      needs_input_grad_more_.resize(inputs.size() - 64);
      needs_input_grad_more_[i - 64] = needs;
    }
  }
}

bool Context::needs_input_grad(size_t i) const {
  if (i < 64) return (needs_input_grad_mask_ >> i) & 1u;
  return i - 64 < needs_input_grad_more_.size() && needs_input_grad_more_[i - 64];
}

void Context::save_for_backward(const std::vector<Tensor>& tensors) {
  saved_.clear();
  saved_.reserve(tensors.size());
  for (const Tensor& t : tensors) saved_.emplace_back(t, /*check_version=*/true);
}

size_t Context::keep(const Tensor& t) {
  saved_.emplace_back(t, /*check_version=*/false);
  return saved_.size() - 1;
}

Tensor Context::saved(size_t i) const {
  TALLY_CHECK(i < saved_.size(), "op '", op_name_, "' asked for saved tensor ", i, " of ", saved_.size());
  return saved_[i].unpack(op_name_);
}

GradSink Context::grad_sink(size_t i, DType dtype) const {
  if (!edges_ || i >= edges_->size() || !needs_input_grad(i)) return {};
  const Edge& edge = (*edges_)[i];
  auto* acc = dynamic_cast<AccumulateGrad*>(edge.node.get());
  if (!acc) return {};
  std::shared_ptr<TensorImpl> leaf = acc->leaf();
  if (!leaf) return {};
  auto* state = std::get_if<LeafState>(&detail::StateAccess::state(*leaf));
  if (!state || !state->grad.defined()) return {};
  for (const auto& h : state->hooks)
    if (h->hook) return {};  // hooks must see the gradient: no bypass
  const Tensor& g = state->grad;
  if (g.shape() != edge.meta.shape || g.dtype() != edge.meta.dtype || g.device() != edge.meta.device ||
      g.dtype() != dtype || !g.is_contiguous())
    return {};
  // From here on the buffer holds this backward's gradient (the caller's promise).
  GradSink sink{g, state->grad_discarded};
  state->grad_discarded = false;
  return sink;
}

int64_t Context::saved_bytes() const {
  int64_t bytes = 0;
  for (const SavedTensor& s : saved_)
    if (s.defined()) bytes += s.data().nbytes();
  return bytes;
}

bool needs_graph(const std::vector<Tensor>& inputs) {
  if (!grad_enabled()) return false;
  for (const Tensor& t : inputs)
    if (t.defined() && t.requires_grad()) return true;
  return false;
}

void connect(Node& node, const std::shared_ptr<Node>& self, const std::vector<Tensor>& inputs,
             const std::vector<Tensor>& outputs) {
  auto& edges = node.next_edges();
  edges.reserve(inputs.size());
  for (const Tensor& in : inputs) edges.push_back(in.defined() ? gradient_edge(in) : Edge{});
  for (size_t i = 0; i < outputs.size(); ++i) {
    AutogradState& state = detail::StateAccess::state(outputs[i]);
    TALLY_CHECK(std::holds_alternative<NoGrad>(state), "output ", i, " of '", node.name(),
                "' already has autograd state; an op's outputs must be fresh tensors");
    state = InteriorState{self, static_cast<uint32_t>(i)};
  }
}

void check_context_holds_no_output(std::span<const std::byte> context, const char* op,
                                   const std::vector<Tensor>& outputs) {
  // One walk over the context and its containers, every output looked for in each span;
  // the first output kept is named.
  size_t kept = outputs.size();
  for_each_handle_span(context, [&](std::span<const std::byte> span, bool) {
    for (size_t i = 0; i < kept; ++i)
      if (bytes_hold_tensor(span, outputs[i])) kept = i;
  });
  if (kept < outputs.size())
    TALLY_FAIL("op '", op, "' keeps its own output ", outputs[kept].str(),
               " in its context as a plain Tensor member (or in a container member): that is a reference cycle "
               "(node -> context -> output -> node) that outlives any graph never run backward (memory contract R2). "
               "Keep it with ctx.save_for_backward() or ctx.keep(), which store it without its graph");
}


}  // namespace tally::autograd
