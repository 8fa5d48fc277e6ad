// Where a parameter unit's values are while the model runs.
//
// By default every parameter is always resident. ZeRO-3 (dist/zero.h) keeps each unit
// (the embeddings, a layer, the final norm) sharded across ranks and gathers it only
// around its use. The model tells a residency when a unit is about to be used and when
// it is done with it: in forward by calling acquire/release around the unit's ops, and in
// backward through identity markers on the activations that cross the unit's border.
// The marker on the unit's output runs its backward before the unit's ops' backward
// (acquire); the marker on the unit's input runs after them (release).
#pragma once
#include <cstddef>
#include <vector>

namespace tally::nn {

class ParameterResidency {
 public:
  virtual ~ParameterResidency() = default;
  // After acquire(u), unit u's parameters hold their values; release(u) may drop them.
  // `backward`: the call comes from backward (the unit's gradients are about to be made).
  virtual void acquire(size_t unit, bool backward) = 0;
  virtual void release(size_t unit, bool backward) = 0;
  // A hint: unit u is next; a residency may start gathering it now.
  virtual void prefetch(size_t unit) {}
};

}  // namespace tally::nn
