// module.cc: the nanobind module `jax_kvcanary._kvcanary`, exporting the CPU FFI handler capsules.
// CUDA handlers live in the separate `_kvcanary_cuda` module (cuda_module.cc) when it is built.
#include "cpu_handlers.h"
#include "registrations.h"

NB_MODULE(_kvcanary, m) {
  m.def("build_info", &kvcanary::build_info);
  m.def("constants", &kvcanary::constants);
  m.def("registrations", []() {
    return kvcanary::registrations(kvcanary::kvcanary_verify_cpu, kvcanary::kvcanary_write_cpu,
                                   kvcanary::kvcanary_plan_cpu, kvcanary::kvcanary_scatter_cpu);
  });
  m.def("set_max_threads", &kvcanary::set_cpu_max_threads, nanobind::arg("n"));
  m.def("max_threads", &kvcanary::cpu_max_threads);
}
