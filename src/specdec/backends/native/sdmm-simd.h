/* sdmm's SIMD kernels, written once for SD_VL lanes (sd-simd.h): one lane per weight row, a
 * 16-row group as SDMM_R / SD_VL vectors of rows (h picks one), and a tile of up to SDMM_TILE
 * activation rows per pass over those rows' weights, so each weight byte is read and unpacked once
 * per tile. The per-lane arithmetic is sdmm.h's; sdmm.c's reference kernels spell it out. Include
 * it with SD_VL and SDMM_TILE (4 or 8) defined, inside the file's SD_TARGET_PUSH, then define the
 * file's kernels with SDMM_KERNEL. */
#pragma once

#include "sd-simd.h"
#include "sdmm.h"

_Static_assert(SDMM_TILE == 4 || SDMM_TILE == 8, "sdmm_kernel_simd's switch has cases up to 8");

SD_INLINE void prefetch_block(const void * blk, size_t size) {
    for (size_t l = 0; l < size; l += 64) {
        _mm_prefetch((const char *) blk + SDMM_PREFETCH_BYTES + l, _MM_HINT_T0);
    }
}

/* One Q4_K super-block of rows h of a group times the tile's NT activation rows (row t's block
 * at a[t * nsb]): facc[t] += its two float terms, in sdmm.h's order. */
SD_INLINE void q4k_block(const sdmm_q4k_r16 * blk, const sdmm_act * a, int nsb, const int NT,
                         int h, vfloat * facc) {
    const vint m4 = vi_set1_8(0x0F);
    prefetch_block(blk, sizeof(*blk));
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 8; j++) {
        vint acc[SDMM_TILE];
        for (int t = 0; t < NT; t++) {
            acc[t] = vi_zero();
        }
        for (int c = 0; c < 4; c++) {
            const vint L = vi_load(blk->qs[j][c] + 4 * SD_VL * h);
            const vint lo = vi_and(L, m4);                   /* 32j+4c..    */
            const vint hi = vi_and(vi_srli16(L, 4), m4);     /* 32j+16+4c.. */
            for (int t = 0; t < NT; t++) {
                const int8_t * q = a[(size_t) t * nsb].qs + 32 * j + 4 * c;
                acc[t] = vi_dpbusd(acc[t], lo, vi_bcast32(q));
                acc[t] = vi_dpbusd(acc[t], hi, vi_bcast32(q + 16));
            }
        }
        const vint sc = vi_u8_to_32(blk->sc[j] + SD_VL * h);
        for (int t = 0; t < NT; t++) {
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc[t], sc));
        }
    }
    vint m[4];
    for (int i = 0; i < 4; i++) {
        m[i] = vi_u8_to_16(blk->m[i][SD_VL * h]);
    }
    const vfloat d = vf_from_f16(blk->d + SD_VL * h);
    const vfloat dmin = vf_from_f16(blk->dmin + SD_VL * h);
    for (int t = 0; t < NT; t++) {
        const sdmm_act * A = a + (size_t) t * nsb;
        vint summ = vi_zero();
        for (int i = 0; i < 4; i++) {
            summ = vi_dpwssd(summ, m[i], vi_bcast32(&A->b32[2 * i]));
        }
        const vfloat da = vf_set1(A->d);
        facc[t] = vf_fmadd(vf_from_i32(sumi[t]), vf_mul(d, da), facc[t]);
        facc[t] = vf_fnmadd(vf_from_i32(summ), vf_mul(dmin, da), facc[t]);
    }
}

/* The same for a Q6_K super-block: facc[t] += its float term. */
SD_INLINE void q6k_block(const sdmm_q6k_r16 * blk, const sdmm_act * a, int nsb, const int NT,
                         int h, vfloat * facc) {
    const vint m4 = vi_set1_8(0x0F), m30 = vi_set1_8(0x30);
    prefetch_block(blk, sizeof(*blk));
    vint sumi[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        sumi[t] = vi_zero();
    }
    for (int j = 0; j < 16; j++) {
        const vint L0 = vi_load(blk->ql[j][0] + 4 * SD_VL * h);
        const vint L1 = vi_load(blk->ql[j][1] + 4 * SD_VL * h);
        const vint H = vi_load(blk->qh[j] + 4 * SD_VL * h);
        /* quants 0..63 of values 16j+0..3, +4..7, +8..11, +12..15 of each row */
        const vint w0 = vi_or(vi_and(L0, m4), vi_and(vi_slli16(H, 4), m30));
        const vint w1 = vi_or(vi_and(L1, m4), vi_and(vi_slli16(H, 2), m30));
        const vint w2 = vi_or(vi_and(vi_srli16(L0, 4), m4), vi_and(H, m30));
        const vint w3 = vi_or(vi_and(vi_srli16(L1, 4), m4), vi_and(vi_srli16(H, 2), m30));
        const vint sc = vi_i8_to_32(blk->sc[j] + SD_VL * h);
        for (int t = 0; t < NT; t++) {
            const sdmm_act * A = a + (size_t) t * nsb;
            const int8_t * q = A->qs + 16 * j;
            vint acc = vi_set1_32(A->nb16[j]); /* the -32 offset, exact */
            acc = vi_dpbusd(acc, w0, vi_bcast32(q));
            acc = vi_dpbusd(acc, w1, vi_bcast32(q + 4));
            acc = vi_dpbusd(acc, w2, vi_bcast32(q + 8));
            acc = vi_dpbusd(acc, w3, vi_bcast32(q + 12));
            sumi[t] = vi_add32(sumi[t], vi_mullo32(acc, sc));
        }
    }
    const vfloat d = vf_from_f16(blk->d + SD_VL * h);
    for (int t = 0; t < NT; t++) {
        const vfloat da = vf_set1(a[(size_t) t * nsb].d);
        facc[t] = vf_fmadd(vf_from_i32(sumi[t]), vf_mul(d, da), facc[t]);
    }
}

/* Rows h of the group w (its nsb super-blocks) times NT activation rows: y[t * ldy + r] for the
 * group's first `valid` rows r of h. A lane's K loop runs whole, in order, here. */
SD_INLINE void sdmm_tile(int type, const void * w, int nsb, const sdmm_act * a, const int NT,
                         float * y, size_t ldy, int h, int valid) {
    vfloat facc[SDMM_TILE];
    for (int t = 0; t < NT; t++) {
        facc[t] = vf_zero();
    }
    for (int s = 0; s < nsb; s++) {
        if (type == SDMM_TYPE_Q4_K) {
            q4k_block((const sdmm_q4k_r16 *) w + s, a + s, nsb, NT, h, facc);
        } else {
            q6k_block((const sdmm_q6k_r16 *) w + s, a + s, nsb, NT, h, facc);
        }
    }
    for (int t = 0; t < NT; t++) {
        vf_store_lanes(y + (size_t) t * ldy + SD_VL * h, facc[t], valid);
    }
}

/* sdmm.h's sdmm_kernel_fn for `type`: b activation rows in ceil(b / SDMM_TILE) tiles whose sizes
 * differ by at most one. The switch turns a tile's size into a constant, so each tile's loops
 * unroll and its accumulators live in registers. */
SD_INLINE void sdmm_kernel_simd(int type, const void * w, int nsb, int ngroups, int n_valid,
                                const sdmm_act * a, int b, float * y, size_t ldy) {
    const size_t group_bytes = type == SDMM_TYPE_Q4_K ? sizeof(sdmm_q4k_r16) : sizeof(sdmm_q6k_r16);
    for (int g = 0; g < ngroups; g++) {
        const void * wg = (const char *) w + (size_t) g * (size_t) nsb * group_bytes;
        for (int h = 0; h < SDMM_R / SD_VL; h++) {
            const int valid = n_valid - g * SDMM_R - SD_VL * h;
            if (valid <= 0) {
                break;
            }
            const int ntiles = (b + SDMM_TILE - 1) / SDMM_TILE, base = b / ntiles, extra = b % ntiles;
            for (int t = 0, i = 0, nt; t < ntiles; t++, i += nt) {
                nt = base + (t < extra);
                const sdmm_act * at = a + (size_t) i * nsb;
                float * yt = y + (size_t) i * ldy + g * SDMM_R;
                switch (nt) {
                    case 1: sdmm_tile(type, wg, nsb, at, 1, yt, ldy, h, valid); break;
                    case 2: sdmm_tile(type, wg, nsb, at, 2, yt, ldy, h, valid); break;
                    case 3: sdmm_tile(type, wg, nsb, at, 3, yt, ldy, h, valid); break;
#if SDMM_TILE > 4
                    case 4: sdmm_tile(type, wg, nsb, at, 4, yt, ldy, h, valid); break;
                    case 5: sdmm_tile(type, wg, nsb, at, 5, yt, ldy, h, valid); break;
                    case 6: sdmm_tile(type, wg, nsb, at, 6, yt, ldy, h, valid); break;
                    case 7: sdmm_tile(type, wg, nsb, at, 7, yt, ldy, h, valid); break;
#endif
                    default: sdmm_tile(type, wg, nsb, at, SDMM_TILE, yt, ldy, h, valid); break;
                }
            }
        }
    }
}

/* SDMM_KERNEL(sdmm_kernel_q4k_avx2, SDMM_TYPE_Q4_K): defines that sdmm.h kernel as this file's
 * instance of sdmm_kernel_simd. */
#define SDMM_KERNEL(name, type)                                                                  \
    void name(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a, int b,      \
              float * y, size_t ldy) {                                                           \
        sdmm_kernel_simd(type, w, nsb, ngroups, n_valid, a, b, y, ldy);                          \
    }
