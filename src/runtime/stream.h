// Streams and events: the order in which a device runs work, and markers in it.
//
// A stream runs what is submitted to it in order; an event recorded on a stream is
// ready once everything submitted before it has run. Another stream can wait for it
// (cross-stream ordering), and the host can wait for it (synchronize). The caching
// allocator of an asynchronous device uses events to reuse a block only after the
// streams that used it are done with it.
//
// On the CPU, work runs on the calling thread as it is submitted: an event is ready the
// moment it is recorded and waiting costs nothing. The interface is what lets the same
// ops and communication code drive an asynchronous device.
#pragma once
#include <memory>

#include "core/device.h"

namespace tally::runtime {

class Event {
 public:
  virtual ~Event() = default;
  virtual bool ready() const = 0;        // has all work recorded before it run?
  virtual void synchronize() const = 0;  // blocks the host until ready
};

class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device device() const = 0;
  virtual std::shared_ptr<Event> record() = 0;  // an event after all work submitted so far
  virtual void wait(const Event& event) = 0;     // later work on this stream waits for `event`
  virtual void synchronize() = 0;                // blocks the host until the stream is idle
};

}  // namespace tally::runtime
