// cuda_kernels.h: the CUDA launchers of the four ops (cuda_kernels.cu) and the scratch each needs.
// No XLA types: the CUDA FFI handlers (cuda_handlers.cc) call these on XLA's stream, and the CPU
// emulation harness (tests/cuda_emu) calls them on the CPU. Every pointer is device memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "canary_core.h"

namespace kvcanary {

// Bytes of scratch a launch needs. The handlers take their scratch as their last ffi_call result,
// sized in Python (src/jax_kvcanary/_ffi.py) through these functions (exported by cuda_module.cc).
int64_t verify_scratch_bytes(int64_t capacity);                               // capacity = V
int64_t write_scratch_bytes(int64_t write_req_capacity, int64_t num_tokens);  // C, N
int64_t plan_scratch_bytes(int64_t batch_size);                               // min(bs, C)

// Each *_enqueue issues a launch's stream operations and returns cudaGetLastError(). None syncs,
// allocates or reads device data on the host (command-buffer safe). With less scratch than
// *_scratch_bytes() asks for, nothing is enqueued and cudaErrorInvalidValue is returned.

// VERIFY (format §8.3). num_valid, enable: int32[1].
cudaError_t verify_enqueue(const VerifyArgs& a, int64_t capacity, const int32_t* num_valid, const int32_t* enable,
                           const LogView& log, ScratchView scratch, cudaStream_t stream);

// WRITE (format §7.3, §7.4). offsets: [capacity + 1]; num_valid_reqs, chain_flag: int32[1]
// (chain_flag is enable_chain_position_assert; a.chain_assert is not read).
cudaError_t write_enqueue(const WriteArgs& a, IndexView offsets, int64_t capacity, int64_t num_tokens,
                          const int32_t* num_valid_reqs, const int32_t* chain_flag, const LogView& log,
                          ScratchView scratch, cudaStream_t stream);

// PLAN (format §9.3): bs <= wcap; every output element is written.
cudaError_t plan_enqueue(const PlanArgs& a, int64_t bs, int64_t vcap, int64_t wcap, const PlanOut& out,
                         ScratchView scratch, cudaStream_t stream);

// scatter_req_token_ids (format §9.5) into an int32 or int64 pool [rows, cols]; needs no scratch.
template <typename T>
cudaError_t scatter_enqueue(T* pool, int64_t rows, int64_t cols, IndexView flat, int64_t total, IndexView offsets,
                            IndexView req_pool_indices, int64_t bs, cudaStream_t stream);

}  // namespace kvcanary
