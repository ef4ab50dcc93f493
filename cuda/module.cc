// module.cc: the nanobind module `jax_kvcanary._kvcanary`, exporting the FFI handler capsules.
// registrations() maps each FFI target name to {platform: capsule}; one target name per op serves
// both platforms. CUDA handlers live in the separate `_kvcanary_cuda` module when it is built.
#include <nanobind/nanobind.h>

#include <string>

#include "cpu_handlers.h"

namespace nb = nanobind;

namespace {
template <typename T>
nb::capsule encapsulate(T* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

NB_MODULE(_kvcanary, m) {
  m.def("registrations", []() {
    nb::dict out;
    out["kvcanary_verify"] = encapsulate(kvcanary::kvcanary_verify_cpu);
    out["kvcanary_write"] = encapsulate(kvcanary::kvcanary_write_cpu);
    out["kvcanary_plan"] = encapsulate(kvcanary::kvcanary_plan_cpu);
    out["kvcanary_scatter"] = encapsulate(kvcanary::kvcanary_scatter_cpu);
    return out;
  });
}
