// The process-wide worker pool behind run_workers (parallel.h).
//
// One call uses the pool at a time. The caller posts a job (the worker to run and how many pool
// threads may join it), runs its own copy, closes the job and waits for the copies that joined.
// Pool threads sleep on a condition variable between jobs: they never spin, so they do not take
// cores from the caller's other threads (torch's OpenMP workers, for one).
#include "cpu/parallel.h"

#include <pthread.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace flashcpp::cpu {
namespace {

int hardware_threads() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

class Pool {
 public:
  /// Runs the job on `helpers` pool threads besides the caller; false when another call holds the
  /// pool (the caller then starts threads of its own).
  bool run(int helpers, WorkerRef worker) {
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true)) return false;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while (spawned_ < helpers) {
        std::thread(&Pool::serve, this).detach();
        ++spawned_;
      }
      job_ = &worker;
      slots_ = helpers;
      joined_ = finished_ = 0;
      open_ = true;
      ++generation_;
    }
    for (int i = 0; i < helpers; ++i) wake_.notify_one();
    // Closes the job and waits for the copies that joined, also when the caller's copy throws:
    // they run the worker that lives in the caller's frame.
    struct Close {
      Pool* pool;
      ~Close() {
        std::unique_lock<std::mutex> lk(pool->mu_);
        pool->open_ = false;  // every item is taken (parallel.h's contract): late wakers skip the job
        pool->done_.wait(lk, [&] { return pool->finished_ == pool->joined_; });
        pool->job_ = nullptr;
        pool->busy_.store(false);
      }
    } close{this};
    worker();
    return true;
  }

 private:
  void serve() {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      wake_.wait(lk, [&] { return open_ && slots_ > 0 && generation_ != seen; });
      seen = generation_;
      --slots_;
      ++joined_;
      const WorkerRef* job = job_;
      lk.unlock();
      (*job)();
      lk.lock();
      if (++finished_ == joined_ && !open_) done_.notify_one();
    }
  }

  std::atomic<bool> busy_{false};  // set while a call uses the pool (a flag, not a mutex: a nested
                                  // call on the same thread must see it taken, not deadlock)
  std::mutex mu_;    // guards everything below
  std::condition_variable wake_, done_;
  int spawned_ = 0;
  const WorkerRef* job_ = nullptr;
  int slots_ = 0, joined_ = 0, finished_ = 0;
  bool open_ = false;
  std::uint64_t generation_ = 0;
};

// The pool is never destroyed: its threads sleep in it until the process exits. A child of fork()
// has none of the parent's threads, so it starts a pool of its own (the parent's stays unused).
std::atomic<Pool*> g_pool{nullptr};

Pool& pool() {
  static const bool at_fork = [] { return pthread_atfork(nullptr, nullptr, [] { g_pool.store(nullptr); }) == 0; }();
  (void)at_fork;
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  auto* made = new Pool();  // no threads yet, so the loser of a race just deletes its own
  if (g_pool.compare_exchange_strong(p, made, std::memory_order_acq_rel)) return *made;
  delete made;
  return *p;
}

void run_on_fresh_threads(int threads, WorkerRef worker) {
  std::vector<std::thread> extra;
  extra.reserve(static_cast<std::size_t>(threads - 1));
  for (int t = 1; t < threads; ++t) extra.emplace_back([worker] { worker(); });
  struct Join {
    std::vector<std::thread>& threads;
    ~Join() {
      for (auto& th : threads) th.join();  // also when the caller's copy throws
    }
  } join{extra};
  worker();
}

}  // namespace

int threads_for(int requested, std::int64_t items, double work_per_item) {
  if (items <= 1) return 1;
  std::int64_t t = requested;
  if (requested <= 0) {
    const double by_work = static_cast<double>(items) * std::max(work_per_item, 0.0) / kMinWorkPerThread;
    t = std::min<std::int64_t>(hardware_threads(), std::max<std::int64_t>(1, static_cast<std::int64_t>(by_work)));
  }
  return static_cast<int>(std::clamp<std::int64_t>(t, 1, items));
}

void run_workers(int threads, WorkerRef worker) {
  if (threads <= 1) {
    worker();
    return;
  }
  if (!pool().run(threads - 1, worker)) run_on_fresh_threads(threads, worker);
}

}  // namespace flashcpp::cpu
