/* sdfa's SIMD kernel, written once for SD_VL lanes (sd-simd.h): a walk's rows in tiles of SD_VL,
 * a tile's rows in the lanes of one vector for the scores and the softmax, each row's output in
 * d/SD_VL vectors for the V sum.
 * The arithmetic is sdfa.h's, operation for operation (sdfa.c's reference spells it out), so the
 * AVX2 (sdfa-avx2.c) and AVX-512 (sdfa-avx512.c) instances give the same bits. Include it with
 * SD_VL defined, inside the file's SD_TARGET_PUSH. */
#pragma once

#include "sd-simd.h"
#include "sdfa.h"

#include <math.h>

/* sdfa's exp (sdfa.c: sdfa_exp), lane by lane */
SD_INLINE vfloat sdfa_exp_v(vfloat x) {
    const vmask ok = vf_ge(x, vf_set1(SDFA_EXP_MIN));
    const vfloat n = vf_round(vf_mul(x, vf_set1(SDFA_EXP_LOG2E)));
    vfloat r = vf_fmadd(n, vf_set1(-SDFA_EXP_LN2_HI), x);
    r = vf_fmadd(n, vf_set1(-SDFA_EXP_LN2_LO), r);
    vfloat y = vf_set1(SDFA_EXP_P5);
    y = vf_fmadd(y, r, vf_set1(SDFA_EXP_P4));
    y = vf_fmadd(y, r, vf_set1(SDFA_EXP_P3));
    y = vf_fmadd(y, r, vf_set1(SDFA_EXP_P2));
    y = vf_fmadd(y, r, vf_set1(SDFA_EXP_P1));
    y = vf_fmadd(y, r, vf_set1(SDFA_EXP_P0));
    y = vf_fmadd(y, vf_mul(r, r), r);
    y = vf_add(y, vf_set1(1.0f));
    const vint e = vi_slli32(vi_add32(vf_to_i32(n), vi_set1_32(127)), 23);
    return vf_maskz(ok, vf_mul(y, vf_as_bits(e)));
}

/* Positions before the last one some row of `rows` sees (its mask is not -inf there): past it
 * every block is masked for each of them and would add exactly nothing (sdfa.h), so their walk
 * stops there. llama.cpp pads the cache it attends over to a multiple of 256 cells, masked. */
SD_INLINE int sdfa_live(const uint16_t * const * mask, int rows, int n_kv) {
    int live = 0;
    for (int r = 0; r < rows; r++) {
        if (mask[r] == NULL) {
            return n_kv;
        }
        if (r > 0 && mask[r] == mask[r - 1]) { /* a token's query heads: one mask row */
            continue;
        }
        int p = n_kv;
        while (p > live && mask[r][p - 1] == SDFA_F16_NEG_INF) {
            p--;
        }
        live = p;
    }
    return live;
}

/* Positions per register block of the scores (their integer dots in registers, SDFA_JB of them,
 * the scores themselves in memory) and lane-vectors per block of a row's V sum. */
enum { SDFA_JB = 8, SDFA_CB = 8, SDFA_TILES = SDFA_MAX_ROWS / SD_VL };

/* A tile's mask, lanes = rows: rows sharing a mask row (the query heads of one token) are a run
 * whose block of values is converted once and broadcast, each later run blended over the lanes
 * from its first row on; a tile of more runs than this (or with a row without a mask) fills its
 * lanes one by one. */
#define SDFA_MAX_RUNS 4

/* One tile of SD_VL rows: its quantized queries transposed (lanes = rows), its softmax state and
 * its mask. Rows past the walk's have qq = 0 and dq = 0. */
typedef struct {
    _Alignas(64) int32_t qi[SDFA_MAX_D / 4][SD_VL]; /* qq, 4 values (one 4-product dot) a lane */
#if SD_VL == 16
    _Alignas(64) int32_t qoff[SDFA_MAX_D / 32][SD_VL]; /* 128 * sum of a block's qq (below) */
#endif
    _Alignas(64) float dq[SDFA_MAX_D / 32][SD_VL];
    vfloat M, S;
    int rows, nblk, runs; /* runs < 0: more than SDFA_MAX_RUNS */
    const uint16_t * run[SDFA_MAX_RUNS];
    float first[SDFA_MAX_RUNS];
} sdfa_lanes;

/* A block of SDFA_P positions as the tiles take it: each position's key row in the cache (zeros
 * past it) with its f16 scales in f32, and the values in f32. */
typedef struct {
    const sdfa_block_q8_0 * k[SDFA_P];
    _Alignas(64) float dk[SDFA_P][SDFA_MAX_D / 32];
    _Alignas(64) float vf[SDFA_P][SDFA_MAX_D];
} sdfa_block;

static const sdfa_block_q8_0 sdfa_zero_key[SDFA_MAX_D / 32]; /* a position past the cache */

/* acc + 4 products of key and query bytes per lane, each lane's 4 bytes of qq against the same 4
 * of the key. AVX-512 VNNI's vpdpbusd multiplies unsigned by signed bytes: it takes k + 128 (the
 * key's byte ^ 0x80) against qq, and the tile's 128 * sum(qq) comes off once per block
 * (sdfa_scores). AVX2's maddubs (u8 x s8 pairs summed in int16) takes |k| against qq with k's
 * sign: a pair stays within 2 * 128 * 127 < 2^15, and madd widens the pairs exactly. */
SD_INLINE vint sdfa_dot4(vint acc, vint k4, vint qv) {
#if SD_VL == 16
    return vi_dpbusd(acc, vi_xor(k4, vi_set1_8((char) 0x80)), qv);
#else
    return vi_dpbusd(acc, vi_abs8(k4), vi_sign8(qv, k4));
#endif
}

/* s[j] = sum over the blocks c in order of fma(I_jc, dq_c * dk_jc, .) for the positions j0 ..
 * j0 + SDFA_JB (sdfa.h), I_jc the block's exact integer dot. Not inlined: alone, the compiler
 * keeps every accumulator in a register. */
static __attribute__((noinline)) void sdfa_scores(const sdfa_lanes * l, const sdfa_block * kb,
                                                  int d, int j0, float (*s)[SD_VL]) {
    for (int j = 0; j < SDFA_JB; j++) {
        vf_store(s[j0 + j], vf_zero());
    }
    for (int c = 0; c < d / 32; c++) {
        vint dot[SDFA_JB];
        for (int j = 0; j < SDFA_JB; j++) {
            dot[j] = vi_zero();
        }
        for (int g = 0; g < 8; g++) {
            const vint qv = vi_load(l->qi[8 * c + g]);
#pragma GCC unroll 8
            for (int j = 0; j < SDFA_JB; j++) {
                dot[j] = sdfa_dot4(dot[j], vi_bcast32(kb->k[j0 + j][c].qs + 4 * g), qv);
            }
        }
#if SD_VL == 16
        const vint off = vi_load(l->qoff[c]);
        for (int j = 0; j < SDFA_JB; j++) {
            dot[j] = vi_sub32(dot[j], off);
        }
#endif
        const vfloat dq = vf_load(l->dq[c]);
        for (int j = 0; j < SDFA_JB; j++) {
            const vfloat dqk = vf_mul(dq, vf_set1(kb->dk[j0 + j][c]));
            vf_store(s[j0 + j], vf_fmadd(vf_from_i32(dot[j]), dqk, vf_load(s[j0 + j])));
        }
    }
}

#if SD_VL == 16
/* sdfa_scores for a tile of at most 8 rows: their 8 lanes in ymm registers (the same
 * operations lane by lane; lanes 8..15 of s are left as they were). A zmm tile of 6 rows leaves
 * 10 of 16 lanes idle, and CPUs that split a zmm operation in two 256-bit halves (AMD's Zen 4)
 * spend both halves on it; a ymm operation costs half of it there and no more elsewhere. */
static __attribute__((noinline)) void sdfa_scores8(const sdfa_lanes * l, const sdfa_block * kb,
                                                   int d, int j0, float (*s)[SD_VL]) {
    const __m256i flip = _mm256_set1_epi8((char) 0x80);
    __m256 a[SDFA_JB];
    for (int j = 0; j < SDFA_JB; j++) {
        a[j] = _mm256_setzero_ps();
    }
    for (int c = 0; c < d / 32; c++) {
        __m256i dot[SDFA_JB];
        for (int j = 0; j < SDFA_JB; j++) {
            dot[j] = _mm256_setzero_si256();
        }
        for (int g = 0; g < 8; g++) {
            const __m256i qv = _mm256_load_si256((const __m256i *) l->qi[8 * c + g]);
#    pragma GCC unroll 8
            for (int j = 0; j < SDFA_JB; j++) {
                int32_t k4;
                memcpy(&k4, kb->k[j0 + j][c].qs + 4 * g, 4);
                const __m256i kv = _mm256_xor_si256(_mm256_set1_epi32(k4), flip);
                dot[j] = _mm256_dpbusd_epi32(dot[j], kv, qv);
            }
        }
        const __m256i off = _mm256_load_si256((const __m256i *) l->qoff[c]);
        const __m256 dq = _mm256_load_ps(l->dq[c]);
        for (int j = 0; j < SDFA_JB; j++) {
            const __m256 dqk = _mm256_mul_ps(dq, _mm256_set1_ps(kb->dk[j0 + j][c]));
            a[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(dot[j], off)), dqk, a[j]);
        }
    }
    for (int j = 0; j < SDFA_JB; j++) {
        _mm256_store_ps(s[j0 + j], a[j]);
    }
}
#endif

/* acc[c0 .. c0+n) lane-vectors = acc * alpha, then += p_j v_j for j in order (p_j at
 * p[j * SD_VL]), the n vectors held in registers */
SD_INLINE void sdfa_values(float * acc, float alpha, const float * p,
                           const float (*vf)[SDFA_MAX_D], int c0, int n) {
    vfloat o[SDFA_CB];
    const vfloat ar = vf_set1(alpha);
    for (int c = 0; c < n; c++) {
        o[c] = vf_mul(vf_load(acc + SD_VL * (c0 + c)), ar);
    }
    for (int j = 0; j < SDFA_P; j++) {
        const vfloat pr = vf_set1(p[j * SD_VL]);
#pragma GCC unroll 8
        for (int c = 0; c < n; c++) {
            o[c] = vf_fmadd(pr, vf_load(vf[j] + SD_VL * (c0 + c)), o[c]);
        }
    }
    for (int c = 0; c < n; c++) {
        vf_store(acc + SD_VL * (c0 + c), o[c]);
    }
}

/* The rows `rows` of the walk (from row r0) into lane tile l: queries, mask runs, live blocks. */
SD_INLINE void sdfa_lanes_init(sdfa_lanes * l, const sdfa_walk * t, int r0) {
    const int d = t->d, R = t->rows - r0 < SD_VL ? t->rows - r0 : SD_VL;
    l->rows = R;
    for (int r = 0; r < SD_VL; r++) {
        int8_t qq[SDFA_MAX_D] = {0};
        float dq[SDFA_MAX_D / 32] = {0};
        if (r < R) {
            sdfa_quantize_query(t->q[r0 + r], d, qq, dq);
        }
        for (int c = 0; c < d / 32; c++) {
            l->dq[c][r] = dq[c];
#if SD_VL == 16
            int32_t sum = 0;
            for (int i = 32 * c; i < 32 * c + 32; i++) {
                sum += qq[i];
            }
            l->qoff[c][r] = 128 * sum;
#endif
        }
        for (int g = 0; g < d / 4; g++) {
            memcpy(&l->qi[g][r], qq + 4 * g, 4);
        }
    }
    l->M = vf_set1(-INFINITY);
    l->S = vf_zero();
    l->nblk = (sdfa_live(t->mask + r0, R, t->n_kv) + SDFA_P - 1) / SDFA_P;
    l->runs = 0;
    for (int r = 0; r < R && t->mask[r0] != NULL; r++) {
        if (l->runs > 0 && t->mask[r0 + r] == l->run[l->runs - 1]) {
            continue;
        }
        if (l->runs == SDFA_MAX_RUNS || t->mask[r0 + r] == NULL) {
            l->runs = -1;
            break;
        }
        l->run[l->runs] = t->mask[r0 + r];
        l->first[l->runs++] = (float) r;
    }
}

/* Block b's mask for the tile's lanes, lane r's at mv[j][r] */
SD_INLINE void sdfa_mask(const sdfa_lanes * l, const sdfa_walk * t, int r0, int b,
                         float (*mv)[SD_VL]) {
    const int p0 = b * SDFA_P;
    if (l->runs > 0 && p0 + SDFA_P <= t->n_kv) {
        _Alignas(64) float lane[SD_VL];
        _Alignas(64) float mr[SDFA_MAX_RUNS][SDFA_P];
        for (int r = 0; r < SD_VL; r++) {
            lane[r] = (float) r;
        }
        for (int u = 0; u < l->runs; u++) {
            for (int e = 0; e < SDFA_P / SD_VL; e++) {
                vf_store(mr[u] + SD_VL * e, vf_from_f16(l->run[u] + p0 + SD_VL * e));
            }
        }
        const vfloat lanes = vf_load(lane);
        for (int j = 0; j < SDFA_P; j++) {
            vfloat m = vf_set1(mr[0][j]);
            for (int u = 1; u < l->runs; u++) {
                m = vf_blend(vf_ge(lanes, vf_set1(l->first[u])), m, vf_set1(mr[u][j]));
            }
            vf_store(mv[j], m);
        }
        return;
    }
    for (int j = 0; j < SDFA_P; j++) {
        const int p = p0 + j;
        for (int r = 0; r < SD_VL; r++) { /* past the cache: masked (sdfa.c) */
            const uint16_t * m = r < l->rows ? t->mask[r0 + r] : NULL;
            mv[j][r] = p >= t->n_kv ? -INFINITY : m != NULL ? _cvtsh_ss(m[p]) : 0.0f;
        }
    }
}

/* Block b as the tiles take it (sdfa_block); the next block's rows prefetched, so that they
 * arrive while this one is computed: into L2, as the block's own working set (its values in f32,
 * the tiles' state) fills L1 and would evict them there before their use. */
SD_INLINE void sdfa_block_kv(const sdfa_walk * t, int b, sdfa_block * kb) {
    const int d = t->d;
    for (int j = 0; j < SDFA_P; j++) {
        const int p = b * SDFA_P + j, pn = p + SDFA_P;
        if (pn < t->n_kv) {
            const char * kn = (const char *) t->k + (size_t) pn * t->k_stride;
            const char * vn = (const char *) t->v + (size_t) pn * t->v_stride;
            for (int o = 0; o < d * 34 / 32; o += 64) {
                _mm_prefetch(kn + o, _MM_HINT_T1);
            }
            _mm_prefetch(kn + d * 34 / 32 - 1, _MM_HINT_T1);
            for (int o = 0; o < 2 * d; o += 64) {
                _mm_prefetch(vn + o, _MM_HINT_T1);
            }
        }
        if (p >= t->n_kv) { /* zeros (sdfa.c) */
            kb->k[j] = sdfa_zero_key;
            memset(kb->dk[j], 0, sizeof(kb->dk[j]));
            memset(kb->vf[j], 0, sizeof(float) * (size_t) d);
            continue;
        }
        const sdfa_block_q8_0 * k =
            (const sdfa_block_q8_0 *) ((const char *) t->k + (size_t) p * t->k_stride);
        kb->k[j] = k;
        for (int c = 0; c < d / 32; c++) {
            kb->dk[j][c] = _cvtsh_ss(k[c].d);
        }
        const uint16_t * v = (const uint16_t *) ((const char *) t->v + (size_t) p * t->v_stride);
        for (int c = 0; c < d / SD_VL; c++) {
            vf_store(kb->vf[j] + SD_VL * c, vf_from_f16(v + SD_VL * c));
        }
    }
}

/* One walk: each block of 16 positions is read and converted once, then every lane tile takes
 * its scores, softmax and V sum from it (each tile to its own last live block). */
SD_INLINE void sdfa_kernel_simd(const sdfa_walk * t) {
    enum { W = SD_VL };
    const int d = t->d, nv = d / W, ntiles = (t->rows + W - 1) / W;
    sdfa_lanes lt[SDFA_TILES];
    _Alignas(64) float acc[SDFA_MAX_ROWS][SDFA_MAX_D];
    sdfa_block kb; /* this block's keys and values */
    int nblk = 0;
    for (int l = 0; l < ntiles; l++) {
        sdfa_lanes_init(&lt[l], t, W * l);
        nblk = lt[l].nblk > nblk ? lt[l].nblk : nblk;
    }
    for (int r = 0; r < t->rows; r++) {
        memset(acc[r], 0, sizeof(float) * (size_t) d);
    }
    /* a block's scores, lanes = rows; set once, as a tile of <= 8 rows on AVX-512 writes lanes
     * 0..7 only and the softmax reads every lane (each on its own) */
    _Alignas(64) float sv[SDFA_P][W] = {{0}};
    for (int b = 0; b < nblk; b++) {
        sdfa_block_kv(t, b, &kb);
        for (int l = 0; l < ntiles; l++) {
            sdfa_lanes * tl = &lt[l];
            if (b >= tl->nblk) {
                continue;
            }
            _Alignas(64) float mv[SDFA_P][W]; /* the block's mask, lanes = rows */
            _Alignas(64) float pj[SDFA_P][W]; /* its softmax weights */
            _Alignas(64) float alpha[W];
            sdfa_mask(tl, t, W * l, b, mv);
            for (int j0 = 0; j0 < SDFA_P; j0 += SDFA_JB) {
#if SD_VL == 16
                if (tl->rows <= 8) {
                    sdfa_scores8(tl, &kb, d, j0, sv);
                    continue;
                }
#endif
                sdfa_scores(tl, &kb, d, j0, sv);
            }
            const vfloat scale = vf_set1(t->scale);
            vfloat s[SDFA_P];
            vfloat mb = vf_fmadd(vf_load(sv[0]), scale, vf_load(mv[0]));
            s[0] = mb;
            for (int j = 1; j < SDFA_P; j++) {
                s[j] = vf_fmadd(vf_load(sv[j]), scale, vf_load(mv[j]));
                mb = vf_max(s[j], mb);
            }
            const vfloat Mn = vf_max(mb, tl->M);
            const vmask some = vf_ne(Mn, vf_set1(-INFINITY));
            const vfloat a = vf_blend(some, vf_set1(1.0f), sdfa_exp_v(vf_sub(tl->M, Mn)));
            vfloat S = vf_mul(tl->S, a);
            for (int j = 0; j < SDFA_P; j++) {
                const vfloat pv = vf_maskz(some, sdfa_exp_v(vf_sub(s[j], Mn)));
                S = vf_add(S, pv);
                vf_store(pj[j], pv);
            }
            vf_store(alpha, a);
            tl->M = Mn;
            tl->S = S;
            /* values: each row's d outputs in d/W lane-vectors, summed over j in order */
            for (int r = 0; r < tl->rows; r++) {
                float * ar = acc[W * l + r];
                int c0 = 0;
                for (; c0 + SDFA_CB <= nv; c0 += SDFA_CB) {
                    sdfa_values(ar, alpha[r], &pj[0][r], (const float (*)[SDFA_MAX_D]) kb.vf, c0,
                                SDFA_CB);
                }
                for (; c0 < nv; c0 += 32 / W) { /* d % 32 == 0 */
                    sdfa_values(ar, alpha[r], &pj[0][r], (const float (*)[SDFA_MAX_D]) kb.vf, c0,
                                32 / W);
                }
            }
        }
    }
    for (int l = 0; l < ntiles; l++) {
        _Alignas(64) float Ss[W];
        vf_store(Ss, lt[l].S);
        for (int r = 0; r < lt[l].rows; r++) {
            const vfloat inv = vf_set1(Ss[r] == 0.0f ? 0.0f : 1.0f / Ss[r]);
            const float * ar = acc[W * l + r];
            for (int c = 0; c < nv; c++) {
                const vfloat o = vf_mul(vf_load(ar + W * c), inv);
                /* + 0: every zero leaves as +0 (sdfa.h) */
                vf_storeu(t->out[W * l + r] + W * c, vf_add(o, vf_zero()));
            }
        }
    }
}
