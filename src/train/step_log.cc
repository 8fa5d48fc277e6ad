#include "train/step_log.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/atomic_file.h"
#include "core/json_input.h"
#include "io/files.h"

namespace tally::train {

namespace fs = std::filesystem;

StepLog::StepLog(std::string path, int64_t resumed_step) : path_(std::move(path)), stream_(io::is_stream(path_)) {
  if (stream_) {
    // Written front to back as it is: a resumed run's rows follow whatever the stream took
    // before (nothing to read back and trim), and nothing is fsync'ed.
    file_ = io::open_stream("--log-json", path_);
    return;
  }
  io::create_directories_for("--log-json", path_, fs::path(path_).parent_path().string());
  TALLY_CHECK(!fs::is_directory(path_), "--log-json '", path_, "': is a directory, expected a file path");
  if (resumed_step > 0 && fs::exists(path_)) {
    bool superseded = false;
    std::string kept = rows_up_to(resumed_step, &superseded);
    if (superseded) {
      // Rows of steps after the checkpoint belong to the history `latest` may still name:
      // they stay on disk until this run's own history is committed (commit()).
      deferred_ = true;
      kept_ = std::move(kept);
      return;
    }
    rewrite(kept);  // drops a torn last line
  }
  open(resumed_step > 0 ? "a" : "w");
}

void StepLog::open(const char* mode) {
  file_ = std::fopen(path_.c_str(), mode);
  TALLY_CHECK(file_, "--log-json: cannot write '", path_, "': ", std::strerror(errno));
}

// The rows of steps up to `step`, in order; a torn line (a kill mid-write) or a line that is
// not a row is not kept. `superseded` says whether rows of later steps were there.
std::string StepLog::rows_up_to(int64_t step, bool* superseded) const {
  std::istringstream rows(io::read_file(path_));
  std::string kept, line;
  while (std::getline(rows, line)) {
    if (line.empty()) continue;
    nlohmann::json row;
    try {
      row = parse_json(line, "step log '" + path_ + "'");
    } catch (const Error&) {
      continue;
    }
    if (!row.is_object() || !row.contains("step") || !row["step"].is_number_integer()) continue;
    if (row["step"].get<int64_t>() <= step) kept += line + "\n";
    else *superseded = true;
  }
  return kept;
}

void StepLog::rewrite(const std::string& text) const {
  AtomicFile rewritten(path_);
  rewritten.write(text.data(), text.size());
  rewritten.commit();
}

void StepLog::commit() {
  if (!deferred_) return;
  rewrite(kept_ + held_);
  kept_.clear();
  held_.clear();
  deferred_ = false;
  open("a");
}

StepLog::~StepLog() {
  if (file_) std::fclose(file_);
}

void StepLog::append(const std::string& json_row) {
  if (deferred_) {
    held_ += json_row + "\n";
    return;
  }
  const bool ok = std::fwrite(json_row.data(), 1, json_row.size(), file_) == json_row.size() &&
                  std::fputc('\n', file_) != EOF && std::fflush(file_) == 0;
  TALLY_CHECK(ok, "--log-json: writing '", path_, "' failed: ", std::strerror(errno));
}

void StepLog::sync() {
  if (deferred_) return;  // the held rows are written whole by commit()
  TALLY_CHECK(std::fflush(file_) == 0 && (stream_ || ::fsync(fileno(file_)) == 0), "--log-json: syncing '", path_,
              "' failed: ", std::strerror(errno));
}

}  // namespace tally::train
