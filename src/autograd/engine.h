// The backward engine: iterative (no recursion, so graph depth is unbounded),
// dependency counts computed from the graph reachable from the roots at backward time.
#pragma once
#include <string>
#include <vector>

#include "core/tensor.h"

namespace tally::autograd {

// Computes gradients of `roots` (seeded with `root_grads`, or ones for scalar roots)
// and accumulates them into the leaves' .grad.
//
// Unless retain_graph, every node's saved state is destroyed right after it runs (R3)
// and the traversed edges are cut, so a root tensor kept alive afterwards (a loss kept
// for logging) keeps at most its own, emptied, node alive.
void backward(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads = {},
              bool retain_graph = false);

// True while a backward that retains its graph is running (ops must then not overwrite
// what they saved, since a later backward will read it again).
bool graph_retained();

// S3: searches node -> edge -> node and node -> saved tensor -> grad_fn links for
// cycles. Returns one line per cycle ("a -> b -> a"), empty when the graph is a DAG.
std::vector<std::string> find_cycles(const std::vector<Tensor>& roots);

// Runs find_cycles at the start of every backward and reports cycles to the sanitizer.
void set_cycle_check(bool enabled);
bool cycle_check_enabled();

}  // namespace tally::autograd
