// ZeRO (Rajbhandari et al.): data parallel without every rank holding every model state.
//
// Sharding. The parameter block is made of units (the embeddings, each layer, the final
// norm; nn/parameters.h). Each unit of U elements is split into D pieces of
// c = ceil(U / D) elements; rank r owns piece r of every unit (the last pieces padded with
// zeros), so every collective moves equal blocks, as NCCL requires too.
//
//   stage 1  AdamW's moments are sharded. Gradients are all-reduced as in plain data
//            parallel; each rank updates its pieces of the parameters, then the pieces are
//            all-gathered back into every rank's full parameter block, unit by unit, each
//            unit's gather running while AdamW updates the next (in place where D divides
//            the unit, so no buffer and no copy; through a padded buffer elsewhere).
//   stage 2  Gradients are sharded too. On every microbatch each unit's gradients go into
//            a staging buffer of that unit (the parameters' .grad are views of it), and
//            the moment the unit's last gradient is final the buffer is reduce-scattered
//            into this rank's gradient shard and freed: a full gradient exists one unit at
//            a time. The gradient norm is summed from the shards.
//   stage 3  Parameters are sharded too. A unit's parameters are views of one storage
//            whose bytes exist only while the unit is in use: gathered before its forward
//            (the next unit's gather starts while this one computes), released after,
//            gathered again for its backward and released after it (memory contract R6:
//            the storage's bytes go back even while its views exist; a stale view fails
//            naming the release). The model says when through nn::ParameterResidency.
//
// Persistent memory per rank (P parameters, fp32; padding aside): stage 1 4P + 4P + 8P/D,
// stage 2 4P + 12P/D, stage 3 16P/D plus the units gathered at the moment.
#pragma once
#include <cstdint>
#include <cstddef>
#include <memory>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "nn/parameters.h"
#include "nn/residency.h"
#include "optim/adamw.h"
#include "optim/optimizer.h"

namespace tally::dist {

class ZeroOptimizer final : public optim::Optimizer, public nn::ParameterResidency {
 public:
  // Shards the model states of `params` (which must hold the full, identical model on
  // every rank) over `group`. Stage 3 moves the parameters into per-unit storages and
  // frees the full block; stages 2 and 3 free the full gradient block.
  // Stage 3 also takes a store built without blocks (nn::Blocks::None): its pieces start
  // as zeros, and the model's values come in through store() once this optimizer is the
  // model's residency (nn::fill_whole_parameters), so no rank ever holds the
  // whole model, not even while it is built.
  // Expert parallel (stage 1): the units whose parameters are experts (`expert`, per
  // parameter) differ between expert-parallel ranks, so they are sharded over
  // `expert_group`, the ranks that hold the same experts, and the rest over `group`.
  ZeroOptimizer(nn::ParameterStore& params, optim::AdamWConfig config, Communicator& group, int stage,
                Communicator* expert_group = nullptr, const std::vector<bool>& expert = {});
  ~ZeroOptimizer() override;
  ZeroOptimizer(const ZeroOptimizer&) = delete;
  ZeroOptimizer& operator=(const ZeroOptimizer&) = delete;

  int stage() const { return stage_; }

  // After each microbatch's backward (stages 2 and 3): waits for its reduce-scatters,
  // reduces any unit backward did not reach, and releases what stage 3 still holds.
  void finish_microbatch();
  // The global L2 norm of the full gradient (stage 1: of the all-reduced block; stages 2
  // and 3: summed from every rank's shard).
  double gradient_norm();
  // One AdamW update of this rank's shard (gradients scaled by grad_scale first), then
  // stages 1 and 2 all-gather the parameters; gradients are zeroed.
  void step(double lr, double grad_scale);

  // optim::Optimizer: moments unit by unit (collective: every rank calls them).
  int64_t steps_taken() const override { return t_; }
  void set_steps_taken(int64_t t) override { t_ = t; }
  Tensor moment_unit(int which, size_t unit) override;
  void set_moment_unit(int which, size_t unit, const Tensor& values) override;

  // nn::ParameterResidency (stages 2 and 3; collective in stage 3).
  void acquire(size_t unit, bool backward) override;
  void release(size_t unit, bool backward) override;
  void prefetch(size_t unit) override;
  bool holds_values() const override { return stage_ == 3; }
  // Stage 3: keeps this rank's part of parameter `param`'s whole value.
  void store(size_t param, const Tensor& value) override;
  // Stage 3, collective: every rank sends rank 0 its part of parameter `param` (point to
  // point, so only rank 0 holds the whole parameter; an all-gather would give every rank
  // the whole unit).
  Tensor value_at_root(size_t param) override;

  // Bytes this rank holds for model states by construction.
  struct Footprint {
    int64_t parameters = 0, gradients = 0, optimizer = 0;
    int64_t total() const { return parameters + gradients + optimizer; }
  };
  Footprint footprint() const;
  int64_t unit_bytes(size_t unit) const;  // a gathered unit (stage 3), padding included

 private:
  struct Piece {
    Communicator* group = nullptr;           // the ranks the unit is sharded over
    int64_t unit_begin = 0, unit_numel = 0;  // the unit in the block
    int64_t size = 0;                        // c: elements per rank
    int64_t own_begin = 0, own = 0;          // this rank's valid elements in the block
    int64_t local = 0;                       // offset of the piece in the shard buffers
  };
  struct Staging {  // one unit's gradients during a microbatch (stages 2 and 3)
    Tensor buffer;  // D * c elements: the unit's gradient, padded
    Tensor piece;   // c elements: this rank's reduced piece
    std::shared_ptr<Work> work;
    int pending = 0;  // parameters whose gradient is not final yet
    bool active = false;   // the buffer is the parameters' .grad
    bool reduced = false;  // its reduce-scatter was started in this microbatch
    bool final = false;    // every gradient of it is final in this microbatch
  };

  // Parameter `param`'s gradient is final in this backward (its post-accumulate hook).
  void gradient_final(size_t param);
  // Unit `u` gets no more gradients in this microbatch: reduce it, after the units above.
  void mark_final(size_t u);
  void stage_gradients(size_t unit);
  void start_reduce(size_t unit);
  void absorb(size_t unit);
  void gather(size_t unit, bool async);
  void wait_gather(size_t unit);
  // Stages 1 and 2, after the unit's update: every rank's pieces of unit `u` into every
  // rank's parameter block. Returns the gather in flight, or null when it is done.
  std::shared_ptr<Work> gather_parameters(size_t u);
  Tensor piece_of(const Tensor& shard, size_t unit) const;
  Communicator& group_of(size_t unit) const { return *pieces_[unit].group; }
  // The elements [begin, end) of the parameter block that both parameter `param` and
  // rank `r`'s piece of its unit cover (empty: begin == end).
  std::pair<int64_t, int64_t> overlap(size_t param, int64_t r) const;
  // Stage 3: this rank's values of the parameter block's elements [lo, hi), an overlap of
  // parameter `param` with this rank's piece, as a view of its parameter shard.
  Tensor own_values(size_t param, int64_t lo, int64_t hi) const;

  nn::ParameterStore& params_;
  optim::AdamWConfig config_;
  Communicator& group_;
  int stage_;
  int64_t t_ = 0;
  std::vector<Piece> pieces_;  // per unit
  int64_t local_numel_ = 0;
  Tensor m_, v_;             // OptimizerState: this rank's pieces
  Tensor grad_shard_;        // stages 2, 3: Gradient (persistent)
  Tensor param_shard_;       // stage 3: Parameter
  std::vector<Tensor> gathered_;                   // stage 3: per unit, a storage that comes and goes
  std::vector<std::shared_ptr<Work>> gathering_;   // stage 3: a gather in flight per unit
  std::vector<Staging> staging_;
  size_t in_flight_ = SIZE_MAX;  // the unit whose reduce-scatter was started last
  size_t next_unit_ = 0;         // units [0, next_unit_) are not started in this microbatch
  std::vector<HookHandle> hooks_;  // stages 2, 3: a post-accumulate hook per parameter, removed with this
};

}  // namespace tally::dist
