#include "dist/step_engine.h"

#include <algorithm>
#include <optional>

#include "autograd/grad_mode.h"
#include "ops/ops.h"
#include "runtime/backend.h"
#include "runtime/profiler.h"

namespace tally::dist {

namespace profiler = runtime::profiler;

StepEngine::StepEngine(const World& world, const EngineConfig& config, const FillWeights& fill)
    : world_(world), config_(config), model_parallel_(world.tp() * world.pp() * world.ep() > 1) {
  check_pipeline(config.pp_schedule, world.pp(), config.virtual_stages, config.microbatches, config.model.n_layer,
                 config.pp_last_stage_layers);
  build_model(fill);
  build_optimizer();
  if (pipeline_)
    in_flight_bound_ = pipeline_in_flight_bound(config.pp_schedule, world.pp(), world.pp_rank(), config.microbatches,
                                                config.virtual_stages);
}

StepEngine::~StepEngine() {
  if (model_) model_->set_residency(nullptr);
}

nn::ModelShard StepEngine::shard_of(int pp_rank, int tp_rank, int ep_rank) const {
  if (!model_parallel_) return {};
  nn::ModelShard shard = pipeline_shard(config_.model.n_layer, world_.pp(), pp_rank, config_.virtual_stages, world_.tp(),
                                        tp_rank, config_.pp_last_stage_layers);
  shard.ep = world_.ep();
  shard.ep_rank = ep_rank;
  return shard;
}

// The model, built without the blocks the run does not keep whole: ZeRO-2 keeps gradient
// shards of its own, ZeRO-3 its parameters too. ZeRO-3's optimizer binds the parameters
// and takes each rank's part of the weights as they are read or drawn, one whole
// parameter at a time: no rank ever holds the whole model. Then tensor parallelism,
// recomputation, the device and the pipeline.
void StepEngine::build_model(const FillWeights& fill) {
  const nn::Blocks blocks = config_.zero < 2    ? nn::Blocks::ParametersAndGradients
                            : config_.zero == 2 ? nn::Blocks::Parameters
                                                : nn::Blocks::None;
  // ZeRO-3 gathers units in the model's order while reduce-scatters wait for gradients, and
  // which experts a rank's backward reaches depends on its tokens: the late reduce-scatter
  // of a unit one rank's tokens left an expert of would meet another rank's gather.
  TALLY_CHECK(config_.zero < 3 || config_.model.n_experts == 0 || world_.replicas() == 1, "--zero 3 with ",
              config_.model.n_experts, " experts a sparse layer over ", world_.replicas(),
              " data-parallel ranks is not supported yet (an expert some rank's tokens skip is reduced late); use "
              "--zero 2 or lower");
  const nn::Transformer::RouterLosses& losses = config_.router_losses;
  const bool router_losses = losses.balance > 0 || losses.z > 0;
  TALLY_CHECK(!router_losses || config_.model.n_experts > 0, "--moe-balance-loss-coef ", losses.balance,
              " / --moe-z-loss-coef ", losses.z, ": router losses need a mixture of experts, and ",
              config_.model.describe(), " has no experts");
  TALLY_CHECK(!router_losses || world_.cp() == 1, "--moe-balance-loss-coef / --moe-z-loss-coef with --cp ", world_.cp(),
              ": each is a function of a microbatch's routing, and each context-parallel rank routes only its part "
              "of the sequences; train without them or without --cp");
  TALLY_CHECK(config_.model.router_aux_loss_coef == 0 || world_.cp() == 1, "--cp ", world_.cp(),
              ": the load-balancing loss is a function of every token's routing in the batch, and each rank sees only "
              "its part of the sequences; train without it (router_aux_loss_coef 0) or without --cp");
  // Built on the host (a dry run: on the meta device, which fills nothing).
  const Device built_on = config_.device.is_meta() ? config_.device : Device::cpu();
  model_ = std::make_unique<nn::Transformer>(config_.model, shard_of(world_.pp_rank(), world_.tp_rank(), world_.ep_rank()),
                                             blocks, built_on);
  if (config_.zero == 3) {
    zero_ = std::make_unique<ZeroOptimizer>(model_->params(), config_.adamw, world_.replica_group(), 3);
    model_->set_residency(zero_.get());
  }
  fill(*model_);
  // Set-up's peak: the shard's parameters and gradients, and one whole parameter beside
  // them.
  if (model_parallel_) setup_peak_ = runtime::ledger(config_.device).stats().peak_allocated;
  if (world_.tp() > 1) {
    tensor_parallel_ = std::make_unique<TensorParallel>(world_.tp_group(), config_.sequence_parallel);
    model_->set_tensor_parallel(tensor_parallel_.get());
  }
  if (world_.cp() > 1) {
    TALLY_CHECK(config_.device.runs_as() == DeviceType::CPU, "--cp ", world_.cp(),
                ": context parallelism runs on the CPU (its collectives are MPI's); --device ", config_.device.str(),
                " is not supported with it");
    context_parallel_ = std::make_unique<ContextParallel>(world_.cp_group());
    model_->set_context_parallel(context_parallel_.get());
  }
  if (world_.ep() > 1) {
    expert_parallel_ = std::make_unique<ExpertParallel>(world_.ep_group());
    model_->set_expert_parallel(expert_parallel_.get());
  }
  model_->set_recompute(config_.recompute);
  model_->set_expert_capacity_factor(config_.expert_capacity_factor);
  model_->set_router_losses(config_.router_losses);
  model_->move_to(config_.device);  // built and loaded on the host; trained where --device says
  if (world_.pp() > 1)
    pipeline_ = std::make_unique<PipelineStage>(*model_, world_.pp_group(), config_.pp_schedule, config_.virtual_stages);
}

// AdamW over the whole block, or ZeRO over the data-parallel group (ZeRO-3's is made
// with the model); then what the optimizer's state must come before (the bf16 copy, as
// the plan orders the parts) and the gradients' reduction.
void StepEngine::build_optimizer() {
  // Expert parallel: the experts' model states over the ranks that hold the same experts.
  std::vector<bool> expert(model_->params().size());
  for (size_t i = 0; i < expert.size(); ++i) expert[i] = model_->is_expert(i);
  Communicator* expert_replicas = world_.ep() > 1 ? &world_.expert_replica_group() : nullptr;
  if (config_.zero == 0) adamw_ = std::make_unique<optim::AdamW>(model_->params(), config_.adamw);
  else if (!zero_)
    zero_ = std::make_unique<ZeroOptimizer>(model_->params(), config_.adamw, world_.replica_group(), config_.zero,
                                            expert_replicas, expert);
  // ZeRO-2/3's set-up peak: ZeRO-2's parameter block and shards, just made; ZeRO-3's
  // shards and the one whole parameter it read or drew at a time.
  if (config_.zero >= 2) setup_peak_ = runtime::ledger(config_.device).stats().peak_allocated;
  if (zero_ && zero_->stage() >= 2) model_->set_residency(zero_.get());
  model_->set_matmul_dtype(config_.matmul_dtype);
  model_->set_loss_chunk_rows(config_.chunked_loss ? nn::Transformer::default_loss_chunk_rows(config_.model.padded_vocab_size)
                                                   : 0);
  // Plain data parallel and ZeRO-1 average full gradients with bucketed all-reduces.
  // Expert parallel: the experts' gradients over the ranks that hold the same experts.
  if (config_.zero <= 1 && world_.replicas() > 1)
    all_reduce_ = std::make_unique<GradientAllReduce>(model_->params(), world_.replica_group(), config_.bucket_bytes,
                                                      expert_replicas, expert);
  // One process's gradients are final once backward has written them, so their norm is
  // summed during the step's last backward, each gradient while it is still in cache
  // (optim/grad_norm.h). Data parallel's change once more, in the all-reduce. On a GPU
  // each gradient's sum would be a wait for the device in the middle of backward.
  if (!model_parallel_ && !zero_ && world_.replicas() == 1 && config_.device.runs_as() == DeviceType::CPU)
    backward_norm_ = std::make_unique<optim::BackwardGradientNorm>(model_->params());
}

optim::Optimizer& StepEngine::optimizer() {
  return adamw_ ? static_cast<optim::Optimizer&>(*adamw_) : static_cast<optim::Optimizer&>(*zero_);
}

// A batch's tokens on the training device (the loader fills host buffers): the tensor
// itself when it is there already.
Tensor StepEngine::local(const Tensor& t) const {
  return on_device(context_parallel_ ? context_parallel_->local_tokens(t) : t);
}

Tensor StepEngine::on_device(const Tensor& t) const {
  if (t.device() == config_.device) return t;
  Tensor moved = Tensor::empty(t.shape(), t.dtype(), config_.device, current_owner("microbatch_tokens"));
  moved.copy_(t);
  return moved;
}

double StepEngine::forward_backward(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer) {
  const int64_t tp_bytes_before = world_.tp_group().stats().payload_bytes;
  const CommStats cp_before = world_.cp_group().stats(), ep_before = world_.ep_group().stats();
  aux_loss_sum_ = 0;
  const double local = pipeline_ ? run_pipeline(step, loader, sanitizer) : run_microbatches(step, loader, sanitizer);
  tp_payload_bytes_ = world_.tp_group().stats().payload_bytes - tp_bytes_before;
  const CommStats cp_after = world_.cp_group().stats();
  cp_traffic_ = {cp_after.operations - cp_before.operations, cp_after.payload_bytes - cp_before.payload_bytes,
                 cp_after.busy_seconds - cp_before.busy_seconds};
  const CommStats ep_after = world_.ep_group().stats();
  ep_traffic_ = {ep_after.operations - ep_before.operations, ep_after.payload_bytes - ep_before.payload_bytes,
                 ep_after.busy_seconds - ep_before.busy_seconds};
  const double total = world_.replica_group().all_reduce_scalar(local, ReduceOp::Sum);
  const double count = static_cast<double>(config_.microbatches * world_.replicas());
  if (model_->config().router_aux_loss_coef > 0)
    aux_loss_ = world_.replica_group().all_reduce_scalar(aux_loss_sum_, ReduceOp::Sum) / count;
  if (model_->config().n_experts > 0) reduce_expert_load();
  return total / count + reduce_router_losses(count);
}

// Each rank's sums over the layers it ran, summed over the replicas and the pipeline's
// stages (tensor-parallel ranks hold the same ones) and averaged as the loss is.
double StepEngine::reduce_router_losses(double count) {
  const nn::Transformer::RouterLosses& k = config_.router_losses;
  if (k.balance <= 0 && k.z <= 0) return 0;
  const nn::Transformer::RouterLosses mine = model_->take_router_loss_values();
  const std::vector<double> sums = summed_over_replicas_and_stages({mine.balance, mine.z}, "moe.router_losses");
  router_losses_ = {sums[0] / count, sums[1] / count};
  return k.balance * router_losses_.balance + k.z * router_losses_.z;
}

std::vector<double> StepEngine::summed_over_replicas_and_stages(const std::vector<double>& values,
                                                                const char* owner) const {
  Tensor t = Tensor::empty({static_cast<int64_t>(values.size())}, DType::F64, Device::cpu(),
                           make_owner(Category::Communication, owner));
  std::copy(values.begin(), values.end(), t.data<double>());
  world_.replica_group().all_reduce(t);
  world_.pp_group().all_reduce(t);
  return t.to_vector<double>();
}

// Each rank counted its own tokens in its own stage's layers: summed over the replicas
// (data and context parallel) and the pipeline stages, every rank holds the whole step's
// counts.
void StepEngine::reduce_expert_load() {
  const nn::TransformerConfig& c = model_->config();
  const int64_t sparse = c.sparse_layer_count();
  std::vector<int64_t> local = model_->take_expert_load();
  local.resize(static_cast<size_t>(sparse * c.n_experts), 0);
  local.push_back(model_->take_dropped_pairs());  // last: the pairs dropped past capacity
  const std::vector<double> load =
      summed_over_replicas_and_stages(std::vector<double>(local.begin(), local.end()), "moe.expert_load");
  const auto [lo, hi] = std::minmax_element(load.begin(), load.end() - 1);
  expert_load_ = {static_cast<int64_t>(*lo), static_cast<int64_t>(*hi), static_cast<int64_t>(load.back())};
}

// Microbatches one after another, each forward then backward: the loader's buffers are
// read in place (each microbatch's backward runs before the next is read).
double StepEngine::run_microbatches(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer) {
  const int64_t N = config_.microbatches, D = world_.dp(), replicas = world_.replicas();
  double loss_sum = 0;
  for (int64_t mb = 0; mb < N; ++mb) {
    sanitizer.begin_microbatch(mb);
    const bool last = mb + 1 == N;
    {
      const data::Batch& batch = loader.batch_at(step, mb * D + world_.dp_rank(), N * D);
      std::optional<profiler::PhaseScope> phase(std::in_place, "forward");
      nn::ForwardResult result = model_->forward(local(batch.inputs), local(batch.targets));
      Tensor loss = std::move(result.loss);
      if (result.aux_loss.defined()) aux_loss_sum_ += result.aux_loss.item();  // its number only
      result = nn::ForwardResult();
      if (config_.on_microbatch_loss) config_.on_microbatch_loss(mb, loss);
      // At the end of the first forward the live set is exactly model states + loader
      // buffers + saved activations (measured; the plan predicts it).
      if (live_after_forward_ == 0) live_after_forward_ = runtime::ledger(config_.device).stats().allocated;
      loss_sum += loss.item();  // R4: only the number escapes the microbatch
      phase.emplace("backward");
      if (last && all_reduce_) all_reduce_->arm();  // reduce while the last backward runs
      if (last && backward_norm_) backward_norm_->arm();
      (N * replicas == 1 ? loss : ops::scale(loss, 1.0 / static_cast<double>(N * replicas))).backward();
      if (last && all_reduce_) all_reduce_->start_rest();  // before the loss's all-reduce on the same group
    }
    if (zero_) zero_->finish_microbatch();
    sanitizer.end_microbatch();
  }
  return loss_sum;
}

// A pipeline stage's schedule. The loader's buffers are refilled per call, so each
// microbatch keeps its own copy (the embedding and the loss save them for backward,
// which runs later).
double StepEngine::run_pipeline(int64_t step, data::BatchSource& loader, sanitizer::Sanitizer& sanitizer) {
  const int64_t N = config_.microbatches, D = world_.dp();
  auto batch_of = [&](int64_t mb) {
    const data::Batch& b = loader.batch_at(step, mb * D + world_.dp_rank(), N * D);
    auto own = [&](const Tensor& full) {
      const Tensor t = context_parallel_ ? context_parallel_->local_tokens(full) : full;
      if (context_parallel_ && t.device() == config_.device) return t;  // a copy of its own already
      Tensor copy = Tensor::empty(t.shape(), t.dtype(), config_.device, current_owner("microbatch_tokens"));
      copy.copy_(t);
      return copy;
    };
    return std::pair<Tensor, Tensor>{own(b.inputs), own(b.targets)};
  };
  // Data parallel overlaps its all-reduce with the step's last backward, which under
  // gpipe and 1f1b finishes every parameter of the stage; interleaved chunks finish at
  // different times, so their reduction starts after the pipeline.
  profiler::PhaseScope phase("pipeline");
  const double loss_sum = pipeline_->run(N, batch_of, 1.0 / static_cast<double>(N * world_.replicas()), sanitizer, [&] {
    if (all_reduce_ && config_.virtual_stages == 1) all_reduce_->arm();
  }, config_.on_microbatch_loss);
  if (all_reduce_ && config_.virtual_stages > 1) all_reduce_->arm();
  if (all_reduce_) all_reduce_->start_rest();  // before the loss's all-reduces
  TALLY_CHECK(pipeline_->last().max_in_flight <= in_flight_bound_, "pipeline stage ", world_.pp_rank(), " held ",
              pipeline_->last().max_in_flight, " microbatches at once; the ",
              pipeline_schedule_name(config_.pp_schedule), " schedule needs ", in_flight_bound_);
  return world_.pp_group().all_reduce_scalar(loss_sum, ReduceOp::Sum);  // the last stage's
}

void StepEngine::finalize_grads() {
  if (all_reduce_) all_reduce_->finish();
  if (!model_parallel_) return;
  // The tied embedding's two copies (first and last stage) take the sum of their
  // gradients; weights shared by the heads, and under sequence parallelism every replicated
  // parameter, saw only part of the work on each rank, so their gradients are summed.
  sum_tied_embedding_gradients(*model_, world_.pp_group());
  if (tensor_parallel_) sum_replicated_gradients(*model_, world_.tp_group(), config_.sequence_parallel);
}

// The norm each layout can take cheapest: a shard's squares summed over its groups; ZeRO's
// from the shards; one process's summed during the last backward; a GPU's in one pass
// over the gradient block (one wait for the device); else per parameter after backward.
double StepEngine::grad_norm() {
  profiler::PhaseScope phase("grad_norm");
  if (model_parallel_) return model_parallel_gradient_norm(*model_, world_);
  if (zero_) return zero_->gradient_norm();
  if (backward_norm_) return backward_norm_->finish();
  if (config_.device.runs_as() != DeviceType::CPU) return optim::block_gradient_norm(model_->params());
  return optim::gradient_norm(model_->params());
}

void StepEngine::optimizer_step(double lr, double grad_scale) {
  profiler::PhaseScope phase("optimizer");
  autograd::NoGradGuard no_grad;
  OwnerScope scope("optimizer");
  if (zero_) return zero_->step(lr, grad_scale);
  adamw_->step(lr, grad_scale);
  model_->params().discard_grads();  // the next step's backward writes them afresh: no zeroing pass
}

void StepEngine::synchronize() {
  if (config_.device.runs_as() != DeviceType::CPU) runtime::backend(config_.device).default_stream().synchronize();
}

// Every replica evaluates the same batch; context-parallel ranks each their own tokens of
// it, whose mean losses average to the batch's.
double StepEngine::evaluate(const data::Batch& b) {
  const Tensor inputs = local(b.inputs), targets = local(b.targets);
  const double loss =
      pipeline_ ? pipeline_->evaluate(inputs, targets) : model_->forward(inputs, targets).loss.item();
  if (!context_parallel_) return loss;
  return world_.cp_group().all_reduce_scalar(loss, ReduceOp::Sum) / world_.cp();
}

int64_t StepEngine::model_state_bytes() const {
  const int64_t P = model_->num_parameters();  // this rank's (its shard's under --tp/--pp)
  return (zero_ ? zero_->footprint().total() : 16 * P) + (config_.matmul_dtype == DType::BF16 ? 2 * P : 0);
}

std::string StepEngine::model_state_formula() const {
  const int z = config_.zero;
  std::string formula = z == 0                       ? "16P"
                        : z == 1 && world_.ep() > 1 ? "8P + 8P/D (the experts' 8P/(D/E))"
                        : z == 1                    ? "8P + 8P/D"
                        : z == 2                    ? "4P + 12P/D"
                                                    : "16P/D";
  if (config_.matmul_dtype == DType::BF16) formula += " + 2P (bf16 copy)";
  return formula;
}

const PipelineStepStats* StepEngine::pipeline_stats() const { return pipeline_ ? &pipeline_->last() : nullptr; }
const ReductionStats* StepEngine::all_reduce_stats() const { return all_reduce_ ? &all_reduce_->last() : nullptr; }

std::vector<std::string> StepEngine::describe() const {
  std::vector<std::string> lines;
  const int TP = world_.tp(), PP = world_.pp();
  const int64_t D = world_.replicas();
  if (model_parallel_) {
    std::string parts;
    if (TP > 1) parts = "tensor parallel " + std::to_string(TP) + (config_.sequence_parallel ? " with sequence parallel" : "");
    if (TP > 1 && PP > 1) parts += ", ";
    if (PP > 1)
      parts += "pipeline " + std::to_string(PP) + " stages, " + pipeline_schedule_name(config_.pp_schedule) +
               (config_.virtual_stages > 1 ? " x " + std::to_string(config_.virtual_stages) + " chunks" : "");
    if (world_.ep() > 1)
      parts += std::string(parts.empty() ? "" : ", ") + "expert parallel " + std::to_string(world_.ep()) + ": " +
               std::to_string(model_->local_experts()) + " of " + std::to_string(config_.model.n_experts) +
               " experts a layer here, tokens exchanged by all-to-all";
    lines.push_back("model parallel: " + parts + ", recompute " + nn::recompute_name(config_.recompute) +
                    "; this rank holds " + std::to_string(model_->num_parameters()) + " of the " +
                    std::to_string(nn::Transformer::layout_only(config_.model).num_parameters()) + " parameters");
  }
  std::string reduction;
  if (config_.zero)
    reduction = "ZeRO stage " + std::to_string(config_.zero) + (D == 1 ? " over 1 data-parallel rank: nothing sharded" : "");
  else if (D > 1)
    reduction = "bucketed all-reduce of " + std::to_string(all_reduce_->buckets().size()) + " buckets";
  else
    reduction = model_parallel_ ? "no data parallel" : "one process";
  if (world_.cp() > 1)
    reduction += "; context parallel " + std::to_string(world_.cp()) + ": each rank holds " +
                 "2 of " + std::to_string(2 * world_.cp()) +
                 " chunks of every sequence, keys and values all-gathered";
  lines.push_back("parallel: " + world_.describe() + ", " + reduction);
  return lines;
}

}  // namespace tally::dist
