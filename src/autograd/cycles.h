// The cycle check (memory contract S3): reference cycles among graph nodes and tensors.
//
// The strong references the public API can create are followed:
//   node -> next node (edges)            tensor (interior) -> its grad_fn node
//   node -> tensor its context holds     tensor (leaf) -> tensor one of its hooks captures
//   node -> tensor a pre-hook captures   node -> tensor saved with its graph (testing only)
// Tensors held as plain members of a context, or captured by value in a hook, are found
// by scanning those objects' bytes for the address of a live tensor (the way
// LeakSanitizer scans memory for pointers); only addresses of tensors that are alive
// right now are followed. A container member (a std::vector<Tensor>) is followed one
// level, through a copy of the memory it delimits (for_each_handle_span). A hook that
// holds its own tensor where no scan sees (a std::function keeps its captures on the
// heap) is found when registered, by copying the callable (GradHook::holds).
#pragma once
#include <string>
#include <vector>

#include "autograd/node.h"
#include "core/tensor.h"

namespace tally::autograd {

// Every cycle reachable from `roots`, one line each, e.g.
//   "fused_linear [h.0] -> (context member) tensor 'y' -> fused_linear [h.0]".
// Empty when the graph is a DAG.
std::vector<std::string> find_cycles(const std::vector<Tensor>& roots);
// The cycles through `node` (why it is still alive, when nothing outside holds it).
std::vector<std::string> find_cycles_through(const Node& node);
// The cycles through a tensor (a leaf kept alive by a hook capturing it).
std::vector<std::string> find_cycles_through(const TensorImpl& tensor);
// Every cycle reachable from any of `nodes`, each once.
std::vector<std::string> find_cycles_from(const std::vector<const Node*>& nodes);

}  // namespace tally::autograd
