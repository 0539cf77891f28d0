/* sdmm: repacking, activation quantization, the scalar reference kernels and the dispatch.
 * The contract and the layouts are in sdmm.h. */
#include "sdmm.h"

#include "sd-common.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

_Static_assert(sizeof(sdmm_block_q2_K) == 84, "ggml's block_q2_K is 84 bytes");
_Static_assert(sizeof(sdmm_block_iq4_xs) == 136, "ggml's block_iq4_xs is 136 bytes");
_Static_assert(sizeof(sdmm_block_iq4_nl) == 18, "ggml's block_iq4_nl is 18 bytes");
_Static_assert(sizeof(sdmm_q2k_r16) == 1600, "sdmm_q2k_r16 layout");
_Static_assert(sizeof(sdmm_iq4xs_r16) == 2208, "sdmm_iq4xs_r16 layout");
_Static_assert(sizeof(sdmm_f16_r16) == 1024, "sdmm_f16_r16 layout");
_Static_assert(sizeof(sdmm_actf) == 128, "sdmm_actf layout");
_Static_assert(sizeof(sdmm_block_q3_K) == 110, "ggml's block_q3_K is 110 bytes");
_Static_assert(sizeof(sdmm_block_q4_K) == 144, "ggml's block_q4_K is 144 bytes");
_Static_assert(sizeof(sdmm_block_q5_K) == 176, "ggml's block_q5_K is 176 bytes");
_Static_assert(sizeof(sdmm_block_q6_K) == 210, "ggml's block_q6_K is 210 bytes");
_Static_assert(sizeof(sdmm_q4k_r16) == 2368, "sdmm_q4k_r16 layout");
_Static_assert(sizeof(sdmm_q5k_r16) == 2880, "sdmm_q5k_r16 layout");
_Static_assert(sizeof(sdmm_q6k_r16) == 3360, "sdmm_q6k_r16 layout");
_Static_assert(sizeof(sdmm_block_q4_0) == 18, "ggml's block_q4_0 is 18 bytes");
_Static_assert(sizeof(sdmm_block_q4_1) == 20, "ggml's block_q4_1 is 20 bytes");
_Static_assert(sizeof(sdmm_block_q5_0) == 22, "ggml's block_q5_0 is 22 bytes");
_Static_assert(sizeof(sdmm_block_q5_1) == 24, "ggml's block_q5_1 is 24 bytes");
_Static_assert(sizeof(sdmm_block_q8_0) == 34, "ggml's block_q8_0 is 34 bytes");
_Static_assert(sizeof(sdmm_q4_0_r16) == 288, "sdmm_q4_0_r16 layout");
_Static_assert(sizeof(sdmm_q4_1_r16) == 320, "sdmm_q4_1_r16 layout");
_Static_assert(sizeof(sdmm_q5_0_r16) == 352, "sdmm_q5_0_r16 layout");
_Static_assert(sizeof(sdmm_q5_1_r16) == 384, "sdmm_q5_1_r16 layout");
_Static_assert(sizeof(sdmm_q8_0_r16) == 544, "sdmm_q8_0_r16 layout");
_Static_assert(sizeof(sdmm_act) == 448, "sdmm_act layout");
_Static_assert(sizeof(sdmm_act32) == 64, "sdmm_act32 layout");

/* ------------------------------------------------------------------------------------------ */
/* quants of ggml's blocks, by value index v in 0..255                                        */

/* the low 4 bits of value v of a Q4_K or Q5_K block's qs (the same layout) */
static int q4k_src(const uint8_t * qs, int v) {
    const int chunk = v / 64, l = v % 64; /* 32 bytes per 64 values: low nibbles, then high */
    return l < 32 ? qs[32 * chunk + l] & 0xF : qs[32 * chunk + l - 32] >> 4;
}

/* 0..31 (dequantize_row_q5_K) */
static int q5k_src(const sdmm_block_q5_K * b, int v) {
    return q4k_src(b->qs, v) | ((b->qh[v % 32] >> (v / 32)) & 1) << 4;
}

/* sub-block j's scale and min from a K-quant's 12 packed bytes (Q4_K's and Q5_K's) */
static void q4k_scale_min(const uint8_t * q, int j, uint8_t * sc, uint8_t * m) {
    /* ggml's get_scale_min_k4 */
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* 0..3: value v's quant of a Q2_K block (dequantize_row_q2_K: byte 32n + l, bits 2i) */
static int q2k_src(const sdmm_block_q2_K * b, int v) {
    const int n = v / 128, i = (v % 128) / 32, l = v % 32;
    return (b->qs[32 * n + l] >> (2 * i)) & 3;
}

/* 0..7: value v's quant + 4 (dequantize_row_q3_K: the low 2 bits, minus 4 where the hmask bit is
 * clear) */
static int q3k_src(const sdmm_block_q3_K * b, int v) {
    const int n = v / 128, j = (v % 128) / 32, l = v % 32;
    const int lo = (b->qs[32 * n + l] >> (2 * j)) & 3;
    return lo + 4 * ((b->hmask[l] >> (4 * n + j)) & 1);
}

/* scale i (0..15) of a Q3_K block, -32..31 (ggml's kmask unpacking, one scale at a time: the
 * low 4 bits from byte i % 8, nibble i / 8; the high 2 from byte 8 + i % 4, bits 2 (i / 4)) */
static int q3k_scale(const sdmm_block_q3_K * b, int i) {
    const int lo = (b->scales[i % 8] >> (4 * (i / 8))) & 0xF;
    const int hi = (b->scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (lo | hi << 4) - 32;
}

/* 0..63, the stored quant before ggml's -32 */
static int q6k_src(const sdmm_block_q6_K * b, int v) {
    const int half = v / 128, quarter = (v % 128) / 32, l = v % 32;
    const uint8_t * ql = b->ql + 64 * half + (quarter & 1) * 32;
    const int lo = quarter < 2 ? ql[l] & 0xF : ql[l] >> 4;
    const int hi = (b->qh[32 * half + l] >> (2 * quarter)) & 3;
    return lo | hi << 4;
}

/* 0..15, the stored quant of a 32-value block's qs (Q4_0's, Q4_1's; Q5_0's, Q5_1's low bits) */
static int nibble_src(const uint8_t * qs, int v) {
    return v < 16 ? qs[v] & 0xF : qs[v - 16] >> 4;
}

/* sub-block j's ls (0..63) of an IQ4_XS block (dequantize_row_iq4_xs) */
static int iq4xs_ls(const sdmm_block_iq4_xs * b, int j) {
    return ((b->scales_l[j / 2] >> (4 * (j % 2))) & 0xF) | ((b->scales_h >> (2 * j)) & 3) << 4;
}

static const int8_t KVALUES_IQ4NL[16] = SDMM_KVALUES_IQ4NL;

/* 0..31: a 32-value block's low nibbles and fifth bits (Q5_0's, Q5_1's; before Q5_0's -16) */
static int q5_src(const uint8_t * qs, const uint8_t * qh4, int v) {
    uint32_t qh;
    memcpy(&qh, qh4, sizeof(qh));
    return nibble_src(qs, v) | (int) ((qh >> v) & 1) << 4;
}

/* ------------------------------------------------------------------------------------------ */
/* quants of the repacked groups, by row r and value index                                    */

/* value v of sub-block j of row r in Q4_K's quant layout (Q4_K's, Q5_K's low bits, IQ4_XS's) */
static int nibble_packed(const uint8_t (*qs)[4][64], int r, int j, int v) {
    const uint8_t byte = qs[j][(v % 16) / 4][4 * r + v % 4];
    return v < 16 ? byte & 0xF : byte >> 4;
}

static int q4k_packed(const sdmm_q4k_r16 * g, int r, int j, int v) { /* v in sub-block j */
    return nibble_packed(g->qs, r, j, v);
}

static int q6k_packed(const sdmm_q6k_r16 * g, int r, int j, int v) { /* v in sub-block j */
    const int c = v / 4, t = v % 4; /* dword c of the sub-block */
    const uint8_t lo = g->ql[j][c & 1][4 * r + t];
    const int lo4 = c < 2 ? lo & 0xF : lo >> 4;
    const int hi2 = (g->qh[j][4 * r + t] >> (2 * c)) & 3;
    return lo4 | hi2 << 4;
}

/* 0..31: value v of a 32-value block packed as the 4- and 5-bit groups store it: low nibbles
 * qs[c], fifth bits qh (NULL: a 4-bit group) */
static int q32_packed(const uint8_t (*qs)[64], const uint8_t * qh, int r, int v) {
    const int c = (v % 16) / 4, t = v % 4, hi_bit = v < 16 ? c : 4 + c;
    const uint8_t byte = qs[c][4 * r + t];
    const int lo4 = v < 16 ? byte & 0xF : byte >> 4;
    return lo4 | (qh != NULL ? ((qh[4 * r + t] >> hi_bit) & 1) << 4 : 0);
}

static int q2k_packed(const sdmm_q2k_r16 * g, int r, int j, int v) { /* v in sub-block j */
    return (g->qs[j][4 * r + v % 4] >> (2 * (v / 4))) & 3;
}

static int q8_0_packed(const sdmm_q8_0_r16 * g, int r, int v) { /* the signed value */
    return (int) g->qs[v / 4][4 * r + v % 4] - 128;
}

/* ------------------------------------------------------------------------------------------ */
/* packing                                                                                    */

/* pack_row_<type>(group, r, src): row r of a group's block from that row's ggml block src, one
 * function per type (TYPES' pack) */

/* row r of a Q4_K group from a K-quant's d, dmin, packed scales and the 256 quants' low 4 bits
 * (Q4_K's and Q5_K's: the same layout) */
static void pack_row_q4k_(sdmm_q4k_r16 * out, int r, sdmm_half d, sdmm_half dmin,
                          const uint8_t * scales, const uint8_t * qs) {
    out->d[r] = d;
    out->dmin[r] = dmin;
    for (int j = 0; j < 8; j++) {
        q4k_scale_min(scales, j, &out->sc[j][r], &out->m[j / 2][r][j % 2]);
        for (int c = 0; c < 4; c++) {
            for (int t = 0; t < 4; t++) {
                const int lo = q4k_src(qs, 32 * j + 4 * c + t);
                const int hi = q4k_src(qs, 32 * j + 16 + 4 * c + t);
                out->qs[j][c][4 * r + t] = (uint8_t) (lo | hi << 4);
            }
        }
    }
}

static void pack_row_q4k(void * group, int r, const void * src) {
    sdmm_q4k_r16 * out = group;
    const sdmm_block_q4_K * b = src;
    pack_row_q4k_(out, r, b->d, b->dmin, b->scales, b->qs);
}

static void pack_row_q5k(void * group, int r, const void * src) {
    sdmm_q5k_r16 * out = group;
    const sdmm_block_q5_K * b = src;
    pack_row_q4k_(&out->lo, r, b->d, b->dmin, b->scales, b->qs);
    for (int j = 0; j < 8; j++) {
        for (int c = 0; c < 4; c++) {
            for (int t = 0; t < 4; t++) {
                const int lo = q5k_src(b, 32 * j + 4 * c + t) >> 4;
                const int hi = q5k_src(b, 32 * j + 16 + 4 * c + t) >> 4;
                out->qh[j][4 * r + t] |= (uint8_t) (lo << c | hi << (4 + c));
            }
        }
    }
}

/* row r of a Q6_K group from d, 16 scales and 256 unsigned 6-bit quants q[v] (value
 * d*sc*(q - 32)) */
static void pack_row_256x6(sdmm_q6k_r16 * out, int r, sdmm_half d, const int8_t * sc,
                           const int * qv) {
    out->d[r] = d;
    for (int j = 0; j < 16; j++) {
        out->sc[j][r] = sc[j];
        for (int t = 0; t < 4; t++) {
            int q[4]; /* dwords 0..3 of sub-block j */
            for (int c = 0; c < 4; c++) {
                q[c] = qv[16 * j + 4 * c + t];
            }
            out->ql[j][0][4 * r + t] = (uint8_t) ((q[0] & 0xF) | (q[2] & 0xF) << 4);
            out->ql[j][1][4 * r + t] = (uint8_t) ((q[1] & 0xF) | (q[3] & 0xF) << 4);
            out->qh[j][4 * r + t] = (uint8_t) ((q[0] >> 4) | (q[1] >> 4) << 2 | (q[2] >> 4) << 4 |
                                               (q[3] >> 4) << 6);
        }
    }
}

static void pack_row_q6k(void * group, int r, const void * src) {
    sdmm_q6k_r16 * out = group;
    const sdmm_block_q6_K * b = src;
    int q[SDMM_QK];
    for (int v = 0; v < SDMM_QK; v++) {
        q[v] = q6k_src(b, v);
    }
    pack_row_256x6(out, r, b->d, b->scales, q);
}

static void pack_row_q2k(void * group, int r, const void * src) {
    sdmm_q2k_r16 * out = group;
    const sdmm_block_q2_K * b = src;
    out->d[r] = b->d;
    out->dmin[r] = b->dmin;
    for (int j = 0; j < 16; j++) {
        out->sc[j][r] = b->scales[j] & 0xF;
        out->m[j / 2][r][j % 2] = b->scales[j] >> 4;
        for (int t = 0; t < 4; t++) {
            uint8_t byte = 0;
            for (int c = 0; c < 4; c++) {
                byte |= (uint8_t) (q2k_src(b, 16 * j + 4 * c + t) << (2 * c));
            }
            out->qs[j][4 * r + t] = byte;
        }
    }
}

/* IQ4_XS: Q4_K's quant layout for its indices, ls - 32 as the scale */
static void pack_row_iq4xs(void * group, int r, const void * src) {
    sdmm_iq4xs_r16 * out = group;
    const sdmm_block_iq4_xs * b = src;
    out->d[r] = b->d;
    for (int j = 0; j < 8; j++) {
        out->sc[j][r] = (int8_t) (iq4xs_ls(b, j) - 32);
        for (int c = 0; c < 4; c++) {
            for (int t = 0; t < 4; t++) {
                const int lo = nibble_src(b->qs + 16 * j, 4 * c + t);
                const int hi = nibble_src(b->qs + 16 * j, 16 + 4 * c + t);
                out->qs[j][c][4 * r + t] = (uint8_t) (lo | hi << 4);
            }
        }
    }
}

/* F16, BF16: a 32-value block's 16-bit patterns, as stored */
static void pack_row_f16(void * group, int r, const void * src) {
    sdmm_f16_r16 * out = group;
    const uint16_t * w = src;
    for (int c = 0; c < 32; c++) {
        out->w[c][r] = w[c];
    }
}

/* Q3_K's quant q (value d*sc*(q - 4)) as q + 28 in Q6_K's group: d*sc*(q + 28 - 32) */
static void pack_row_q3k(void * group, int r, const void * src) {
    sdmm_q6k_r16 * out = group;
    const sdmm_block_q3_K * b = src;
    int q[SDMM_QK];
    int8_t sc[16];
    for (int v = 0; v < SDMM_QK; v++) {
        q[v] = q3k_src(b, v) + 28;
    }
    for (int i = 0; i < 16; i++) {
        sc[i] = (int8_t) q3k_scale(b, i);
    }
    pack_row_256x6(out, r, b->d, sc, q);
}

/* row r of a 4- or 5-bit 32-value group from its block's low nibbles qs and fifth bits qh4
 * (NULL: none): the group's qs[c] and qh (NULL: none) */
static void pack_row_32(uint8_t (*qs)[64], uint8_t * qh, int r, const uint8_t * src_qs,
                        const uint8_t * src_qh4) {
    for (int c = 0; c < 4; c++) {
        for (int t = 0; t < 4; t++) {
            const int v = 4 * c + t;
            const int lo = src_qh4 ? q5_src(src_qs, src_qh4, v) : nibble_src(src_qs, v);
            const int hi = src_qh4 ? q5_src(src_qs, src_qh4, 16 + v) : nibble_src(src_qs, 16 + v);
            qs[c][4 * r + t] = (uint8_t) ((lo & 0xF) | (hi & 0xF) << 4);
            if (qh != NULL) {
                qh[4 * r + t] |= (uint8_t) ((lo >> 4) << c | (hi >> 4) << (4 + c));
            }
        }
    }
}

static void pack_row_q4_0(void * group, int r, const void * src) {
    sdmm_q4_0_r16 * out = group;
    const sdmm_block_q4_0 * b = src;
    out->d[r] = b->d;
    pack_row_32(out->qs, NULL, r, b->qs, NULL);
}

static void pack_row_q4_1(void * group, int r, const void * src) {
    sdmm_q4_1_r16 * out = group;
    const sdmm_block_q4_1 * b = src;
    out->d[r] = b->d;
    out->m[r] = b->m;
    pack_row_32(out->qs, NULL, r, b->qs, NULL);
}

static void pack_row_q5_0(void * group, int r, const void * src) {
    sdmm_q5_0_r16 * out = group;
    const sdmm_block_q5_0 * b = src;
    out->d[r] = b->d;
    pack_row_32(out->qs, out->qh, r, b->qs, b->qh);
}

static void pack_row_q5_1(void * group, int r, const void * src) {
    sdmm_q5_1_r16 * out = group;
    const sdmm_block_q5_1 * b = src;
    out->q.d[r] = b->d;
    out->m[r] = b->m;
    pack_row_32(out->q.qs, out->q.qh, r, b->qs, b->qh);
}

static void pack_row_q8_0(void * group, int r, const void * src) {
    sdmm_q8_0_r16 * out = group;
    const sdmm_block_q8_0 * b = src;
    out->d[r] = b->d;
    for (int v = 0; v < 32; v++) {
        out->qs[v / 4][4 * r + v % 4] = (uint8_t) (b->qs[v] + 128);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* activations: ggml's quantize_row_q8_K_ref (K-quants) or quantize_row_q8_0_ref's rule with a
 * float scale (the 32-value types), operation for operation, plus the sums                  */

static int nearest_int(float fval) {
    const float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof(int));
    return (i & 0x007fffff) - 0x00400000;
}

static void quantize_row_q8_0(const float * x, int64_t k, sdmm_act32 * out, size_t stride) {
    for (int64_t s = 0; s < k / 32; s++, x += 32) {
        sdmm_act32 * a = out + (size_t) s * stride;
        memset(a, 0, sizeof(*a));
        float amax = 0;
        for (int j = 0; j < 32; j++) {
            amax = fmaxf(amax, fabsf(x[j]));
        }
        const float d = amax / 127;
        const float id = d != 0 ? 1.0f / d : 0.0f;
        for (int j = 0; j < 32; j++) {
            /* |x id| <= 127 (1 + 3 eps) for finite x; the clamp keeps the conversion defined for
             * an inf, a nan or a subnormal amax (fmaxf takes -127 over a nan) */
            const float v = fminf(fmaxf(x[j] * id, -127.0f), 127.0f);
            a->qs[j] = (int8_t) roundf(v);
            a->sum += a->qs[j];
        }
        a->d = d;
    }
}

static void quantize_row_q8_K(const float * x, int64_t k, sdmm_act * out, size_t stride) {
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
            a->b16[j] = (int16_t) sum;
            a->b32[j / 2] = (int16_t) (a->b32[j / 2] + sum);
            int lo = 0; /* quants 16j + i with i % 4 < 2: the low 16-bit half of a lane */
            for (int i = 0; i < 16; i += 4) {
                lo += a->qs[16 * j + i] + a->qs[16 * j + i + 1];
            }
            a->o16[j] = (uint16_t) (-32 * lo) | (uint32_t) (uint16_t) (-32 * (sum - lo)) << 16;
        }
        a->d = 1 / iscale;
    }
}

static uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float f32_from_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* fp32 -> fp16, rounding to nearest even (ggml's ggml_compute_fp32_to_fp16 without F16C; F16C's
 * conversion gives the same bits for every number) */
static uint16_t sd_f2h(float f) {
    float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;
    const uint32_t w = f32_bits(f), shl1_w = w + w, sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) {
        bias = 0x71000000u;
    }
    base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
    return (uint16_t) ((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

/* fp32 -> bf16, rounding to nearest even, a nan kept quiet (ggml's ggml_compute_fp32_to_bf16) */
static uint16_t sd_f2bf(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (uint16_t) ((u >> 16) | 64);
    }
    return (uint16_t) ((u + (0x7fffu + ((u >> 16) & 1))) >> 16);
}

static float sd_bf2f(uint16_t h) {
    return f32_from_bits((uint32_t) h << 16);
}

/* the float types' activations: each value rounded to the weight's type, as ggml converts them
 * (its vec_dot_type for F16 is F16, for BF16 BF16), held as floats */
static void round_row(int type, const float * x, int64_t k, sdmm_actf * out, size_t stride) {
    for (int64_t s = 0; s < k / 32; s++, x += 32) {
        sdmm_actf * a = out + (size_t) s * stride;
        for (int j = 0; j < 32; j++) {
            a->x[j] = type == SDMM_TYPE_BF16 ? sd_bf2f(sd_f2bf(x[j])) : sd_h2f(sd_f2h(x[j]));
        }
    }
}

static int float_type(int type) {
    return type == SDMM_TYPE_F16 || type == SDMM_TYPE_BF16;
}

void sdmm_quantize_row(int type, const float * x, int64_t k, void * out, size_t stride) {
    if (float_type(type)) {
        round_row(type, x, k, (sdmm_actf *) out, stride);
    } else if (sdmm_block_cols(type) == SDMM_QK) {
        quantize_row_q8_K(x, k, (sdmm_act *) out, stride);
    } else {
        quantize_row_q8_0(x, k, (sdmm_act32 *) out, stride);
    }
}

/* ------------------------------------------------------------------------------------------ */
/* the reference kernels: the same operations as the SIMD ones, one lane at a time            */

/* row r of a Q4_K group's super-block blk against one activation super-block A: acc plus its two
 * float terms; Q5_K's with its fifth bits qh (NULL: Q4_K) */
static float q4k_ref_block(const sdmm_q4k_r16 * blk, const uint8_t (*qh)[64], int r,
                           const sdmm_act * A, float acc) {
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 8; j++) {
        int32_t dot = 0;
        for (int v = 0; v < 32; v++) {
            const int c = (v % 16) / 4, bit = v < 16 ? c : 4 + c;
            const int hi = qh != NULL ? ((qh[j][4 * r + v % 4] >> bit) & 1) << 4 : 0;
            dot += (q4k_packed(blk, r, j, v) | hi) * A->qs[32 * j + v];
        }
        sumi += dot * blk->sc[j][r];
        summ += blk->m[j / 2][r][j % 2] * A->b32[j];
    }
    const float f1 = sd_h2f(blk->d[r]) * A->d;
    const float f2 = sd_h2f(blk->dmin[r]) * A->d;
    acc = fmaf((float) sumi, f1, acc);
    return fmaf(-(float) summ, f2, acc);
}

/* the same for Q2_K: 16 sub-blocks of 16 values, a scale and a min each */
static float q2k_ref_block(const sdmm_q2k_r16 * blk, int r, const sdmm_act * A, float acc) {
    int32_t sumi = 0, summ = 0;
    for (int j = 0; j < 16; j++) {
        int32_t dot = 0;
        for (int v = 0; v < 16; v++) {
            dot += q2k_packed(blk, r, j, v) * A->qs[16 * j + v];
        }
        sumi += dot * blk->sc[j][r];
        summ += blk->m[j / 2][r][j % 2] * A->b16[j];
    }
    acc = fmaf((float) sumi, sd_h2f(blk->d[r]) * A->d, acc);
    return fmaf(-(float) summ, sd_h2f(blk->dmin[r]) * A->d, acc);
}

/* the same for IQ4_XS: acc plus its float term */
static float iq4xs_ref_block(const sdmm_iq4xs_r16 * blk, int r, const sdmm_act * A, float acc) {
    int32_t sumi = 0;
    for (int j = 0; j < 8; j++) {
        int32_t dot = 0;
        for (int v = 0; v < 32; v++) {
            dot += KVALUES_IQ4NL[nibble_packed(blk->qs, r, j, v)] * A->qs[32 * j + v];
        }
        sumi += dot * blk->sc[j][r];
    }
    return fmaf((float) sumi, sd_h2f(blk->d[r]) * A->d, acc);
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

/* Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL: the integer dot product of a 32-value block (its quants less
 * `offset`, or IQ4_NL's values of them: kv not NULL), then its float terms, the mins' (m16 not
 * NULL) last */
static float q32_ref_block(const sdmm_half * d16, const sdmm_half * m16, const uint8_t * qh,
                           const uint8_t (*qs)[64], int offset, const int8_t * kv, int r,
                           const sdmm_act32 * A, float acc) {
    int32_t sumi = 0;
    for (int v = 0; v < 32; v++) {
        const int q = q32_packed(qs, qh, r, v);
        sumi += (kv != NULL ? kv[q] : q - offset) * A->qs[v];
    }
    acc = fmaf((float) sumi, sd_h2f(d16[r]) * A->d, acc);
    return m16 != NULL ? fmaf((float) A->sum, sd_h2f(m16[r]) * A->d, acc) : acc;
}

/* F16, BF16: one fma per value, in order */
static float f16_ref_block(const sdmm_f16_r16 * blk, int bf16, int r, const sdmm_actf * A,
                           float acc) {
    for (int c = 0; c < 32; c++) {
        const float w = bf16 ? sd_bf2f(blk->w[c][r]) : sd_h2f(blk->w[c][r]);
        acc = fmaf(w, A->x[c], acc);
    }
    return acc;
}

/* Q8_0: the integer dot product of a 32-value block, then its float term */
static float q8_0_ref_block(const sdmm_q8_0_r16 * blk, int r, const sdmm_act32 * A, float acc) {
    int32_t sumi = 0;
    for (int v = 0; v < 32; v++) {
        sumi += q8_0_packed(blk, r, v) * A->qs[v];
    }
    return fmaf((float) sumi, sd_h2f(blk->d[r]) * A->d, acc);
}

/* the reference kernel's step for each group layout, in the table's one signature */
static float ref_q4k(const void * blk, int r, const void * A, float acc) {
    return q4k_ref_block(blk, NULL, r, A, acc);
}
static float ref_q5k(const void * blk, int r, const void * A, float acc) {
    const sdmm_q5k_r16 * g = blk;
    return q4k_ref_block(&g->lo, g->qh, r, A, acc);
}
static float ref_q6k(const void * blk, int r, const void * A, float acc) {
    return q6k_ref_block(blk, r, A, acc);
}
static float ref_q4_0(const void * blk, int r, const void * A, float acc) {
    const sdmm_q4_0_r16 * g = blk;
    return q32_ref_block(g->d, NULL, NULL, g->qs, 8, NULL, r, A, acc);
}
static float ref_q4_1(const void * blk, int r, const void * A, float acc) {
    const sdmm_q4_1_r16 * g = blk;
    return q32_ref_block(g->d, g->m, NULL, g->qs, 0, NULL, r, A, acc);
}
static float ref_q5_0(const void * blk, int r, const void * A, float acc) {
    const sdmm_q5_0_r16 * g = blk;
    return q32_ref_block(g->d, NULL, g->qh, g->qs, 16, NULL, r, A, acc);
}
static float ref_q5_1(const void * blk, int r, const void * A, float acc) {
    const sdmm_q5_1_r16 * g = blk;
    return q32_ref_block(g->q.d, g->m, g->q.qh, g->q.qs, 0, NULL, r, A, acc);
}
static float ref_q8_0(const void * blk, int r, const void * A, float acc) {
    return q8_0_ref_block(blk, r, A, acc);
}
static float ref_q2k(const void * blk, int r, const void * A, float acc) {
    return q2k_ref_block(blk, r, A, acc);
}
static float ref_iq4xs(const void * blk, int r, const void * A, float acc) {
    return iq4xs_ref_block(blk, r, A, acc);
}
static float ref_iq4nl(const void * blk, int r, const void * A, float acc) {
    const sdmm_iq4nl_r16 * g = blk;
    return q32_ref_block(g->d, NULL, NULL, g->qs, 0, KVALUES_IQ4NL, r, A, acc);
}
static float ref_f16(const void * blk, int r, const void * A, float acc) {
    return f16_ref_block(blk, 0, r, A, acc);
}
static float ref_bf16(const void * blk, int r, const void * A, float acc) {
    return f16_ref_block(blk, 1, r, A, acc);
}

/* ------------------------------------------------------------------------------------------ */
/* the types                                                                                  */

/* a group layout's kernels, by path (NULL where the path is not compiled in) */
#if SD_BUILDS_AVXVNNI
#    define SDMM_AVXVNNI_(g) sdmm_kernel_##g##_avxvnni
#else
#    define SDMM_AVXVNNI_(g) NULL
#endif
#if SD_BUILDS_AVX512_VNNI
#    define SDMM_AVX512_(g) sdmm_kernel_##g##_avx512
#else
#    define SDMM_AVX512_(g) NULL
#endif
#if SD_X86
#    define SDMM_KERNELS_(g) \
        {sdmm_kernel_##g##_ref, sdmm_kernel_##g##_avx2, SDMM_AVXVNNI_(g), SDMM_AVX512_(g)}
#else
#    define SDMM_KERNELS_(g) {sdmm_kernel_##g##_ref}
#endif

/* The types sdmm multiplies: the one place that says, per type, how many values a block holds,
 * ggml's block and sdmm's 16-row group of it, how a row is packed into the group and which
 * kernels multiply it. Q3_K is packed into Q6_K's group (each quant the same value) and runs its
 * kernels; IQ4_NL's block is Q4_0's layout, packed alike. */
static const struct {
    int type, cols;
    size_t src_bytes, group_bytes;
    void (*pack)(void * group, int r, const void * src); /* row r of a group from its block */
    float (*ref)(const void * blk, int r, const void * A, float acc); /* reference: one block */
    sdmm_kernel_fn kernel[SD_ISA_COUNT];
} TYPES[] = {
    {SDMM_TYPE_Q3_K, SDMM_QK, sizeof(sdmm_block_q3_K), sizeof(sdmm_q6k_r16), pack_row_q3k,
     ref_q6k, SDMM_KERNELS_(q6k)},
    {SDMM_TYPE_Q4_K, SDMM_QK, sizeof(sdmm_block_q4_K), sizeof(sdmm_q4k_r16), pack_row_q4k,
     ref_q4k, SDMM_KERNELS_(q4k)},
    {SDMM_TYPE_Q5_K, SDMM_QK, sizeof(sdmm_block_q5_K), sizeof(sdmm_q5k_r16), pack_row_q5k,
     ref_q5k, SDMM_KERNELS_(q5k)},
    {SDMM_TYPE_Q6_K, SDMM_QK, sizeof(sdmm_block_q6_K), sizeof(sdmm_q6k_r16), pack_row_q6k,
     ref_q6k, SDMM_KERNELS_(q6k)},
    {SDMM_TYPE_Q4_0, 32, sizeof(sdmm_block_q4_0), sizeof(sdmm_q4_0_r16), pack_row_q4_0, ref_q4_0,
     SDMM_KERNELS_(q4_0)},
    {SDMM_TYPE_Q4_1, 32, sizeof(sdmm_block_q4_1), sizeof(sdmm_q4_1_r16), pack_row_q4_1, ref_q4_1,
     SDMM_KERNELS_(q4_1)},
    {SDMM_TYPE_Q5_0, 32, sizeof(sdmm_block_q5_0), sizeof(sdmm_q5_0_r16), pack_row_q5_0, ref_q5_0,
     SDMM_KERNELS_(q5_0)},
    {SDMM_TYPE_Q5_1, 32, sizeof(sdmm_block_q5_1), sizeof(sdmm_q5_1_r16), pack_row_q5_1, ref_q5_1,
     SDMM_KERNELS_(q5_1)},
    {SDMM_TYPE_Q8_0, 32, sizeof(sdmm_block_q8_0), sizeof(sdmm_q8_0_r16), pack_row_q8_0, ref_q8_0,
     SDMM_KERNELS_(q8_0)},
    {SDMM_TYPE_Q2_K, SDMM_QK, sizeof(sdmm_block_q2_K), sizeof(sdmm_q2k_r16), pack_row_q2k,
     ref_q2k, SDMM_KERNELS_(q2k)},
    {SDMM_TYPE_IQ4_XS, SDMM_QK, sizeof(sdmm_block_iq4_xs), sizeof(sdmm_iq4xs_r16),
     pack_row_iq4xs, ref_iq4xs, SDMM_KERNELS_(iq4xs)},
    {SDMM_TYPE_IQ4_NL, 32, sizeof(sdmm_block_iq4_nl), sizeof(sdmm_iq4nl_r16), pack_row_q4_0,
     ref_iq4nl, SDMM_KERNELS_(iq4nl)},
    {SDMM_TYPE_F16, 32, 32 * sizeof(uint16_t), sizeof(sdmm_f16_r16), pack_row_f16, ref_f16,
     SDMM_KERNELS_(f16)},
    {SDMM_TYPE_BF16, 32, 32 * sizeof(uint16_t), sizeof(sdmm_f16_r16), pack_row_f16, ref_bf16,
     SDMM_KERNELS_(bf16)},
};
#undef SDMM_KERNELS_
#define SDMM_NTYPES ((int) (sizeof(TYPES) / sizeof(TYPES[0])))

static int type_index(int type) { /* -1: not a type sdmm multiplies */
    for (int i = 0; i < SDMM_NTYPES; i++) {
        if (TYPES[i].type == type) {
            return i;
        }
    }
    return -1;
}

int sdmm_supported_type(int type) {
    return type_index(type) >= 0;
}

int sdmm_block_cols(int type) {
    const int i = type_index(type);
    return i < 0 ? SDMM_QK : TYPES[i].cols;
}

size_t sdmm_group_bytes(int type) {
    const int i = type_index(type);
    return i < 0 ? 0 : TYPES[i].group_bytes;
}

size_t sdmm_act_bytes(int type) {
    if (float_type(type)) {
        return sizeof(sdmm_actf);
    }
    return sdmm_block_cols(type) == SDMM_QK ? sizeof(sdmm_act) : sizeof(sdmm_act32);
}

size_t sdmm_packed_size(int type, int64_t n, int64_t k) {
    return (size_t) ((n + SDMM_R - 1) / SDMM_R) * (size_t) (k / sdmm_block_cols(type)) *
           sdmm_group_bytes(type);
}

void sdmm_pack(int type, const void * src, int64_t n, int64_t k, void * dst) {
    const int i = type_index(type);
    if (i < 0) {
        return;
    }
    const size_t out_bytes = TYPES[i].group_bytes, in_bytes = TYPES[i].src_bytes;
    const int64_t nb = k / TYPES[i].cols;
    for (int64_t g = 0; g < (n + SDMM_R - 1) / SDMM_R; g++) {
        for (int64_t s = 0; s < nb; s++) {
            char * out = (char *) dst + (size_t) (g * nb + s) * out_bytes;
            memset(out, 0, out_bytes); /* rows past n stay zero: d = 0, outputs not stored */
            for (int r = 0; r < SDMM_R && g * SDMM_R + r < n; r++) {
                const size_t row_block = (size_t) ((g * SDMM_R + r) * nb + s);
                TYPES[i].pack(out, r, (const char *) src + row_block * in_bytes);
            }
        }
    }
}

/* sdmm_kernel_fn for `type`, one output at a time: the blocks in order into one float */
static void kernel_ref(int type, const void * w, int nsb, int ngroups, int n_valid,
                       const void * a, int b, float * y, size_t ldy) {
    const char * groups = (const char *) w;
    const size_t group_bytes = sdmm_group_bytes(type), act_bytes = sdmm_act_bytes(type);
    float (*const ref)(const void *, int, const void *, float) = TYPES[type_index(type)].ref;
    for (int g = 0; g < ngroups; g++) {
        for (int i = 0; i < b; i++) {
            for (int r = 0; r < SDMM_R && g * SDMM_R + r < n_valid; r++) {
                float acc = 0.0f;
                for (int s = 0; s < nsb; s++) {
                    const void * blk = groups + ((size_t) g * nsb + s) * group_bytes;
                    const void * A = (const char *) a + ((size_t) s * b + i) * act_bytes;
                    acc = ref(blk, r, A, acc);
                }
                y[(size_t) i * ldy + g * SDMM_R + r] = acc;
            }
        }
    }
}

#define SDMM_REF_(name, type)                                                                \
    void name(const void * w, int nsb, int ngroups, int n_valid, const void * a, int b,      \
              float * y, size_t ldy) {                                                       \
        kernel_ref(type, w, nsb, ngroups, n_valid, a, b, y, ldy);                            \
    }
SDMM_REF_(sdmm_kernel_q4k_ref, SDMM_TYPE_Q4_K)
SDMM_REF_(sdmm_kernel_q5k_ref, SDMM_TYPE_Q5_K)
SDMM_REF_(sdmm_kernel_q6k_ref, SDMM_TYPE_Q6_K)
SDMM_REF_(sdmm_kernel_q4_0_ref, SDMM_TYPE_Q4_0)
SDMM_REF_(sdmm_kernel_q4_1_ref, SDMM_TYPE_Q4_1)
SDMM_REF_(sdmm_kernel_q5_0_ref, SDMM_TYPE_Q5_0)
SDMM_REF_(sdmm_kernel_q5_1_ref, SDMM_TYPE_Q5_1)
SDMM_REF_(sdmm_kernel_q8_0_ref, SDMM_TYPE_Q8_0)
SDMM_REF_(sdmm_kernel_q2k_ref, SDMM_TYPE_Q2_K)
SDMM_REF_(sdmm_kernel_iq4xs_ref, SDMM_TYPE_IQ4_XS)
SDMM_REF_(sdmm_kernel_iq4nl_ref, SDMM_TYPE_IQ4_NL)
SDMM_REF_(sdmm_kernel_f16_ref, SDMM_TYPE_F16)
SDMM_REF_(sdmm_kernel_bf16_ref, SDMM_TYPE_BF16)
#undef SDMM_REF_

/* ------------------------------------------------------------------------------------------ */
/* dispatch                                                                                   */

int sdmm_isa_supported(int isa) {
    return sd_isa_runs(isa);
}

int sdmm_isa_selected(void) {
    static int selected = -2;
    return sd_isa_select_once(&selected, sdmm_isa_supported);
}

sdmm_kernel_fn sdmm_kernel(int type, int isa) {
    const int t = type_index(type);
    if (t < 0 || isa < 0 || isa >= SD_ISA_COUNT || !sdmm_isa_supported(isa)) {
        return NULL;
    }
    return TYPES[t].kernel[isa]; /* NULL where the path is not compiled in */
}

double sdmm_peak_macs(long iters) {
#if SD_X86
    switch (sdmm_isa_selected()) {
#    if SD_BUILDS_AVX512_VNNI
        case SD_ISA_AVX512:
            return sdmm_avx512_peak_macs(iters);
#    endif
#    if SD_BUILDS_AVXVNNI
        case SD_ISA_AVXVNNI:
            return sdmm_avxvnni_peak_macs(iters);
#    endif
        case SD_ISA_AVX2:
            return sdmm_avx2_peak_macs(iters);
        default:
            break;
    }
#endif
    (void) iters;
    return 0.0;
}

int sdmm_matmul(int type, int isa, const void * packed, int64_t n, int64_t k, const float * x,
                int64_t b, float * y) {
    const sdmm_kernel_fn kernel = sdmm_kernel(type, isa);
    if (kernel == NULL || k % sdmm_block_cols(type) != 0 || n < 1 || b < 1) {
        return -1;
    }
    const int64_t nsb = k / sdmm_block_cols(type);
    const size_t act_bytes = sdmm_act_bytes(type);
    char * acts = (char *) malloc((size_t) (b * nsb) * act_bytes);
    if (acts == NULL) {
        return -1;
    }
    for (int64_t i = 0; i < b; i++) {
        sdmm_quantize_row(type, x + i * k, k, acts + (size_t) i * act_bytes, (size_t) b);
    }
    kernel(packed, (int) nsb, (int) ((n + SDMM_R - 1) / SDMM_R), (int) n, acts, (int) b, y,
           (size_t) n);
    free(acts);
    return 0;
}
