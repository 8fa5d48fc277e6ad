#include "dist/pipeline.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>

#include "autograd/grad_mode.h"
#include "core/owner.h"
#include "ops/ops.h"

namespace tally::dist {

namespace {
double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

PipelineSchedule parse_pipeline_schedule(const std::string& text) {
  if (text == "gpipe") return PipelineSchedule::GPipe;
  if (text == "1f1b") return PipelineSchedule::OneFOneB;
  if (text == "interleaved") return PipelineSchedule::Interleaved;
  TALLY_FAIL("--pp-schedule: expected gpipe, 1f1b or interleaved, got '", text, "'");
}

const char* pipeline_schedule_name(PipelineSchedule s) {
  switch (s) {
    case PipelineSchedule::GPipe: return "gpipe";
    case PipelineSchedule::OneFOneB: return "1f1b";
    case PipelineSchedule::Interleaved: return "interleaved";
  }
  return "?";
}

void check_pipeline(PipelineSchedule schedule, int stages, int virtual_stages, int64_t microbatches, int64_t layers,
                    int64_t last_stage_layers) {
  TALLY_CHECK(last_stage_layers >= 0, "--pp-last-stage-layers must be >= 0 (0: split evenly), got ", last_stage_layers);
  TALLY_CHECK(last_stage_layers == 0 || stages > 1, "--pp-last-stage-layers needs --pp > 1");
  TALLY_CHECK(virtual_stages >= 1, "--virtual-stages must be >= 1, got ", virtual_stages);
  TALLY_CHECK(schedule == PipelineSchedule::Interleaved || virtual_stages == 1, "--virtual-stages ", virtual_stages,
              " needs --pp-schedule interleaved (", pipeline_schedule_name(schedule), " runs one chunk per stage)");
  TALLY_CHECK(virtual_stages == 1 || stages > 1, "--virtual-stages ", virtual_stages, " needs --pp > 1 (chunks are "
              "pipeline stages)");
  // The default schedule (1f1b) is every run's; another one named without stages would do nothing.
  TALLY_CHECK(stages > 1 || schedule == PipelineSchedule::OneFOneB, "--pp-schedule ", pipeline_schedule_name(schedule),
              " needs --pp > 1 (a schedule orders pipeline stages' microbatches; this run has one stage)");
  if (stages == 1) return;
  if (schedule == PipelineSchedule::OneFOneB)
    TALLY_CHECK(microbatches >= stages, "--pp-schedule 1f1b with --pp ", stages, " needs at least ", stages,
                " microbatches per step (--grad-accum), got ", microbatches,
                "; with fewer, every stage waits for the whole pipeline (use --pp-schedule gpipe)");
  if (schedule == PipelineSchedule::Interleaved) {
    TALLY_CHECK(virtual_stages >= 2, "--pp-schedule interleaved needs --virtual-stages >= 2, got ", virtual_stages);
    TALLY_CHECK(microbatches % stages == 0, "--pp-schedule interleaved needs --grad-accum to be a multiple of --pp ",
                stages, " (Megatron's schedule runs microbatches in groups of P), got ", microbatches);
  }
  TALLY_CHECK(layers >= static_cast<int64_t>(stages) * virtual_stages, "--pp ", stages, " x --virtual-stages ",
              virtual_stages, " = ", static_cast<int64_t>(stages) * virtual_stages, " stages, but the model has only ",
              layers, " layers");
  const int64_t others = static_cast<int64_t>(stages) * virtual_stages - 1;
  TALLY_CHECK(last_stage_layers == 0 || (last_stage_layers < layers && layers - last_stage_layers >= others),
              "--pp-last-stage-layers ", last_stage_layers, ": the other ", others, " stages need at least one of the ",
              layers, " layers each");
}

std::vector<PipelineAction> pipeline_actions(PipelineSchedule schedule, int P, int s, int64_t N, int V) {
  std::vector<PipelineAction> out;
  if (schedule == PipelineSchedule::GPipe || P == 1) {
    for (int64_t m = 0; m < N; ++m) out.push_back({true, m, 0});
    for (int64_t m = 0; m < N; ++m) out.push_back({false, m, 0});
    return out;
  }
  if (schedule == PipelineSchedule::OneFOneB) {
    const int64_t warmup = std::min<int64_t>(P - s - 1, N);
    for (int64_t m = 0; m < warmup; ++m) out.push_back({true, m, 0});
    for (int64_t i = 0; i < N - warmup; ++i) {
      out.push_back({true, warmup + i, 0});
      out.push_back({false, i, 0});
    }
    for (int64_t i = N - warmup; i < N; ++i) out.push_back({false, i, 0});
    return out;
  }
  // Interleaved (Megatron's forward_backward_pipelining_with_interleaving): virtual
  // microbatch k runs chunk (k mod PV) / P of microbatch (k / PV) * P + k mod P; forwards
  // go up the chunks, backwards down them.
  const int64_t total = N * V, PV = static_cast<int64_t>(P) * V;
  auto microbatch = [&](int64_t k) { return (k / PV) * P + k % P; };
  const int64_t warmup = std::min<int64_t>(static_cast<int64_t>(P - s - 1) * 2 + static_cast<int64_t>(V - 1) * P, total);
  auto fwd = [&](int64_t k) { out.push_back({true, microbatch(k), static_cast<int>((k % PV) / P)}); };
  auto bwd = [&](int64_t k) { out.push_back({false, microbatch(k), V - 1 - static_cast<int>((k % PV) / P)}); };
  for (int64_t k = 0; k < warmup; ++k) fwd(k);
  for (int64_t i = 0; i < total - warmup; ++i) {
    fwd(warmup + i);
    bwd(i);
  }
  for (int64_t i = total - warmup; i < total; ++i) bwd(i);
  return out;
}

int64_t pipeline_in_flight_bound(PipelineSchedule schedule, int P, int s, int64_t N, int V) {
  // Counted from the action list itself: a microbatch is in flight from its first
  // forward on this rank to its last backward.
  std::map<int64_t, int> chunks_open;
  int64_t most = 0;
  for (const PipelineAction& a : pipeline_actions(schedule, P, s, N, V)) {
    if (a.forward) chunks_open[a.microbatch]++;
    else if (--chunks_open[a.microbatch] == 0) chunks_open.erase(a.microbatch);
    most = std::max<int64_t>(most, static_cast<int64_t>(chunks_open.size()));
  }
  return most;
}

std::vector<std::pair<int64_t, int64_t>> split_layers(int64_t layers, int stages, int64_t last_stage_layers) {
  std::vector<std::pair<int64_t, int64_t>> out;
  const int even = last_stage_layers > 0 ? stages - 1 : stages;
  const int64_t shared = layers - (last_stage_layers > 0 ? last_stage_layers : 0);
  const int64_t base = shared / even, extra = shared % even;
  int64_t first = 0;
  for (int i = 0; i < even; ++i) {
    const int64_t n = base + (i < extra ? 1 : 0);
    out.emplace_back(first, first + n);
    first += n;
  }
  if (last_stage_layers > 0) out.emplace_back(first, layers);
  return out;
}

nn::ModelShard pipeline_shard(int64_t layers, int P, int s, int V, int tp, int tp_rank, int64_t last_stage_layers) {
  nn::ModelShard shard;
  shard.tp = tp;
  shard.tp_rank = tp_rank;
  const int S = P * V;
  const auto ranges = split_layers(layers, S, last_stage_layers);
  for (int v = 0; v < V; ++v) {
    const int g = v * P + s;
    shard.chunks.push_back({ranges[static_cast<size_t>(g)].first, ranges[static_cast<size_t>(g)].second, g == 0, g == S - 1});
  }
  return shard;
}

PipelineStage::PipelineStage(nn::Transformer& model, Communicator& pp_group, PipelineSchedule schedule, int virtual_stages,
                             ReceivedInputs* received)
    : model_(model), group_(pp_group), schedule_(schedule), stages_(pp_group.size()), stage_(pp_group.rank()),
      virtual_stages_(virtual_stages), received_(received) {
  TALLY_CHECK(static_cast<int>(model.num_chunks()) == virtual_stages, "internal: the model holds ", model.num_chunks(),
              " chunks, the pipeline runs ", virtual_stages);
}

bool PipelineStage::runs_head() const {
  for (size_t c = 0; c < model_.num_chunks(); ++c)
    if (model_.shard().chunks[c].head) return true;
  return false;
}

Shape PipelineStage::activation_shape(int64_t batch, int64_t seq) const {
  const nn::TensorParallelOps* tp = model_.tensor_parallel();
  const int64_t local_seq = tp && tp->sequence_parallel() ? seq / tp->size() : seq;
  return {batch, local_seq, model_.config().n_embd};
}

namespace {
// Tags: the boundary between global stages g and g+1 carries activations on 2g and
// gradients on 2g+1; messages of one boundary arrive in microbatch order (MPI does not
// overtake between one pair of ranks on one tag), which is the order both sides use.
int activation_tag(int g) { return 2 * g; }
int gradient_tag(int g) { return 2 * g + 1; }

// What one chunk of one microbatch keeps from its forward to its backward.
struct InFlight {
  Tensor input;   // the received activation: a leaf that requires grad (not on the first chunk)
  Tensor output;  // the chunk's output, or its scaled loss on the model's last chunk
  std::shared_ptr<Work> sent;  // the output's send to the next stage
};

// A receive posted ahead of the action that needs it.
struct Posted {
  Tensor buffer;
  std::shared_ptr<Work> work;
};
}  // namespace

Tensor ReceivedInputs::input(const Tensor& received) {
  received.set_requires_grad(true);  // a fresh leaf: the stage's graph starts here
  return received;
}

// One step of one stage: the schedule's actions in order, each forward keeping what its
// backward needs (InFlight), receives posted one action ahead.
class PipelineStage::Step {
 public:
  Step(PipelineStage& stage, int64_t microbatches, const BatchFn& batch, double loss_scale,
       sanitizer::Sanitizer& sanitizer, const std::function<void()>& before_last_backward, const LossHook& on_loss)
      : stage_(stage), batch_(batch), loss_scale_(loss_scale), sanitizer_(sanitizer),
        before_last_backward_(before_last_backward), on_loss_(on_loss),
        actions_(pipeline_actions(stage.schedule_, stage.stages_, stage.stage_, microbatches, stage.virtual_stages_)) {
    for (size_t i = 0; i < actions_.size(); ++i)
      if (!actions_[i].forward) last_backward_ = i;
  }

  double run() {
    // Every microbatch has the first one's shape (the first action is microbatch 0's forward).
    sanitizer_.begin_microbatch(actions_[0].microbatch);
    first_batch_ = batch_(actions_[0].microbatch);
    activation_shape_ = stage_.activation_shape(first_batch_.first.shape()[0], first_batch_.first.shape()[1]);
    for (size_t i = 0; i < actions_.size(); ++i) {
      post_receive(i);
      post_receive(i + 1);
      sanitizer_.begin_microbatch(actions_[i].microbatch);  // what follows is this microbatch's
      if (actions_[i].forward) forward(i);
      else backward(i);
    }
    if (gradient_sent_) wait_timed(*gradient_sent_);
    TALLY_CHECK(flight_.empty() && backwards_left_.empty() && posted_.empty(), "internal: the pipeline schedule left ",
                flight_.size(), " forwards without a backward");
    return loss_sum_;
  }

 private:
  const nn::ModelShard::Chunk& chunk(size_t i) const {
    return stage_.model_.shard().chunks[static_cast<size_t>(actions_[i].chunk)];
  }
  int global(size_t i) const { return stage_.global_stage(actions_[i].chunk); }
  int stages() const { return stage_.stages_ * stage_.virtual_stages_; }

  void wait_timed(Work& w) {
    const double t0 = now_seconds();
    w.wait();
    stage_.last_.idle_seconds += now_seconds() - t0;
  }

  // Action i's receive, posted one action ahead so that it arrives while the previous
  // action computes. A buffer belongs to its own microbatch (the sanitizer's clock is set
  // to it while the buffer is made).
  void post_receive(size_t i) {
    if (i >= actions_.size() || posted_.count(i)) return;
    const PipelineAction& a = actions_[i];
    if (a.forward ? chunk(i).embed : chunk(i).head) return;  // it receives nothing
    sanitizer_.begin_microbatch(a.microbatch);
    const int g = global(i);
    const DType dtype = stage_.model_.params().dtype();
    Posted p;
    if (a.forward) {
      OwnerScope scope("pp_recv");
      p.buffer = Tensor::empty(activation_shape_, dtype, stage_.model_.params().device(), current_owner("activation"));
      p.work = stage_.group_.recv_async(p.buffer, (g - 1 + stages()) % stages() % stage_.stages_, activation_tag(g - 1));
    } else {
      p.buffer = Tensor::empty(activation_shape_, dtype, stage_.model_.params().device(),
                               make_owner(Category::Communication, "comm:pp_recv_grad"));
      p.work = stage_.group_.recv_async(p.buffer, (g + 1) % stage_.stages_, gradient_tag(g));
    }
    posted_.emplace(i, std::move(p));
  }

  // Action i's receive, waited for.
  Tensor received(size_t i) {
    auto it = posted_.find(i);
    TALLY_CHECK(it != posted_.end(), "internal: pipeline action ", i, " has no receive posted");
    Posted p = std::move(it->second);
    posted_.erase(it);
    wait_timed(*p.work);
    return p.buffer;
  }

  void forward(size_t i) {
    const PhaseMark phase("forward");
    const PipelineAction& a = actions_[i];
    auto [tokens, targets] = i == 0 ? std::move(first_batch_) : batch_(a.microbatch);
    InFlight f;
    Tensor input = tokens;
    if (!chunk(i).embed) input = f.input = stage_.received_inputs().input(received(i));
    nn::ForwardResult r = stage_.model_.forward_chunk(static_cast<size_t>(a.chunk), input, chunk(i).head ? targets : Tensor());
    if (chunk(i).head) {
      loss_sum_ += r.loss.item();
      if (on_loss_) on_loss_(a.microbatch, r.loss);
      f.output = loss_scale_ == 1.0 ? r.loss : ops::scale(r.loss, loss_scale_);
    } else {
      f.output = r.hidden;
      f.sent = stage_.group_.send_async(f.output.detach(), (global(i) + 1) % stage_.stages_, activation_tag(global(i)));
      stage_.last_.bytes_sent += f.output.nbytes();
    }
    backwards_left_[a.microbatch]++;
    stage_.last_.max_in_flight = std::max<int64_t>(stage_.last_.max_in_flight, static_cast<int64_t>(backwards_left_.size()));
    flight_.emplace(std::make_pair(a.microbatch, a.chunk), std::move(f));
  }

  void backward(size_t i) {
    const PhaseMark phase("backward");
    const PipelineAction& a = actions_[i];
    auto it = flight_.find({a.microbatch, a.chunk});
    TALLY_CHECK(it != flight_.end(), "internal: pipeline backward of microbatch ", a.microbatch, " chunk ", a.chunk,
                " before its forward");
    InFlight f = std::move(it->second);
    flight_.erase(it);
    if (i == last_backward_ && before_last_backward_) before_last_backward_();
    if (chunk(i).head) {
      f.output.backward();
    } else {
      f.output.backward(received(i));
      wait_timed(*f.sent);
    }
    if (!chunk(i).embed) send_input_gradient(i, f.input);
    stage_.received_inputs().done(f.input);
    f = InFlight();
    if (--backwards_left_[a.microbatch] == 0) {
      backwards_left_.erase(a.microbatch);
      sanitizer_.end_microbatch(a.microbatch);
    }
  }

  // The received activation's gradient goes back in a buffer of its own, so the leaf and
  // its gradient die with this microbatch. The last gradient sent is waited for before
  // the next is sent, so a stage holds one send buffer, not one per microbatch
  // (deadlock-free for these schedules: a stage's previous gradient is received by its
  // neighbour at or before that neighbour's next backward, which needs nothing more from
  // this stage).
  void send_input_gradient(size_t i, const Tensor& input) {
    if (gradient_sent_) wait_timed(*gradient_sent_);
    gradient_sent_.reset();  // its buffer is freed before the next is made
    Tensor out = Tensor::empty(input.shape(), input.dtype(), input.device(), make_owner(Category::Communication, "comm:pp_send_grad"));
    out.copy_(input.grad());
    gradient_sent_ = stage_.group_.send_async(out, (global(i) - 1 + stages()) % stages() % stage_.stages_, gradient_tag(global(i) - 1));
    stage_.last_.bytes_sent += out.nbytes();
  }

  PipelineStage& stage_;
  const BatchFn& batch_;
  double loss_scale_;
  sanitizer::Sanitizer& sanitizer_;
  const std::function<void()>& before_last_backward_;
  const LossHook& on_loss_;
  const std::vector<PipelineAction> actions_;
  size_t last_backward_ = SIZE_MAX;
  std::pair<Tensor, Tensor> first_batch_;
  Shape activation_shape_;
  std::map<std::pair<int64_t, int>, InFlight> flight_;  // (microbatch, chunk)
  std::map<int64_t, int> backwards_left_;               // per microbatch: chunks whose backward has not run
  std::map<size_t, Posted> posted_;                     // action index -> its receive
  std::shared_ptr<Work> gradient_sent_;
  double loss_sum_ = 0;
};

ReceivedInputs& PipelineStage::received_inputs() {
  static ReceivedInputs own;
  return received_ ? *received_ : own;
}

double PipelineStage::run(int64_t N, const BatchFn& batch, double loss_scale, sanitizer::Sanitizer& sanitizer,
                          const std::function<void()>& before_last_backward, const LossHook& on_loss) {
  last_ = PipelineStepStats();
  const double begin = now_seconds();
  const double loss_sum = Step(*this, N, batch, loss_scale, sanitizer, before_last_backward, on_loss).run();
  last_.seconds = now_seconds() - begin;
  return loss_sum;
}

void sum_tied_embedding_gradients(nn::Transformer& model, Communicator& pp) {
  if (!model.config().tie_embeddings || pp.size() == 1) return;
  const bool first = pp.rank() == 0, last = pp.rank() == pp.size() - 1;
  if (!first && !last) return;
  const Tensor grad = model.params().get("wte").grad();
  TALLY_CHECK(grad.defined(), "internal: the tied embedding has no gradient on pipeline stage ", pp.rank());
  const int other = first ? pp.size() - 1 : 0;
  constexpr int kTag = 30000;  // above every activation and gradient tag (2 x stages)
  // In pieces of at most 1M elements: the exchange needs one piece of staging, not a copy
  // of the whole (V, C) gradient (154 MB for GPT-2 124M).
  const Tensor flat = grad.reshape({-1});
  const int64_t n = flat.numel(), piece = std::min<int64_t>(n, int64_t{1} << 20);
  Tensor theirs = Tensor::empty({piece}, grad.dtype(), grad.device(), make_owner(Category::Communication, "comm:embedding_group"));
  for (int64_t at = 0; at < n; at += piece) {
    const int64_t len = std::min(piece, n - at);
    Tensor mine = flat.slice(0, at, at + len), into = theirs.slice(0, 0, len);
    auto sent = pp.send_async(mine, other, kTag);
    pp.recv(into, other, kTag);
    sent->wait();  // `mine` is read by the send: add only after it completes
    ops::add_(mine, into);
  }
  grad.storage().bump_version();
}

double PipelineStage::evaluate(const Tensor& tokens, const Tensor& targets) {
  autograd::InferenceModeGuard inference;
  const auto& chunks = model_.shard().chunks;
  const int S = stages_ * virtual_stages_;
  const Shape act_shape = activation_shape(tokens.shape()[0], tokens.shape()[1]);
  double loss = 0;
  // Global stages in order: this rank runs its chunks as their turn comes.
  for (int v = 0; v < virtual_stages_; ++v) {
    const nn::ModelShard::Chunk& chunk = chunks[static_cast<size_t>(v)];
    const int g = global_stage(v);
    Tensor input = tokens;
    if (!chunk.embed) {
      input = Tensor::empty(act_shape, model_.params().dtype(), model_.params().device(),
                            make_owner(Category::Communication, "comm:pp_eval"));
      group_.recv(input, (g - 1 + S) % S % stages_, activation_tag(g - 1));
    }
    nn::ForwardResult r = model_.forward_chunk(static_cast<size_t>(v), input, chunk.head ? targets : Tensor());
    if (chunk.head) loss = r.loss.item();
    else group_.send(r.hidden, (g + 1) % stages_, activation_tag(g));
  }
  // The last stage's loss, on every stage.
  return group_.all_reduce_scalar(runs_head() ? loss : 0.0, ReduceOp::Sum);
}

}  // namespace tally::dist
