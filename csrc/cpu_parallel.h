// cpu_parallel.h: how the CPU launchers (cpu_launchers.h) spread a launch over threads. No XLA types:
// the CPU handlers pass XLA's intra-op thread pool, the native fuzz driver a pool of std::threads.
//
// An executor runs body(k) for every chunk k in [0, n), and says how finely a launch may be cut:
//   Sequential               the calling thread alone (one chunk per launch);
//   PoolExecutor<Pool>       the calling thread plus up to workers-1 tasks of `Pool` (anything with
//                            schedule(F&&)), each claiming chunks from a shared counter; chunks of at
//                            least `min_chunk` entries (tests cut small launches finely with it).
// The caller never waits for a task to start: it runs every chunk nobody else has claimed and then
// waits only for the chunks other threads are running. So a caller that is itself a pool thread
// cannot deadlock, and a task that starts late finds nothing left to do and exits without touching
// the body (its shared state is reference-counted, the body's captures are not used by then).
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

namespace kvcanary {

// Launches smaller than two chunks of this many entries (verify, plan) or tokens (write) run on one
// thread: below it, handing chunks to other threads costs more than it saves.
constexpr int64_t kMinParallelChunk = 8192;

struct Sequential {
  int64_t workers() const { return 1; }
  int64_t min_chunk() const { return kMinParallelChunk; }
  template <class Body>
  void run_chunks(int64_t n, const Body& body) const {
    for (int64_t k = 0; k < n; ++k) body(k);
  }
};

template <class Pool>
class PoolExecutor {
 public:
  PoolExecutor(Pool& pool, int64_t workers, int64_t min_chunk = kMinParallelChunk)
      : pool_(pool), workers_(workers < 1 ? 1 : workers), min_chunk_(min_chunk < 1 ? 1 : min_chunk) {}
  int64_t workers() const { return workers_; }
  int64_t min_chunk() const { return min_chunk_; }

  template <class Body>
  void run_chunks(int64_t n, const Body& body) const {
    if (n <= 0) return;
    if (workers_ <= 1 || n == 1) return Sequential{}.run_chunks(n, body);
    struct Shared {
      std::atomic<int64_t> next{0}, done{0};
      int64_t n = 0;
      const Body* body = nullptr;
      std::mutex mu;
      std::condition_variable cv;
    };
    auto shared = std::make_shared<Shared>();
    shared->n = n;
    shared->body = &body;
    auto work = [](Shared& s) {
      for (;;) {
        const int64_t k = s.next.fetch_add(1);
        if (k >= s.n) return;
        (*s.body)(k);
        if (s.done.fetch_add(1) + 1 == s.n) {
          std::lock_guard<std::mutex> lock(s.mu);
          s.cv.notify_all();
        }
      }
    };
    const int64_t tasks = std::min(workers_ - 1, n - 1);
    for (int64_t t = 0; t < tasks; ++t) pool_.schedule([shared, work] { work(*shared); });
    work(*shared);
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->done.load() == n; });
  }

 private:
  Pool& pool_;
  int64_t workers_;
  int64_t min_chunk_;
};

// Chunks for `items` units of work on `exec`: at least exec.min_chunk() units each, about four per
// worker (so that uneven chunks even out), and 1 (the sequential path) when the launch is small.
template <class Exec>
int64_t chunk_count(int64_t items, const Exec& exec) {
  if (exec.workers() <= 1 || items < 2 * exec.min_chunk()) return 1;
  return std::min(items / exec.min_chunk(), 4 * exec.workers());
}

// Bounds of chunk k of `n` chunks over [0, items): contiguous, in order, sizes differing by at most 1.
inline int64_t chunk_begin(int64_t k, int64_t n, int64_t items) { return items / n * k + std::min(k, items % n); }

}  // namespace kvcanary
