# cuda/cuda.cmake: the optional CUDA module `_kvcanary_cuda` (included at the end of CMakeLists.txt).
#
#   JAX_KVCANARY_CUDA      auto (default): build it when a CUDA compiler is found; on: required (fails
#                          without nvcc); off: never. The environment variable of the same name wins
#                          (CMakeLists.txt reads it), so `JAX_KVCANARY_CUDA=on pip install .` works.
#   CMAKE_CUDA_ARCHITECTURES  default 90 (H100/H200, sm_90); e.g. -DCMAKE_CUDA_ARCHITECTURES="80;90".
#   JAX_KVCANARY_WERROR    ON: warnings are errors for the CUDA sources (CI's compile check).
#
# No GPU is needed to build: CI compiles and links the module with nvcc alone.
string(TOLOWER "${JAX_KVCANARY_CUDA}" _kvc_cuda_mode)
if(_kvc_cuda_mode MATCHES "^(off|0|false|no)$")
  message(STATUS "jax_kvcanary: CUDA handlers disabled (JAX_KVCANARY_CUDA=${JAX_KVCANARY_CUDA})")
  return()
elseif(_kvc_cuda_mode MATCHES "^(on|1|true|yes)$")
  set(_kvc_cuda_required TRUE)
elseif(_kvc_cuda_mode STREQUAL "auto")
  set(_kvc_cuda_required FALSE)
else()
  message(FATAL_ERROR "jax_kvcanary: JAX_KVCANARY_CUDA must be auto, on or off, got '${JAX_KVCANARY_CUDA}'")
endif()

if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES OR "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "")
  set(CMAKE_CUDA_ARCHITECTURES 90 CACHE STRING "CUDA architectures of _kvcanary_cuda (default 90: H100/H200)")
endif()
option(JAX_KVCANARY_WERROR "Treat warnings in the CUDA sources as errors" OFF)

include(CheckLanguage)
check_language(CUDA)
if(NOT CMAKE_CUDA_COMPILER)
  if(_kvc_cuda_required)
    message(FATAL_ERROR "jax_kvcanary: JAX_KVCANARY_CUDA=on but no CUDA compiler was found "
                        "(put nvcc on PATH or set CMAKE_CUDA_COMPILER / CUDACXX)")
  endif()
  message(STATUS "jax_kvcanary: no CUDA compiler found; building the CPU module only")
  return()
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)
message(STATUS "jax_kvcanary: building _kvcanary_cuda with ${CMAKE_CUDA_COMPILER} "
               "(${CMAKE_CUDA_COMPILER_VERSION}) for CUDA architectures ${CMAKE_CUDA_ARCHITECTURES}")

# The kernels and their launchers (no XLA types): a static library of position-independent objects,
# linked into the module with the FFI handlers (host code, compiled by the C++ compiler).
add_library(kvcanary_cuda_kernels STATIC cuda/cuda_kernels.cu)
set_target_properties(kvcanary_cuda_kernels PROPERTIES
  CUDA_STANDARD 17
  CUDA_STANDARD_REQUIRED ON
  POSITION_INDEPENDENT_CODE ON
  CUDA_VISIBILITY_PRESET hidden
  CUDA_RUNTIME_LIBRARY Static)
target_include_directories(kvcanary_cuda_kernels PRIVATE csrc cuda)
target_compile_options(kvcanary_cuda_kernels PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:-O3 -Xcompiler=-Wall,-Wextra -Xptxas=-warn-spills,-warn-lmem-usage>)
if(JAX_KVCANARY_WERROR)
  target_compile_options(kvcanary_cuda_kernels PRIVATE
    $<$<COMPILE_LANGUAGE:CUDA>:--Werror=all-warnings -Xcompiler=-Werror>)
endif()

nanobind_add_module(_kvcanary_cuda NB_STATIC cuda/cuda_module.cc cuda/cuda_handlers.cc)
target_include_directories(_kvcanary_cuda SYSTEM PRIVATE ${XLA_DIR})
target_include_directories(_kvcanary_cuda PRIVATE csrc cuda)
target_compile_options(_kvcanary_cuda PRIVATE -Wall -Wextra -O3)
if(JAX_KVCANARY_WERROR)
  target_compile_options(_kvcanary_cuda PRIVATE -Werror)
endif()
# Static CUDA runtime: importing the module needs no libcudart and no driver (CPU-only machines).
target_link_libraries(_kvcanary_cuda PRIVATE kvcanary_cuda_kernels CUDA::cudart_static)
install(TARGETS _kvcanary_cuda LIBRARY DESTINATION jax_kvcanary)
