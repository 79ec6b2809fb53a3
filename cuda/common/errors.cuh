// Bad values that only the GPU sees (index arrays in device memory) are reported from the kernels, without a host
// synchronisation: the first thread to find one claims a per-device word with atomicExch and writes what, where
// and which value into pinned host memory mapped into the GPU's address space. fa2cupy/device_errors.py reads it
// and raises a ValueError naming the argument at the next call (or at fa2cupy.check_device_errors()).
#pragma once
#include "common/types.cuh"

namespace fa2 {

// The codes fa2cupy/device_errors.py turns into messages.
enum BadValue : int {
    kBadCacheSeqlen = 1,
    kBadCacheBatchIdx = 2,
    kBadBlockTable = 3,
    kBadCuSeqlensQ = 4,
    kBadCuSeqlensK = 5,
    kBadRotaryPosition = 6,  // a rotated position (value) past the rows of rotary_cos / rotary_sin
    kBadCacheLeftpad = 7,    // cache_leftpad[row] (value) outside [0, cache_seqlens[row]]
    kBadVarlenPage = 8,      // block_table[row, col] (value) of a paged varlen forward is not a page of k
};

// Records the first bad value: what (BadValue), where (row, col of the offending array) and the value itself.
// The claim is an exchange (the word is 1 once claimed, so only the first finds 0): one register where atomicCAS
// takes a pair, which the Hopper forward's 32-register producer spilled around.
FA2_DEVICE void report_bad_value(int* claim, long long* host, int what, int row, int col, int value) {
    if (atomicExch(claim, 1) == 0) {
        volatile long long* report = host;
        report[1] = ((long long)row << 32) | (unsigned)col;
        report[2] = value;
        __threadfence_system();
        report[0] = what;  // last: the host reads the rest once it sees this
    }
}

}  // namespace fa2
