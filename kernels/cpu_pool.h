// Persistent worker threads for the CPU backend.
//
// Calibration calls the kernels once per observed tensor per batch (thousands of calls), so
// spawning threads per call cost more than the work on small tensors. The pool starts its threads
// on first use and keeps them blocked on a condition variable between jobs.
//
// Contract of run(workers, fn): fn(0) runs on the calling thread, fn(1..workers-1) on pool
// threads, but a job may get fewer workers than asked (another thread is using the pool, a thread
// could not be created): fn must share its work through an atomic task counter, never assume that
// a given worker id runs. Results then do not depend on how many workers took part.
//
// Fork: a child process inherits the pool object but none of its threads; the pool records its
// pid and a child builds a fresh one (the old one is leaked, its locks are never touched again).
#ifndef QTOOL_CPU_POOL_H
#define QTOOL_CPU_POOL_H

#include <sched.h>
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace qt {

constexpr int kMaxThreads = 64;

// CPUs this process may run on (the affinity mask, which containers and taskset narrow), capped.
inline int available_cpus() {
  int n = 0;
#ifdef CPU_COUNT
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) n = CPU_COUNT(&set);
#endif
  if (n < 1) n = static_cast<int>(std::thread::hardware_concurrency());
  return std::max(1, std::min(n, kMaxThreads));
}

// QTOOL_CPU_THREADS when set to a positive integer, else every available CPU.
inline int default_threads() {
  const char* env = getenv("QTOOL_CPU_THREADS");
  if (env != nullptr && *env != '\0') {
    char* end = nullptr;
    const long v = strtol(env, &end, 10);
    if (end != nullptr && *end == '\0' && v >= 1) return static_cast<int>(std::min<long>(v, kMaxThreads));
  }
  return available_cpus();
}

class Pool {
 public:
  explicit Pool(pid_t owner) : pid_(owner) {}
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  pid_t pid() const { return pid_; }

  void run(int workers, const std::function<void(int)>& fn) {
    if (workers <= 1) {
      fn(0);
      return;
    }
    std::unique_lock<std::mutex> job_lock(job_mutex_, std::try_to_lock);
    if (!job_lock.owns_lock()) {  // another thread's job holds the pool: run this one alone
      fn(0);
      return;
    }
    const int helpers = grow(workers - 1);
    if (helpers == 0) {
      fn(0);
      return;
    }
    {
      std::lock_guard<std::mutex> lk(mutex_);
      job_ = &fn;
      wanted_ = helpers;
      running_ = helpers;
      ++generation_;
    }
    wake_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mutex_);
    done_.wait(lk, [this] { return running_ == 0; });
    job_ = nullptr;
  }

 private:
  // Starts threads until `helpers` exist (or creation fails); returns how many can help.
  int grow(int helpers) {
    helpers = std::min(helpers, kMaxThreads - 1);
    while (static_cast<int>(threads_.size()) < helpers) {
      const int id = static_cast<int>(threads_.size()) + 1;
      try {
        threads_.emplace_back([this, id] { loop(id); });
      } catch (...) {  // std::system_error: out of threads; run with what exists
        break;
      }
    }
    return std::min(helpers, static_cast<int>(threads_.size()));
  }

  void loop(int id) {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mutex_);
    for (;;) {
      wake_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (id > wanted_) continue;
      const std::function<void(int)>* job = job_;
      lk.unlock();
      (*job)(id);
      lk.lock();
      if (--running_ == 0) done_.notify_one();
    }
  }

  const pid_t pid_;
  std::mutex job_mutex_;  // one job at a time
  std::mutex mutex_;      // guards the fields below
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;  // threads_[i] is worker i + 1; never joined (see instance)
  const std::function<void(int)>* job_ = nullptr;
  uint64_t generation_ = 0;
  int wanted_ = 0;
  int running_ = 0;
};

// The process's pool. Never destroyed: joining blocked threads from a static destructor at exit
// (possibly while another thread still runs a job) is riskier than letting exit end them.
inline Pool& pool() {
  static std::atomic<Pool*> current{nullptr};
  static std::mutex create;
  const pid_t me = getpid();
  Pool* p = current.load(std::memory_order_acquire);
  if (p != nullptr && p->pid() == me) return *p;
  std::lock_guard<std::mutex> lk(create);
  p = current.load(std::memory_order_acquire);
  if (p == nullptr || p->pid() != me) {
    p = new Pool(me);
    current.store(p, std::memory_order_release);
  }
  return *p;
}

// Participants a job may use (the caller included): qt_cpu_set_num_threads, else the default.
inline std::atomic<int>& configured_threads() {
  static std::atomic<int> n{0};  // 0: not set, use default_threads()
  return n;
}

inline int thread_budget() {
  const int n = configured_threads().load(std::memory_order_relaxed);
  if (n >= 1) return n;
  static const int fallback = default_threads();
  return fallback;
}

}  // namespace qt

#endif  // QTOOL_CPU_POOL_H
