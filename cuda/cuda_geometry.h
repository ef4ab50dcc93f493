// cuda_geometry.h: the launch geometry of the CUDA launchers (cuda_kernels.cu). The CPU emulation
// harness (tests/cuda_emu) may shrink it (multiples of 32 threads per block) so that small inputs
// reach the multi-tile and grid-stride paths; the defaults are the production geometry.
#pragma once

#ifndef KVC_VERIFY_THREADS
#define KVC_VERIFY_THREADS 256      // verify: threads per block (one entry per thread per tile)
#endif
#ifndef KVC_VERIFY_MAX_BLOCKS
#define KVC_VERIFY_MAX_BLOCKS 1024  // verify: at most this many blocks; more entries -> longer chunks
#endif
#ifndef KVC_WRITE_THREADS
#define KVC_WRITE_THREADS 128       // write: threads per request block = entries per tile
#endif
#ifndef KVC_ONE_BLOCK_THREADS
#define KVC_ONE_BLOCK_THREADS 1024  // the single-block scan kernels (write prep/scan, plan rows)
#endif
#ifndef KVC_PLAN_THREADS
#define KVC_PLAN_THREADS 256        // plan entries: threads per block
#endif
#ifndef KVC_SCATTER_THREADS
#define KVC_SCATTER_THREADS 256     // scatter: pool columns per block
#endif
#ifndef KVC_MAX_GRID_BLOCKS
#define KVC_MAX_GRID_BLOCKS 65535   // grid cap of the request / entry / column grids (grid-stride)
#endif
