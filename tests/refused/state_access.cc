// R1 (docs/memory-contract.md): user code cannot reset a tensor's autograd state; only
// the autograd code StateAccess names may.
// expect: private
#include "autograd/node.h"

void control(const tally::Tensor& t) { (void)std::get_if<tally::autograd::LeafState>(&t.impl()->autograd()); }

#ifdef REFUSED
void bypass(const tally::Tensor& t) { tally::autograd::detail::StateAccess::state(t) = tally::autograd::LeafState{}; }
#endif
