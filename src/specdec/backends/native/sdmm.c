/* sdmm: repacking, activation quantization, the scalar reference kernels and the dispatch.
 * The contract and the layouts are in sdmm.h. */
#include "sdmm.h"

#include "sd-common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(sdmm_block_q4_K) == 144, "ggml's block_q4_K is 144 bytes");
_Static_assert(sizeof(sdmm_block_q6_K) == 210, "ggml's block_q6_K is 210 bytes");
_Static_assert(sizeof(sdmm_q4k_r16) == 2368, "sdmm_q4k_r16 layout");
_Static_assert(sizeof(sdmm_q6k_r16) == 3360, "sdmm_q6k_r16 layout");
_Static_assert(sizeof(sdmm_act) == 384, "sdmm_act layout");

/* ------------------------------------------------------------------------------------------ */
/* quants of ggml's blocks, by value index v in 0..255                                        */

static int q4k_src(const sdmm_block_q4_K * b, int v) {
    const int chunk = v / 64, l = v % 64; /* 32 bytes per 64 values: low nibbles, then high */
    return l < 32 ? b->qs[32 * chunk + l] & 0xF : b->qs[32 * chunk + l - 32] >> 4;
}

static void q4k_scale_min(const sdmm_block_q4_K * b, int j, uint8_t * sc, uint8_t * m) {
    const uint8_t * q = b->scales; /* ggml's get_scale_min_k4 */
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 0..63, the stored quant before ggml's -32 */
static int q6k_src(const sdmm_block_q6_K * b, int v) {
    const int half = v / 128, quarter = (v % 128) / 32, l = v % 32;
    const uint8_t * ql = b->ql + 64 * half + (quarter & 1) * 32;
    const int lo = quarter < 2 ? ql[l] & 0xF : ql[l] >> 4;
    const int hi = (b->qh[32 * half + l] >> (2 * quarter)) & 3;
    return lo | hi << 4;
}

/* ------------------------------------------------------------------------------------------ */
/* quants of the repacked groups, by row r and value index                                    */

static int q4k_packed(const sdmm_q4k_r16 * g, int r, int j, int v) { /* v in sub-block j */
    const uint8_t byte = g->qs[j][(v % 16) / 4][4 * r + v % 4];
    return v < 16 ? byte & 0xF : byte >> 4;
}

static int q6k_packed(const sdmm_q6k_r16 * g, int r, int j, int v) { /* v in sub-block j */
    const int c = v / 4, t = v % 4; /* dword c of the sub-block */
    const uint8_t lo = g->ql[j][c & 1][4 * r + t];
    const int lo4 = c < 2 ? lo & 0xF : lo >> 4;
    const int hi2 = (g->qh[j][4 * r + t] >> (2 * c)) & 3;
    return lo4 | hi2 << 4;
}

/* ------------------------------------------------------------------------------------------ */
/* packing                                                                                    */

int sdmm_supported_type(int type) {
    return type == SDMM_TYPE_Q4_K || type == SDMM_TYPE_Q6_K;
}

size_t sdmm_group_bytes(int type) {
    return type == SDMM_TYPE_Q4_K ? sizeof(sdmm_q4k_r16)
           : type == SDMM_TYPE_Q6_K ? sizeof(sdmm_q6k_r16)
                                    : 0;
}

size_t sdmm_packed_size(int type, int64_t n, int64_t k) {
    return (size_t) ((n + SDMM_R - 1) / SDMM_R) * (size_t) (k / SDMM_QK) * sdmm_group_bytes(type);
}

static void pack_q4k(const sdmm_block_q4_K * src, int64_t n, int64_t nsb, sdmm_q4k_r16 * dst) {
    for (int64_t g = 0; g < (n + SDMM_R - 1) / SDMM_R; g++) {
        for (int64_t s = 0; s < nsb; s++) {
            sdmm_q4k_r16 * out = dst + g * nsb + s;
            memset(out, 0, sizeof(*out)); /* rows past n stay zero: d = 0, outputs not stored */
            for (int r = 0; r < SDMM_R && g * SDMM_R + r < n; r++) {
                const sdmm_block_q4_K * b = src + (g * SDMM_R + r) * nsb + s;
                out->d[r] = b->d;
                out->dmin[r] = b->dmin;
                for (int j = 0; j < 8; j++) {
                    q4k_scale_min(b, j, &out->sc[j][r], &out->m[j / 2][r][j % 2]);
                    for (int c = 0; c < 4; c++) {
                        for (int t = 0; t < 4; t++) {
                            const int lo = q4k_src(b, 32 * j + 4 * c + t);
                            const int hi = q4k_src(b, 32 * j + 16 + 4 * c + t);
                            out->qs[j][c][4 * r + t] = (uint8_t) (lo | hi << 4);
                        }
                    }
                }
            }
        }
    }
}

static void pack_q6k(const sdmm_block_q6_K * src, int64_t n, int64_t nsb, sdmm_q6k_r16 * dst) {
    for (int64_t g = 0; g < (n + SDMM_R - 1) / SDMM_R; g++) {
        for (int64_t s = 0; s < nsb; s++) {
            sdmm_q6k_r16 * out = dst + g * nsb + s;
            memset(out, 0, sizeof(*out));
            for (int r = 0; r < SDMM_R && g * SDMM_R + r < n; r++) {
                const sdmm_block_q6_K * b = src + (g * SDMM_R + r) * nsb + s;
                out->d[r] = b->d;
                for (int j = 0; j < 16; j++) {
                    out->sc[j][r] = b->scales[j];
                    for (int t = 0; t < 4; t++) {
                        int q[4]; /* dwords 0..3 of sub-block j */
                        for (int c = 0; c < 4; c++) {
                            q[c] = q6k_src(b, 16 * j + 4 * c + t);
                        }
                        out->ql[j][0][4 * r + t] = (uint8_t) ((q[0] & 0xF) | (q[2] & 0xF) << 4);
                        out->ql[j][1][4 * r + t] = (uint8_t) ((q[1] & 0xF) | (q[3] & 0xF) << 4);
                        out->qh[j][4 * r + t] = (uint8_t) ((q[0] >> 4) | (q[1] >> 4) << 2 |
                                                           (q[2] >> 4) << 4 | (q[3] >> 4) << 6);
                    }
                }
            }
        }
    }
}

void sdmm_pack(int type, const void * src, int64_t n, int64_t k, void * dst) {
    if (type == SDMM_TYPE_Q4_K) {
        pack_q4k((const sdmm_block_q4_K *) src, n, k / SDMM_QK, (sdmm_q4k_r16 *) dst);
    } else if (type == SDMM_TYPE_Q6_K) {
        pack_q6k((const sdmm_block_q6_K *) src, n, k / SDMM_QK, (sdmm_q6k_r16 *) dst);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* activations: ggml's quantize_row_q8_K_ref, operation for operation, plus the sums          */

static int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

void sdmm_quantize_row(const float * x, int64_t k, sdmm_act * out, size_t stride) {
    for (int64_t s = 0; s < k / SDMM_QK; s++, x += SDMM_QK) {
        sdmm_act * a = out + (size_t) s * stride;
        memset(a, 0, sizeof(*a));
        float max = 0, amax = 0;
        for (int j = 0; j < SDMM_QK; j++) {
            const float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0) {
            continue; /* d = 0, quants 0 */
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < SDMM_QK; j++) {
            const float scaled = iscale * x[j];
            const int v = nearest_int(scaled);
            a->qs[j] = (int8_t) (v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) {
                sum += a->qs[16 * j + i];
            }
            a->nb16[j] = -32 * sum;
            a->b32[j / 2] = (int16_t) (a->b32[j / 2] + sum);
        }
        a->d = 1 / iscale;
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the reference kernels: the same operations as the SIMD ones, one lane at a time            */

/* row r of a Q4_K group's super-block blk against one activation super-block A: acc plus its two
 * float terms */
static float q4k_ref_block(const sdmm_q4k_r16 * blk, int r, const sdmm_act * A, float acc) {
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 8; j++) {
        int32_t dot = 0;
        for (int v = 0; v < 32; v++) {
            dot += q4k_packed(blk, r, j, v) * A->qs[32 * j + v];
        }
        sumi += dot * blk->sc[j][r];
        summ += blk->m[j / 2][r][j % 2] * A->b32[j];
    }
    const float f1 = sd_h2f(blk->d[r]) * A->d;
    const float f2 = sd_h2f(blk->dmin[r]) * A->d;
    acc = fmaf((float) sumi, f1, acc);
    return fmaf(-(float) summ, f2, acc);
}

/* the same for Q6_K: acc plus its float term */
static float q6k_ref_block(const sdmm_q6k_r16 * blk, int r, const sdmm_act * A, float acc) {
    int32_t sumi = 0;
    for (int j = 0; j < 16; j++) {
        int32_t dot = A->nb16[j];
        for (int v = 0; v < 16; v++) {
            dot += q6k_packed(blk, r, j, v) * A->qs[16 * j + v];
        }
        sumi += dot * blk->sc[j][r];
    }
    const float f1 = sd_h2f(blk->d[r]) * A->d;
    return fmaf((float) sumi, f1, acc);
}

/* sdmm_kernel_fn for `type`, one output at a time: the super-blocks in order into one float */
static void kernel_ref(int type, const void * w, int nsb, int ngroups, int n_valid,
                       const sdmm_act * a, int b, float * y, size_t ldy) {
    const char * groups = (const char *) w;
    const size_t group_bytes = sdmm_group_bytes(type);
    for (int g = 0; g < ngroups; g++) {
        for (int i = 0; i < b; i++) {
            for (int r = 0; r < SDMM_R && g * SDMM_R + r < n_valid; r++) {
                float acc = 0.0f;
                for (int s = 0; s < nsb; s++) {
                    const void * blk = groups + ((size_t) g * nsb + s) * group_bytes;
                    const sdmm_act * A = a + (size_t) s * b + i;
                    acc = type == SDMM_TYPE_Q4_K ? q4k_ref_block(blk, r, A, acc)
                                                 : q6k_ref_block(blk, r, A, acc);
                }
                y[(size_t) i * ldy + g * SDMM_R + r] = acc;
            }
        }
    }
}

void sdmm_kernel_q4k_ref(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a,
                         int b, float * y, size_t ldy) {
    kernel_ref(SDMM_TYPE_Q4_K, w, nsb, ngroups, n_valid, a, b, y, ldy);
}

void sdmm_kernel_q6k_ref(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a,
                         int b, float * y, size_t ldy) {
    kernel_ref(SDMM_TYPE_Q6_K, w, nsb, ngroups, n_valid, a, b, y, ldy);
}

/* ------------------------------------------------------------------------------------------ */
/* dispatch                                                                                   */

int sdmm_isa_supported(int isa) {
    switch (isa) {
        case SD_ISA_REF:
            return 1;
        case SD_ISA_AVX2:
            return SD_CPU_HAS(SD_FEATURES_AVX2);
        case SD_ISA_AVX512:
            return SD_CPU_HAS(SD_FEATURES_AVX512_VNNI);
        default:
            return 0;
    }
}

int sdmm_isa_selected(void) {
    static int selected = -2;
    if (selected == -2) {
        selected = sd_isa_select(sdmm_isa_supported);
    }
    return selected;
}

sdmm_kernel_fn sdmm_kernel(int type, int isa) {
    if (!sdmm_isa_supported(isa)) {
        return NULL;
    }
    switch (isa) {
        case SD_ISA_REF:
            return type == SDMM_TYPE_Q4_K ? sdmm_kernel_q4k_ref
                   : type == SDMM_TYPE_Q6_K ? sdmm_kernel_q6k_ref
                                            : NULL;
#if SD_X86
        case SD_ISA_AVX2:
            return type == SDMM_TYPE_Q4_K ? sdmm_kernel_q4k_avx2
                   : type == SDMM_TYPE_Q6_K ? sdmm_kernel_q6k_avx2
                                            : NULL;
        case SD_ISA_AVX512:
            return type == SDMM_TYPE_Q4_K ? sdmm_kernel_q4k_avx512
                   : type == SDMM_TYPE_Q6_K ? sdmm_kernel_q6k_avx512
                                            : NULL;
#endif
        default:
            return NULL;
    }
}

double sdmm_peak_macs(long iters) {
#if SD_X86
    if (sdmm_isa_supported(SD_ISA_AVX512)) {
        return sdmm_avx512_peak_macs(iters);
    }
#endif
    (void) iters;
    return 0.0;
}

int sdmm_matmul(int type, int isa, const void * packed, int64_t n, int64_t k, const float * x,
                int64_t b, float * y) {
    const sdmm_kernel_fn kernel = sdmm_kernel(type, isa);
    if (kernel == NULL || k % SDMM_QK != 0 || n < 1 || b < 1) {
        return -1;
    }
    const int64_t nsb = k / SDMM_QK;
    sdmm_act * acts = (sdmm_act *) malloc((size_t) (b * nsb) * sizeof(sdmm_act));
    if (acts == NULL) {
        return -1;
    }
    for (int64_t i = 0; i < b; i++) {
        sdmm_quantize_row(x + i * k, k, acts + i, (size_t) b);
    }
    kernel(packed, (int) nsb, (int) ((n + SDMM_R - 1) / SDMM_R), (int) n, acts, (int) b, y,
           (size_t) n);
    free(acts);
    return 0;
}
