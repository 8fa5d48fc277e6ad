// Parameters, laid out like llm.c: every parameter is a named view into ONE parameter
// block, and its gradient a view at the same offset of ONE gradient block. Sizes are
// known before anything is allocated; the optimizer's state mirrors the same layout.
//
// Why one block: zero_grad and the gradient norm are one pass each, AdamW runs as one
// fused loop, and the memory report shows exactly two allocations of 4 bytes per
// parameter.
//
// The block is ordered by *unit*: a unit is a group of parameters used together (the
// embeddings, one transformer layer, the final norm), declared one after the other, so
// each unit is a contiguous range of the block and the block's tail is what backward
// finishes first. Data parallel all-reduces contiguous ranges of the gradient block in
// that reverse order, and ZeRO shards, gathers and reduce-scatters per unit.
// (llm.c's files stack each kind of weight over layers instead; io/model_files.cc maps
// between the two.)
#pragma once
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/tensor.h"

namespace tally::nn {

// The blocks ParameterStore::allocate makes.
enum class Blocks {
  ParametersAndGradients,  // training with the model's own gradients
  Parameters,              // no gradient block: forward only (sampling, export), a source to copy a
                           // shard from, or ZeRO-2, which keeps gradient shards of its own
  None,                    // neither: ZeRO-3 keeps every unit as pieces over the ranks and binds
                           // the parameters to storages of its own (rebind), so no rank ever
                           // holds the whole model; its values come in through the residency
                           // (nn/residency.h: store)
};

struct ParameterSpec {
  std::string name;   // e.g. "h.3.attn.c_attn.weight"
  Shape shape;
  bool decay = true;  // weight decay applies (2-D weights); false for biases and norms
  size_t unit = 0;    // the unit it belongs to
};

struct ParameterUnit {
  std::string name;          // "embed", "h.3", "ln_f"
  int64_t begin = 0, end = 0;  // element range in the blocks
  size_t first = 0, last = 0;  // parameter indices [first, last)
  int64_t numel() const { return end - begin; }
};

class ParameterStore {
 public:
  // Starts a new unit; parameters declared next belong to it. Only before allocate().
  size_t begin_unit(std::string name);
  // Declares a parameter in the current unit; returns its index. Only before allocate().
  size_t declare(std::string name, Shape shape, bool decay);
  // Allocates the blocks `blocks` names and makes the parameters (and their gradients)
  // views of them; with Blocks::None the parameters stay undefined until rebound.
  void allocate(DType dtype = DType::F32, Device device = Device::cpu(), Blocks blocks = Blocks::ParametersAndGradients);
  // Moves the parameter block to `device` (new blocks there, the values copied, the
  // gradients discarded; the old blocks are freed). Before an optimizer or a compute copy
  // refers to the blocks: the model is built and loaded on the host, then moved.
  void move_to(Device device);
  // Where and in what dtype the parameters are, also while ZeRO-3 has released the block
  // (kept here: the released block has no bytes to read them from).
  Device device() const { return device_; }
  DType dtype() const { return dtype_; }

  size_t size() const { return specs_.size(); }
  const ParameterSpec& spec(size_t i) const { return specs_[i]; }
  const Tensor& param(size_t i) const { return params_[i]; }
  const Tensor& operator[](size_t i) const { return params_[i]; }
  const Tensor& get(const std::string& name) const;
  size_t index_of(const std::string& name) const;
  int64_t offset(size_t i) const { return offsets_[i]; }  // element offset in the blocks
  int64_t numel() const { return total_; }
  size_t num_units() const { return units_.size(); }
  const ParameterUnit& unit(size_t u) const { return units_[u]; }

  const Tensor& flat_params() const { return flat_params_; }  // (numel), Category::Parameter
  // (numel), Category::Gradient. Gradients discarded and not written since are filled
  // with zeros first, so the block always reads as the gradients' values.
  const Tensor& flat_grads() const;
  // Whether the gradient block exists (not after release_grads): a check that, unlike
  // flat_grads(), never writes the discarded gradients.
  bool has_grad_block() const { return flat_grads_.defined(); }
  // Parameters [first, last)'s range of the gradient block, settled the same way: what
  // data parallel reduces while backward still runs, without touching the gradients
  // backward has yet to write.
  Tensor grads_of(size_t first, size_t last) const;
  void zero_grad() const;
  // Makes every gradient zero without a pass over the block (Tensor::discard_grad): the
  // next backward overwrites each gradient instead of adding to it. What a training step
  // does after the optimizer has read them.
  void discard_grads() const;

  // Mixed precision (--dtype bf16): a copy of the parameter block in `dtype`, the operand
  // the GEMMs read, 2 bytes per parameter (Category::Parameter, owner "parameters.bf16").
  // The fp32 block stays the master weights the optimizer updates; the copy follows it
  // lazily: compute_copy() rounds the whole block again when the fp32 block's version
  // moved (an optimizer step, a load, a ZeRO gather), so a step pays one pass however many
  // microbatches it has. Needs the parameter block (not after release_params).
  void enable_compute_copy(DType dtype);
  bool has_compute_copy() const { return compute_block_.defined(); }
  // Parameter i in the compute dtype, current with the fp32 block.
  const Tensor& compute_copy(size_t i) const;
  // The whole copy, for an optimizer that writes it while it updates the fp32 block (AdamW
  // does, saving the refresh's pass); it then calls compute_copy_refreshed().
  const Tensor& compute_block() const { return compute_block_; }
  // The copy was written from the fp32 block as it is now (its current version).
  void compute_copy_refreshed();

  // Replaces parameter i with `param` (same shape; a view of another storage, e.g. a
  // ZeRO-3 unit buffer). The new tensor becomes a registered parameter named like the old.
  void rebind(size_t i, const Tensor& param);
  // Drops the gradient block; the parameters' .grad become undefined (ZeRO-2 and -3 give
  // them views of per-unit staging buffers during backward instead).
  void release_grads();
  // Drops the parameter block (after rebinding every parameter elsewhere, as ZeRO-3 does).
  void release_params();

 private:
  std::vector<ParameterSpec> specs_;
  // name -> index, for index_of: a loader asks it once a tensor, so a scan would make
  // loading quadratic in the number of parameters.
  std::unordered_map<std::string, size_t> index_by_name_;
  std::vector<ParameterUnit> units_;
  std::vector<int64_t> offsets_;
  std::vector<Tensor> params_;
  int64_t total_ = 0;
  bool allocated_ = false;  // declarations are closed
  Tensor flat_params_, flat_grads_;
  Device device_ = Device::cpu();
  DType dtype_ = DType::F32;
  Tensor compute_block_;                 // the parameter block in the compute dtype (or undefined)
  std::vector<Tensor> compute_views_;    // parameter i's view of it
  // The fp32 block's version the copy was made from (none: not made yet).
  mutable std::optional<uint64_t> compute_version_;
};

}  // namespace tally::nn
