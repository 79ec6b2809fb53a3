// Warp-level broadcasts and reductions (shuffles).
#pragma once
#include "common/types.cuh"

namespace fa2 {

// A value every lane of the warp holds alike, passed through a broadcast from lane 0 so that ptxas knows it is
// warp-uniform: a value loaded from memory it takes for divergent, and then keeps what derives from it (loop
// counts, ring slots, addresses) in vector registers and wraps instructions that need uniform operands (an
// mbarrier arrival's address) in loops over the lanes.
FA2_DEVICE int warp_uniform(int x) {
    return __shfl_sync(0xffffffffu, x, 0);
}
FA2_DEVICE float quad_max(float x) {  // max over the 4 lanes that share an mma row
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
FA2_DEVICE float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}
FA2_DEVICE float warp_max(float x) {  // over all 32 lanes
#pragma unroll
    for (int step = 16; step > 0; step /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, step));
    return x;
}
FA2_DEVICE float warp_sum(float x) {
#pragma unroll
    for (int step = 16; step > 0; step /= 2) x += __shfl_xor_sync(0xffffffffu, x, step);
    return x;
}

}  // namespace fa2
