// Programmatic dependent launch (griddepcontrol, sm_90): where a kernel waits for the one before it in the stream
// and lets the next one start. On older GPUs both compile to nothing.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// ---- programmatic dependent launch (sm_90; nothing on older GPUs) -----------------------------------------------
// A kernel launched with programmatic stream serialization (fa2cupy/build.py's Launch) may start while the kernel
// before it in the stream is still running: it waits here before its first global memory access, until that
// kernel has finished and its writes are visible (at once if it was launched without the attribute).
#if __CUDA_ARCH__ >= 900
#define FA2_GRID_DEPENDENCIES 1  // programmatic launches exist: wait_for_prior_grids may wait
#else
#define FA2_GRID_DEPENDENCIES 0
#endif
FA2_DEVICE void wait_for_prior_grids() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Lets the next kernel in the stream start its launch now (it waits for this one in wait_for_prior_grids): its
// blocks take SMs as this kernel's blocks leave them, instead of after the last one has finished.
FA2_DEVICE void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

}  // namespace fa2
