/* sdmm's SIMD kernels, written once for SD_VL lanes (sd-simd.h): one lane per weight row, a
 * 16-row group as SDMM_R / SD_VL vectors of rows (h picks one). A group's weights are read from
 * memory once for up to SDMM_CHUNK activation rows: each super-block, while it is in cache, goes
 * to every tile of up to SDMM_TILE rows, and a sub-block's weights are unpacked once per tile.
 * The per-lane arithmetic is sdmm.h's; sdmm.c's reference kernels spell it out. Include it with
 * SD_VL and SDMM_TILE (4, 8 or 16) defined, inside the file's SD_TARGET_PUSH, then define the
 * file's kernels with SDMM_KERNEL (and its peak probe with SDMM_PEAK). */
#pragma once

#include "sd-simd.h"
#include "sdmm.h"

#include <time.h>

_Static_assert(SDMM_TILE == 4 || SDMM_TILE == 8 || SDMM_TILE == 16,
               "sdmm_kernel_simd's switch has cases up to 16");

/* Activation rows whose float accumulators one pass over a group keeps (on the stack: a tile's
 * integer sums are what stays in registers); past it the group's weights are read again. */
#define SDMM_CHUNK 64

/* A share of the prefetch of the block SDMM_PREFETCH_BYTES ahead: its lines [first, first +
 * count) from `at` (at NULL: none). A kernel with sub-blocks issues it a sub-block at a time:
 * a whole block's lines at once (52 for Q6_K) fill the queue of misses and the loads beside them
 * wait (docs/kernels.md). */
typedef struct {
    const char * at;
    int first, count;
} sdmm_ahead;

/* Share j of nj of pf's lines (nj a constant: the division is a shift) */
SD_INLINE void prefetch_share(sdmm_ahead pf, int j, int nj) {
    if (pf.at == NULL) {
        return;
    }
    for (int l = pf.first + pf.count * j / nj; l < pf.first + pf.count * (j + 1) / nj; l++) {
        _mm_prefetch(pf.at + 64 * l, _MM_HINT_T1);
    }
}

/* The fifth bits of a 32-value block in Q5_0's qh layout (byte 4r+t: bit c = hi1(4c+t), bit
 * 4+c = hi1(16+4c+t)), each moved to bit 4 of its value's byte: hb[c] for values 4c.. (c =
 * 0..3), hb[4+c] for 16+4c.. (a 16-bit shift by at most 4 moves no set bit of the mask across
 * bytes) */
SD_INLINE void fifth_bits(const uint8_t * qh, vint * hb) {
    const vint m10 = vi_set1_8(0x10), H = vi_load(qh);
    const vint s[8] = {vi_slli16(H, 4), vi_slli16(H, 3), vi_slli16(H, 2), vi_slli16(H, 1),
                       H,               vi_srli16(H, 1), vi_srli16(H, 2), vi_srli16(H, 3)};
    for (int c = 0; c < 8; c++) {
        hb[c] = vi_and(s[c], m10);
    }
}

/* The IQ4 values (IQ4_XS, IQ4_NL) in every 128-bit lane, for vi_lut16: signed for AVX2's
 * maddubs, which multiplies |w| by the activation given w's sign (vi_sign8; 2 * 127 * 127 <
 * 2^15, so exact); offset by 128 for vpdpbusd's unsigned operand, the 128 taken out of the sum
 * exactly (-128 * the activations' sum) */
static const int8_t SDMM_IQ4_VALUES[16] = SDMM_KVALUES_IQ4NL;
#if SD_DOT16
#    define SDMM_IQ4_OFFSET 0
#else
#    define SDMM_IQ4_OFFSET 128
#endif
SD_INLINE vint iq4_table(void) {
    const vint t = vi_bcast128(SDMM_IQ4_VALUES);
    return SDMM_IQ4_OFFSET ? vi_xor(t, vi_set1_8((char) 0x80)) : t;
}

#if SD_DOT16
/* A sub-block scale per lane (32 bits, sign-extended) as the int16 pair (sc, sc): one madd of a
 * lane's two 16-bit sums by it is sc times their sum, the integer vpmulld gives. */
SD_INLINE vint scale_pair(vint sc) {
    return vi_or(vi_and(sc, vi_set1_32(0xFFFF)), vi_slli32(sc, 16));
}
#endif

/* The float term of a super-block without mins (Q6_K, IQ4_XS): row t's outputs
 * facc[t * SDMM_R ..] += sumi[t] * (d * da). */
SD_INLINE void scale_float(const sdmm_half * d16, const sdmm_act * a, const int NT, int h,
                           const vint * sumi, float * facc) {
    const vfloat d = vf_from_f16(d16 + SD_VL * h);
    for (int t = 0; t < NT; t++) {
        const vfloat da = vf_set1(a[t].d);
        vf_store(facc + t * SDMM_R,
                 vf_fmadd(vf_from_i32(sumi[t]), vf_mul(d, da), vf_load(facc + t * SDMM_R)));
    }
}

/* The float terms of a super-block with mins (Q4_K, Q5_K: npairs 4, 32-value sub-blocks; Q2_K:
 * 8, 16-value ones, b16 set): row t's outputs facc[t * SDMM_R ..] += sumi[t] * (d * da), then
 * -= summ * (dmin * da), summ the mins m (int16 pairs per lane) times the activation's sums of
 * the sub-blocks (b32 or b16). */
SD_INLINE void mins_float(const sdmm_half * d16, const sdmm_half * dmin16,
                          const uint8_t (*mins)[SDMM_R][2], const int npairs, const int b16,
                          const sdmm_act * a, const int NT, int h, const vint * sumi,
                          float * facc) {
    vint m[8];
    for (int i = 0; i < npairs; i++) {
        m[i] = vi_u8_to_16(mins[i][SD_VL * h]);
    }
    const vfloat d = vf_from_f16(d16 + SD_VL * h);
    const vfloat dmin = vf_from_f16(dmin16 + SD_VL * h);
    for (int t = 0; t < NT; t++) {
        const sdmm_act * A = a + t;
        const int16_t * bs = b16 ? A->b16 : A->b32;
        vint summ = vi_zero();
        for (int i = 0; i < npairs; i++) {
            summ = vi_dpwssd(summ, m[i], vi_bcast32(&bs[2 * i]));
        }
        const vfloat da = vf_set1(A->d);
        vfloat f = vf_load(facc + t * SDMM_R);
        f = vf_fmadd(vf_from_i32(sumi[t]), vf_mul(d, da), f);
        vf_store(facc + t * SDMM_R, vf_fnmadd(vf_from_i32(summ), vf_mul(dmin, da), f));
    }
}

/* One Q4_K super-block of rows h of a group times the tile's NT activation rows (row t's block
 * at a[t]): row t's outputs facc[t * SDMM_R ..] += its two float terms, in sdmm.h's order. A
 * sub-block's weights are unpacked once into registers and multiplied into every row of the
 * tile. Q5_K's super-block is Q4_K's with fifth bits qh (NULL: Q4_K; the branch folds away). */
SD_INLINE void q4k_block(const sdmm_q4k_r16 * blk, const uint8_t (*qh)[64], const sdmm_act * a,
                         const int NT, int h, float * facc, sdmm_ahead pf) {
    const vint m4 = vi_set1_8(0x0F);
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 8; j++) {
        prefetch_share(pf, j, 8);
        vint lo[4], hi[4];
        for (int c = 0; c < 4; c++) {
            const vint L = vi_load(blk->qs[j][c] + 4 * SD_VL * h);
            lo[c] = vi_and(L, m4);                   /* 32j+4c..    */
            hi[c] = vi_and(vi_srli16(L, 4), m4);     /* 32j+16+4c.. */
        }
        if (qh != NULL) {
            vint hb[8];
            fifth_bits(qh[j] + 4 * SD_VL * h, hb);
            for (int c = 0; c < 4; c++) {
                lo[c] = vi_or(lo[c], hb[c]);
                hi[c] = vi_or(hi[c], hb[4 + c]);
            }
        }
        const vint sc = vi_u8_to_32(blk->sc[j] + SD_VL * h);
#if SD_DOT16
        /* a lane's 16-bit halves each sum 16 products (Q4_K: 16 * 15 * 127 < 2^15) or, for
         * Q5_K's 0..31, two sums of 8 (8 * 31 * 127 < 2^15): each sum fits, so it is exact */
        const vint sc2 = scale_pair(sc);
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 32 * j;
            vint x[4];
            for (int c = 0; c < 4; c++) {
                x[c] = vi_add16(vi_maddubs(lo[c], vi_bcast32(q + 4 * c)),
                                vi_maddubs(hi[c], vi_bcast32(q + 16 + 4 * c)));
            }
            vint p0 = vi_add16(x[0], x[1]), p1 = vi_add16(x[2], x[3]);
            vi_keep(p0); /* two chains of adds, not one of seven (the sums are exact either way) */
            vi_keep(p1);
            vint acc;
            if (qh != NULL) {
                acc = vi_add32(vi_madd16(p0, sc2), vi_madd16(p1, sc2));
            } else {
                acc = vi_madd16(vi_add16(p0, p1), sc2);
            }
            sumi[t] = vi_add32(sumi[t], acc);
        }
#else
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 32 * j;
            vint acc = vi_dpbusd(vi_zero(), lo[0], vi_bcast32(q));
            acc = vi_dpbusd(acc, hi[0], vi_bcast32(q + 16));
            for (int c = 1; c < 4; c++) {
                acc = vi_dpbusd(acc, lo[c], vi_bcast32(q + 4 * c));
                acc = vi_dpbusd(acc, hi[c], vi_bcast32(q + 16 + 4 * c));
            }
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc, sc));
        }
#endif
    }
    mins_float(blk->d, blk->dmin, blk->m, 4, 0, a, NT, h, sumi, facc);
}

/* The same for a Q2_K super-block: 16 sub-blocks of 16 two-bit quants. */
SD_INLINE void q2k_block(const sdmm_q2k_r16 * blk, const sdmm_act * a, const int NT, int h,
                         float * facc) {
    const vint m3 = vi_set1_8(3);
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 16; j++) {
        const vint Q = vi_load(blk->qs[j] + 4 * SD_VL * h);
        /* quants of values 16j+0..3, +4..7, +8..11, +12..15 of each row (a 16-bit shift moves
         * no bit the mask keeps across bytes) */
        const vint w[4] = {vi_and(Q, m3), vi_and(vi_srli16(Q, 2), m3),
                           vi_and(vi_srli16(Q, 4), m3), vi_and(vi_srli16(Q, 6), m3)};
        const vint sc = vi_u8_to_32(blk->sc[j] + SD_VL * h);
#if SD_DOT16
        /* a lane's 16-bit halves each sum 8 products, 8 * 3 * 127 < 2^15: exact */
        const vint sc2 = scale_pair(sc);
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 16 * j;
            const vint p = vi_add16(vi_add16(vi_maddubs(w[0], vi_bcast32(q)),
                                             vi_maddubs(w[1], vi_bcast32(q + 4))),
                                    vi_add16(vi_maddubs(w[2], vi_bcast32(q + 8)),
                                             vi_maddubs(w[3], vi_bcast32(q + 12))));
            sumi[t] = vi_add32(sumi[t], vi_madd16(p, sc2));
        }
#else
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 16 * j;
            vint acc = vi_dpbusd(vi_zero(), w[0], vi_bcast32(q));
            for (int c = 1; c < 4; c++) {
                acc = vi_dpbusd(acc, w[c], vi_bcast32(q + 4 * c));
            }
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc, sc));
        }
#endif
    }
    mins_float(blk->d, blk->dmin, blk->m, 8, 1, a, NT, h, sumi, facc);
}

/* The same for an IQ4_XS super-block: 8 sub-blocks of 32 values looked up from 4-bit indices
 * (Q4_K's layout), a signed scale each, one float term. */
SD_INLINE void iq4xs_block(const sdmm_iq4xs_r16 * blk, const sdmm_act * a, const int NT, int h,
                           float * facc, sdmm_ahead pf) {
    const vint m4 = vi_set1_8(0x0F), table = iq4_table();
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 8; j++) {
        prefetch_share(pf, j, 8);
        vint w[8]; /* values 32j+4c.. (c = 0..3), then 32j+16+4c.. */
        for (int c = 0; c < 4; c++) {
            const vint L = vi_load(blk->qs[j][c] + 4 * SD_VL * h);
            w[c] = vi_lut16(table, vi_and(L, m4));
            w[4 + c] = vi_lut16(table, vi_and(vi_srli16(L, 4), m4));
        }
        const vint sc = vi_i8_to_32(blk->sc[j] + SD_VL * h);
#if SD_DOT16
        /* each 4 products widened at once by a madd with the scale pair (sc, sc) */
        const vint sc2 = scale_pair(sc);
        vint aw[8];
        for (int c = 0; c < 8; c++) {
            aw[c] = vi_abs8(w[c]);
        }
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 32 * j;
            vint acc = sumi[t];
            for (int c = 0; c < 8; c++) {
                const int col = c < 4 ? 4 * c : 16 + 4 * (c - 4);
                const vint x = vi_maddubs(aw[c], vi_sign8(vi_bcast32(q + col), w[c]));
                acc = vi_add32(acc, vi_madd16(x, sc2));
            }
            sumi[t] = acc;
        }
#else
        for (int t = 0; t < NT; t++) {
            const int8_t * q = a[t].qs + 32 * j;
            vint acc = vi_set1_32(-SDMM_IQ4_OFFSET * a[t].b32[j]);
            for (int c = 0; c < 4; c++) {
                acc = vi_dpbusd(acc, w[c], vi_bcast32(q + 4 * c));
                acc = vi_dpbusd(acc, w[4 + c], vi_bcast32(q + 16 + 4 * c));
            }
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc, sc));
        }
#endif
    }
    scale_float(blk->d, a, NT, h, sumi, facc);
}

/* The same for a Q6_K super-block: row t's outputs facc[t * SDMM_R ..] += its float term. */
SD_INLINE void q6k_block(const sdmm_q6k_r16 * blk, const sdmm_act * a, const int NT,
                         int h, float * facc, sdmm_ahead pf) {
    const vint m4 = vi_set1_8(0x0F), m30 = vi_set1_8(0x30);
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 16; j++) {
        prefetch_share(pf, j, 16);
        const vint L0 = vi_load(blk->ql[j][0] + 4 * SD_VL * h);
        const vint L1 = vi_load(blk->ql[j][1] + 4 * SD_VL * h);
        const vint H = vi_load(blk->qh[j] + 4 * SD_VL * h);
        /* quants 0..63 of values 16j+0..3, +4..7, +8..11, +12..15 of each row */
        const vint w0 = vi_or(vi_and(L0, m4), vi_and(vi_slli16(H, 4), m30));
        const vint w1 = vi_or(vi_and(L1, m4), vi_and(vi_slli16(H, 2), m30));
        const vint w2 = vi_or(vi_and(vi_srli16(L0, 4), m4), vi_and(H, m30));
        const vint w3 = vi_or(vi_and(vi_srli16(L1, 4), m4), vi_and(vi_srli16(H, 2), m30));
        const vint sc = vi_i8_to_32(blk->sc[j] + SD_VL * h);
#if SD_DOT16
        /* a lane's 16-bit halves each sum 8 products and their share of the -32 offset (o16):
         * sum (q - 32) * a over 8 values, |.| <= 8 * 32 * 127 < 2^15, so exact */
        const vint sc2 = scale_pair(sc);
        for (int t = 0; t < NT; t++) {
            const sdmm_act * A = a + t;
            const int8_t * q = A->qs + 16 * j;
            const vint p01 = vi_add16(vi_maddubs(w0, vi_bcast32(q)),
                                      vi_maddubs(w1, vi_bcast32(q + 4)));
            const vint p23 = vi_add16(vi_maddubs(w2, vi_bcast32(q + 8)),
                                      vi_maddubs(w3, vi_bcast32(q + 12)));
            const vint p = vi_add16(vi_add16(vi_bcast32(&A->o16[j]), p01), p23);
            sumi[t] = vi_add32(sumi[t], vi_madd16(p, sc2));
        }
#else
        for (int t = 0; t < NT; t++) {
            const sdmm_act * A = a + t;
            const int8_t * q = A->qs + 16 * j;
            vint acc = vi_set1_32(A->nb16[j]); /* the -32 offset, exact */
            acc = vi_dpbusd(acc, w0, vi_bcast32(q));
            acc = vi_dpbusd(acc, w1, vi_bcast32(q + 4));
            acc = vi_dpbusd(acc, w2, vi_bcast32(q + 8));
            acc = vi_dpbusd(acc, w3, vi_bcast32(q + 12));
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc, sc));
        }
#endif
    }
    scale_float(blk->d, a, NT, h, sumi, facc);
}

/* The float terms of a 32-value block: row t's outputs facc[t * SDMM_R ..] += sumi[t] * (d *
 * da), then (Q5_1, m16 not NULL) += sum[t] * (m * da). */
SD_INLINE void block32_float(const sdmm_half * d16, const sdmm_half * m16, const sdmm_act32 * a,
                             const int NT, const vint * sumi, float * facc) {
    const vfloat d = vf_from_f16(d16);
    for (int t = 0; t < NT; t++) {
        const vfloat da = vf_set1(a[t].d);
        vfloat f = vf_fmadd(vf_from_i32(sumi[t]), vf_mul(d, da), vf_load(facc + t * SDMM_R));
        if (m16 != NULL) {
            f = vf_fmadd(vf_set1((float) a[t].sum), vf_mul(vf_from_f16(m16), da), f);
        }
        vf_store(facc + t * SDMM_R, f);
    }
}

/* A 4- or 5-bit 32-value block of rows h of a group (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) times the
 * tile's NT activation rows: scales d16, mins m16 (NULL: none), fifth bits qh (NULL: none) and
 * low nibbles qs of the group. The quants are unsigned: vpdpbusd multiplies them so, and an
 * offset (Q4_0's 8, Q5_0's 16) comes out of the sum exactly (-offset * sum). IQ4_NL (iq4 set)
 * looks its values up from the quants (iq4_table, with its own offset). */
SD_INLINE void q32_block(const sdmm_half * d16, const sdmm_half * m16, const uint8_t * qh,
                         const uint8_t (*qs)[64], int offset, const int iq4,
                         const sdmm_act32 * a, const int NT, int h, float * facc) {
    const vint m4 = vi_set1_8(0x0F);
    vint hb[8];
    if (qh != NULL) {
        fifth_bits(qh + 4 * SD_VL * h, hb);
    }
    vint w[8]; /* values 4c.. (c = 0..3), then 16+4c.. */
    for (int c = 0; c < 4; c++) {
        const vint L = vi_load(qs[c] + 4 * SD_VL * h);
        w[c] = vi_and(L, m4);
        w[4 + c] = vi_and(vi_srli16(L, 4), m4);
        if (qh != NULL) {
            w[c] = vi_or(w[c], hb[c]);
            w[4 + c] = vi_or(w[4 + c], hb[4 + c]);
        }
    }
    vint sumi[SDMM_TILE];
    if (iq4) {
        const vint table = iq4_table();
        for (int c = 0; c < 8; c++) {
            w[c] = vi_lut16(table, w[c]);
        }
        offset = SDMM_IQ4_OFFSET;
    }
#if SD_DOT16
    if (iq4) { /* signed values: |w| times the activation given w's sign, as in Q8_0's */
        vint aw[8];
        for (int c = 0; c < 8; c++) {
            aw[c] = vi_abs8(w[c]);
        }
        for (int t = 0; t < NT; t++) {
            vint acc = vi_zero();
            for (int c = 0; c < 8; c++) {
                acc = vi_dpbusd(acc, aw[c], vi_sign8(vi_bcast32(a[t].qs + 4 * c), w[c]));
            }
            sumi[t] = acc;
        }
        block32_float(d16 + SD_VL * h, NULL, a, NT, sumi, facc);
        return;
    }
#endif
    for (int t = 0; t < NT; t++) {
        vint acc = vi_set1_32(-offset * a[t].sum);
#if SD_DOT16
        /* a lane's 16-bit halves each sum 16 products (16 * 15 * 127 < 2^15) or, with fifth
         * bits, two sums of 8 (8 * 31 * 127 < 2^15); widened by a madd with ones, exactly */
        const vint ones = vi_set1_32(0x00010001); /* int16 pairs (1, 1) */
        vint p[2];
        for (int c = 0; c < 8; c++) {
            const vint x = vi_maddubs(w[c], vi_bcast32(a[t].qs + 4 * c));
            const int k = qh != NULL && c >= 4; /* which sum */
            p[k] = c == 4 * k ? x : vi_add16(p[k], x);
        }
        acc = vi_add32(acc, vi_madd16(p[0], ones));
        if (qh != NULL) {
            acc = vi_add32(acc, vi_madd16(p[1], ones));
        }
#else
        for (int c = 0; c < 8; c++) {
            acc = vi_dpbusd(acc, w[c], vi_bcast32(a[t].qs + 4 * c));
        }
#endif
        sumi[t] = acc;
    }
    block32_float(d16 + SD_VL * h, m16 != NULL ? m16 + SD_VL * h : NULL, a, NT, sumi, facc);
}

/* A Q8_0 block of rows h of a group times the tile's NT activation rows. */
SD_INLINE void q8_0_block(const sdmm_q8_0_r16 * blk, const sdmm_act32 * a, const int NT, int h,
                          float * facc) {
    vint w[8];
    for (int c = 0; c < 8; c++) {
        w[c] = vi_load(blk->qs[c] + 4 * SD_VL * h); /* q + 128 */
    }
    vint sumi[SDMM_TILE];
#if !SD_DOT16
    /* vpdpbusd on q + 128 and the activation; the offset comes out exactly: -128 * sum */
    for (int t = 0; t < NT; t++) {
        vint acc = vi_set1_32(-128 * a[t].sum);
        for (int c = 0; c < 8; c++) {
            acc = vi_dpbusd(acc, w[c], vi_bcast32(a[t].qs + 4 * c));
        }
        sumi[t] = acc;
    }
#else
    /* maddubs would saturate on q + 128 (2 * 255 * 127 > 2^15): |q| times the activation with
     * q's sign, as ggml does (2 * 128 * 127 < 2^15); the same exact sums */
    vint aw[8];
    for (int c = 0; c < 8; c++) {
        w[c] = vi_xor(w[c], vi_set1_8((char) 0x80)); /* q */
        aw[c] = vi_abs8(w[c]);                        /* |q|, 128 for -128 */
    }
    for (int t = 0; t < NT; t++) {
        vint acc = vi_zero();
        for (int c = 0; c < 8; c++) {
            acc = vi_dpbusd(acc, aw[c], vi_sign8(vi_bcast32(a[t].qs + 4 * c), w[c]));
        }
        sumi[t] = acc;
    }
#endif
    block32_float(blk->d + SD_VL * h, NULL, a, NT, sumi, facc);
}

/* A float block (F16, BF16: bf16 set) of rows h of a group times the tile's NT activation rows:
 * each lane one fma per value, in order, into row t's outputs facc[t * SDMM_R ..]. */
SD_INLINE void f16_block(const sdmm_f16_r16 * blk, const int bf16, const sdmm_actf * a,
                         const int NT, int h, float * facc) {
    vfloat acc[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        acc[t] = vf_load(facc + t * SDMM_R);
    }
    for (int c = 0; c < 32; c++) {
        const uint16_t * p = blk->w[c] + SD_VL * h;
        const vfloat w = bf16 ? vf_from_bf16(p) : vf_from_f16(p);
        for (int t = 0; t < NT; t++) {
            acc[t] = vf_fmadd(w, vf_set1(a[t].x[c]), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        vf_store(facc + t * SDMM_R, acc[t]);
    }
}

/* One block of rows h of a group times a tile of NT activation rows (at, of the type's kind),
 * issuing the prefetch share pf (the 32-value blocks' few lines at once). */
SD_INLINE void sdmm_tile(int type, const void * blk, const void * at, const int NT, int h,
                         float * facc, sdmm_ahead pf) {
    switch (type) { /* these spread their share over their sub-blocks (Q2_K's, short and bound
                     * by compute, ran slower so) */
        case SDMM_TYPE_Q4_K:
        case SDMM_TYPE_Q5_K:
        case SDMM_TYPE_Q6_K:
        case SDMM_TYPE_IQ4_XS:
            break;
        default:
            prefetch_share(pf, 0, 1);
    }
    switch (type) {
        case SDMM_TYPE_Q4_K:
            q4k_block((const sdmm_q4k_r16 *) blk, NULL, (const sdmm_act *) at, NT, h, facc, pf);
            break;
        case SDMM_TYPE_Q5_K:
            q4k_block(&((const sdmm_q5k_r16 *) blk)->lo, ((const sdmm_q5k_r16 *) blk)->qh,
                      (const sdmm_act *) at, NT, h, facc, pf);
            break;
        case SDMM_TYPE_Q6_K:
            q6k_block((const sdmm_q6k_r16 *) blk, (const sdmm_act *) at, NT, h, facc, pf);
            break;
        case SDMM_TYPE_Q4_0: {
            const sdmm_q4_0_r16 * g = (const sdmm_q4_0_r16 *) blk;
            q32_block(g->d, NULL, NULL, g->qs, 8, 0, (const sdmm_act32 *) at, NT, h, facc);
            break;
        }
        case SDMM_TYPE_Q4_1: {
            const sdmm_q4_1_r16 * g = (const sdmm_q4_1_r16 *) blk;
            q32_block(g->d, g->m, NULL, g->qs, 0, 0, (const sdmm_act32 *) at, NT, h, facc);
            break;
        }
        case SDMM_TYPE_Q5_0: {
            const sdmm_q5_0_r16 * g = (const sdmm_q5_0_r16 *) blk;
            q32_block(g->d, NULL, g->qh, g->qs, 16, 0, (const sdmm_act32 *) at, NT, h, facc);
            break;
        }
        case SDMM_TYPE_Q5_1: {
            const sdmm_q5_1_r16 * g = (const sdmm_q5_1_r16 *) blk;
            q32_block(g->q.d, g->m, g->q.qh, g->q.qs, 0, 0, (const sdmm_act32 *) at, NT, h, facc);
            break;
        }
        case SDMM_TYPE_Q8_0:
            q8_0_block((const sdmm_q8_0_r16 *) blk, (const sdmm_act32 *) at, NT, h, facc);
            break;
        case SDMM_TYPE_Q2_K:
            q2k_block((const sdmm_q2k_r16 *) blk, (const sdmm_act *) at, NT, h, facc);
            break;
        case SDMM_TYPE_IQ4_XS:
            iq4xs_block((const sdmm_iq4xs_r16 *) blk, (const sdmm_act *) at, NT, h, facc, pf);
            break;
        case SDMM_TYPE_IQ4_NL: {
            const sdmm_iq4nl_r16 * g = (const sdmm_iq4nl_r16 *) blk;
            q32_block(g->d, NULL, NULL, g->qs, 0, 1, (const sdmm_act32 *) at, NT, h, facc);
            break;
        }
        case SDMM_TYPE_F16:
        case SDMM_TYPE_BF16:
            f16_block((const sdmm_f16_r16 *) blk, type == SDMM_TYPE_BF16, (const sdmm_actf *) at,
                      NT, h, facc);
            break;
        default: /* SDMM_KERNEL is instantiated for the group layouts above only */
            break;
    }
}

/* The group w (its nsb blocks; its first `valid` rows are stored) times b <= SDMM_CHUNK
 * activation rows (row i's block s at a[s * sb + i]), in tiles of at most SDMM_TILE rows
 * whose sizes differ by at most one: block by block, each read from memory once and
 * multiplied into every tile while it is in cache. A lane's K loop runs whole, in order, here.
 * The switch turns a tile's size into a constant, so each tile's loops unroll and its integer
 * sums live in registers. */
SD_INLINE void sdmm_rows(int type, size_t group_bytes, size_t act_bytes, const void * w, int nsb,
                         const char * a, size_t sb, int b, float * y, size_t ldy, int valid) {
    _Alignas(64) float facc[SDMM_CHUNK * SDMM_R]; /* row i's 16 outputs at facc[16 i] */
    memset(facc, 0, sizeof(float) * (size_t) b * SDMM_R);
    const int nh = valid >= SDMM_R ? SDMM_R / SD_VL : (valid + SD_VL - 1) / SD_VL;
    const int ntiles = (b + SDMM_TILE - 1) / SDMM_TILE, base = b / ntiles, extra = b % ntiles;
    const int lines = (int) ((group_bytes + 63) / 64);
    for (int s = 0; s < nsb; s++) {
        const void * blk = (const char *) w + (size_t) s * group_bytes;
        const char * ahead = (const char *) blk + SDMM_PREFETCH_BYTES;
        for (int h = 0; h < nh; h++) {
            /* the first tile of each h prefetches part h of the block ahead */
            const int first = lines * h / nh, count = lines * (h + 1) / nh - first;
            for (int t = 0, i = 0, nt; t < ntiles; t++, i += nt) {
                nt = base + (t < extra);
                const sdmm_ahead pf = {t == 0 ? ahead : NULL, first, count};
                const char * at = a + ((size_t) s * sb + i) * act_bytes;
                float * ft = facc + i * SDMM_R + h * SD_VL;
                switch (nt) {
#define SDMM_CASE_(n) case n: sdmm_tile(type, blk, at, n, h, ft, pf); break;
                    SDMM_CASE_(1) SDMM_CASE_(2) SDMM_CASE_(3)
#if SDMM_TILE > 4
                    SDMM_CASE_(4) SDMM_CASE_(5) SDMM_CASE_(6) SDMM_CASE_(7)
#endif
#if SDMM_TILE > 8
                    SDMM_CASE_(8) SDMM_CASE_(9) SDMM_CASE_(10) SDMM_CASE_(11) SDMM_CASE_(12)
                    SDMM_CASE_(13) SDMM_CASE_(14) SDMM_CASE_(15)
#endif
#undef SDMM_CASE_
                    default: sdmm_tile(type, blk, at, SDMM_TILE, h, ft, pf); break;
                }
            }
        }
    }
    for (int i = 0; i < b; i++) {
        for (int h = 0; h < nh; h++) {
            vf_store_lanes(y + (size_t) i * ldy + SD_VL * h, vf_load(facc + i * SDMM_R + h * SD_VL),
                           valid - SD_VL * h);
        }
    }
}

/* sdmm.h's sdmm_kernel_fn for `type`: each group's rows against the activation rows, up to
 * SDMM_CHUNK of them per pass over the group's weights. */
SD_INLINE void sdmm_kernel_simd(int type, const void * w, int nsb, int ngroups, int n_valid,
                                const void * a, int b, float * y, size_t ldy) {
    const size_t group_bytes = sdmm_group_bytes(type), act_bytes = sdmm_act_bytes(type);
    for (int g = 0; g < ngroups; g++) {
        const void * wg = (const char *) w + (size_t) g * (size_t) nsb * group_bytes;
        for (int i = 0; i < b; i += SDMM_CHUNK) {
            const int nb = b - i < SDMM_CHUNK ? b - i : SDMM_CHUNK;
            sdmm_rows(type, group_bytes, act_bytes, wg, nsb,
                      (const char *) a + (size_t) i * act_bytes, (size_t) b, nb,
                      y + (size_t) i * ldy + g * SDMM_R, ldy, n_valid - g * SDMM_R);
        }
    }
}

/* SDMM_KERNEL(sdmm_kernel_q4k_avx2, SDMM_TYPE_Q4_K): defines that sdmm.h kernel as this file's
 * instance of sdmm_kernel_simd. */
#define SDMM_KERNEL(name, type)                                                                  \
    void name(const void * w, int nsb, int ngroups, int n_valid, const void * a, int b,          \
              float * y, size_t ldy) {                                                           \
        sdmm_kernel_simd(type, w, nsb, ngroups, n_valid, a, b, y, ldy);                          \
    }

/* SDMM_PEAK(name, step): defines `double name(long iters)`, the int8 peak of this path on the
 * calling core, the ceiling its kernels are measured against: 12 independent chains, each link
 * `step(acc, x, y)`, one instruction of 4 * SD_VL multiply-accumulates whose result feeds the
 * next (y renewed every pass, so nothing is hoisted; 12 cover latency times throughput on
 * the CPUs measured, 5 x 2 on Intel's cores). Returns MACs per second over `iters` x 24 links. */
#define SDMM_PEAK_INIT_(i) vint acc##i = vi_set1_8((char) (i + 1));
#define SDMM_PEAK_SINK_(i) sink = vi_add32(sink, acc##i);
#define SDMM_PEAK_CHAINS_(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#define SDMM_PEAK(name, step)                                                                    \
    double name(long iters) {                                                                    \
        SDMM_PEAK_CHAINS_(SDMM_PEAK_INIT_)                                                       \
        const vint x = vi_set1_8(3); /* vpmaddubsw's links use y alone */                       \
        vint y = vi_set1_8(5);                                                                   \
        (void) x;                                                                                \
        struct timespec t0, t1;                                                                  \
        clock_gettime(CLOCK_MONOTONIC, &t0);                                                     \
        for (long it = 0; it < iters; it++) {                                                    \
            SDMM_PEAK_CHAINS_(SDMM_PEAK_STEP_##step)                                             \
            SDMM_PEAK_CHAINS_(SDMM_PEAK_STEP_##step)                                             \
            __asm__ volatile("" : "+x"(y)); /* a new input every pass */                        \
        }                                                                                        \
        clock_gettime(CLOCK_MONOTONIC, &t1);                                                     \
        vint sink = vi_zero();                                                                   \
        SDMM_PEAK_CHAINS_(SDMM_PEAK_SINK_)                                                       \
        __asm__ volatile("" : : "x"(sink));                                                      \
        const double s = (double) (t1.tv_sec - t0.tv_sec) +                                      \
                         1e-9 * (double) (t1.tv_nsec - t0.tv_nsec);                              \
        return (double) iters * 24.0 * 4.0 * SD_VL / s;                                          \
    }
/* the links: vpdpbusd (AVX-512 VNNI, AVX-VNNI); vpmaddubsw, its product pairs the next link's
 * unsigned input (AVX2) */
#define SDMM_PEAK_STEP_dpbusd(i) acc##i = vi_dpbusd(acc##i, x, y);
#if SD_DOT16
#    define SDMM_PEAK_STEP_maddubs(i) acc##i = vi_maddubs(acc##i, y);
#endif
