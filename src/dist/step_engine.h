// The step engine: one training step of any layout behind one small interface, so that
// the trainer's loop is the same for one process and for every dp x tp x pp layout with
// any ZeRO stage (Megatron-Core's get_forward_backward_func and finalize_model_grads,
// over tally's explicit World).
//
//   StepEngine engine(world, config, fill);   // builds this rank's model shard, its
//                                             // optimizer and every collective's state
//   loss = engine.forward_backward(step, loader, sanitizer);
//   engine.finalize_grads();                  // every gradient reduction, in one place
//   norm = engine.grad_norm();                // of the whole model's gradient
//   engine.optimizer_step(lr, clip_scale(norm, max));
//
// What the engine owns, chosen once from the layout:
//   - the model shard (nn/transformer.h): pipeline chunks and tensor-parallel slices;
//   - the schedule of a step's microbatches: one after another, or a pipeline stage's
//     schedule (dist/pipeline.h: gpipe, 1f1b, interleaved);
//   - the gradients' reduction: the bucketed all-reduce (dist/data_parallel.h), or ZeRO's
//     reduce-scatters (dist/zero.h), each driven by the post-accumulate hooks it installs
//     on the parameters; the tied embedding's and, under sequence parallelism, the
//     replicated parameters' sums;
//   - the gradient norm (one process sums it during the last backward) and the optimizer
//     (AdamW, or ZeRO's sharded AdamW).
//
// Data order: microbatch j of a step on data-parallel rank r reads what one process with
// D x N microbatches a step reads as microbatch j*D + r, so a run on D ranks sees exactly
// the batches of the one-process run with the same global batch. The C context-parallel
// ranks of one data-parallel rank read the same batches and keep their own tokens of them
// (dist/context_parallel.h); gradients are averaged over all D x C replicas.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "data/loader.h"
#include "dist/context_parallel.h"
#include "dist/data_parallel.h"
#include "dist/expert_parallel.h"
#include "dist/pipeline.h"
#include "dist/tensor_parallel.h"
#include "dist/world.h"
#include "dist/zero.h"
#include "nn/transformer.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"
#include "sanitizer/sanitizer.h"

namespace tally::dist {

struct EngineConfig {
  nn::TransformerConfig model;
  int64_t microbatches = 1;  // a step's microbatches on each data-parallel rank (N)
  int zero = 0;              // 0: plain data parallel; 1, 2, 3: ZeRO stage
  int64_t bucket_bytes = int64_t{25} << 20;
  bool sequence_parallel = false;
  PipelineSchedule pp_schedule = PipelineSchedule::OneFOneB;
  int virtual_stages = 1;
  int64_t pp_last_stage_layers = 0;
  nn::Recompute recompute = nn::Recompute::None;
  double expert_capacity_factor = 0;  // nn::Transformer::set_expert_capacity_factor (0: dropless)
  nn::Transformer::RouterLosses router_losses;  // nn::Transformer::set_router_losses (coefficients; 0: off)
  DType matmul_dtype = DType::F32;
  bool chunked_loss = false;
  Device device = Device::cpu();
  optim::AdamWConfig adamw;
  LossHook on_microbatch_loss;  // sees each microbatch's loss (dist/pipeline.h); optional
};

class StepEngine {
 public:
  // Fills a freshly built model shard with its weights (from a file, a checkpoint or an
  // initializer), before ZeRO-1/2 shard them and before the model moves to its device.
  using FillWeights = std::function<void(nn::Transformer& model)>;
  StepEngine(const World& world, const EngineConfig& config, const FillWeights& fill);
  ~StepEngine();
  StepEngine(const StepEngine&) = delete;
  StepEngine& operator=(const StepEngine&) = delete;

  nn::Transformer& model() { return *model_; }
  const nn::Transformer& model() const { return *model_; }
  optim::Optimizer& optimizer();
  const World& world() const { return world_; }

  // Forward and backward of this rank's microbatches of step `step`, each loss scaled by
  // 1 / (N x D x C) so that the gradients sum to the global batch's mean. Returns the mean
  // loss of the global batch (the same on every rank).
  double forward_backward(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer);
  // Completes the step's gradients: the all-reduce's last buckets, the tied embedding's
  // two copies, the replicated parameters' sequence-parallel sums.
  void finalize_grads();
  // The L2 norm of the whole model's gradient (the same on every rank).
  double grad_norm();
  // One AdamW update at `lr`, every gradient scaled by `grad_scale` (the clip) first; the
  // gradients are then discarded for the next step.
  void optimizer_step(double lr, double grad_scale);
  // Waits for the device's queued work (a GPU's step ends when its last kernel has run).
  void synchronize();
  // The loss of one batch without a graph (every rank calls it: a pipeline runs it through
  // its stages, ZeRO-3 gathers the units).
  double evaluate(const data::Batch& batch);

  // ---- what the run reports
  // Whether this rank holds the whole model (sampling runs on one).
  bool holds_whole_model() const { return !model_parallel_; }
  // What the rank at (pipeline stage, tensor-parallel rank, expert-parallel rank) holds
  // (checkpoints put the whole model together from the shards).
  nn::ModelShard shard_of(int pp_rank, int tp_rank, int ep_rank) const;
  // The training device's peak during set-up: building and filling the shard, ZeRO-2/3's
  // sharding (0 when set-up holds no more than a step).
  int64_t setup_peak_bytes() const { return setup_peak_; }
  // Live bytes at the end of the run's first forward: model states, the loader's buffers
  // and one microbatch's saved activations (0 under a pipeline, which holds several).
  int64_t live_after_first_forward() const { return live_after_forward_; }
  // This rank's model states by construction: fp32 parameters, gradients and AdamW's
  // moments (ZeRO: its shares), and the bf16 copy under mixed precision.
  int64_t model_state_bytes() const;
  // The formula of model_state_bytes for the data-parallel report ("8P + 8P/D", ...).
  std::string model_state_formula() const;
  const PipelineStepStats* pipeline_stats() const;  // null without a pipeline
  const ReductionStats* all_reduce_stats() const;   // null without the all-reduce
  int64_t tp_payload_bytes() const { return tp_payload_bytes_; }  // this step's, tensor parallel
  // This step's expert-parallel all-to-alls (dispatch, combine and their gradients, and
  // the count exchanges): bytes handed to them and the seconds they ran.
  const CommStats& ep_traffic() const { return ep_traffic_; }
  // This step's context-parallel collectives: bytes handed to them and seconds they ran
  // (the all-gathers block attention: none of it is hidden behind compute).
  const CommStats& cp_traffic() const { return cp_traffic_; }
  // The last step's load-balancing loss (before its coefficient), averaged as the loss is;
  // negative when the model adds none.
  double aux_loss() const { return aux_loss_; }
  // The last step's balance and z-losses (before their coefficients: each a sum over the
  // sparse layers), averaged over the microbatches as the loss is; zeros when off.
  const nn::Transformer::RouterLosses& router_losses() const { return router_losses_; }
  // The last step's expert load over every rank's tokens: the fewest and the most choices
  // one expert of one sparse layer took (-1 without experts), and those dropped past the
  // experts' capacity (none when dispatch is dropless).
  struct ExpertLoad {
    int64_t min = -1, max = -1, dropped = 0;
  };
  const ExpertLoad& expert_load() const { return expert_load_; }
  // The start-up lines that describe the layout ("parallel: ...").
  std::vector<std::string> describe() const;

 private:
  void build_model(const FillWeights& fill);
  void build_optimizer();
  Tensor on_device(const Tensor& t) const;
  // A batch's tokens or targets as this rank trains on them: its context-parallel local
  // sequences, on the training device.
  Tensor local(const Tensor& t) const;
  double run_microbatches(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer);
  double run_pipeline(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer);

  const World& world_;
  EngineConfig config_;
  bool model_parallel_ = false;  // tp x pp x ep > 1: a rank holds part of the model
  std::unique_ptr<nn::Transformer> model_;
  std::unique_ptr<ZeroOptimizer> zero_;
  std::unique_ptr<optim::AdamW> adamw_;
  std::unique_ptr<TensorParallel> tensor_parallel_;
  std::unique_ptr<ContextParallel> context_parallel_;
  std::unique_ptr<ExpertParallel> expert_parallel_;
  std::unique_ptr<PipelineStage> pipeline_;
  std::unique_ptr<GradientAllReduce> all_reduce_;
  std::unique_ptr<optim::BackwardGradientNorm> backward_norm_;
  int64_t in_flight_bound_ = 0;  // what this pipeline stage's schedule needs at most
  int64_t setup_peak_ = 0;
  int64_t live_after_forward_ = 0;
  int64_t tp_payload_bytes_ = 0;
  CommStats cp_traffic_, ep_traffic_;
  double aux_loss_sum_ = 0, aux_loss_ = -1;
  nn::Transformer::RouterLosses router_losses_;
  // The router losses' share of the step's objective, from every rank's layers.
  double reduce_router_losses(double count);
  // `values` summed over the replicas (data and context parallel) and the pipeline's stages.
  std::vector<double> summed_over_replicas_and_stages(const std::vector<double>& values, const char* owner) const;
  ExpertLoad expert_load_;
  void reduce_expert_load();
};

}  // namespace tally::dist
