// The kernels' parameters: one struct per kernel family, passed by value as a `const __grid_constant__` kernel
// parameter (taking an address, as the TMA copies do of a tensor map, makes no local copy).
//
// fa2cupy/params.py mirrors every struct field by field (a ctypes.Structure of the same names and types); the
// launches set the fields by name (build.Launch) and tests/test_params.py compiles a probe that checks each field's
// offset and size and each struct's size against the mirror. A field added here goes into the mirror too.
//
// Each struct lists the per-call arrays first, then the fixed device pointers, the element strides, the sizes, the
// options, and last the per-call values. Every per-call field is 64 bits wide (pointers, the dropout seed and offset
// as the 64-bit numbers they are, decode's fixed length), so that a call writes each with one store. Strides are in
// elements; a (batch, row, head) stride triple is (i64, int, i64), as the index arithmetic takes it.
//
// A kernel reads its fields in place (`const BwdParams& params = kernel_params;`) or through a local copy (`const
// FwdParams params = kernel_params;`, which the compiler dissolves into one value per field used), whichever
// compiled to fewer registers: with separate kernel arguments the compiler reloaded a parameter wherever it was
// cheaper than holding it, and the fields of one struct are loaded, merged and moved like any other values (read in
// place, 90 of the forward's 193 sm_90 instantiations took more registers and 4 spilled; through a copy, the
// backward's dK/dV kernel at d=160 spilled), or, where the two ran apart, whichever ran faster (the dK/dV kernel at
// d=256, through common/types.cuh's ParamsView). A pointer the kernels read or write through plain loads and stores
// is copied into a __restrict__ local (a struct member's __restrict__ means nothing to the compiler).
#pragma once
#include "common/types.cuh"

namespace fa2 {

// flash_fwd (fwd.cu), and the common part of the Hopper forward's (FwdHopperParams).
// q, o: (batch, seqlen_q, nheads, d), k, v: (batch, seqlen_k, nheads_kv, d) (paged: (num_pages, page_size,
// nheads_kv, d)); lse: (batch, nheads, seqlen_q) float32 (varlen: (nheads, total_q)).
struct FwdParams {
    // The arrays, per call (null where absent).
    const u16* q;
    const u16* k;
    const u16* v;
    u16* o;
    float* lse;
    const int* cu_seqlens_q;  // varlen: the sequences' first rows
    const int* cu_seqlens_k;
    const float* alibi_slopes;  // (batch, nheads) or (nheads,) float32
    const u32* rng_state;       // {seed lo, seed hi, offset lo, offset hi} in device memory, read instead of
                                // seed and offset
    const int* block_table;     // paged K/V: (batch, max_pages) int32
    // The device's error report (common/errors.cuh).
    int* error_claim;
    long long* error_host;
    i64 q_batch_stride;
    int q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;  // (paged: the page stride)
    int k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    int v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    int o_row_stride;
    i64 o_head_stride;
    i64 lse_batch_stride;
    i64 lse_head_stride;
    int max_seqlen_q;  // padded calls: the lengths; varlen: the largest, which the grid was sized for
    int max_seqlen_k;
    int nheads;
    int heads_per_kv;  // query heads per K/V head (MQA/GQA)
    int headdim;       // the real head dim (a multiple of 8, at most the instantiation's)
    int headdim_v;     // v's and o's (the Hopper forward's varlen ragged copies and stores; headdim where they agree)
    int total_q;       // varlen: the rows of q and of k/v (paged: 2**31 - 1)
    int total_k;
    int window_left;  // the mask's window (masks.cuh, WindowMask)
    int window_right;
    float scale;
    float scale_log2;  // scale * log2(e)
    float softcap;     // 0: none
    int alibi_batch_stride;
    u32 dropout_threshold;  // keep iff the 8-bit draw is below it; 0: no dropout
    float dropout_scale;    // 256 / threshold, the scale of the kept scores
    int page_size;          // paged K/V
    u32 page_magic;         // page_size's FastDiv
    int page_shift;
    int max_pages;
    int num_pages;
    // The dropout seed and offset, per call (unless rng_state).
    u64 seed;
    u64 offset;
};

// flash_fwd_hopper (hopper/fwd.cu): the forward's parameters, the persistent grid's and the tensor maps of q, k, v
// and o (fa2cupy/tensor_maps.py; paged calls have no K or V map).
struct FwdHopperParams {
    FwdParams fwd;
    int batch;            // the work items' batch rows (the persistent grid's size does not say)
    int heads_per_group;  // heads per L2 group of the tile counter's order (hopper/scheduler.cuh)
    int* tile_counter;    // per call: zeroed before the launch, or null for the grid stride
    // Softcap and ALiBi (HopperFwdTraits::kMods): UnitModsConstants' fields (attention/masks.cuh)
    float mods_unit;
    float mods_unit_inv;
    int tail_heads;       // heads of the tile counter's last group (hopper/scheduler.cuh)
    TensorMap tmap_q;     // per call, as the pointers
    TensorMap tmap_k;
    TensorMap tmap_v;
    TensorMap tmap_o;
};

// The mma.sync backward (bwd.cu: bwd_preprocess, bwd_dkdv, bwd_dq, bwd_convert_dq, bwd_zero_tail), one struct for
// the family: each launch's per-call fields are the pointers its kernel reads. The row statistics (lse, dsum) and
// the fp32 dQ accumulator share one layout (stat strides, bwd.cu).
struct BwdParams {
    // The arrays, per call (null where absent).
    const u16* q;
    const u16* k;
    const u16* v;
    const u16* out;
    const u16* dout;
    const float* lse;
    float* dsum;
    float* dq_accum;  // fp32, dq_pitch floats per row; null: deterministic (bwd_dq)
    u16* dq;
    u16* dk;
    u16* dv;
    const int* cu_seqlens_q;
    const int* cu_seqlens_k;
    const float* alibi_slopes;
    const u32* rng_state;
    int* error_claim;
    long long* error_host;
    i64 q_batch_stride;
    int q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;
    int k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    int v_row_stride;
    i64 v_head_stride;
    i64 o_batch_stride;
    int o_row_stride;
    i64 o_head_stride;
    i64 do_batch_stride;
    int do_row_stride;
    i64 do_head_stride;
    i64 dq_batch_stride;
    int dq_row_stride;
    i64 dq_head_stride;
    i64 dk_batch_stride;
    int dk_row_stride;
    i64 dk_head_stride;
    i64 dv_batch_stride;
    int dv_row_stride;
    i64 dv_head_stride;
    i64 stat_batch_stride;
    i64 stat_head_stride;
    int max_seqlen_q;
    int max_seqlen_k;
    int nheads;
    int heads_per_kv;
    int headdim;
    int headdim_v;     // v's, dout's, out's (the Hopper dK/dV kernel's varlen ragged copies; headdim where equal)
    int total_q;
    int total_k;
    int batch;         // bwd_zero_tail: the sequences
    int q_row_elems;   // bwd_zero_tail: elements per row of dq, and of dk and dv
    int kv_row_elems;
    int dq_pitch;      // floats per row of the dQ accumulator
    int lanes;         // bwd_preprocess: lanes per row
    int window_left;
    int window_right;
    float scale;
    float scale_log2;
    float softcap;
    int alibi_batch_stride;
    u32 dropout_threshold;
    float dropout_scale;
    u64 seed;  // per call, as the forward's
    u64 offset;
    // bwd_convert_dq after the Hopper dK/dV kernel: per call, that kernel's count of completed additions per
    // (batch, head, query tile of arrival_block_m rows), which the conversion waits for tile by tile (null: it
    // waits for the whole kernel); and the key tiles (arrival_block_n keys) whose blocks add to each query tile.
    int* dq_arrivals;
    int arrival_block_m;
    int arrival_block_n;
};

// bwd_dkdv_hopper (hopper/bwd.cu): the backward's parameters and the tensor maps of q, k, v and dout.
struct BwdHopperParams {
    BwdParams bwd;
    int group_chunk;  // (kv head, batch) groups whose blocks launch key tile by key tile (bwd_dkdv_hopper)
    int dq_rotate;    // walks without a mask rotate (the kernels with HopperBwdTraits::kRotates); deterministic
                      // ones only where a group's blocks fit on the GPU at once
    int deterministic;  // dQ added to each query tile in turns (dq_semaphore: the turn flags)
    int dq_by_map;      // whole query tiles' dQ added through tmap_dq (calls narrower than the kernel's head dim)
    // per call, deterministic or counted (BwdParams::dq_arrivals): a zeroed int per (batch, head, query tile), which
    // counts the tile's completed additions (deterministic: HopperBwdTraits::kTurnPlanes planes of them); else null
    int* dq_semaphore;
    TensorMap tmap_q;  // per call, as the pointers
    TensorMap tmap_k;
    TensorMap tmap_v;
    TensorMap tmap_do;
    // per call: dq_accum as (BwdParams::headdim columns, rows of dq_pitch floats), for the dQ reductions of whole
    // query tiles (dq_by_map; else never encoded)
    TensorMap tmap_dq;
};

// The decode family (decode.cu: decode_attention, kvcache_append, rotary_q). q: (batch, seqlen_q, nheads, d) (the
// attention's: the rotated copy where rotary_q wrote one), k_new/v_new: (batch, seqlen_new, nheads_kv, d), caches
// (cache_rows, capacity, nheads_kv, d) or paged (pages, page_size, nheads_kv, d).
struct DecodeParams {
    // The arrays, per call (null where absent).
    const u16* q;
    u16* k_cache;  // (written by kvcache_append)
    u16* v_cache;
    const u16* k_new;
    const u16* v_new;
    const int* block_table;
    const int* cache_seqlens;  // null: fixed_seqlen for every row
    const int* cache_batch_idx;
    const int* cache_leftpad;
    const u16* rotary_cos;
    const u16* rotary_sin;
    const float* alibi_slopes;
    u16* out;
    float* lse_out;
    u16* q_rotated;      // rotary_q's output
    float* partial_out;  // split-KV workspace: (splits, rows, d) fp32, (splits, rows) fp32, arrival counters
    float* partial_lse;
    int* arrivals;
    int* error_claim;  // per call: the current device's
    long long* error_host;
    i64 q_batch_stride;
    int q_row_stride;
    i64 q_head_stride;
    i64 k_batch_stride;  // the caches'
    int k_row_stride;
    i64 k_head_stride;
    i64 v_batch_stride;
    int v_row_stride;
    i64 v_head_stride;
    i64 k_new_batch_stride;
    int k_new_row_stride;
    i64 k_new_head_stride;
    i64 v_new_batch_stride;
    int v_new_row_stride;
    i64 v_new_head_stride;
    i64 alibi_batch_stride;
    int batch;
    int seqlen_q;
    int nheads;
    int nheads_kv;
    int heads_per_kv;
    int headdim;    // q's and k's
    int headdim_v;  // v's and the output's (at most the instantiation's, as headdim)
    int seqlen_new;
    int capacity;
    int cache_rows;
    int page_size;  // 0: contiguous cache
    int max_pages;
    float scale;
    float scale_log2;
    int window_left;  // kUnlimitedWindow: no limit
    int window_right;
    float softcap;
    int rotary_dim;  // 0: no rotary embedding
    int seqlen_ro;
    int rotary_interleaved;
    int rotary_advance;  // rotary_q: query t of a row at position cache_seqlens + t (else cache_seqlens)
    int q_span;          // kvcache_append: the positions rotary_q rotates from cache_seqlens on (checked)
    int num_splits;
    // The FastDiv divisors of the attention's index arithmetic.
    u32 splits_magic;
    int splits_shift;
    u32 groups_magic;
    int groups_shift;
    u32 heads_kv_magic;
    int heads_kv_shift;
    u32 heads_per_kv_magic;
    int heads_per_kv_shift;
    u32 page_size_magic;
    int page_size_shift;
    int programmatic;           // launched with programmatic stream serialization (sm_90)
    int stream_larger_than_l2;  // K/V copies under evict-first
    i64 fixed_seqlen;           // per call: every row's length where cache_seqlens is null (an int)
};

// merge_states (decode.cu): parts (n, rows, d), lses (n, rows), out (rows, d), lse_out (rows,).
struct MergeParams {
    const void* parts;  // per call
    const float* lses;
    u16* out;
    float* lse_out;
    i64 rows;
    int n;
    int headdim;
};

// dropout_keep_mask (fwd.cu): the keep mask (batch * nheads, seqlen_q, seqlen_k) uint8.
struct DropoutMaskParams {
    unsigned char* mask;  // per call
    int seqlen_q;
    int seqlen_k;
    int nheads;
    u32 threshold;
    u64 seed;  // per call
    u64 offset;
};

}  // namespace fa2
