// Where and when a thread runs, for the diagnostics builds' marks (FA2_FWD_TRACE, FA2_BWD_TRACE, FA2_DECODE_TRACE).
#pragma once
#include "common/types.cuh"

namespace fa2 {

// The SM this thread runs on.
FA2_DEVICE unsigned sm_id() {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    return sm;
}

// The GPU's global timer in nanoseconds (the same clock on every SM, unlike clock64).
FA2_DEVICE unsigned long long global_timer() {
    unsigned long long now;
    asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
    return now;
}

}  // namespace fa2
