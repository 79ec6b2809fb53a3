// mbarriers (sm_90): shared-memory barriers counting arrivals and copied bytes per phase, through which the Hopper
// kernels' producer and consumer warpgroups hand ring slots to each other; the async-proxy fence that makes
// ordinary shared-memory writes visible to wgmma and TMA.
#pragma once
#include "common/types.cuh"
#include "sm80/memory.cuh"

namespace fa2 {

// mbarrier: a 64-bit shared-memory word counting arrivals per phase. A waiter names the parity of the phase it
// waits for; a fresh barrier is in phase 0, so waiting on parity 1 returns at once (a producer's first wait for
// an empty slot).
FA2_DEVICE void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
// `Arrivals` arrivals at once (more than one: a thread that stands in for others).
template <u32 Arrivals = 1>
FA2_DEVICE void mbar_arrive(u32 bar) {
    if constexpr (Arrivals == 1)
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
    else
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(Arrivals) : "memory");
}
FA2_DEVICE bool mbar_try_wait(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}
FA2_DEVICE void mbar_wait(u32 bar, u32 parity) {
    while (!mbar_try_wait(bar, parity)) {
    }
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (counted in the init count).
FA2_DEVICE void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(bar) : "memory");
}

// Orders this thread's view of shared memory written through the generic proxy (cp.async, st.shared) before
// the tensor cores read it through the async proxy (wgmma operands).
FA2_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// `Arrivals` arrivals on `bar` (more than one: a thread that copied others' shares too) once this thread's cp.async
// writes have landed and been fenced over to the async proxy, so that the threads waiting on `bar` read them with
// wgmma without a fence of their own. The thread waits for the copies here: for the rare tile (a varlen sequence's
// ragged one) beside tiles that come by TMA.
template <u32 Arrivals = 1>
FA2_DEVICE void cp_async_fenced_arrive(u32 bar) {
    cp_async_wait_all();
    fence_proxy_async_smem();
    mbar_arrive<Arrivals>(bar);
}

// `Arrivals` arrivals on `bar` (one thread standing in for others where the barrier counts every copying thread)
// that also expect `bytes` more of copies (tma_load) in its current phase.
template <u32 Arrivals = 1>
FA2_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    if constexpr (Arrivals == 1) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    } else {
        asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
        mbar_arrive<Arrivals>(bar);
    }
}

}  // namespace fa2
