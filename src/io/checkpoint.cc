#include "io/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "autograd/grad_mode.h"
#include "core/atomic_file.h"
#include "core/crash_point.h"
#include "core/json_input.h"
#include "core/owner.h"
#include "io/checksum.h"
#include "io/files.h"
#include "io/model_files.h"
#include "nn/llmc_layout.h"

namespace tally::io {

namespace fs = std::filesystem;

namespace {
constexpr int32_t kStateMagic = 20261121;
// 4: the CRC-32 of recipe.json and history.json, which must be there; 3: a CRC-32 of the
// header and the moments; 2: moments in the parameter block's order; 1: llm.c's file
// order. All four are read.
constexpr int32_t kStateVersion = 4;

struct StateHeader {
  int32_t magic, version;
  int64_t step, adam_steps, numel;
  uint64_t rng[4];
  uint32_t crc;          // version 3: CRC-32 of this header (crc = 0) then every byte after it
  uint32_t recipe_crc;   // version 4: CRC-32 of recipe.json's bytes
  uint32_t history_crc;  // version 4: CRC-32 of history.json's bytes
  int32_t pad[256 - 2 - 2 * 3 - 2 * 4 - 3];
};

uint32_t crc_of(const std::string& text) {
  Crc32 crc;
  crc.update(text.data(), text.size());
  return crc.value();
}

std::string recipe_text(const std::vector<std::pair<std::string, std::string>>& recipe) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, value] : recipe) j[name] = value;
  return j.dump(1) + "\n";
}

// A file a version-4 state vouches for: present, and the bytes its CRC was taken of.
std::string read_vouched_file(const fs::path& path, uint32_t crc, const std::string& state_path) {
  TALLY_CHECK(fs::exists(path), "checkpoint file '", path.string(), "' is missing (", state_path,
              " was saved with it): the checkpoint is incomplete");
  std::string text = read_file(path.string());
  TALLY_CHECK(crc_of(text) == crc, "checkpoint file '", path.string(), "': checksum mismatch (", state_path, " stored ",
              crc, ", the file has ", crc_of(text), "): it was changed or is corrupt");
  return text;
}
static_assert(sizeof(StateHeader) == 1024, "state header is 1024 bytes");

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}
}  // namespace

namespace {

// Parameter i's values in `values`, a flat range of the block starting at element `base`
// (0 for the whole block, a unit's begin for a unit), in the parameter's shape.
Tensor parameter_in(const nn::ParameterStore& params, size_t i, const Tensor& values, int64_t base) {
  const int64_t at = params.offset(i) - base;
  return values.slice(0, at, at + shape_numel(params.spec(i).shape)).view(params.spec(i).shape);
}

// A shard's view of a whole model's moments as load_checkpoint_state streams them: each
// whole unit's values are cut into this shard's parameters, and a local unit goes to the
// real optimizer once all its parameters are filled.
class ShardMoments final : public optim::Optimizer {
 public:
  ShardMoments(const nn::Transformer& whole, const nn::Transformer& local, optim::Optimizer& real)
      : whole_(whole), local_(local), real_(real) {
    const nn::ParameterStore& lp = local.params();
    for (size_t i = 0; i < lp.size(); ++i) local_index_[lp.spec(i).name].push_back(i);
    for (int w = 0; w < 2; ++w) {
      staged_[w].resize(lp.num_units());
      filled_[w].assign(lp.num_units(), 0);
    }
  }
  int64_t steps_taken() const override { return real_.steps_taken(); }
  void set_steps_taken(int64_t t) override { real_.set_steps_taken(t); }
  Tensor moment_unit(int, size_t) override { TALLY_FAIL("internal: ShardMoments is read only"); }
  void set_moment_unit(int which, size_t unit, const Tensor& values) override {
    const nn::ParameterStore& wp = whole_.params();
    const nn::ParameterStore& lp = local_.params();
    const nn::ParameterUnit& wu = wp.unit(unit);
    for (size_t j = wu.first; j < wu.last; ++j) {
      auto it = local_index_.find(wp.spec(j).name);
      if (it == local_index_.end()) continue;  // another rank's
      const Tensor whole = parameter_in(wp, j, values, wu.begin);
      for (size_t i : it->second) {  // the tied head's copy shares wte's name
        const size_t lu = lp.spec(i).unit;
        const nn::ParameterUnit& u = lp.unit(lu);
        if (!staged_[which][lu].defined())
          staged_[which][lu] = Tensor::empty({u.numel()}, DType::F32, Device::cpu(), make_owner(Category::Other, "checkpoint.read"));
        const Tensor local = parameter_in(lp, i, staged_[which][lu], u.begin);
        for (auto& [w, l] : local_.shard_regions(i, whole, local)) l.copy_(w);
        filled_[which][lu] += local.numel();
        if (filled_[which][lu] == u.numel()) {
          real_.set_moment_unit(which, lu, staged_[which][lu]);
          staged_[which][lu] = Tensor();
        }
      }
    }
  }
  void check_complete() const {
    for (int w = 0; w < 2; ++w)
      for (size_t u = 0; u < filled_[w].size(); ++u)
        TALLY_CHECK(filled_[w][u] == local_.params().unit(u).numel(), "internal: the checkpoint left unit '",
                    local_.params().unit(u).name, "' of this shard without moments");
  }

 private:
  const nn::Transformer& whole_;
  const nn::Transformer& local_;
  optim::Optimizer& real_;
  std::unordered_map<std::string, std::vector<size_t>> local_index_;
  std::vector<Tensor> staged_[2];
  std::vector<int64_t> filled_[2];
};

// Writes a checkpoint's files into <out_dir>/step_<step>.tmp and publishes the directory
// (see save_checkpoint). Called by every rank of `world`; rank 0 writes. `model_file(path)`
// writes model.bin (path empty on the other ranks); `moment(which, unit)` is called on
// every rank in the same order, m for every unit and then v (ZeRO gathers inside), and
// gives the unit's values on rank 0. Both hand over one piece at a time.
std::string write_checkpoint(const std::string& out_dir, const TrainingState& state, const dist::World& world,
                             int64_t numel, int64_t adam_steps, size_t units,
                             const std::function<void(const std::string&)>& model_file,
                             const std::function<Tensor(int, size_t)>& moment) {
  const bool writer = world.is_root();
  const std::string final_dir = (fs::path(out_dir) / step_dir_name(state.step)).string();
  const std::string tmp_dir = final_dir + ".tmp";
  if (writer) {
    fs::create_directories(out_dir);
    fs::remove_all(tmp_dir);
    fs::create_directories(tmp_dir);
  }
  model_file(writer ? (fs::path(tmp_dir) / "model.bin").string() : std::string());
  {
    StateHeader h;
    std::memset(&h, 0, sizeof h);
    h.magic = kStateMagic;
    h.version = kStateVersion;
    h.step = state.step;
    h.adam_steps = adam_steps;
    h.numel = numel;
    for (int i = 0; i < 4; ++i) h.rng[i] = state.rng_state[i];
    h.recipe_crc = crc_of(recipe_text(state.recipe));
    h.history_crc = crc_of(state.history);
    std::unique_ptr<AtomicFile> out;
    Crc32 crc;
    if (writer) {
      out = std::make_unique<AtomicFile>((fs::path(tmp_dir) / "state.bin").string());
      out->write(&h, sizeof h);  // its checksum is filled in at the end
      crc.update(&h, sizeof h);
    }
    // m for every unit, then v: the parameter block's order.
    for (int which = 0; which < 2; ++which) {
      for (size_t u = 0; u < units; ++u) {
        Tensor values = moment(which, u);
        if (!out) continue;
        values = values.contiguous();
        if (!values.device().is_cpu()) {  // a device's moments are written from a host copy
          Tensor host = Tensor::empty(values.shape(), values.dtype(), Device::cpu(),
                                      make_owner(Category::Other, "checkpoint.write"));
          host.copy_(values);
          values = host;
        }
        out->write(values.raw_data(), static_cast<size_t>(values.nbytes()));
        crc.update(values.raw_data(), static_cast<size_t>(values.nbytes()));
      }
    }
    if (out) {
      h.crc = crc.value();
      out->rewrite(0, &h, sizeof h);
      out->commit();
    }
  }
  if (writer) {
    for (const auto& [name, text] : {std::pair<const char*, std::string>{"recipe.json", recipe_text(state.recipe)},
                                     std::pair<const char*, std::string>{"history.json", state.history}}) {
      AtomicFile out((fs::path(tmp_dir) / name).string());
      out.write(text.data(), text.size());
      out.commit();
    }
    sync_directory(tmp_dir);
    crash_point("checkpoint-written", state.step);
    // Re-saving a step: the old directory is moved aside, not deleted, until the new one is
    // in place, so at every instant `latest` names a complete checkpoint (or its ".old",
    // which recover_out_dir and resolve_checkpoint move back).
    const std::string aside = final_dir + ".old";
    fs::remove_all(aside);
    if (fs::exists(final_dir)) {
      fs::rename(final_dir, aside);
      crash_point("checkpoint-aside", state.step);
    }
    fs::rename(tmp_dir, final_dir);
    sync_directory(out_dir);
    crash_point("checkpoint-renamed", state.step);
    AtomicFile latest((fs::path(out_dir) / "latest").string());
    std::string name = step_dir_name(state.step) + "\n";
    latest.write(name.data(), name.size());
    latest.commit();
    crash_point("checkpoint-latest", state.step);
    fs::remove_all(aside);
  }
  world.world().barrier();  // nobody moves on (or reads `latest`) before the writer is done
  return final_dir;
}

constexpr int kGatherTag = 31000;  // above the pipeline's tags

// A tensor/pipeline/expert-parallel checkpoint, streamed to rank 0 one piece at a time.
// Replica 0 (data- and context-parallel rank 0) of every (stage, tp rank), and under --ep
// data-parallel ranks 1 .. E-1 for their experts, sends its parameters in the
// model file's order (llm.c's: each kind over the layers; a tied head's wte twice), then its
// moments unit by unit, m then v. Rank 0 walks the whole model in the same orders, receives each piece
// from every rank that holds part of it, puts the whole parameter (or unit of moments)
// together in one scratch tensor and writes it. Every rank's sends to rank 0 come in the
// order rank 0 receives them, so nothing waits on anything but its own data; ZeRO-1's
// moment gathers run unit by unit in the same order on every replica.
std::string save_gathered_checkpoint(const std::string& out_dir, const nn::Transformer& model, optim::Optimizer& opt,
                                     const TrainingState& state, const dist::World& world, const ShardLayout& layout) {
  TALLY_CHECK(layout, "internal: a sharded model's checkpoint needs the shard layout");
  const nn::ParameterStore& params = model.params();
  dist::Communicator& comm = world.world();
  const int D = world.replicas(), T = world.tp(), P = world.pp();
  const nn::Transformer whole = nn::Transformer::layout_only(model.config());
  const nn::ParameterStore& wp = whole.params();
  // What a shard sends: not a tied head's copy (its first's is sent), and beyond
  // expert-parallel rank 0 only its experts (the rest is rank 0's too).
  auto sends = [](const nn::Transformer& shard, size_t i) {
    return !shard.is_tied_head_copy(i) && (shard.shard().ep_rank == 0 || shard.is_expert(i));
  };
  auto local_index = [&](const nn::Transformer& shard) {
    std::unordered_map<std::string, size_t> index;  // name -> parameter it sends
    for (size_t i = 0; i < shard.params().size(); ++i)
      if (sends(shard, i)) index.emplace(shard.params().spec(i).name, i);
    return index;
  };
  const auto mine = local_index(model);
  auto moment_piece = [&](const Tensor& unit_values, size_t i) {
    return parameter_in(params, i, unit_values, params.unit(params.spec(i).unit).begin);
  };
  autograd::NoGradGuard no_grad;
  if (!world.is_root()) {
    const bool sender = world.replica_rank() < world.ep();  // replica 0, and its expert-parallel group
    std::vector<std::shared_ptr<dist::Work>> posted;
    auto finish = [&] {
      for (auto& w : posted) w->wait();
      posted.clear();
    };
    if (sender)
      for (const nn::LlmcTensor& t : nn::llmc_tensors(whole))
        for (size_t w : t.params)
          if (auto it = mine.find(wp.spec(w).name); it != mine.end())
            posted.push_back(comm.send_async(params[it->second].detach().contiguous(), 0, kGatherTag));
    finish();  // the parameters are the model's own: no copies held
    for (int which = 0; which < 2; ++which)
      for (size_t u = 0; u < params.num_units(); ++u) {
        const Tensor values = opt.moment_unit(which, u).contiguous();  // every data-parallel rank takes part
        if (!sender) continue;
        for (size_t i = params.unit(u).first; i < params.unit(u).last; ++i)
          if (sends(model, i)) posted.push_back(comm.send_async(moment_piece(values, i).contiguous(), 0, kGatherTag));
        finish();  // one unit's moments at a time
      }
    comm.barrier();  // everyone returns once `latest` names the new checkpoint
    return (fs::path(out_dir) / step_dir_name(state.step)).string();
  }
  // Rank 0: who holds what. Source (pp, tp) is replica 0 of that group (data- and
  // context-parallel rank 0).
  struct Holder {
    int source;
    std::shared_ptr<const nn::Transformer> shard;  // its layout
    size_t index;  // the parameter in it
  };
  std::vector<std::shared_ptr<const nn::Transformer>> shards;
  std::unordered_map<std::string, std::vector<Holder>> holders;  // whole parameter name -> its pieces
  for (int pp = 0; pp < P; ++pp)
    for (int ep = 0; ep < world.ep(); ++ep)
      for (int tp = 0; tp < T; ++tp) {
        const int source = pp * D * T + ep * T + tp;  // data-parallel rank ep (no --cp with --ep)
        auto shard = std::make_shared<const nn::Transformer>(
            nn::Transformer::layout_only(model.config(), source == 0 ? model.shard() : layout(pp, tp, ep)));
        for (const auto& [name, i] : local_index(*shard)) holders[name].push_back({source, shard, i});
      }
  for (auto& [name, list] : holders)
    std::sort(list.begin(), list.end(), [](const Holder& a, const Holder& b) { return a.source < b.source; });
  // Fills `target` (whole parameter `name`'s shape) from its holders; `own(i)` is rank
  // 0's own piece of its parameter i.
  auto gather = [&](const std::string& name, const Tensor& target, const std::function<Tensor(size_t)>& own) {
    for (const Holder& h : holders.at(name)) {
      Tensor piece;
      if (h.source == 0) {
        piece = own(h.index);
      } else {
        piece = Tensor::empty(h.shard->params().spec(h.index).shape, DType::F32, Device::cpu(),
                              make_owner(Category::Communication, "comm:checkpoint_gather"));
        comm.recv(piece, h.source, kGatherTag);
      }
      for (auto& [w, l] : h.shard->shard_regions(h.index, target, piece)) w.copy_(l);
    }
  };
  auto model_file = [&](const std::string& path) {
    save_llmc(path, whole, [&](size_t w) {
      Tensor values = Tensor::empty(wp.spec(w).shape, DType::F32, Device::cpu(), make_owner(Category::Other, "checkpoint.whole_parameter"));
      gather(wp.spec(w).name, values, [&](size_t i) { return params[i].detach(); });
      return values;
    });
  };
  // Rank 0's own units by name: it gathers each (ZeRO-1, with its data-parallel group)
  // when the whole model's unit of that name comes, which is its units' own order.
  std::unordered_map<std::string, size_t> my_units;
  for (size_t u = 0; u < params.num_units(); ++u) my_units.emplace(params.unit(u).name, u);
  auto moment = [&](int which, size_t wu) {
    const nn::ParameterUnit& unit = wp.unit(wu);
    Tensor mine_values;
    if (auto it = my_units.find(unit.name); it != my_units.end()) mine_values = opt.moment_unit(which, it->second).contiguous();
    // Every element is some holder's: written in full below.
    Tensor values = Tensor::empty({unit.numel()}, DType::F32, Device::cpu(), make_owner(Category::OptimizerState, "checkpoint.gather"));
    for (size_t j = unit.first; j < unit.last; ++j)
      gather(wp.spec(j).name, parameter_in(wp, j, values, unit.begin), [&](size_t i) { return moment_piece(mine_values, i); });
    return values;
  };
  std::unique_ptr<dist::World> self = dist::World::self();
  const std::string dir =
      write_checkpoint(out_dir, state, *self, wp.numel(), opt.steps_taken(), wp.num_units(), model_file, moment);
  comm.barrier();  // everyone returns once `latest` names the new checkpoint
  return dir;
}

}  // namespace

std::string save_checkpoint(const std::string& out_dir, const nn::Transformer& model, optim::Optimizer& opt,
                            const TrainingState& state, const dist::World& world, const ShardLayout& layout) {
  if (!model.shard().whole()) return save_gathered_checkpoint(out_dir, model, opt, state, world, layout);
  // ZeRO-3 keeps each parameter in pieces over the ranks: the writer is sent each one's
  // pieces in the file's order and holds one whole parameter at a time (every other rank
  // only sends).
  nn::ParameterResidency* residency = model.residency();
  const bool pieces = residency && residency->holds_values();
  const size_t units = model.params().num_units();
  auto model_file = [&](const std::string& path) {
    auto value = [&](size_t i) { return pieces ? residency->value_at_root(i) : model.params()[i].detach(); };
    if (!path.empty()) save_llmc(path, model, value);
    else if (pieces)
      for (const nn::LlmcTensor& t : nn::llmc_tensors(model))
        for (size_t i : t.params) value(i);
  };
  // Every rank takes part in each gather; only the writer keeps the bytes.
  auto moment = [&](int which, size_t u) { return opt.moment_unit(which, u); };
  return write_checkpoint(out_dir, state, world, model.params().numel(), opt.steps_taken(), units, model_file, moment);
}

namespace {
// The checkpoint directory `latest` names, with line ends (LF or CRLF) and spaces trimmed.
std::string latest_name(const fs::path& latest) {
  std::string name = read_file(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' ')) name.pop_back();
  return name;
}
}  // namespace

std::string latest_step_dir(const std::string& out_dir, const char* flag) {
  const fs::path latest = fs::path(out_dir) / "latest";
  if (!fs::exists(latest)) return "";
  const std::string name = latest_name(latest);
  TALLY_CHECK(!name.empty() && name.find('/') == std::string::npos && name != "." && name != "..", flag, " '", out_dir,
              "': 'latest' holds '", name, "', expected the name of a step directory");
  const std::string dir = (fs::path(out_dir) / name).string();
  // A save killed between moving the old directory aside and renaming the new one in.
  if (!fs::exists(fs::path(dir) / "state.bin") && fs::exists(fs::path(dir + ".old") / "state.bin")) return dir + ".old";
  return dir;
}

std::string resolve_checkpoint(const std::string& path) {
  TALLY_CHECK(fs::is_directory(path), "--resume '", path, "': expected a checkpoint directory or a training --out-dir, found ",
              fs::exists(path) ? "a file" : "nothing");
  if (fs::exists(fs::path(path) / "state.bin")) return path;
  const std::string dir = latest_step_dir(path, "--resume");
  TALLY_CHECK(!dir.empty(), "--resume '", path, "': neither a checkpoint directory (no state.bin) nor an output ",
              "directory (no 'latest' file)");
  TALLY_CHECK(fs::exists(fs::path(dir) / "state.bin"), "--resume '", path, "': 'latest' names '",
              fs::path(dir).filename().string(), "' which has no state.bin");
  return dir;
}

OutDirLock OutDirLock::try_take(const std::string& out_dir) {
  const std::string path = (fs::path(out_dir) / ".tally.lock").string();
  OutDirLock lock;
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  TALLY_CHECK(fd >= 0, "--out-dir '", out_dir, "': cannot open its lock file '", path, "': ", std::strerror(errno));
  if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
    const std::string pid = std::to_string(::getpid());
    // The pid is only what an error names: a failed write leaves the lock as good.
    if (::ftruncate(fd, 0) == 0 && ::pwrite(fd, pid.data(), pid.size(), 0) < 0) errno = 0;
    lock.fd_ = fd;
    return lock;
  }
  const int err = errno;
  char text[32] = {};
  const ssize_t got = ::pread(fd, text, sizeof text - 1, 0);
  ::close(fd);
  TALLY_CHECK(err == EWOULDBLOCK, "--out-dir '", out_dir, "': cannot lock '", path, "': ", std::strerror(err));
  lock.holder_ = got > 0 ? std::strtol(text, nullptr, 10) : 0;
  return lock;
}

OutDirLock::OutDirLock(OutDirLock&& other) noexcept : fd_(other.fd_), holder_(other.holder_) { other.fd_ = -1; }

OutDirLock& OutDirLock::operator=(OutDirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);  // closing the descriptor releases the flock
    fd_ = other.fd_;
    holder_ = other.holder_;
    other.fd_ = -1;
  }
  return *this;
}

OutDirLock::~OutDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

void recover_out_dir(const std::string& out_dir) {
  if (!fs::is_directory(out_dir)) return;
  std::string dir;
  try {
    dir = latest_step_dir(out_dir, "--out-dir");
  } catch (const Error&) {
    // A `latest` that names no step directory: nothing to move back. The run's first save
    // replaces it, and a --resume from here says what is wrong with it.
  }
  if (dir.size() > 4 && dir.ends_with(".old")) {
    const std::string named = dir.substr(0, dir.size() - 4);
    fs::remove_all(named);
    fs::rename(dir, named);
    sync_directory(out_dir);
  }
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    const bool step_leftover = name.rfind("step_", 0) == 0 && (name.ends_with(".tmp") || name.ends_with(".old"));
    const bool file_leftover = abandoned_temporary(name, "latest") || abandoned_temporary(name, "loss.svg");
    if (step_leftover || file_leftover) fs::remove_all(entry.path());
  }
}

std::vector<std::string> checkpoints_in(const std::string& out_dir) {
  std::vector<std::string> found;
  // A run has checkpoints once its first save wrote `latest`. Without it, a step directory
  // is a first save that a kill interrupted (before `latest`), which the next save replaces.
  if (!fs::is_directory(out_dir) || !fs::exists(fs::path(out_dir) / "latest")) return found;
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string name = entry.path().filename().string();
    // Only what a save makes: step_ and the step's digits, holding a checkpoint's state. A
    // directory the user named alike (step_notes/) is theirs, and --overwrite removes these.
    const bool step_name = name.size() > 5 && name.rfind("step_", 0) == 0 &&
                           name.find_first_not_of("0123456789", 5) == std::string::npos;
    if (step_name && entry.is_directory() && fs::exists(entry.path() / "state.bin")) found.push_back(name);
  }
  std::sort(found.begin(), found.end());  // step_%08lld: name order is step order
  found.push_back("latest");
  return found;
}

void remove_checkpoints(const std::string& out_dir) {
  for (const std::string& name : checkpoints_in(out_dir)) fs::remove_all(fs::path(out_dir) / name);
  sync_directory(out_dir);
}

std::vector<std::string> remove_older_checkpoints(const std::string& out_dir, const std::string& newest, int64_t keep,
                                                  int64_t resumed_step, const std::vector<int64_t>& saved_steps) {
  // Steps by number (names are step_%08lld: past 10^8 steps they grow a digit).
  auto step_of = [](const std::string& name) { return std::stoll(name.substr(5)); };
  const int64_t newest_step = step_of(fs::path(newest).filename().string());
  std::vector<std::pair<int64_t, std::string>> older;
  for (const std::string& name : checkpoints_in(out_dir))
    if (name != "latest" && step_of(name) < newest_step &&
        (step_of(name) <= resumed_step ||
         std::find(saved_steps.begin(), saved_steps.end(), step_of(name)) != saved_steps.end()))
      older.emplace_back(step_of(name), name);
  std::sort(older.begin(), older.end());
  const size_t keep_older = static_cast<size_t>(std::max<int64_t>(keep - 1, 0));
  if (older.size() <= keep_older) return {};
  older.resize(older.size() - keep_older);
  std::vector<std::string> removed;
  for (const auto& [step, name] : older) {
    fs::remove_all(fs::path(out_dir) / name);
    removed.push_back(name);
  }
  sync_directory(out_dir);
  return removed;
}

namespace {
// A recipe.json's text (read from `path`) as name -> value pairs.
std::vector<std::pair<std::string, std::string>> parse_recipe(const std::string& text, const std::string& path) {
  const nlohmann::json j = parse_json(text, "checkpoint recipe '" + path + "'");
  TALLY_CHECK(j.is_object(), "checkpoint recipe '", path, "': expected a JSON object");
  std::vector<std::pair<std::string, std::string>> recipe;
  for (auto it = j.begin(); it != j.end(); ++it) {
    TALLY_CHECK(it->is_string(), "checkpoint recipe '", path, "': '", it.key(), "' is not a string");
    recipe.emplace_back(it.key(), it->get<std::string>());
  }
  return recipe;
}
}  // namespace

std::vector<std::pair<std::string, std::string>> load_checkpoint_recipe(const std::string& dir) {
  const fs::path path = fs::path(dir) / "recipe.json";
  if (!fs::exists(path)) return {};  // checkpoints written before recipes were saved
  return parse_recipe(read_file(path.string()), path.string());
}

uint32_t load_checkpoint_model(const std::string& dir, nn::Transformer& model) {
  return load_llmc((fs::path(dir) / "model.bin").string(), model);
}

TrainingState load_checkpoint_state(const std::string& dir, const nn::Transformer& model, optim::Optimizer& opt) {
  if (!model.shard().whole()) {
    // The file holds the whole model's moments: read them against the whole layout, and
    // keep this shard's slices.
    const nn::Transformer whole = nn::Transformer::layout_only(model.config());
    ShardMoments shard(whole, model, opt);
    TrainingState st = load_checkpoint_state(dir, whole, shard);
    shard.check_complete();
    return st;
  }
  const std::string path = (fs::path(dir) / "state.bin").string();
  const nn::ParameterStore& params = model.params();
  int64_t size = 0;
  std::ifstream in;
  open_input(path, "training state", in, &size);
  TALLY_CHECK(size >= 1024, "training state '", path, "' is ", size, " bytes, shorter than its 1024-byte header");
  StateHeader h;
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  TALLY_CHECK(h.magic == kStateMagic, "training state '", path, "': magic ", h.magic, ", expected ", kStateMagic);
  TALLY_CHECK(h.version >= 1 && h.version <= kStateVersion, "training state '", path, "': version ", h.version,
              ", expected 1 to ", kStateVersion);
  // Each version zero-fills the header fields of later ones: a checksum in an older version's
  // header means the version field itself was changed, which would skip the checks.
  TALLY_CHECK((h.version >= 3 || h.crc == 0) && (h.version >= 4 || (h.recipe_crc == 0 && h.history_crc == 0)),
              "training state '", path, "': version ", h.version, " stores no ",
              h.version >= 3 ? "recipe or history checksum" : "checksum", ", yet its header holds one: the version "
              "field is corrupt (expected ", kStateVersion, " for a state with checksums)");
  Crc32 crc;
  const uint32_t stored_crc = h.crc;
  // (Older versions stored no checksum; theirs is computed all the same, for content_crc.)
  h.crc = 0;
  crc.update(&h, sizeof h);
  TALLY_CHECK(h.numel == params.numel(), "training state '", path, "' has moments for ", h.numel,
              " parameters but the model has ", params.numel());
  TALLY_CHECK(h.step >= 0 && h.adam_steps >= 0, "training state '", path, "': negative step (", h.step,
              ") or AdamW step count (", h.adam_steps, "): the file is corrupt");
  TALLY_CHECK(h.numel >= 0 && size == 1024 + 8 * h.numel, "training state '", path, "' is ", size, " bytes, expected ",
              1024 + 8 * h.numel);
  for (int which = 0; which < 2; ++which) {
    if (h.version >= 2) {
      // Versions 2 and 3: the parameter block's order, unit by unit.
      for (size_t u = 0; u < params.num_units(); ++u) {
        Tensor values = Tensor::empty({params.unit(u).numel()}, DType::F32, Device::cpu(),
                                      make_owner(Category::Other, "checkpoint.read"));
        in.read(static_cast<char*>(values.raw_data()), values.nbytes());
        crc.update(values.raw_data(), static_cast<size_t>(values.nbytes()));
        opt.set_moment_unit(which, u, values);
      }
    } else {
      // Version 1 kept the moments in llm.c's file order (each kind over the layers).
      Tensor file_order = Tensor::empty({h.numel}, DType::F32, Device::cpu(), make_owner(Category::Other, "checkpoint.read"));
      in.read(static_cast<char*>(file_order.raw_data()), h.numel * 4);
      crc.update(file_order.raw_data(), static_cast<size_t>(h.numel) * 4);
      Tensor block = Tensor::empty({h.numel}, DType::F32, Device::cpu(), make_owner(Category::Other, "checkpoint.read"));
      int64_t at = 0;
      for (const nn::LlmcTensor& t : nn::llmc_tensors(model))
        for (size_t i : t.params) {
          const int64_t n = params.spec(i).shape.empty() ? 1 : shape_numel(params.spec(i).shape);
          make_view(block, {n}, {1}, params.offset(i)).copy_(make_view(file_order, {n}, {1}, at));
          at += n;
        }
      for (size_t u = 0; u < params.num_units(); ++u)
        opt.set_moment_unit(which, u, make_view(block, {params.unit(u).numel()}, {1}, params.unit(u).begin));
    }
  }
  TALLY_CHECK(in.good(), "training state '", path, "': read failed");
  TALLY_CHECK(h.version < 3 || crc.value() == stored_crc, "training state '", path, "': checksum mismatch (stored ",
              stored_crc, ", computed ", crc.value(), "): the file is corrupt");
  opt.set_steps_taken(h.adam_steps);
  TrainingState s;
  s.step = h.step;
  s.content_crc = crc.value();
  for (int i = 0; i < 4; ++i) s.rng_state[i] = h.rng[i];
  if (h.version >= 4) {
    // Deleting or editing the recipe would turn resume's check off unseen; the state says
    // what it was. The bytes checked are the bytes parsed.
    const fs::path recipe_path = fs::path(dir) / "recipe.json";
    s.recipe = parse_recipe(read_vouched_file(recipe_path, h.recipe_crc, path), recipe_path.string());
    s.history = read_vouched_file(fs::path(dir) / "history.json", h.history_crc, path);
  } else {
    s.recipe = load_checkpoint_recipe(dir);
  }
  return s;
}

}  // namespace tally::io
