// cpu_handlers.h: the CPU FFI handler symbols exported by cpu_handlers.cc.
#pragma once

#include "xla/ffi/api/ffi.h"

#include <cstdint>

namespace kvcanary {
// A process-wide cap on the threads each CPU launch uses (0 = XLA's intra-op pool size; 1 = one thread).
void set_cpu_max_threads(int64_t n);
int64_t cpu_max_threads();

XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_verify_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_write_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_plan_cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(kvcanary_scatter_cpu);
}  // namespace kvcanary
