// cuda_scratch.h: bytes of the scratch result of each CUDA handler (cuda_kernels.cu). The handlers
// take their scratch as an extra ffi_call result, sized by jax_kvcanary/_ffi.py through these
// functions (exported by cuda_module.cc), so XLA allocates it with the call's other buffers.
#pragma once

#include <cstdint>

namespace kvcanary {
int64_t verify_scratch_bytes(int64_t capacity);                               // capacity = V
int64_t write_scratch_bytes(int64_t write_req_capacity, int64_t num_tokens);  // C, N
int64_t plan_scratch_bytes(int64_t batch_size);                               // min(bs, C)
}  // namespace kvcanary
