// Division by a divisor fixed per launch (page sizes, head groups, work-item counts) as a multiplication.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// n / d for a divisor fixed per launch, by a multiply-high and a shift (Granlund & Montgomery 1994) instead of a
// ~20-instruction integer division: the host computes magic and shift (fa2cupy/forward.py fast_divisor). Exact for
// 0 <= n < 2^31.
struct FastDiv {
    u32 magic;
    int shift;
    FA2_DEVICE int div(int n) const { return (int)((__umulhi((u32)n, magic) + (u32)n) >> shift); }
};

}  // namespace fa2
