// Deadlines for collectives queued on a GPU stream, measured from when each one could start.
//
// NcclComm enqueues a collective and returns; the GPU reaches it only after the work queued
// before it (a whole forward and backward, say). Timing the collective from the moment it was
// enqueued would count that compute as "waiting for a peer" and could trip the watchdog on a
// long but healthy step. So each collective gets two events on its stream, one recorded just
// before it and one just after, and its deadline clock starts when the first is seen complete
// (the stream has reached the collective: from then on only the peers can hold it up) and stops
// when the second is. Collectives on one stream complete in order, so only the oldest unfinished
// one is timed; the ones behind it have not started.
//
// The clock starts at the poll that first sees the start event complete (polls are ~100 ms
// apart), so a deadline may run up to one poll interval late, never early.
//
// Events are opaque handles here and their state comes from a query callback, so this logic is
// tested on the CPU with fake events and a fake clock (tests/test_comm.cpp).
#pragma once
#include <chrono>
#include <deque>
#include <functional>
#include <string>
#include <vector>

namespace moe::dist {

class QueuedDeadlines {
 public:
  using Clock = std::chrono::steady_clock;
  enum class EventState { done, pending, failed };
  // The state of an event; on `failed`, *error says why (cudaGetErrorString).
  using Query = std::function<EventState(void* event, std::string* error)>;

  explicit QueuedDeadlines(double timeout_s) : timeout_s_(timeout_s) {}

  // A collective `op` (a string literal: kept by pointer) between the events `start` and `end`,
  // queued after every collective pushed before it on the same stream.
  void push(const char* op, void* start, void* end);

  // Called by the watchdog's poll: drops the finished collectives (their events go to
  // *released for reuse) and returns "" while all is well, else the line to print before
  // aborting: the timeout line of the collective past its deadline, or the failure of an event.
  std::string check(Clock::time_point now, const Query& query, int rank,
                    std::vector<void*>* released);

  bool empty() const { return queue_.empty(); }
  size_t size() const { return queue_.size(); }
  // Every event still held (for destruction).
  std::vector<void*> events() const;

 private:
  struct Entry {
    const char* op = nullptr;
    void* start = nullptr;
    void* end = nullptr;
    bool started = false;  // the start event was seen complete
    Clock::time_point started_at;
  };
  double timeout_s_;
  std::deque<Entry> queue_;
};

}  // namespace moe::dist
