// The CPU backends' threads: one process-wide pool of persistent workers, and the rule for how
// many of them a call uses. Every CPU backend (reference, tiled forward and backward, decode, the
// fused ops) and the engine's CPU ops run their parallel loops through here.
//
// Why a pool: starting threads per call cost more than small calls compute. A decode step of a
// small model on two cores spent most of its time creating two threads and faulting in their
// stacks and malloc arenas, and torch's OpenMP threads, still spinning after torch's previous op,
// held the cores the new threads waited for.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <utility>

namespace flashcpp::cpu {

/// A non-owning reference to a callable `void()`; the callable outlives every call through it.
class WorkerRef {
 public:
  template <class F, class = std::enable_if_t<!std::is_same_v<std::decay_t<F>, WorkerRef>>>
  WorkerRef(F& f) : obj_(&f), call_([](void* o) { (*static_cast<F*>(o))(); }) {}  // NOLINT: implicit by design
  void operator()() const { call_(obj_); }

 private:
  void* obj_;
  void (*call_)(void*);
};

/// Work units (about one fp32 multiply-add, or one element of an elementwise op) that make a
/// thread worth waking, some tens of microseconds: below
/// kMinWorkPerThread per thread, a call that chose its own thread count runs on fewer threads.
inline constexpr double kMinWorkPerThread = 65536.0;

/// The threads for `items` work items of about `work_per_item` units each. `requested` > 0 is the
/// caller's count, honoured up to one thread per item (tests pin counts to exercise the threaded
/// paths). `requested` == 0 means "choose": the cores, but no more than the items and about
/// kMinWorkPerThread units per thread, so that small calls run on the calling thread alone.
int threads_for(int requested, std::int64_t items, double work_per_item);

/// Runs `worker` on `threads` threads at once, one of them the calling thread, and returns when
/// every copy that started has returned. The others come from the process-wide pool; while the
/// pool serves another call (a nested or concurrent one), they are fresh threads instead.
///
/// The contract that lets a call return early: `worker` pulls items from a shared counter until
/// none is left, so when the calling thread's copy returns, every item has been taken. A pool
/// worker that wakes only after that does not run `worker` at all.
void run_workers(int threads, WorkerRef worker);

/// Runs f(item) for every item in [0, n) on `threads` threads (threads_for's count). Items are
/// taken in ascending order, each by a thread that then runs it: so an item that waits only for
/// smaller items (the deterministic backward's dQ order) never waits for one that no thread holds.
template <class F>
void parallel_for(std::int64_t n, int threads, F&& f) {
  if (n <= 0) return;
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    for (std::int64_t item = next.fetch_add(1); item < n; item = next.fetch_add(1)) f(item);
  };
  run_workers(threads, worker);
}

/// parallel_for with a scratch object per thread: f(item, scratch), each thread's scratch from
/// make(), made only by threads that take an item.
template <class Make, class F>
void parallel_for_scratch(std::int64_t n, int threads, Make&& make, F&& f) {
  if (n <= 0) return;
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    std::int64_t item = next.fetch_add(1);
    if (item >= n) return;
    auto scratch = make();
    for (; item < n; item = next.fetch_add(1)) f(item, scratch);
  };
  run_workers(threads, worker);
}

/// Runs body(begin, end) over [0, n) in contiguous chunks, pulled from a shared counter (small
/// chunks balance threads of uneven speed).
template <class F>
void parallel_chunks(std::int64_t n, int threads, F&& body) {
  if (n <= 0) return;
  if (threads <= 1) {
    body(std::int64_t{0}, n);
    return;
  }
  const std::int64_t chunk = std::max<std::int64_t>(1, n / (8 * static_cast<std::int64_t>(threads)));
  std::atomic<std::int64_t> next{0};
  auto worker = [&] {
    for (std::int64_t b = next.fetch_add(chunk); b < n; b = next.fetch_add(chunk)) body(b, std::min(n, b + chunk));
  };
  run_workers(threads, worker);
}

}  // namespace flashcpp::cpu
