// Tensor-core and copy primitives shared by every fa2cupy kernel: the only place that holds inline PTX.
//
// Written against the PTX ISA for sm_80+ (mma.sync m16n8k16, ldmatrix, cp.async). No CUDA headers are
// included so that NVRTC can compile the kernels with nothing but libnvrtc (CI compiles them on a CPU box).
#pragma once

namespace fa2 {

typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

// Element type tags. Tensor-core operands are 16 bits; the tag picks the PTX type names. f32 tags fp32 data
// (decode partial results) for the kernels that read it.
struct f16 {};
struct bf16 {};
struct f32 {};
template <class E>
constexpr int kElemBytes = 2;
template <>
constexpr int kElemBytes<f32> = 4;

#define FA2_DEVICE __device__ __forceinline__

// A compile-time flag as a value: generic lambdas take it to instantiate one body per case (if constexpr inside).
template <bool B>
struct Bool {
    static constexpr bool value = B;
};

constexpr float kLog2e = 1.4426950408889634f;  // log2(e): exp(x) = exp2(x * kLog2e)

FA2_DEVICE u32 smem_u32(const void* ptr) {
    u32 addr;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(ptr));
    return addr;
}

// `p`, but opaque to the compiler: addresses formed from it stay one register plus an immediate offset, where
// ptxas had re-derived each from 64-bit index arithmetic (four instructions a copy in the paged K/V loader).
// (keep_here, beside wait_for_prior_grids, is its volatile form, which also keeps the value's place in order.)
template <class T>
FA2_DEVICE const T* opaque(const T* p) {
    asm("" : "+l"(p));
    return p;
}

// ---- asynchronous global -> shared copies (Ampere cp.async) ---------------------------------------------
// 16 bytes per thread; `valid == false` writes zeros instead of reading, which is how ragged tiles
// (seqlen or head dim not a tile multiple) stay finite without branching around the copy.
FA2_DEVICE void cp_async_16(u32 dst, const void* src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
// L2 eviction policies (createpolicy, for cache_hint accesses). Evict-last: for a result another block reads back
// within microseconds (decode's split partials) while a stream goes through L2. Evict-first: for a stream read once
// that is larger than L2 anyway (it cannot stay there; under evict-first a cache that fits L2 lost its residency to
// the SDPA calls the bench interleaves: 8 x 1k 0.66x). Evict-unchanged: as if with no policy (an explicit
// evict_normal one cost an L2-resident 8 x 1k cache 8%; evict-unchanged is level with no hint).
FA2_DEVICE u64 l2_evict_first() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
FA2_DEVICE u64 l2_evict_unchanged() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_unchanged.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
FA2_DEVICE u64 l2_evict_last() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
    return policy;
}
// cp_async_16 with an L2 prefetch hint of 256 bytes, under an L2 policy: for streams read once in whole 256-byte
// rows (decode's K/V).
FA2_DEVICE void cp_async_16_prefetch256(u32 dst, const void* src, bool valid, u64 policy) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint.L2::256B [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(valid ? 16 : 0), "l"(policy));
}
// Stores under an L2 policy.
FA2_DEVICE void st_global_f32x2(float* ptr, float a, float b, u64 policy) {
    asm volatile("st.global.L2::cache_hint.v2.f32 [%0], {%1, %2}, %3;\n" ::"l"(ptr), "f"(a), "f"(b), "l"(policy)
                 : "memory");
}
FA2_DEVICE void st_global_f32(float* ptr, float a, u64 policy) {
    asm volatile("st.global.L2::cache_hint.f32 [%0], %1, %2;\n" ::"l"(ptr), "f"(a), "l"(policy) : "memory");
}
FA2_DEVICE void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
FA2_DEVICE void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// ---- ldmatrix: four 8x8 b16 matrices per warp, addresses supplied by lanes 8i..8i+7 for matrix i --------
FA2_DEVICE void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
FA2_DEVICE void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// The converse (sm_90): register i of each lane holds two b16 of matrix i in the mma C-fragment layout (row
// lane / 4, columns 2 (lane % 4) and the next), and lanes 8i..8i+7 give the addresses of matrix i's rows.
FA2_DEVICE void stmatrix_x4(u32 addr, const u32 (&r)[4]) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(r[0]),
                 "r"(r[1]), "r"(r[2]), "r"(r[3])
                 : "memory");
}

// ---- mma.sync m16n8k16, fp32 accumulate ------------------------------------------------------------------
// Fragment layouts (PTX ISA, "mma.m16n8k16"), with g = lane / 4 and t = lane % 4:
//   A (16x16, row-major): a[0] = (g, 2t..2t+1), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..), a[3] = (g+8, 2t+8..)
//   B (16x8, "col"):      b[0] = (k 2t..2t+1, n g), b[1] = (k 2t+8.., n g)
//   C (16x8):             c[0..1] = (g, 2t..2t+1), c[2..3] = (g+8, 2t..2t+1)
template <class E>
struct Mma;
template <>
struct Mma<bf16> {
    static FA2_DEVICE void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    // Two floats -> one register of two bf16, `lo` in the low half (the lower column index).
    static FA2_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};
template <>
struct Mma<f16> {
    static FA2_DEVICE void run(float (&c)[4], const u32 (&a)[4], u32 b0, u32 b1) {
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};\n"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
    static FA2_DEVICE u32 pack(float lo, float hi) {
        u32 r;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
        return r;
    }
};

// The C fragments of two adjacent n8 tiles (columns k0..k0+7 and k0+8..k0+15 of one m16 row tile) are, packed to
// 16 bits, exactly the A fragment of one k16 step: how P (forward) and dS (backward dQ) go from accumulators to
// operands without touching memory.
template <class E>
FA2_DEVICE void c_to_a(u32 (&a)[4], const float (&c0)[4], const float (&c1)[4]) {
    a[0] = Mma<E>::pack(c0[0], c0[1]);
    a[1] = Mma<E>::pack(c0[2], c0[3]);
    a[2] = Mma<E>::pack(c1[0], c1[1]);
    a[3] = Mma<E>::pack(c1[2], c1[3]);
}

// ---- scalar helpers ----------------------------------------------------------------------------------------
FA2_DEVICE float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}
// prmt.b32: result byte n is byte (selector >> 4 n) & 7 of the pair {a (bytes 0-3), b (4-7)}, or, where bit 3 of
// that nibble is set, that byte's top bit repeated eight times (__byte_perm drops the bit, and with it this mode).
FA2_DEVICE u32 prmt_b32(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}
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

FA2_DEVICE void st_shared_u32(u32 addr, u32 v) { asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(v)); }
FA2_DEVICE void st_shared_v2_f32(u32 addr, float a, float b) {
    asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(addr), "f"(a), "f"(b) : "memory");
}
FA2_DEVICE void ld_shared_v2_f32(u32 addr, float& a, float& b) {
    asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];\n" : "=f"(a), "=f"(b) : "r"(addr) : "memory");
}
FA2_DEVICE void ld_shared_v4(u32 addr, u32 (&r)[4]) {
    asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
FA2_DEVICE void ld_global_v4(const void* ptr, u32 (&r)[4]) {
    asm volatile("ld.global.nc.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "l"(ptr));
}
// Loads of data other blocks wrote (relaxed, GPU scope: from L2), issued in program order: ptxas keeps volatile asm
// in order, where it moved plain loads behind the math on loads issued before them (a second L2 round trip).
FA2_DEVICE float ld_relaxed_gpu(const float* ptr) {
    float x;
    asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];\n" : "=f"(x) : "l"(ptr));
    return x;
}
// (also a guess read before wait_for_prior_grids: coherent at GPU scope, it leaves no L1 copy that the same read
// after the wait could hit; volatile, it stays before the wait)
FA2_DEVICE int ld_relaxed_gpu(const int* ptr) {
    int x;
    asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(x) : "l"(ptr));
    return x;
}
FA2_DEVICE float4 ld_relaxed_gpu_v4(const float* ptr) {
    float4 x;
    asm volatile("ld.relaxed.gpu.global.v4.f32 {%0, %1, %2, %3}, [%4];\n"
                 : "=f"(x.x), "=f"(x.y), "=f"(x.z), "=f"(x.w)
                 : "l"(ptr));
    return x;
}
// Adds two consecutive floats to global memory without reading back (fp32 dQ accumulation in the backward).
FA2_DEVICE void red_add_f32x2(float* ptr, float a, float b) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(ptr), "f"(a), "f"(b) : "memory");
#else
    atomicAdd(ptr, a);
    atomicAdd(ptr + 1, b);
#endif
}
// Adds four consecutive floats (16-byte aligned): one L2 request per 128-byte line when a warp covers whole lines.
FA2_DEVICE void red_add_f32x4(float* ptr, const u32 (&v)[4]) {
#if __CUDA_ARCH__ >= 900
    asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "f"(__uint_as_float(v[0])),
                 "f"(__uint_as_float(v[1])), "f"(__uint_as_float(v[2])), "f"(__uint_as_float(v[3]))
                 : "memory");
#else
#pragma unroll
    for (int i = 0; i < 4; ++i) atomicAdd(ptr + i, __uint_as_float(v[i]));
#endif
}
// Unpacks two 16-bit floats (lo, hi) of one register to fp32.
template <class E>
FA2_DEVICE float2 unpack2(u32 v);
template <>
FA2_DEVICE float2 unpack2<bf16>(u32 v) {
    return make_float2(__uint_as_float(v << 16), __uint_as_float(v & 0xffff0000u));
}
template <>
FA2_DEVICE float2 unpack2<f16>(u32 v) {
    float lo, hi;
    asm("{ .reg .f16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }" : "=f"(lo), "=f"(hi) : "r"(v));
    return make_float2(lo, hi);
}

FA2_DEVICE void st_global_v4(void* ptr, const u32 (&r)[4]) {
    asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"l"(ptr), "r"(r[0]), "r"(r[1]), "r"(r[2]),
                 "r"(r[3]));
}

// Release and acquire at GPU scope in one fence: with a block barrier before it (release) or after it (acquire),
// one thread's fence orders the whole block's memory accesses around an atomic flag (fences are cumulative).
FA2_DEVICE void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

// A compile-time number passed as an argument (lambdas take no template arguments).
template <int N>
struct Const {
    static constexpr int value = N;
};

// n / d for a divisor fixed per launch, by a multiply-high and a shift (Granlund & Montgomery 1994) instead of a
// ~20-instruction integer division: the host computes magic and shift (fa2cupy/forward.py fast_divisor). Exact for
// 0 <= n < 2^31.
struct FastDiv {
    u32 magic;
    int shift;
    FA2_DEVICE int div(int n) const { return (int)((__umulhi((u32)n, magic) + (u32)n) >> shift); }
};

FA2_DEVICE float pos_inf() { return __int_as_float(0x7f800000); }
FA2_DEVICE float quiet_nan() { return __int_as_float(0x7fc00000); }

// ---- shared-memory tiles ----------------------------------------------------------------------------------
// A tile of Rows x Cols 16-bit elements, row-major, each row padded by 16 bytes. With a row pitch that is an
// odd number of 16-byte chunks the 8 row addresses of one ldmatrix land in 8 different bank groups, so the
// tile is conflict-free for ldmatrix (plain and .trans) and for cp.async fills at any head dim, without the
// head-dim-specific XOR swizzles (a swizzle needs >= 8 chunks per row; head dim 32 has 4).
// Swizzle (Cols a multiple of 64): unpadded rows, 16-byte chunk c of row r stored at chunk c ^ (r % 8), just as
// conflict-free for ldmatrix; a warp's cp.async fill of two 256-byte rows is then one contiguous 512-byte span,
// which the padded pitch splits: streaming K/V from HBM into padded rows ran 4% slower (bench/read_ceiling.py).
template <int Rows, int Cols, bool Swizzle = false>
struct SmemTile {
    static_assert(Cols % 16 == 0, "tile columns must be a multiple of 16 elements");
    static_assert(!Swizzle || Cols % 64 == 0, "the XOR swizzle needs a multiple of 8 chunks per row");
    static constexpr int kPitch = Swizzle ? Cols : Cols + 8;  // elements
    static constexpr int kBytes = Rows * kPitch * 2;
    static FA2_DEVICE u32 at(u32 base, int row, int col) {
        if constexpr (Swizzle) return base + (row * kPitch + (((col >> 3) ^ (row & 7)) << 3) + (col & 7)) * 2;
        return base + (row * kPitch + col) * 2;
    }

    // Global -> shared for the whole tile by `Threads` threads, 16 bytes each. Rows >= rows_valid and
    // columns >= cols_valid (a multiple of 8) are zero-filled rather than read.
    template <int Threads>
    static FA2_DEVICE void load_async(u32 base, const u16* gmem, int row_stride, int rows_valid, int cols_valid,
                                      int tid) {
        constexpr int kChunksPerRow = Cols / 8;
        constexpr int kChunks = Rows * kChunksPerRow;
        if constexpr (Threads % kChunksPerRow == 0) {
            // Each thread keeps one column and walks down rows: one pointer and a fixed step instead of a
            // precomputed 64-bit offset per chunk (those cost 2 registers each and spilled at head dim 128).
            constexpr int kRowStep = Threads / kChunksPerRow;
            const int r0 = tid / kChunksPerRow, c = (tid % kChunksPerRow) * 8;
            const u16* src = gmem + r0 * row_stride + c;
            const int step = kRowStep * row_stride;  // the host keeps row strides below 2^24
            const bool col_ok = c < cols_valid;
#pragma unroll
            for (int i = 0; i < (Rows + kRowStep - 1) / kRowStep; ++i) {
                const int r = r0 + i * kRowStep;
                if (Rows % kRowStep == 0 || r < Rows) {
                    const bool ok = col_ok && r < rows_valid;
                    cp_async_16(at(base, r, c), ok ? src : gmem, ok);
                }
                src += step;
            }
        } else {
#pragma unroll
            for (int i = 0; i < (kChunks + Threads - 1) / Threads; ++i) {
                const int idx = tid + i * Threads;
                if (kChunks % Threads == 0 || idx < kChunks) {
                    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
                    const bool ok = r < rows_valid && c < cols_valid;
                    cp_async_16(at(base, r, c), ok ? gmem + r * row_stride + c : gmem, ok);
                }
            }
        }
    }

    // K and V tiles together from gathered rows (paged K/V): locate(r, page, slot) finds tile row r (its page and
    // its slot in the page) and returns true, or returns false for a row to zero-fill; rows_at(page, slot, k_row,
    // v_row) points k_row/v_row at that row's first elements. One look-up serves both tiles (their rows come from
    // the same page). Columns >= cols_valid are zero-filled as in load_async. Zero-filled chunks name k_any/v_any
    // (any valid address) as their source, which is not read.
    // Where each copy instruction takes whole rows (32 / (Cols / 8) of them) and a warp's copies cover at most 32
    // rows, each lane looks one of the warp's rows up, all at once, and the copies take the rows' pages by
    // shuffles: one look-up round trip per tile instead of one per copy (those held paged calls at ~0.76x packed
    // speed). Other widths, or ByLanes false, look each chunk's row up in turn.
    template <int Threads, bool ByLanes, class Locate, class RowsAt>
    static FA2_DEVICE void load_async_pair_rows(u32 base_k, u32 base_v, const u16* k_any, const u16* v_any,
                                                int cols_valid, int tid, Locate locate, RowsAt rows_at) {
        constexpr int kChunksPerRow = Cols / 8;
        constexpr int kChunks = Rows * kChunksPerRow;
        if constexpr (ByLanes && 32 % kChunksPerRow == 0 && kChunks % Threads == 0 && Rows <= Threads) {
            constexpr int kRowsPerCopy = 32 / kChunksPerRow, kCopies = kChunks / Threads;
            static_assert(kCopies * kRowsPerCopy <= 32, "a warp's rows, one per lane");
            const int lane = tid & 31, warp_first = tid - lane, c = lane % kChunksPerRow * 8;
            // Row of this warp's copy i, sub-row s: (warp_first + i * Threads) / kChunksPerRow + s.
            int my_page = -1, my_slot = 0;
            if (lane < kCopies * kRowsPerCopy &&
                !locate((warp_first + lane / kRowsPerCopy * Threads) / kChunksPerRow + lane % kRowsPerCopy,
                        my_page, my_slot))
                my_page = -1;
#pragma unroll 1
            for (int i = 0; i < kCopies; ++i) {
                const int from = i * kRowsPerCopy + lane / kChunksPerRow;
                const int page = __shfl_sync(0xffffffffu, my_page, from);
                const int slot = __shfl_sync(0xffffffffu, my_slot, from);
                const int r = (warp_first + i * Threads) / kChunksPerRow + lane / kChunksPerRow;
                const bool ok = page >= 0 && c < cols_valid;
                const u16 *k_row = k_any, *v_row = v_any;
                if (ok) rows_at(page, slot, k_row, v_row);
                cp_async_16(at(base_k, r, c), ok ? k_row + c : k_any, ok);
                cp_async_16(at(base_v, r, c), ok ? v_row + c : v_any, ok);
            }
        } else {
            // Not unrolled: unrolled, every chunk's look-up and two 64-bit addresses are live at once, and kernels
            // at the register cap spill (92 bytes at d=64 128x128).
#pragma unroll 1
            for (int i = 0; i < (kChunks + Threads - 1) / Threads; ++i) {
                const int idx = tid + i * Threads;
                if (kChunks % Threads == 0 || idx < kChunks) {
                    const int r = idx / kChunksPerRow, c = (idx % kChunksPerRow) * 8;
                    const u16 *k_row = k_any, *v_row = v_any;
                    // (look-up and addresses in one step: with the addresses set after the test of ok, the d=64
                    // 128 x 128 row spilled 72 bytes)
                    const bool ok = [&] {
                        int page, slot;
                        if (!locate(r, page, slot)) return false;
                        rows_at(page, slot, k_row, v_row);
                        return true;
                    }() && c < cols_valid;
                    cp_async_16(at(base_k, r, c), ok ? k_row + c : k_any, ok);
                    cp_async_16(at(base_v, r, c), ok ? v_row + c : v_any, ok);
                }
            }
        }
    }

    // Epilogue of a warp that owns rows [row0, row0 + MTiles*16) of the tile: its fp32 C fragments (times `scale`)
    // are packed into those rows of shared memory, then written to global memory 16 bytes per lane, row by row.
    // Rows at or past `rows_valid` and columns at or past `cols_valid` are not written. Only this warp may use
    // those shared-memory rows meanwhile.
    template <class E, int MTiles, int DTiles>
    static FA2_DEVICE void store_warp_rows(u32 base, const float (&acc)[MTiles][DTiles][4], float scale, int row0,
                                           u16* gmem, int row_stride, int rows_valid, int cols_valid, int lane) {
        static_assert(DTiles * 8 == Cols, "the fragments span the tile's columns");
        __syncwarp();
#pragma unroll
        for (int mt = 0; mt < MTiles; ++mt)
#pragma unroll
            for (int dt = 0; dt < DTiles; ++dt)
#pragma unroll
                for (int half = 0; half < 2; ++half)
                    st_shared_u32(at(base, row0 + mt * 16 + (lane >> 2) + half * 8, dt * 8 + (lane & 3) * 2),
                                  Mma<E>::pack(acc[mt][dt][2 * half] * scale, acc[mt][dt][2 * half + 1] * scale));
        __syncwarp();
        constexpr int kWarpChunks = MTiles * 16 * DTiles;
#pragma unroll
        for (int i = 0; i < (kWarpChunks + 31) / 32; ++i) {
            const int idx = lane + i * 32;
            const int r = idx / DTiles, c = (idx % DTiles) * 8;
            if ((kWarpChunks % 32 == 0 || idx < kWarpChunks) && r < rows_valid && c < cols_valid) {
                u32 chunk[4];
                ld_shared_v4(at(base, row0 + r, c), chunk);
                st_global_v4(gmem + (i64)r * row_stride + c, chunk);
            }
        }
    }

    // A operand (16 rows x 16 k) at (row0, k0) for mma.m16n8k16 — matches the A fragment order.
    static FA2_DEVICE void load_a(u32 (&a)[4], u32 base, int row0, int k0, int lane) {
        ldmatrix_x4(a, at(base, row0 + (lane & 7) + ((lane >> 3) & 1) * 8, k0 + (lane >> 4) * 8));
    }
    // A operand (16 rows x 16 k) at (m0, k0) from a tile stored transposed, [k][m] (dS^T in the backward).
    static FA2_DEVICE void load_a_trans(u32 (&a)[4], u32 base, int m0, int k0, int lane) {
        ldmatrix_x4_trans(a, at(base, k0 + (lane & 7) + (lane >> 4) * 8, m0 + ((lane >> 3) & 1) * 8));
    }
    // B operands for two n8 tiles from a tile stored [n][k] (K in S = Q K^T): b[0..1] n-tile n0, b[2..3] n0+8.
    static FA2_DEVICE void load_b_nk(u32 (&b)[4], u32 base, int n0, int k0, int lane) {
        ldmatrix_x4(b, at(base, n0 + (lane & 7) + (lane >> 4) * 8, k0 + ((lane >> 3) & 1) * 8));
    }
    // B operands for two n8 tiles from a tile stored [k][n] (V in O = P V), transposed by ldmatrix.
    static FA2_DEVICE void load_b_kn(u32 (&b)[4], u32 base, int k0, int n0, int lane) {
        ldmatrix_x4_trans(b, at(base, k0 + (lane & 7) + ((lane >> 3) & 1) * 8, n0 + (lane >> 4) * 8));
    }
};

// ---- warp-level tile products (the steps every attention kernel here is made of) ------------------------------
// Accumulators are mma C fragments: acc[m][n] is the m16 x n8 tile (m, n) of the warp's result.

template <int MTiles, int NTiles>
FA2_DEVICE void zero_fragments(float (&acc)[MTiles][NTiles][4]) {
#pragma unroll
    for (int m = 0; m < MTiles; ++m)
#pragma unroll
        for (int n = 0; n < NTiles; ++n)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[m][n][e] = 0.f;
}

// acc += A B over k in [0, 16 KSteps): load_a(a, m, kk) gives the A fragment of row tile m and k step kk (from
// shared memory or registers), load_b(b, np, kk) the B fragments of n8 tiles 2np and 2np+1 (SmemTile::load_b_nk
// for B stored [n][k], load_b_kn for [k][n]). Each B fragment feeds all MTiles row tiles.
template <class E, int KSteps, int MTiles, int NTiles, class LoadA, class LoadB>
FA2_DEVICE void mma_tiles(float (&acc)[MTiles][NTiles][4], LoadA&& load_a, LoadB&& load_b) {
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk) {
        u32 a[MTiles][4];
#pragma unroll
        for (int m = 0; m < MTiles; ++m) load_a(a[m], m, kk);
#pragma unroll
        for (int np = 0; np < NTiles / 2; ++np) {
            u32 b[4];
            load_b(b, np, kk);
#pragma unroll
            for (int m = 0; m < MTiles; ++m) {
                Mma<E>::run(acc[m][2 * np], a[m], b[0], b[1]);
                Mma<E>::run(acc[m][2 * np + 1], a[m], b[2], b[3]);
            }
        }
    }
}

// Two such products in one pass, acc1 += A1 B1 and acc2 += A2 B2, fragments loaded side by side (the backward's
// S = Q K^T with dP = dO V^T, their transposes, and dV += P^T dO with dK += dS^T Q). load_a(a1, a2, m, kk) and
// load_b(b1, b2, np, kk) fill both.
template <class E, int KSteps, int MTiles, int NTiles, class LoadA, class LoadB>
FA2_DEVICE void mma_tiles_pair(float (&acc1)[MTiles][NTiles][4], float (&acc2)[MTiles][NTiles][4], LoadA&& load_a,
                               LoadB&& load_b) {
#pragma unroll
    for (int kk = 0; kk < KSteps; ++kk) {
        u32 a1[MTiles][4], a2[MTiles][4];
#pragma unroll
        for (int m = 0; m < MTiles; ++m) load_a(a1[m], a2[m], m, kk);
#pragma unroll
        for (int np = 0; np < NTiles / 2; ++np) {
            u32 b1[4], b2[4];
            load_b(b1, b2, np, kk);
#pragma unroll
            for (int m = 0; m < MTiles; ++m) {
                Mma<E>::run(acc1[m][2 * np], a1[m], b1[0], b1[1]);
                Mma<E>::run(acc1[m][2 * np + 1], a1[m], b1[2], b1[3]);
                Mma<E>::run(acc2[m][2 * np], a2[m], b2[0], b2[1]);
                Mma<E>::run(acc2[m][2 * np + 1], a2[m], b2[2], b2[3]);
            }
        }
    }
}

// acc += P B with P straight from C fragments (the previous product, NTiles n8 columns = the k of this one) and
// B from the tile at b_base stored [k][n] (V in O = P V, K in dQ = dS K), transposed by ldmatrix.
template <class E, class BTile, int MTiles, int NTiles, int DTiles>
FA2_DEVICE void mma_c_b(float (&acc)[MTiles][DTiles][4], const float (&p)[MTiles][NTiles][4], u32 b_base, int lane) {
#pragma unroll
    for (int kk = 0; kk < NTiles / 2; ++kk) {
        u32 a[MTiles][4];
#pragma unroll
        for (int m = 0; m < MTiles; ++m) c_to_a<E>(a[m], p[m][2 * kk], p[m][2 * kk + 1]);
#pragma unroll
        for (int dp = 0; dp < DTiles / 2; ++dp) {
            u32 b[4];
            BTile::load_b_kn(b, b_base, kk * 16, dp * 16, lane);
#pragma unroll
            for (int m = 0; m < MTiles; ++m) {
                Mma<E>::run(acc[m][2 * dp], a[m], b[0], b[1]);
                Mma<E>::run(acc[m][2 * dp + 1], a[m], b[2], b[3]);
            }
        }
    }
}

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
// Keeps a value's computation before this point: an empty volatile asm that reads and rewrites it, and volatile
// asm keeps its program order (with wait_for_prior_grids too). For index arithmetic that needs no memory, done while
// a block waits for the kernel before instead of after (ptxas had put nearly all of it after the wait).
template <class T>
FA2_DEVICE void keep_here(T*& p) {
    asm volatile("" : "+l"(p));
}
FA2_DEVICE void keep_here(int& x) { asm volatile("" : "+r"(x)); }
// Lets the next kernel in the stream start its launch now (it waits for this one in wait_for_prior_grids): its
// blocks take SMs as this kernel's blocks leave them, instead of after the last one has finished.
FA2_DEVICE void allow_next_grid() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// ---- Hopper (sm_90a): mbarriers, warpgroup MMA ------------------------------------------------------------
// Used only by cuda/fwd_hopper.cu and cuda/bwd_hopper.cu, compiled for sm_90a alone; nothing here is emitted
// elsewhere.
//
// mbarrier: a 64-bit shared-memory word counting arrivals per phase. A waiter names the parity of the phase it
// waits for; a fresh barrier is in phase 0, so waiting on parity 1 returns at once (a producer's first wait for
// an empty slot).
FA2_DEVICE void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
FA2_DEVICE void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
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
// A named barrier (ids 1-15; 0 is __syncthreads'): waits for `threads` arrivals, its own included.
FA2_DEVICE void named_barrier_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's view of shared memory written through the generic proxy (cp.async, st.shared) before
// the tensor cores read it through the async proxy (wgmma operands).
FA2_DEVICE void fence_proxy_async_smem() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// One arrival on `bar` once this thread's cp.async writes have landed and been fenced over to the async proxy, so
// that the threads waiting on `bar` read them with wgmma without a fence of their own. The thread waits for the
// copies here: for the rare tile (a varlen sequence's ragged one) beside tiles that come by TMA.
FA2_DEVICE void cp_async_fenced_arrive(u32 bar) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    fence_proxy_async_smem();
    mbar_arrive(bar);
}

// Bulk reduction from shared to global memory (no tensor map): `bytes` (a multiple of 16, both addresses 16-byte
// aligned) of fp32 added element-wise at `dst`, asynchronously. The shared memory must be written and made visible
// to the async proxy (fence_proxy_async_smem, then a barrier) before; wait_read before it is rewritten.
FA2_DEVICE void bulk_reduce_add_f32(float* dst, u32 src, u32 bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(dst), "r"(src),
                 "r"(bytes)
                 : "memory");
}
// Tensor maps (TMA): a CUtensorMap encoded on the host (fa2cupy/tensor_maps.py) and passed by value as a
// __grid_constant__ kernel parameter, which the copies name by its generic address. Four dimensions, innermost
// first: the head dim's columns, the head, the row, the batch row; boxes of 64 columns (128 bytes, the 128-byte
// swizzle of SwizzledSlabs: a slab per box) and a tile's rows.
struct alignas(64) TensorMap {
    unsigned long long opaque[16];
};
// One box of `map` at (column, head, row, batch) into shared memory at `dst` (1024-byte aligned for the swizzle),
// its bytes counted on mbarrier `bar` (rows outside the tensor read as zeros).
FA2_DEVICE void tma_load(u32 dst, const TensorMap& map, int column, int head, int row, int batch, u32 bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
        "l"(reinterpret_cast<u64>(&map)), "r"(column), "r"(head), "r"(row), "r"(batch), "r"(bar)
        : "memory");
}
// One box of shared memory at `src` out to `map` at (column, head, row, batch), in this thread's bulk group (rows
// outside the tensor are not written). src written by ordinary stores: fence_proxy_async_smem and a barrier first.
FA2_DEVICE void tma_store(const TensorMap& map, int column, int head, int row, int batch, u32 src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];\n" ::"l"(
                     reinterpret_cast<u64>(&map)),
                 "r"(column), "r"(head), "r"(row), "r"(batch), "r"(src)
                 : "memory");
}
// `Arrivals` arrivals on `bar` (one thread standing in for others where the barrier counts every copying thread)
// that also expect `bytes` more of copies (tma_load) in its current phase.
template <u32 Arrivals = 1>
FA2_DEVICE void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    if constexpr (Arrivals == 1) {
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
    } else {
        asm volatile("mbarrier.expect_tx.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
        asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "n"(Arrivals) : "memory");
    }
}
FA2_DEVICE void bulk_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
FA2_DEVICE void bulk_wait_read() {  // this thread's bulk groups but the last N have read their shared memory
    asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
FA2_DEVICE void bulk_wait() {  // ... and completed
    asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}

// wgmma: issued by the 4 warps of a warpgroup together, asynchronous until wait_group. fence before the first
// wgmma that reads registers written by ordinary instructions (accumulators rescaled by the softmax, A fragments).
FA2_DEVICE void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
FA2_DEVICE void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
FA2_DEVICE void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// The compiler sees a wgmma as finished when its asm statement ends; this pins registers an in-flight wgmma
// reads or writes until after wgmma_wait (no move, no reuse across it).
template <int A, int B, int C>
FA2_DEVICE void pin_registers(float (&x)[A][B][C]) {
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
        for (int j = 0; j < B; ++j)
#pragma unroll
            for (int k = 0; k < C; ++k) asm volatile("" : "+f"(x[i][j][k])::"memory");
}
template <int A, int B>
FA2_DEVICE void pin_registers(u32 (&x)[A][B]) {
#pragma unroll
    for (int i = 0; i < A; ++i)
#pragma unroll
        for (int j = 0; j < B; ++j) asm volatile("" : "+r"(x[i][j])::"memory");
}

// Shared-memory matrix descriptor for the 128-byte swizzle (PTX ISA, "Matrix Descriptor Format"): operands are
// stored as slabs of 64 16-bit columns, each row of a slab 128 bytes with its 16-byte chunk c at c ^ (row % 8)
// (SwizzledSlabs below), slabs 1024-byte aligned. K-major operands (Q, K): rows 8 apart at 1024 bytes (stride
// byte offset), the leading offset unused; a k16 step inside a slab moves the start by 32 bytes. MN-major (V as
// the B of P V, N = head dim): the next 64 columns at `leading` bytes (the next slab), 8 keys at 1024 bytes.
FA2_DEVICE u64 smem_desc_sw128(u32 addr, u32 leading) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)((leading & 0x3FFFF) >> 4) << 16) | ((u64)(1024 >> 4) << 32) |
           (1ull << 62);
}

// d (+)= A B on tensor cores, m64nNk16, fp32 accumulators in the mma C-fragment layout of each warp's 16 rows
// (d[0][n8 tile][4], as OnlineSoftmax holds scores). ss: A and B from shared memory, both K-major; accumulate 0
// overwrites d. ss_mn: both MN-major in shared memory (the backward's dQ = dS K from dS^T and K as stored).
// rs_mn: A from registers (each warp's m16k16 A fragment, c_to_a), B MN-major in shared memory.
template <class E, int N>
struct Wgmma;
#define FA2_WGMMA_ACC4(i) "+f"(d[0][i][0]), "+f"(d[0][i][1]), "+f"(d[0][i][2]), "+f"(d[0][i][3])
#define FA2_WGMMA_ACC_N64 FA2_WGMMA_ACC4(0), FA2_WGMMA_ACC4(1), FA2_WGMMA_ACC4(2), FA2_WGMMA_ACC4(3), FA2_WGMMA_ACC4(4), FA2_WGMMA_ACC4(5), FA2_WGMMA_ACC4(6), FA2_WGMMA_ACC4(7)
#define FA2_WGMMA_ACC_N128 FA2_WGMMA_ACC_N64, FA2_WGMMA_ACC4(8), FA2_WGMMA_ACC4(9), FA2_WGMMA_ACC4(10), FA2_WGMMA_ACC4(11), FA2_WGMMA_ACC4(12), FA2_WGMMA_ACC4(13), FA2_WGMMA_ACC4(14), FA2_WGMMA_ACC4(15)
// One specialisation per (type, N): the accumulator operands are N / 2 registers, listed by ACC; DREGS names them
// in the instruction; SS_OPS / RS_OPS are the operands after them, SS_PRED / RS_PRED the accumulate flag's.
// FA2_WGMMA_SS writes one shared-memory form, its operands' majors given by TRANS (imm-trans-a, imm-trans-b); the
// accumulator operands come last, as they expand to a list.
#define FA2_WGMMA_SS(NAME, TRANS, TY, N, DREGS, SS_OPS, SS_PRED, ...)                                              \
    static FA2_DEVICE void NAME(float (&d)[1][N / 8][4], u64 desc_a, u64 desc_b, int accumulate) {                 \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " SS_PRED ", 0;\n"                                          \
                     "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " DREGS ", " SS_OPS           \
                     ", p, 1, 1, " TRANS ";\n}\n"                                                                  \
                     : __VA_ARGS__                                                                                 \
                     : "l"(desc_a), "l"(desc_b), "r"(accumulate));                                                 \
    }
#define FA2_WGMMA_M64(TY, N, DREGS, ACC, SS_OPS, SS_PRED, RS_OPS, RS_PRED)                                          \
    template <>                                                                                                    \
    struct Wgmma<TY, N> {                                                                                          \
        FA2_WGMMA_SS(ss, "0, 0", TY, N, DREGS, SS_OPS, SS_PRED, ACC)                                               \
        FA2_WGMMA_SS(ss_mn, "1, 1", TY, N, DREGS, SS_OPS, SS_PRED, ACC)                                            \
        static FA2_DEVICE void rs_mn(float (&d)[1][N / 8][4], const u32 (&a)[4], u64 desc_b, int accumulate) {     \
            asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " RS_PRED ", 0;\n"                                      \
                         "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." #TY "." #TY " " DREGS ", " RS_OPS       \
                         ", p, 1, 1, 1;\n}\n"                                                                      \
                         : ACC                                                                                     \
                         : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate));              \
        }                                                                                                          \
    };
FA2_WGMMA_M64(bf16, 64, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", FA2_WGMMA_ACC_N64, "%32, %33", "%34",
              "{%32, %33, %34, %35}, %36", "%37")
FA2_WGMMA_M64(f16, 64, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}", FA2_WGMMA_ACC_N64, "%32, %33", "%34",
              "{%32, %33, %34, %35}, %36", "%37")
FA2_WGMMA_M64(bf16, 128, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", FA2_WGMMA_ACC_N128, "%64, %65", "%66",
              "{%64, %65, %66, %67}, %68", "%69")
FA2_WGMMA_M64(f16, 128, "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}", FA2_WGMMA_ACC_N128, "%64, %65", "%66",
              "{%64, %65, %66, %67}, %68", "%69")
#undef FA2_WGMMA_M64
#undef FA2_WGMMA_SS
#undef FA2_WGMMA_ACC_N128
#undef FA2_WGMMA_ACC_N64
#undef FA2_WGMMA_ACC4

// A tile of Rows x Cols 16-bit elements as the 128-byte-swizzle slabs wgmma reads (Cols a multiple of 64):
// slab s holds columns 64s..64s+63 of every row, row r at r * 128 bytes, its chunk c (8 columns) at c ^ (r % 8).
template <int Rows, int Cols>
struct SwizzledSlabs {
    static_assert(Cols % 64 == 0 && Rows % 8 == 0, "whole 64-column slabs of 8-row atoms");
    static constexpr int kSlabs = Cols / 64, kRowBytes = 128, kSlabBytes = Rows * kRowBytes,
                         kBytes = kSlabs * kSlabBytes;
    static FA2_DEVICE u32 at(u32 base, int r, int c) {
        return base + (c >> 6) * kSlabBytes + r * kRowBytes + ((((c >> 3) & 7) ^ (r & 7)) << 4);
    }
};

// A tile of SwizzledSlabs from `map`'s rows `row` .. (its box's rows) of (head, batch): one TMA box per slab, its
// bytes counted on `bar`. (The 128-byte swizzle of a box of 64 columns is the slabs' own.)
template <class Tile>
FA2_DEVICE void tma_load_tile(u32 dst, const TensorMap& map, int head, int row, int batch, u32 bar) {
    for (int slab = 0; slab < Tile::kSlabs; ++slab)
        tma_load(dst + slab * Tile::kSlabBytes, map, 64 * slab, head, row, batch, bar);
}

// A tile of SwizzledSlabs at `src` out to `map`'s rows `row` .. (its box's rows) of (head, batch): one TMA store per
// slab, in one bulk group (rows outside the tensor are not written).
template <class Tile>
FA2_DEVICE void tma_store_tile(const TensorMap& map, int head, int row, int batch, u32 src) {
    for (int slab = 0; slab < Tile::kSlabs; ++slab)
        tma_store(map, 64 * slab, head, row, batch, src + slab * Tile::kSlabBytes);
    bulk_commit();
}

// A producer warpgroup's share of copying tiles of Cols-wide rows into SwizzledSlabs (cp.async): thread `ptid` of
// Threads copies one 16-byte column chunk of every kRowStep-th row, a multiple of 8 rows apart, so its swizzled
// position within a row is the same for all of them and its addresses advance by constants.
template <int Threads, int Cols>
struct SlabLoader {
    static constexpr int kChunksPerRow = Cols / 8, kRowStep = Threads / kChunksPerRow;
    static_assert(kRowStep % 8 == 0, "a thread's rows share one swizzle phase");
    int first_row, column;
    FA2_DEVICE explicit SlabLoader(int ptid) : first_row(ptid / kChunksPerRow), column(ptid % kChunksPerRow * 8) {}
    // Tile's rows of `src` (row_stride elements apart) into the tile at `dst`, zeros from row `valid` on.
    template <class Tile>
    FA2_DEVICE void load(u32 dst, const u16* src, int row_stride, int valid) const {
        constexpr int kRows = Tile::kBytes / (Cols * 2);
        u32 to = Tile::at(dst, first_row, column);
        const u16* from = src + (i64)first_row * row_stride + column;
        const i64 step = (i64)kRowStep * row_stride;
#pragma unroll 4  // (4 copies in flight per thread)
        for (int row = first_row; row < kRows; row += kRowStep, to += kRowStep * Tile::kRowBytes, from += step)
            cp_async_16(to, row < valid ? from : src, row < valid);
    }
    // Paged K/V: a tile's rows gathered from pages. Lane j of producer warp w holds the address of row 32 w + j
    // (null: zero-filled), and the warp copies its 32 rows 4 at a time, 8 lanes a row, each row's address handed
    // round by a shuffle: so every copy instruction reads 128 contiguous bytes of each of 4 rows (whole lines, as
    // the packed loader's 256 of 2). Copies of fewer bytes from more rows cost the LSU a pass per line: 32 bytes of
    // 16 rows an instruction held paged calls at ~0.85x packed speed, one row per copy with its page worked out
    // each time (~40 instructions a copy) at ~0.6x.
    template <class Tile>
    FA2_DEVICE void load_paged_rows(u32 dst, const u16* row, const u16* any, int warp, int lane) const {
        static_assert(Tile::kBytes / (Cols * 2) == Threads && Threads % 32 == 0, "a warp's 32 rows");
        const int chunk = lane % 8;
#pragma unroll
        for (int g = 0; g < 8; ++g) {
            const u16* src = reinterpret_cast<const u16*>(
                __shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(row), 4 * g + lane / 8));
            const bool ok = src != nullptr;
            src = opaque((ok ? src : any) + 8 * chunk);  // (each copy's source: this register plus a constant)
#pragma unroll
            for (int s = 0; s < Cols / 64; ++s)
                cp_async_16(Tile::at(dst, 32 * warp + 4 * g + lane / 8, 64 * s + 8 * chunk), src + 64 * s, ok);
        }
    }
};

}  // namespace fa2
