// Pipeline parallelism: the model's layers split into stages on the ranks of the pipeline
// group, microbatches flowing through them under a schedule (Megatron-LM's).
//
//   gpipe        every microbatch's forward, then every backward: a stage holds the
//                activations of all N microbatches at once.
//   1f1b         stage s runs P-s-1 warm-up forwards, then alternates one forward and one
//                backward, then drains: it holds at most P-s microbatches.
//   interleaved  1F1B over V chunks per rank (global stage v*P + s is chunk v of rank s):
//                the bubble shrinks V-fold, (P-1)/(V*N + P-1) instead of (P-1)/(N + P-1).
//
// Activations and their gradients move between neighbouring stages by point-to-point
// sends and receives, posted asynchronously. A received activation enters the stage's
// graph as a fresh leaf that requires grad and is never an op's output, by construction
// (R1: leaf xor interior); its gradient is copied into a send buffer right after that
// microbatch's backward, and the leaf, its gradient and the chunk's output are dropped
// before the microbatch ends, so the sanitizer's boundary sees nothing of it survive.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "dist/communicator.h"
#include "nn/transformer.h"
#include "sanitizer/sanitizer.h"

namespace tally::dist {

enum class PipelineSchedule { GPipe, OneFOneB, Interleaved };
PipelineSchedule parse_pipeline_schedule(const std::string& text);  // "gpipe" | "1f1b" | "interleaved"
const char* pipeline_schedule_name(PipelineSchedule s);

struct PipelineAction {
  bool forward = true;
  int64_t microbatch = 0;
  int chunk = 0;  // this rank's model chunk (0 unless interleaved)
};

// Checks the schedule's requirements and names the flag that breaks one: 1F1B needs
// N >= P microbatches, interleaved N a multiple of P, and the layers must cover every
// one of the P*V stages.
void check_pipeline(PipelineSchedule schedule, int stages, int virtual_stages, int64_t microbatches, int64_t layers,
                    int64_t last_stage_layers = 0);
// Stage `stage`'s actions for one step of N microbatches, in order.
std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int stages, int stage, int64_t microbatches,
                                             int virtual_stages);
// The most microbatches stage `stage` holds at once under the schedule (forward run,
// backward not yet): min(P - s, N) for 1F1B, N for GPipe.
int64_t pipeline_in_flight_bound(PipelineSchedule schedule, int stages, int stage, int64_t microbatches,
                                 int virtual_stages);
// The layers of each of S stages, as even as possible: the first L mod S stages take
// one layer more (the last stage also runs the head and the loss). With
// `last_stage_layers` K > 0 (Megatron's --decoder-last-pipeline-num-layers) the last
// stage takes K and the others share the rest so: a large vocabulary's head costs as
// much as several layers (GPT-2 124M's as ~5.5), and fewer layers beside it balance the
// stages.
std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t layers, int stages, int64_t last_stage_layers = 0);
// What rank (pipeline stage `stage`, tensor-parallel rank `tp_rank`) holds: chunk v is
// global stage v*P + stage.
nn::ModelShard pipeline_shard(int64_t layers, int stages, int stage, int virtual_stages, int tp, int tp_rank,
                              int64_t last_stage_layers = 0);

struct PipelineStepStats {
  double seconds = 0;       // the step's pipeline time on this rank
  double idle_seconds = 0;  // of which waiting for a neighbour's activation or gradient
  int64_t max_in_flight = 0;
  int64_t bytes_sent = 0;
};

// With a tied head, the first stage's wte and the last stage's copy both take the sum of
// the two gradients (Megatron's embedding group). Both ranks add the same two tensors, so
// the copies stay bit-equal. A no-op on other stages and untied models.
void sum_tied_embedding_gradients(nn::Transformer& model, Communicator& pp_group);

// How a stage turns a received activation into its chunk's input, and what becomes of
// that input after its microbatch's backward. This class is the stage's own rule: a
// fresh leaf that requires grad, let go after the backward. Tests derive from it to
// break that rule in a real pipeline (an input kept to the end of the step; a receive
// that is an op's output and a leaf at once) and show that each break is caught.
class ReceivedInputs {
 public:
  virtual ~ReceivedInputs() = default;
  virtual Tensor input(const Tensor& received);
  virtual void done(const Tensor& input) { (void)input; }
};

// Runs one stage's share of a step. Every rank of the pipeline group calls run() with the
// same number of microbatches.
// Called with each microbatch's loss after its forward and before its backward, on the
// rank that computes it (for logging each microbatch's loss, as RL trainers do). The loss
// still carries its graph: keep its value (item()) or a detached copy. Keeping the tensor
// itself keeps its graph's node past the microbatch, the leak of docs/memory-contract.md's
// seed 001, which the strict sanitizer reports at the microbatch's boundary.
using LossHook = std::function<void(int64_t microbatch, const Tensor& loss)>;

class PipelineStage {
 public:
  // `received` (not owned; null: the stage's own ReceivedInputs) decides what a received
  // activation becomes.
  PipelineStage(nn::Transformer& model, Communicator& pp_group, PipelineSchedule schedule, int virtual_stages,
                ReceivedInputs* received = nullptr);

  // The microbatch's tokens and targets (read on the stages that need them).
  using BatchFn = std::function<std::pair<Tensor, Tensor>(int64_t microbatch)>;
  // Runs forward and backward of N microbatches; each loss is scaled by `loss_scale`
  // before its backward. `before_last_backward` runs before the step's last backward
  // (data parallel arms its overlapped all-reduce there). Returns the sum of this rank's
  // unscaled losses (0 on a stage without the head). `on_loss` sees each loss on the stage
// with the head.
  double run(int64_t microbatches, const BatchFn& batch, double loss_scale, sanitizer::Sanitizer& sanitizer,
             const std::function<void()>& before_last_backward = {}, const LossHook& on_loss = {});
  // A forward of one batch through the pipeline without a graph (evaluation); the loss
  // on every stage.
  double evaluate(const Tensor& tokens, const Tensor& targets);
  const PipelineStepStats& last() const { return last_; }
  bool runs_head() const;

 private:
  class Step;
  int global_stage(int chunk) const { return chunk * stages_ + stage_; }
  Shape activation_shape(int64_t batch, int64_t seq) const;
  ReceivedInputs& received_inputs();

  nn::Transformer& model_;
  Communicator& group_;
  PipelineSchedule schedule_;
  int stages_, stage_, virtual_stages_;
  PipelineStepStats last_;
  ReceivedInputs* received_;  // non-owning; null: the stage's own
};

}  // namespace tally::dist
