#include "autograd/checkpoint.h"

#include "autograd/engine.h"
#include "autograd/function.h"
#include "autograd/observer.h"

namespace tally::autograd {

namespace {
struct CheckpointFn {
  static constexpr const char* kName = "checkpoint";
  struct Context : autograd::Context {  // saved: the region's inputs
    Region region;
    bool inputs_are_edges = false;  // recorded with the inputs (not as a source)
  };
  static std::vector<Tensor> backward(Context& ctx, std::vector<Tensor>& grads) {
    std::vector<Tensor> detached;
    for (size_t i = 0; i < ctx.num_saved(); ++i) {
      Tensor d = ctx.saved(i).detach();
      if (ctx.needs_input_grad(i)) d.set_requires_grad(true);
      detached.push_back(d);
    }
    Tensor out;
    const uint64_t first_recomputed = next_sequence_nr();
    {
      set_grad_enabled(true);  // the engine runs backward under no-grad; recompute records
      struct Restore {
        ~Restore() { set_grad_enabled(false); }
      } restore;
      out = ctx.region(detached);
    }
    // One gradient per edge: none when the node was recorded as a source.
    std::vector<Tensor> input_grads(ctx.inputs_are_edges ? detached.size() : 0);
    if (out.requires_grad()) {
      autograd::backward_within({out}, {grads[0]}, first_recomputed, "checkpoint");
      for (size_t i = 0; i < detached.size(); ++i) {
        if (!ctx.needs_input_grad(i)) continue;
        input_grads[i] = detached[i].grad();
        // An activation's gradient, passed on to the enclosing graph: the accumulator made
        // it a leaf's .grad, which the ledger would count among the model's gradients.
        if (input_grads[i].defined()) input_grads[i].storage().retag(Category::Activation);
      }
    }
    for (EngineObserver* o : engine_observers()) o->region_recomputed(detached);
    return input_grads;  // `detached`, their grads' other owners and `out` die here
  }
};
}  // namespace

Tensor checkpoint(const Region& region, const std::vector<Tensor>& inputs) {
  Tensor out;
  {
    NoGradGuard no_grad;
    out = region(inputs);
  }
  // A fresh output: the region's result may alias an input or carry no-grad state.
  Tensor result = out.detach();
  if (grad_enabled()) {
    auto ctx = std::make_unique<CheckpointFn::Context>();
    ctx->region = region;
    ctx->save_for_backward(inputs);
    // Parameters inside the region need the node even when no input requires grad.
    ctx->inputs_are_edges = needs_graph(inputs);
    if (ctx->inputs_are_edges) record<CheckpointFn>(std::move(ctx), inputs, {result});
    else record_source<CheckpointFn>(std::move(ctx), {result});
  }
  return result;
}

}  // namespace tally::autograd
