// The CPU backends' thread pool (src/cpu/parallel.h): every item runs exactly once, on the thread
// count asked for, across reuse, nesting, concurrent callers, a throwing worker and fork().
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu/parallel.h"

namespace flashcpp::cpu {
namespace {

int cores() { return static_cast<int>(std::max(1u, std::thread::hardware_concurrency())); }

// Each item of [0, n) ran once, and at most `threads` distinct threads ran them.
void expect_each_once(std::int64_t n, int threads) {
  std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
  std::mutex mu;
  std::set<std::thread::id> ids;
  parallel_for(n, threads, [&](std::int64_t i) {
    hits[static_cast<std::size_t>(i)].fetch_add(1);
    std::lock_guard<std::mutex> lk(mu);
    ids.insert(std::this_thread::get_id());
  });
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1) << "item " << i << " of " << n;
  EXPECT_LE(static_cast<int>(ids.size()), std::max(threads, 1));
}

TEST(ThreadsFor, HonoursAnExplicitCountUpToTheItems) {
  EXPECT_EQ(threads_for(4, 100, 0.0), 4);  // even for no work: tests pin counts
  EXPECT_EQ(threads_for(8, 3, 1e9), 3);
  EXPECT_EQ(threads_for(8, 1, 1e9), 1);
  EXPECT_EQ(threads_for(8, 0, 1e9), 1);
}

TEST(ThreadsFor, ChoosesOneThreadForSmallWorkAndTheCoresForLarge) {
  EXPECT_EQ(threads_for(0, 64, 10.0), 1);                      // 640 units: not worth a second thread
  EXPECT_EQ(threads_for(0, 2, kMinWorkPerThread), std::min(2, cores()));
  EXPECT_EQ(threads_for(0, 1000, 1e6), cores());
  EXPECT_EQ(threads_for(0, 3, 1e9), std::min(3, cores()));
  EXPECT_EQ(threads_for(0, 100, -5.0), 1);                     // a bad estimate is no work
}

TEST(RunWorkers, EveryItemOnceForManyShapes) {
  for (int threads : {1, 2, 3, 5, 8})
    for (std::int64_t n : {0, 1, 2, 7, 64, 1001}) expect_each_once(n, threads);
}

TEST(RunWorkers, ThePoolServesCallAfterCall) {
  for (int rep = 0; rep < 2000; ++rep) {
    std::atomic<std::int64_t> sum{0};
    parallel_for(37, 1 + rep % 4, [&](std::int64_t i) { sum.fetch_add(i); });
    ASSERT_EQ(sum.load(), 37 * 36 / 2) << "call " << rep;
  }
}

TEST(RunWorkers, AllThreadsAskedForRunAtOnce) {
  // Four items that each wait until all four have started: finishes only if four threads run
  // them at the same time (the pool, or fresh threads, must supply three besides the caller).
  constexpr int kThreads = 4;
  std::atomic<int> arrived{0};
  parallel_for(kThreads, kThreads, [&](std::int64_t) {
    arrived.fetch_add(1);
    while (arrived.load() < kThreads) std::this_thread::yield();
  });
  EXPECT_EQ(arrived.load(), kThreads);
}

TEST(RunWorkers, ANestedCallRunsOnFreshThreads) {
  std::atomic<std::int64_t> sum{0};
  parallel_for(6, 3, [&](std::int64_t i) {
    parallel_for(10, 2, [&](std::int64_t j) { sum.fetch_add(i * 10 + j); });
  });
  EXPECT_EQ(sum.load(), 59 * 60 / 2);
}

TEST(RunWorkers, ConcurrentCallersEachGetEveryItem) {
  std::vector<std::thread> callers;
  std::atomic<int> bad{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&, c] {
      for (int rep = 0; rep < 200; ++rep) {
        std::atomic<std::int64_t> sum{0};
        parallel_for(50 + c, 2 + c % 2, [&](std::int64_t i) { sum.fetch_add(i + 1); });
        if (sum.load() != (50 + c) * (51 + c) / 2) bad.fetch_add(1);
      }
    });
  for (auto& t : callers) t.join();
  EXPECT_EQ(bad.load(), 0);
}

TEST(RunWorkers, AThrowingCallerLeavesThePoolUsable) {
  // The other threads hold their first item until the caller has taken one, so the caller does
  // take one (and throws) while they still run the worker that lives in its frame.
  std::atomic<int> ran{0};
  std::atomic<bool> caller_took{false};
  const std::thread::id caller = std::this_thread::get_id();
  EXPECT_THROW(parallel_for(64, 3,
                            [&](std::int64_t) {
                              ran.fetch_add(1);
                              if (std::this_thread::get_id() == caller) {
                                caller_took = true;
                                throw std::runtime_error("caller fails");
                              }
                              while (!caller_took.load()) std::this_thread::yield();
                            }),
               std::runtime_error);
  EXPECT_GE(ran.load(), 1);
  expect_each_once(500, 3);
}

TEST(ParallelForScratch, MakesAScratchOnlyPerThreadThatTakesAnItem) {
  std::atomic<int> made{0};
  std::atomic<std::int64_t> sum{0};
  parallel_for_scratch(
      100, 4, [&] { made.fetch_add(1); return std::vector<int>(3, 0); },
      [&](std::int64_t i, std::vector<int>& s) {
        s[0] += 1;
        sum.fetch_add(i);
      });
  EXPECT_EQ(sum.load(), 99 * 100 / 2);
  EXPECT_GE(made.load(), 1);
  EXPECT_LE(made.load(), 4);
  made = 0;
  parallel_for_scratch(1, 4, [&] { made.fetch_add(1); return 0; }, [](std::int64_t, int&) {});
  EXPECT_EQ(made.load(), 1);
}

TEST(ParallelChunks, CoversTheRangeOnceInContiguousPieces) {
  for (int threads : {1, 2, 4})
    for (std::int64_t n : {1, 5, 100, 4097}) {
      std::vector<std::atomic<int>> hits(static_cast<std::size_t>(n));
      parallel_chunks(n, threads, [&](std::int64_t a, std::int64_t b) {
        ASSERT_LT(a, b);
        for (std::int64_t i = a; i < b; ++i) hits[static_cast<std::size_t>(i)].fetch_add(1);
      });
      for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<std::size_t>(i)].load(), 1);
    }
}

TEST(RunWorkers, AForkedChildGetsAPoolOfItsOwn) {
  expect_each_once(100, 3);  // the parent's pool has threads now; the child inherits none of them
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    alarm(20);  // a child waiting for threads it does not have dies instead of hanging the test
    // Three items that each wait for all three to start: the child's pool must really run them.
    std::atomic<int> arrived{0};
    parallel_for(3, 3, [&](std::int64_t) {
      arrived.fetch_add(1);
      while (arrived.load() < 3) std::this_thread::yield();
    });
    std::atomic<std::int64_t> sum{0};
    parallel_for(100, 3, [&](std::int64_t i) { sum.fetch_add(i); });
    _exit(sum.load() == 99 * 100 / 2 ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << "the child did not exit (signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

}  // namespace
}  // namespace flashcpp::cpu
