// Warp-level tile products on mma.sync: the steps every mma.sync attention kernel here is made of.
#pragma once
#include "common/types.cuh"
#include "sm80/mma.cuh"

namespace fa2 {

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

}  // namespace fa2
