// Hints to the compiler about values: an address it must not re-derive (opaque) and a computation it must keep
// where it stands (keep_here). Empty asm statements: they emit no instruction.
#pragma once
#include "common/types.cuh"

namespace fa2 {

// `p`, but opaque to the compiler: addresses formed from it stay one register plus an immediate offset, where
// ptxas had re-derived each from 64-bit index arithmetic (four instructions a copy in the paged K/V loader).
// (keep_here, beside wait_for_prior_grids, is its volatile form, which also keeps the value's place in order.)
template <class T>
FA2_DEVICE const T* opaque(const T* p) {
    asm("" : "+l"(p));
    return p;
}

// Keeps a value's computation before this point: an empty volatile asm that reads and rewrites it, and volatile
// asm keeps its program order (with wait_for_prior_grids too). For index arithmetic that needs no memory, done while
// a block waits for the kernel before instead of after (ptxas had put nearly all of it after the wait).
template <class T>
FA2_DEVICE void keep_here(T*& p) {
    asm volatile("" : "+l"(p));
}
FA2_DEVICE void keep_here(int& x) { asm volatile("" : "+r"(x)); }

}  // namespace fa2
