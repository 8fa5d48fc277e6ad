// Activation recomputation ("checkpointing"): run a region without saving its
// activations, and recompute them during backward.
//
// R5: the region's node saves only its inputs; in backward it recomputes the region on
// detached copies of the inputs, differentiates it, returns the input gradients, and
// then everything it made (the recomputed graph, the detached inputs and their .grad)
// goes out of scope with the node's context. Parameters used inside the region receive
// their gradients directly from the inner backward.
#pragma once
#include <functional>
#include <vector>

#include "core/tensor.h"

namespace tally::autograd {

using Region = std::function<Tensor(const std::vector<Tensor>&)>;

Tensor checkpoint(const Region& region, const std::vector<Tensor>& inputs);

}  // namespace tally::autograd
