/* sdfa's SIMD kernel, written once for SD_VL lanes (sd-simd.h): SD_VL query rows in the lanes of
 * one vector for the scores and the softmax, each row's output in d/SD_VL vectors for the V sum.
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

/* Positions before the last one some row of the tile sees (its mask is not -inf there): past it
 * every block is masked for every row and would add exactly nothing (sdfa.h), so the walk stops
 * there. llama.cpp pads the cache it attends over to a multiple of 256 cells, masked. */
SD_INLINE int sdfa_live(const sdfa_tile * t) {
    int live = 0;
    for (int r = 0; r < t->rows; r++) {
        if (t->mask[r] == NULL) {
            return t->n_kv;
        }
        int p = t->n_kv;
        while (p > live && t->mask[r][p - 1] == SDFA_F16_NEG_INF) {
            p--;
        }
        live = p;
    }
    return live;
}

SD_INLINE void sdfa_kernel_simd(const sdfa_tile * t) {
    enum { W = SD_VL };
    const int d = t->d, R = t->rows, nblk = (sdfa_live(t) + SDFA_P - 1) / SDFA_P, nv = d / W;
    _Alignas(64) float qt[SDFA_MAX_D][W];      /* the rows' queries, transposed: lanes = rows */
    _Alignas(64) float kf[SDFA_P][SDFA_MAX_D]; /* this block's keys, dequantized */
    _Alignas(64) float vf[SDFA_P][SDFA_MAX_D]; /* this block's values, in f32 */
    _Alignas(64) float mv[SDFA_P][W];          /* this block's mask, per row */
    _Alignas(64) float pj[SDFA_P][W];          /* this block's softmax weights, per row */
    _Alignas(64) float alpha[W];
    _Alignas(64) float acc[W][SDFA_MAX_D];
    for (int i = 0; i < d; i++) {
        for (int r = 0; r < W; r++) {
            qt[i][r] = r < R ? t->q[r][i] : 0.0f;
        }
    }
    memset(acc, 0, sizeof(acc));
    vfloat M = vf_set1(-INFINITY), S = vf_zero();
    for (int b = 0; b < nblk; b++) {
        for (int j = 0; j < SDFA_P; j++) {
            const int p = b * SDFA_P + j;
            if (p >= t->n_kv) { /* past the cache: masked, and v = 0 (sdfa.c) */
                memset(kf[j], 0, sizeof(float) * (size_t) d);
                memset(vf[j], 0, sizeof(float) * (size_t) d);
                for (int r = 0; r < W; r++) {
                    mv[j][r] = -INFINITY;
                }
                continue;
            }
            const sdfa_block_q8_0 * k =
                (const sdfa_block_q8_0 *) ((const char *) t->k + (size_t) p * t->k_stride);
            for (int c = 0; c < d / 32; c++) {
                const vfloat dk = vf_set1(_cvtsh_ss(k[c].d));
                for (int e = 0; e < 32 / W; e++) {
                    vf_store(kf[j] + 32 * c + W * e, vf_mul(vf_from_i8(k[c].qs + W * e), dk));
                }
            }
            const uint16_t * v = (const uint16_t *) ((const char *) t->v + (size_t) p * t->v_stride);
            for (int c = 0; c < nv; c++) {
                vf_store(vf[j] + W * c, vf_from_f16(v + W * c));
            }
            for (int r = 0; r < W; r++) {
                mv[j][r] = r < R && t->mask[r] ? _cvtsh_ss(t->mask[r][p]) : 0.0f;
            }
        }
        /* scores: 16 positions' dot products side by side, each summed over i in order */
        vfloat s[SDFA_P];
        for (int j = 0; j < SDFA_P; j++) {
            s[j] = vf_zero();
        }
        for (int i = 0; i < d; i++) {
            const vfloat qv = vf_load(qt[i]);
            for (int j = 0; j < SDFA_P; j++) {
                s[j] = vf_fmadd(qv, vf_set1(kf[j][i]), s[j]);
            }
        }
        const vfloat scale = vf_set1(t->scale);
        vfloat mb = vf_fmadd(s[0], scale, vf_load(mv[0]));
        s[0] = mb;
        for (int j = 1; j < SDFA_P; j++) {
            s[j] = vf_fmadd(s[j], scale, vf_load(mv[j]));
            mb = vf_max(s[j], mb);
        }
        const vfloat Mn = vf_max(mb, M);
        const vmask some = vf_ne(Mn, vf_set1(-INFINITY));
        const vfloat a = vf_blend(some, vf_set1(1.0f), sdfa_exp_v(vf_sub(M, Mn)));
        S = vf_mul(S, a);
        for (int j = 0; j < SDFA_P; j++) {
            const vfloat pv = vf_maskz(some, sdfa_exp_v(vf_sub(s[j], Mn)));
            S = vf_add(S, pv);
            vf_store(pj[j], pv);
        }
        vf_store(alpha, a);
        M = Mn;
        /* values: each row's d outputs in d/W lane-vectors, summed over j in order */
        for (int r = 0; r < R; r++) {
            vfloat o[SDFA_MAX_D / W];
            const vfloat ar = vf_set1(alpha[r]);
            for (int c = 0; c < nv; c++) {
                o[c] = vf_mul(vf_load(acc[r] + W * c), ar);
            }
            for (int j = 0; j < SDFA_P; j++) {
                const vfloat pr = vf_set1(pj[j][r]);
                for (int c = 0; c < nv; c++) {
                    o[c] = vf_fmadd(pr, vf_load(vf[j] + W * c), o[c]);
                }
            }
            for (int c = 0; c < nv; c++) {
                vf_store(acc[r] + W * c, o[c]);
            }
        }
    }
    _Alignas(64) float Ss[W];
    vf_store(Ss, S);
    for (int r = 0; r < R; r++) {
        const vfloat inv = vf_set1(Ss[r] == 0.0f ? 0.0f : 1.0f / Ss[r]);
        for (int c = 0; c < nv; c++) {
            const vfloat o = vf_mul(vf_load(acc[r] + W * c), inv);
            vf_storeu(t->out[r] + W * c, vf_add(o, vf_zero())); /* + 0: every zero +0 (sdfa.h) */
        }
    }
}
