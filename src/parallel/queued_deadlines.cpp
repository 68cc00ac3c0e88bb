#include "parallel/queued_deadlines.hpp"

#include "parallel/watchdog.hpp"

namespace moe::dist {

void QueuedDeadlines::push(const char* op, void* start, void* end) {
  Entry e;
  e.op = op;
  e.start = start;
  e.end = end;
  queue_.push_back(e);
}

std::string QueuedDeadlines::check(Clock::time_point now, const Query& query, int rank,
                                   std::vector<void*>* released) {
  const std::string who = "moe-train: rank " + std::to_string(rank) + ": ";
  std::string error;
  while (!queue_.empty()) {
    Entry& e = queue_.front();
    const EventState end = query(e.end, &error);
    if (end == EventState::failed)
      return who + e.op + " failed on the GPU: " + error + "; aborting";
    if (end == EventState::done) {
      released->push_back(e.start);
      released->push_back(e.end);
      queue_.pop_front();
      continue;
    }
    if (!e.started) {
      const EventState start = query(e.start, &error);
      if (start == EventState::failed)
        return who + e.op + " failed on the GPU: " + error + "; aborting";
      if (start == EventState::pending) return "";  // earlier work still runs: no clock yet
      e.started = true;
      e.started_at = now;
    }
    if (timeout_s_ > 0 && std::chrono::duration<double>(now - e.started_at).count() >= timeout_s_)
      return timeout_line(rank, e.op, timeout_s_);
    return "";  // the ones behind it have not started
  }
  return "";
}

std::vector<void*> QueuedDeadlines::events() const {
  std::vector<void*> all;
  for (const Entry& e : queue_) {
    all.push_back(e.start);
    all.push_back(e.end);
  }
  return all;
}

}  // namespace moe::dist
