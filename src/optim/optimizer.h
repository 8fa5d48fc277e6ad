// What a checkpoint needs from an optimizer, whatever holds its state: the step count,
// and AdamW's two moments in the parameter block's order, one unit at a time.
//
// The unit-by-unit exchange is what lets any data-parallel layout read what any other
// wrote: AdamW hands out views of its full moments; ZeRO (dist/zero.h) gathers a unit
// from the ranks' shards (a collective: every rank calls it) and, on loading, keeps the
// piece it owns.
#pragma once
#include <cstddef>
#include <cstdint>

#include "core/tensor.h"

namespace tally::optim {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  virtual int64_t steps_taken() const = 0;
  virtual void set_steps_taken(int64_t t) = 0;
  // Moment `which` (0: first, m; 1: second, v) of unit `unit`: unit.numel() values in the
  // block's order.
  virtual Tensor moment_unit(int which, size_t unit) = 0;
  virtual void set_moment_unit(int which, size_t unit, const Tensor& values) = 0;
};

}  // namespace tally::optim
