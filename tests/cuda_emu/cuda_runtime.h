// tests/cuda_emu/cuda_runtime.h: a CPU stand-in for the CUDA runtime, so that cuda/cuda_kernels.cu
// can be compiled by g++ and its kernels executed on a machine without a GPU (tests/test_cuda_emu.py).
//
// Execution model: a launch runs its blocks one after another; the threads of a block are real
// std::threads. __syncthreads is a block barrier, __shfl_up_sync a warp exchange through a buffer
// and two warp barriers, atomics are GCC __atomic builtins. `__shared__` is `static`, which gives
// one copy shared by the threads of the (single) running block. A barrier that some thread of the
// block never reaches (non-uniform control flow around __syncthreads, undefined on a GPU) is
// reported and aborts instead of hanging. Nothing here models GPU memory ordering or warp
// scheduling; it checks the kernels' logic, indexing and order of results.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static

struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
typedef struct CUstream_st* cudaStream_t;
enum cudaMemcpyKind { cudaMemcpyDeviceToDevice = 3 };
inline cudaError_t cudaMemsetAsync(void* p, int v, size_t n, cudaStream_t) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memmove(d, s, n);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorName(cudaError_t e) { return e == cudaErrorInvalidValue ? "cudaErrorInvalidValue" : "cudaErrorEmulated"; }
inline const char* cudaGetErrorString(cudaError_t) { return "emulated"; }

namespace emu {

class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void wait(const char* what) {
    std::unique_lock<std::mutex> lock(m_);
    const unsigned long gen = gen_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return gen_ != gen; })) {
      std::fprintf(stderr, "cuda_emu: %s barrier timed out (%d of %d threads arrived): non-uniform barrier?\n",
                   what, arrived_, n_);
      std::abort();
    }
  }

 private:
  std::mutex m_;
  std::condition_variable cv_;
  int n_;
  int arrived_ = 0;
  unsigned long gen_ = 0;
};

struct Block {
  explicit Block(unsigned threads) : bar(static_cast<int>(threads)), xchg(threads) {
    for (unsigned w = 0; w < (threads + 31) / 32; ++w) warp_bars.emplace_back(new Barrier(32));
  }
  Barrier bar;
  std::vector<std::unique_ptr<Barrier>> warp_bars;
  std::vector<unsigned long long> xchg;  // one word per thread
  std::atomic<int> acc{0};
};
inline thread_local Block* cur = nullptr;

template <class K, class... A>
void launch(K kernel, dim3 grid, dim3 block, const A&... args) {
  if (block.x % 32 != 0 || block.x > 1024 || grid.x < 1) {
    std::fprintf(stderr, "cuda_emu: bad launch geometry grid=%u block=%u\n", grid.x, block.x);
    std::abort();
  }
  for (unsigned b = 0; b < grid.x; ++b) {
    Block blk(block.x);
    std::vector<std::thread> threads;
    threads.reserve(block.x);
    for (unsigned t = 0; t < block.x; ++t) {
      threads.emplace_back([&, t] {
        threadIdx = uint3{t, 0, 0};
        blockIdx = uint3{b, 0, 0};
        blockDim = block;
        gridDim = grid;
        cur = &blk;
        kernel(args...);
      });
    }
    for (auto& th : threads) th.join();
  }
}

}  // namespace emu

#define KVC_LAUNCH(kernel, grid, block, stream, ...) ((void)(stream), emu::launch(kernel, dim3(grid), dim3(block), __VA_ARGS__))

inline void __syncthreads() { emu::cur->bar.wait("__syncthreads"); }
inline int __syncthreads_count(int pred) {
  emu::Block* b = emu::cur;
  b->bar.wait("__syncthreads_count");
  if (pred) b->acc.fetch_add(1);
  b->bar.wait("__syncthreads_count");
  const int n = b->acc.load();
  b->bar.wait("__syncthreads_count");
  if (threadIdx.x == 0) b->acc.store(0);
  b->bar.wait("__syncthreads_count");
  return n;
}
inline int __syncthreads_or(int pred) { return __syncthreads_count(pred ? 1 : 0) > 0 ? 1 : 0; }

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta) {
  static_assert(sizeof(T) <= 8, "shuffle of a word");
  if (mask != 0xffffffffu) {
    std::fprintf(stderr, "cuda_emu: only full-warp shuffles are emulated\n");
    std::abort();
  }
  emu::Block* b = emu::cur;
  const unsigned lane = threadIdx.x & 31u, warp = threadIdx.x >> 5;
  unsigned long long w = 0;
  std::memcpy(&w, &v, sizeof(T));
  b->xchg[threadIdx.x] = w;
  b->warp_bars[warp]->wait("__shfl_up_sync");
  T out = v;
  if (lane >= delta) std::memcpy(&out, &b->xchg[threadIdx.x - delta], sizeof(T));
  b->warp_bars[warp]->wait("__shfl_up_sync");
  return out;
}

inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long cmp, unsigned long long val) {
  __atomic_compare_exchange_n(p, &cmp, val, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
  return cmp;  // the old value (unchanged cmp on success)
}
inline unsigned atomicOr(unsigned* p, unsigned v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
