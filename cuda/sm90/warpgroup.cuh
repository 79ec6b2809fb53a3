// Warpgroup coordination (sm_90a): named barriers between some warps of a block, and the register reallocation
// (setmaxnreg) that moves a producer warpgroup's registers to the consumer warpgroups.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// A named barrier (ids 1-15; 0 is __syncthreads'): waits for `threads` arrivals, its own included.
FA2_DEVICE void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

}  // namespace fa2
