// The JSONL step log (--log-json): one JSON object per step, appended and flushed as the
// step ends. What it guarantees when a run is killed or the disk fills:
//   - A row is flushed to the file before the step's checkpoint is written, and fsync'ed
//     then, so every checkpointed step has its row on disk.
//   - Resuming from the checkpoint of step S drops the rows after S (written by the run
//     that went on after S), so the resumed run appends each later step exactly once: no
//     repeats. Those rows may be the only record of steps the newest checkpoint (`latest`)
//     holds; so they stay on disk, and the resumed run's rows are held, until the run
//     commits its own history (its first checkpoint, or its end): then the log is rewritten
//     atomically as the rows up to S and the run's own.
//   - Every write and flush is checked: a full disk ends the run with an error naming the
//     file, never a silently truncated log.
#pragma once
#include <cstdint>
#include <cstdio>
#include <string>

namespace tally::train {

class StepLog {
 public:
  // Opens `path` (creating its directory). With resumed_step > 0 the rows of steps after it
  // are dropped first; with 0 the file starts empty. A stream (io::is_stream: /dev/stdout,
  // a pipe) is written as it is: rows go after what it took before, and sync() only flushes.
  StepLog(std::string path, int64_t resumed_step);
  ~StepLog();
  StepLog(const StepLog&) = delete;
  StepLog& operator=(const StepLog&) = delete;

  void append(const std::string& json_row);  // one line, flushed
  void sync();                               // fsync: the rows so far survive a crash
  // The run's history is committed (its checkpoint is `latest`, or it ended): held rows
  // replace those of the superseded history. Nothing to do when none were held.
  void commit();

  const std::string& path() const { return path_; }

 private:
  std::string rows_up_to(int64_t step, bool* superseded) const;
  void rewrite(const std::string& text) const;
  void open(const char* mode);

  std::string path_;
  bool stream_ = false;
  std::FILE* file_ = nullptr;
  bool deferred_ = false;  // rows of a superseded history are on disk: this run's are held
  std::string kept_;       // the rows up to the resumed step, while deferred
  std::string held_;       // this run's rows, while deferred
};

}  // namespace tally::train
