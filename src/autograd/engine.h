// The backward engine: iterative (no recursion, so graph depth is unbounded),
// dependency counts computed from the graph reachable from the roots at backward time.
//
// The engine trusts no Function: every gradient a node returns is checked against the
// shape, dtype and device of the input it is for (recorded on the edge), and a mismatch
// is an error naming the Function and both shapes. It knows nothing of particular ops,
// devices or the sanitizer: gradients are summed through the device's backend, and
// observers (autograd/observer.h) hear when a backward begins and when each leaf's
// gradient is final.
#pragma once
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

// The backward of a graph recorded from sequence number `first_sequence_nr` on (a
// recomputed region's, inside the backward of the graph that encloses it). It may reach
// older nodes only through leaves' accumulators: any other older node belongs to the
// enclosing graph, whose own backward must run it once with every share of its gradient.
// Reaching one is an error naming its op and `region`, raised before any node runs.
void backward_within(const std::vector<Tensor>& roots, const std::vector<Tensor>& root_grads,
                     uint64_t first_sequence_nr, const char* region);

}  // namespace tally::autograd
