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

PipelineStage::PipelineStage(nn::Transformer& model, Communicator& pp_group, PipelineSchedule schedule, int virtual_stages)
    : model_(model), group_(pp_group), schedule_(schedule), stages_(pp_group.size()), stage_(pp_group.rank()),
      virtual_stages_(virtual_stages) {
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
}  // namespace

double PipelineStage::run(int64_t N, const BatchFn& batch, double loss_scale, sanitizer::Sanitizer& sanitizer,
                          const std::function<void()>& before_last_backward) {
  const auto& chunks = model_.shard().chunks;
  const int S = stages_ * virtual_stages_;
  const std::vector<PipelineAction> actions = pipeline_actions(schedule_, stages_, stage_, N, virtual_stages_);
  std::map<std::pair<int64_t, int>, InFlight> flight;  // (microbatch, chunk)
  std::map<int64_t, int> backwards_left;               // per microbatch: chunks whose backward has not run
  // The last gradient sent back: waited for before the next is sent, so a stage holds one
  // send buffer, not one per microbatch (deadlock-free for these schedules: a stage's
  // previous gradient is received by its neighbour at or before that neighbour's next
  // backward, which needs nothing more from this stage).
  std::shared_ptr<Work> gradient_sent;
  std::vector<Tensor> kept;                            // Fault::KeepReceived only
  last_ = PipelineStepStats();
  const double begin = now_seconds();
  double loss_sum = 0;
  size_t last_backward = actions.size();
  for (size_t i = 0; i < actions.size(); ++i)
    if (!actions[i].forward) last_backward = i;

  auto wait_timed = [&](Work& w) {
    const double t0 = now_seconds();
    w.wait();
    last_.idle_seconds += now_seconds() - t0;
  };
  // Every microbatch has the first one's shape (the first action is microbatch 0's forward).
  sanitizer.begin_microbatch(actions[0].microbatch);
  std::pair<Tensor, Tensor> first_batch = batch(actions[0].microbatch);
  const Shape act_shape = activation_shape(first_batch.first.shape()[0], first_batch.first.shape()[1]);
  const DType dtype = model_.params().dtype();
  // Receives are posted one action ahead, so the next action's activation or gradient
  // arrives while this one computes. A buffer belongs to its own microbatch (the
  // sanitizer's clock is set to it while the buffer is made).
  struct Posted {
    Tensor buffer;
    std::shared_ptr<Work> work;
  };
  std::map<size_t, Posted> posted;  // action index -> its receive
  auto post_receive = [&](size_t i) {
    if (i >= actions.size() || posted.count(i)) return;
    const PipelineAction& n = actions[i];
    const nn::ModelShard::Chunk& ch = chunks[static_cast<size_t>(n.chunk)];
    const int g = global_stage(n.chunk);
    if (n.forward ? ch.embed : ch.head) return;  // it receives nothing
    sanitizer.begin_microbatch(n.microbatch);
    Posted p;
    if (n.forward) {
      OwnerScope scope("pp_recv");
      p.buffer = Tensor::empty(act_shape, dtype, Device::cpu(), current_owner("activation"));
      p.work = group_.recv_async(p.buffer, (g - 1 + S) % S % stages_, activation_tag(g - 1));
    } else {
      p.buffer = Tensor::empty(act_shape, dtype, Device::cpu(), make_owner(Category::Communication, "comm:pp_recv_grad"));
      p.work = group_.recv_async(p.buffer, (g + 1) % stages_, gradient_tag(g));
    }
    posted.emplace(i, std::move(p));
  };
  // This action's receive, waited for.
  auto received = [&](size_t i) {
    auto it = posted.find(i);
    TALLY_CHECK(it != posted.end(), "internal: pipeline action ", i, " has no receive posted");
    Posted p = std::move(it->second);
    posted.erase(it);
    wait_timed(*p.work);
    return p.buffer;
  };
  for (size_t i = 0; i < actions.size(); ++i) {
    const PipelineAction& a = actions[i];
    const nn::ModelShard::Chunk& chunk = chunks[static_cast<size_t>(a.chunk)];
    const int g = global_stage(a.chunk);
    post_receive(i);
    post_receive(i + 1);
    sanitizer.begin_microbatch(a.microbatch);  // what follows is this microbatch's
    if (a.forward) {
      auto [tokens, targets] = i == 0 ? std::move(first_batch) : batch(a.microbatch);
      InFlight f;
      Tensor input = tokens;
      if (!chunk.embed) {
        f.input = received(i);
        if (fault_ == Fault::LeafAndOutput) {
          // The receive recorded as an op (its output depends on a tensor that requires
          // grad), then made a leaf as well: R1 refuses it here.
          Tensor source = Tensor::zeros(act_shape, f.input.dtype(), Device::cpu());
          source.set_requires_grad(true);
          f.input = ops::add(source, f.input);
        }
        f.input.set_requires_grad(true);  // a fresh leaf: the stage's graph starts here
        input = f.input;
      }
      nn::ForwardResult r = model_.forward_chunk(static_cast<size_t>(a.chunk), input, chunk.head ? targets : Tensor());
      if (chunk.head) {
        loss_sum += r.loss.item();
        f.output = loss_scale == 1.0 ? r.loss : ops::scale(r.loss, loss_scale);
      } else {
        f.output = r.hidden;
        f.sent = group_.send_async(f.output.detach(), (g + 1) % stages_, activation_tag(g));
        last_.bytes_sent += f.output.nbytes();
      }
      backwards_left[a.microbatch]++;
      last_.max_in_flight = std::max<int64_t>(last_.max_in_flight, static_cast<int64_t>(backwards_left.size()));
      flight.emplace(std::make_pair(a.microbatch, a.chunk), std::move(f));
    } else {
      auto it = flight.find({a.microbatch, a.chunk});
      TALLY_CHECK(it != flight.end(), "internal: pipeline backward of microbatch ", a.microbatch, " chunk ", a.chunk,
                  " before its forward");
      InFlight f = std::move(it->second);
      flight.erase(it);
      if (i == last_backward && before_last_backward) before_last_backward();
      if (chunk.head) {
        f.output.backward();
      } else {
        f.output.backward(received(i));
        wait_timed(*f.sent);
      }
      if (!chunk.embed) {
        // The received activation's gradient goes back in a buffer of its own, so the
        // leaf and its gradient die now, with this microbatch.
        if (gradient_sent) wait_timed(*gradient_sent);
        gradient_sent.reset();  // its buffer is freed before the next is made
        Tensor out = Tensor::empty(f.input.shape(), f.input.dtype(), Device::cpu(), make_owner(Category::Communication, "comm:pp_send_grad"));
        out.copy_(f.input.grad());
        gradient_sent = group_.send_async(out, (g - 1 + S) % S % stages_, gradient_tag(g - 1));
        last_.bytes_sent += out.nbytes();
      }
      if (fault_ == Fault::KeepReceived && f.input.defined()) kept.push_back(f.input);
      f = InFlight();
      if (--backwards_left[a.microbatch] == 0) {
        backwards_left.erase(a.microbatch);
        sanitizer.end_microbatch(a.microbatch);
      }
    }
  }
  if (gradient_sent) wait_timed(*gradient_sent);
  TALLY_CHECK(flight.empty() && backwards_left.empty() && posted.empty(), "internal: the pipeline schedule left ", flight.size(),
              " forwards without a backward");
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
  Tensor theirs = Tensor::empty({piece}, grad.dtype(), Device::cpu(), make_owner(Category::Communication, "comm:embedding_group"));
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
      input = Tensor::empty(act_shape, model_.params().dtype(), Device::cpu(), make_owner(Category::Communication, "comm:pp_eval"));
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
