#include "io/checkpoint.h"

#include <sys/stat.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "io/atomic_file.h"
#include "io/model_files.h"

namespace tally::io {

namespace fs = std::filesystem;

namespace {
constexpr int32_t kStateMagic = 20261121;
constexpr int32_t kStateVersion = 1;

struct StateHeader {
  int32_t magic, version;
  int64_t step, adam_steps, numel;
  uint64_t rng[4];
  int32_t pad[256 - 2 - 2 * 3 - 2 * 4];
};
static_assert(sizeof(StateHeader) == 1024, "state header is 1024 bytes");

std::string step_dir_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}
}  // namespace

std::string save_checkpoint(const std::string& out_dir, const nn::Transformer& model, const optim::AdamW& opt,
                            const TrainingState& state) {
  fs::create_directories(out_dir);
  const std::string final_dir = (fs::path(out_dir) / step_dir_name(state.step)).string();
  const std::string tmp_dir = final_dir + ".tmp";
  fs::remove_all(tmp_dir);
  fs::create_directories(tmp_dir);
  save_llmc_gpt2((fs::path(tmp_dir) / "model.bin").string(), model);
  {
    StateHeader h;
    std::memset(&h, 0, sizeof h);
    h.magic = kStateMagic;
    h.version = kStateVersion;
    h.step = state.step;
    h.adam_steps = opt.steps_taken();
    h.numel = opt.m().numel();
    for (int i = 0; i < 4; ++i) h.rng[i] = state.rng_state[i];
    AtomicFile out((fs::path(tmp_dir) / "state.bin").string());
    out.write(&h, sizeof h);
    out.write(opt.m().raw_data(), static_cast<size_t>(h.numel) * 4);
    out.write(opt.v().raw_data(), static_cast<size_t>(h.numel) * 4);
    out.commit();
  }
  fs::remove_all(final_dir);
  fs::rename(tmp_dir, final_dir);
  AtomicFile latest((fs::path(out_dir) / "latest").string());
  std::string name = step_dir_name(state.step) + "\n";
  latest.write(name.data(), name.size());
  latest.commit();
  return final_dir;
}

std::string resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "state.bin")) return path;
  fs::path latest = fs::path(path) / "latest";
  TALLY_CHECK(fs::exists(latest), "--resume '", path, "': neither a checkpoint directory (no state.bin) nor an output ",
              "directory (no 'latest' file)");
  std::string name = read_file(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  std::string dir = (fs::path(path) / name).string();
  TALLY_CHECK(fs::exists(fs::path(dir) / "state.bin"), "--resume '", path, "': 'latest' names '", name,
              "' which has no state.bin");
  return dir;
}

TrainingState load_checkpoint(const std::string& dir, nn::Transformer& model, optim::AdamW& opt) {
  load_llmc_gpt2((fs::path(dir) / "model.bin").string(), model);
  const std::string path = (fs::path(dir) / "state.bin").string();
  int64_t size = 0;
  std::ifstream in = open_input(path, "training state", &size);
  TALLY_CHECK(size >= 1024, "training state '", path, "' is ", size, " bytes, shorter than its 1024-byte header");
  StateHeader h;
  in.read(reinterpret_cast<char*>(&h), sizeof h);
  TALLY_CHECK(h.magic == kStateMagic, "training state '", path, "': magic ", h.magic, ", expected ", kStateMagic);
  TALLY_CHECK(h.version == kStateVersion, "training state '", path, "': version ", h.version, ", expected ", kStateVersion);
  TALLY_CHECK(h.numel == opt.m().numel(), "training state '", path, "' has moments for ", h.numel,
              " parameters but the model has ", opt.m().numel());
  TALLY_CHECK(h.step >= 0 && h.adam_steps >= 0, "training state '", path, "': negative step (", h.step,
              ") or AdamW step count (", h.adam_steps, "): the file is corrupt");
  TALLY_CHECK(size == 1024 + 8 * h.numel, "training state '", path, "' is ", size, " bytes, expected ", 1024 + 8 * h.numel);
  in.read(static_cast<char*>(opt.m().raw_data()), h.numel * 4);
  in.read(static_cast<char*>(opt.v().raw_data()), h.numel * 4);
  TALLY_CHECK(in.good(), "training state '", path, "': read failed");
  opt.set_steps_taken(h.adam_steps);
  TrainingState s;
  s.step = h.step;
  for (int i = 0; i < 4; ++i) s.rng_state[i] = h.rng[i];
  return s;
}

}  // namespace tally::io
