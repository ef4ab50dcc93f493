// cuda_module.cc: the nanobind module `jax_kvcanary._kvcanary_cuda`, exporting the CUDA FFI handler
// capsules (cuda_handlers.cc) under the CPU module's target names, so one ffi_call lowers to the
// native handler of either platform. Importing this module needs no GPU and no CUDA driver: the
// CUDA runtime is linked statically and only initialises on the first launch.
#include "cuda_handlers.h"
#include "cuda_kernels.h"
#include "registrations.h"

NB_MODULE(_kvcanary_cuda, m) {
  m.def("build_info", &kvcanary::build_info);
  m.def("constants", &kvcanary::constants);
  m.def("registrations", []() {
    return kvcanary::registrations(kvcanary::kvcanary_verify_cuda, kvcanary::kvcanary_write_cuda,
                                   kvcanary::kvcanary_plan_cuda, kvcanary::kvcanary_scatter_cuda);
  });
  // Bytes of the scratch result of each handler: the CUDA launch geometry decides them.
  m.def("verify_scratch_bytes", &kvcanary::verify_scratch_bytes, nanobind::arg("capacity"));
  m.def("write_scratch_bytes", &kvcanary::write_scratch_bytes, nanobind::arg("write_req_capacity"),
        nanobind::arg("num_tokens"));
  m.def("plan_scratch_bytes", &kvcanary::plan_scratch_bytes, nanobind::arg("batch_size"));
}
