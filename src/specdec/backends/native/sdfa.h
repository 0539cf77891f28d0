/* sdfa: specdec's flash attention for a q8_0 K cache and an f16 V cache, one walk of the cache
 * for many query rows, and batch-invariant by construction.
 *
 * Why: ggml's CPU flash attention walks the KV cache once per query row and head, with a
 * scalar exp and one dot product reduced per position; a verify of b tokens over c cached
 * positions pays b x heads walks. Here the rows sharing a KV head (its query heads, for every
 * token of the pass) walk the cache together, up to SDFA_MAX_ROWS at a time: each block of
 * positions is read once (its values converted to f32), then taken by every tile of W rows (W =
 * 16 on AVX-512, 8 on AVX2), one SIMD lane per row for the scores (a tile of at most 8 rows on
 * AVX-512 takes them in 8-lane registers: a single step's 6 or 7 rows would leave most of 16
 * idle).
 *
 * Each row's arithmetic is fixed whatever the tile, the walk, the batch or the instruction set:
 *   query  quantized once per walk as a q8_0 key is (sdfa_quantize_query): per 32 values c,
 *          dq_c = max|q| / 127 and qq = nearbyint(q * (1 / dq_c)), int8 in [-127, 127];
 *   score  s_p = fma(sum_c fma(I_pc, dq_c * dk_pc, .), scale, mask_p), the sum over the blocks c
 *          in order from 0, where I_pc = sum of qq * k over block c is an exact integer (|I| <
 *          2^20; VNNI's vpdpbusd on AVX-512, maddubs and madd on AVX2) and dk_pc is the key
 *          block's f16 scale. ggml's CPU attention takes the dot of a q8_0 key in int8 alike
 *          (the query in q8_0 per 32 values); 4 products a lane per instruction instead of 1;
 *   blocks of P = 16 positions from position 0: M' = max(M, max_j s_j), alpha = exp(M - M'),
 *          p_j = exp(s_j - M') (0 where s_j or M' is -inf), S = S*alpha + p_0 + p_1 + ...,
 *          acc = acc*alpha, then acc = fma(p_j, v_j, acc) for j in order (v in f32);
 *   output acc * (1 / S) + 0.
 * exp is sdfa's own (Cody-Waite reduction and a degree-5 polynomial, SDFA_EXP_* below, the same
 * operations on every path). Positions past the cache or masked to -inf add exactly nothing (but
 * for a zero's sign, which the final + 0 makes +0 on every path), so a single step and a row of a
 * batch, whose caches end in different places, get the same bits, and a tile's walk may stop
 * after the last position its rows see.
 */
#pragma once

#include "sd-isa.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ggml's block_q8_0 (ggml-common.h), mirrored so that the kernels build without ggml: a K row
 * is d/32 of them */
typedef struct {
    uint16_t d; /* f16 scale */
    int8_t qs[32];
} sdfa_block_q8_0;

#define SDFA_P 16       /* positions per softmax block */
#define SDFA_F16_NEG_INF 0xFC00 /* a mask's -inf, as f16 bits */
#define SDFA_MAX_D 256  /* largest head dimension (DK = DV) */
#define SDFA_MAX_ROWS 64 /* rows per walk: 8 tiles on AVX2, 4 on AVX-512 */

/* sdfa's exp(x), Cephes' expf (cephes/single/expf.c): n = round(x * log2 e), r = x - n ln 2 in two
 * steps (ln 2 = LN2_HI + LN2_LO, LN2_HI exact in 9 bits so n * LN2_HI is exact), then
 * e^r ~ 1 + r + r^2 (P0 + P1 r + ... + P5 r^5) (Horner), times 2^n; 0 below MIN (e^x < 2^-125,
 * where 2^n leaves the normal range). */
#define SDFA_EXP_LOG2E 1.44269504088896341f
#define SDFA_EXP_LN2_HI 0.693359375f
#define SDFA_EXP_LN2_LO (-2.12194440e-4f)
#define SDFA_EXP_P5 1.9875691500e-4f
#define SDFA_EXP_P4 1.3981999507e-3f
#define SDFA_EXP_P3 8.3334519073e-3f
#define SDFA_EXP_P2 4.1665795894e-2f
#define SDFA_EXP_P1 1.6666665459e-1f
#define SDFA_EXP_P0 5.0000001201e-1f
#define SDFA_EXP_MIN (-87.0f)

/* The query's quantization for the scores (above), the same function on every path: qq[i] for
 * i < d and dq[c] for c < d / 32. A block with a NaN or an infinity gets dq = NaN (so its scores
 * are NaN, as a float dot's would be) and qq = 0; an all-zero block dq = 0 and qq = 0. */
void sdfa_quantize_query(const float * q, int d, int8_t * qq, float * dq);

/* One walk: query rows against one KV head. */
typedef struct {
    int d;                      /* head dimension of K, V and the queries: 32 <= d <= 256, d % 32
                                   == 0 (a K row is whole q8_0 blocks) */
    int n_kv;                   /* cached positions */
    float scale;                /* KQ scale (1/sqrt(d) for these models) */
    const void * k;             /* q8_0 rows: position p at (char *) k + p * k_stride */
    size_t k_stride;
    const uint16_t * v;         /* f16 rows: position p at (char *) v + p * v_stride */
    size_t v_stride;
    int rows;                   /* rows in this walk, 1..SDFA_MAX_ROWS */
    const float * q[SDFA_MAX_ROWS];       /* row r's f32 query (d values) */
    const uint16_t * mask[SDFA_MAX_ROWS]; /* row r's f16 mask over positions (NULL: no mask; rows
                                             of one token share theirs) */
    float * out[SDFA_MAX_ROWS];           /* row r's output (d values) */
} sdfa_walk;

/* sdfa's paths (enum sd_isa): can this CPU run `isa` (every feature of its list in sd-isa.h;
 * its AVX-512 path needs VNNI, as sdmm's does: an AVX-512 CPU without it runs AVX2's), the one
 * it runs (sd_isa_select: $SPECDEC_MM_ISA forces sdmm and sdfa alike, else the best; -1 if the
 * named one cannot run here), and the kernels. */
int sdfa_isa_supported(int isa);
int sdfa_isa_selected(void);
typedef void (*sdfa_kernel_fn)(const sdfa_walk * t);
sdfa_kernel_fn sdfa_kernel(int isa);
void sdfa_kernel_ref(const sdfa_walk * t);
void sdfa_kernel_avx2(const sdfa_walk * t);
void sdfa_kernel_avx512(const sdfa_walk * t);

/* For tests: attention of `rows` query rows (row r's query at q + r*d) against one KV head, in
 * walks of `walk` rows (1..SDFA_MAX_ROWS); row r's mask row at mask + (r / group)*n_kv, the same
 * pointer for each `group` rows as for a token's query heads, or none; out: rows x d. */
int sdfa_attend(int isa, int d, int n_kv, float scale, const void * k, size_t k_stride,
                const uint16_t * v, size_t v_stride, const float * q, const uint16_t * mask,
                int group, int rows, int walk, float * out);

#ifdef __cplusplus
}
#endif
