// Warpgroup coordination (sm_90a): named barriers between some warps of a block, and the register reallocation
// (setmaxnreg) that moves a producer warpgroup's registers to the consumer warpgroups.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// A named barrier (ids 1-15; 0 is __syncthreads'): waits for `threads` arrivals, its own included.
FA2_DEVICE void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// The same with the id and count in the instruction (immediates).
template <int Id, int Threads>
FA2_DEVICE void named_barrier_sync() {
    asm volatile("bar.sync %0, %1;\n" ::"n"(Id), "n"(Threads) : "memory");
}
// One arrival on a named barrier without waiting for it (a warpgroup handing a turn on to another that waits there).
template <int Id, int Threads>
FA2_DEVICE void named_barrier_arrive() {
    asm volatile("bar.arrive %0, %1;\n" ::"n"(Id), "n"(Threads) : "memory");
}

// setmaxnreg: the warpgroup gives up registers down to Registers a thread (a producer, which needs few), or claims
// them up to Registers (the consumers, once the producer's are free); every warp of the warpgroup executes it.
template <int Registers>
FA2_DEVICE void warpgroup_release_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(Registers));
}
template <int Registers>
FA2_DEVICE void warpgroup_claim_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Registers));
}

}  // namespace fa2
