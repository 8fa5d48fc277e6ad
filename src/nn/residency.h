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

#include "core/tensor.h"

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

  // Whether the residency keeps the parameters' values itself (ZeRO-3: a piece of every
  // unit on each rank, and no parameter block). Then a source of the whole model's values
  // (an initializer, a file) hands each parameter's value to store() instead of writing
  // the parameter, and a writer asks for it with value_at_root().
  virtual bool holds_values() const { return false; }
  // Parameter `param`'s new value (its whole shape, fp32, contiguous, on the CPU): the
  // residency keeps its part of it. Every rank is given the same values.
  virtual void store(size_t param, const Tensor& value) { (void)param, (void)value; }
  // Collective over the ranks that share the values, each calling it for the same
  // parameters in the same order: parameter `param`'s whole value on the first of them
  // (undefined elsewhere), put together from every rank's part.
  virtual Tensor value_at_root(size_t param) { (void)param; return Tensor(); }
};

}  // namespace tally::nn
