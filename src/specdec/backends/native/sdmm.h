/* sdmm: specdec's matrix multiply for quantized weights (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS;
 * Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) and float weights (F16, BF16) times
 * activations of any number of rows, written for the 1..64-row batches a speculative verify runs
 * (and the single steps of a draft model), and batch-invariant by construction.
 *
 * Why: a verify pass scores K+1 tokens at once. ggml's CPU kernels pick a different code path, and
 * so a different float summation order, for a single row (GEMV) than for a batch (repacked GEMM,
 * tiled GEMM), so row i of a batch differs from the single step of token i in the last bits and
 * greedy speculation drifts from greedy target-only decoding at near-ties. Here every output
 * element y[i][r] is computed by the same instruction sequence whatever the number of rows, the
 * instruction set or the thread count:
 *   - integer part: sub-block dot products of u8 weights and s8 activations, exact in any order
 *     (VNNI's vpdpbusd and AVX2's maddubs+madd give the same 32-bit sums), times the sub-block
 *     scale, summed in int32;
 *   - float part, per block s in order (a super-block of 256 values for the K-quants, a block of
 *     32 for the others), in one SIMD lane per weight row:
 *       Q4_K, Q5_K: acc = fma(float(sumi), d*da, acc); acc = fma(-float(summ), dmin*da, acc)
 *       Q4_1, Q5_1: acc = fma(float(sumi), d*da, acc); acc = fma(float(suma), m*da, acc)
 *       Q6_K, Q4_0, Q5_0, Q8_0: acc = fma(float(sumi), d*da, acc)
 *     (`d*da` rounded once to float; suma: the activation block's sum of quants); Q3_K is packed
 *     into Q6_K's group (each quant the same value) and runs its kernel. A lane's arithmetic never
 *     depends on its neighbours, and a
 *     row's K loop is never split across threads;
 *   - float weights (F16, BF16) have no integer part: the activations are rounded to the
 *     weight's type, as ggml rounds them, and each lane runs one fma chain over k in order,
 *     acc = fma(w, x, acc), in 32-value blocks.
 * The scalar reference (SD_ISA_REF) spells out the same operations with fmaf, so every path
 * gives the same bits (tests/test_kernels.py checks it).
 *
 * Layout: weights are repacked at load into groups of SDMM_R = 16 rows, one SIMD lane per row:
 * a 64-byte load holds 4 consecutive quants of each of the 16 rows, so one vpdpbusd multiplies
 * 4 columns of 16 weight rows by 4 columns of one activation row (broadcast). Each weight byte
 * is read from memory once for up to 64 activation rows and unpacked once per tile of them.
 *
 * Activations are quantized per row as ggml quantizes them for the type: to Q8_K for the
 * K-quants and IQ4_XS (quantize_row_q8_K_ref, reproduced exactly; sdmm_act), to 32-value blocks
 * with a float scale for the other quantized types (quantize_row_q8_0_ref's rule, the scale kept
 * in float; sdmm_act32), with the sums the kernels need precomputed; rounded to fp16 or bf16 for
 * the float types (sdmm_actf).
 *
 * Glossary: n = weight rows (outputs per activation row), k = columns (the reduction length, a
 * multiple of the type's block: sdmm_block_cols), b = activation rows (tokens), nsb = k /
 * sdmm_block_cols blocks per row.
 */
#pragma once

#include "sd-isa.h"

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define SDMM_QK 256 /* values per super-block (ggml's QK_K) */
#define SDMM_R 16   /* weight rows per repacked group: one 32-bit SIMD lane each in a zmm */
/* How far ahead of the super-block being multiplied the kernels prefetch weights, into L2. Past
 * a few rows of activations a super-block takes long enough that the hardware prefetchers fall
 * behind and memory latency shows (measured: on an Intel Xeon, 8 rows x a 151,936-row Q4_K
 * matrix ran 2.4x slower than from cache without a prefetch; on an AMD EPYC, 8 rows x the Q6_K
 * output matrix ran twice as slow with none or with one 4 KiB ahead into L1 as with this one).
 * The K-quants' kernels issue it a share per sub-block, not a block's lines at once (sdmm_ahead). */
#define SDMM_PREFETCH_BYTES 16384

/* ggml type ids of the weight types sdmm multiplies (ggml.h's enum ggml_type; sdmm-buft.cpp
 * checks them against it at compile time) */
#define SDMM_TYPE_F16 1
#define SDMM_TYPE_Q4_0 2
#define SDMM_TYPE_Q4_1 3
#define SDMM_TYPE_Q5_0 6
#define SDMM_TYPE_Q5_1 7
#define SDMM_TYPE_Q8_0 8
#define SDMM_TYPE_Q2_K 10
#define SDMM_TYPE_Q3_K 11
#define SDMM_TYPE_Q4_K 12
#define SDMM_TYPE_Q5_K 13
#define SDMM_TYPE_Q6_K 14
#define SDMM_TYPE_IQ4_NL 20
#define SDMM_TYPE_IQ4_XS 23
#define SDMM_TYPE_BF16 30

typedef uint16_t sdmm_half; /* IEEE binary16 bits */

/* ggml's block layouts (ggml-common.h), mirrored so that the kernels build without ggml */
typedef struct {
    sdmm_half d, dmin;
    uint8_t scales[12]; /* 8 six-bit scales and 8 six-bit mins, packed */
    uint8_t qs[128];    /* 4-bit quants */
} sdmm_block_q4_K;

typedef struct {
    uint8_t scales[16]; /* sub-block j (16 values): scale (low 4 bits), min (high 4 bits) */
    uint8_t qs[64];     /* 2 bits: value 128n + 32i + l at bits 2i of byte 32n + l */
    sdmm_half d, dmin;
} sdmm_block_q2_K;

typedef struct {
    uint8_t hmask[32];  /* bit 4i + j of byte l: the third bit of value 128i + 32j + l (+ 16) */
    uint8_t qs[64];     /* low 2 bits */
    uint8_t scales[12]; /* 16 six-bit scales, stored + 32, packed */
    sdmm_half d;
} sdmm_block_q3_K;

typedef struct {
    sdmm_half d, dmin;
    uint8_t scales[12]; /* as Q4_K's */
    uint8_t qh[32];     /* bit 2c (2c+1) of byte l: the fifth bit of value 64c + l (64c + 32 + l) */
    uint8_t qs[128];    /* low 4 bits, as Q4_K's quants */
} sdmm_block_q5_K;

typedef struct {
    uint8_t ql[128];   /* low 4 bits */
    uint8_t qh[64];    /* high 2 bits */
    int8_t scales[16]; /* one per 16 values */
    sdmm_half d;
} sdmm_block_q6_K;

typedef struct {
    sdmm_half d;
    uint8_t qs[16]; /* 4 bits: values v (low nibble) and v + 16 (high) */
} sdmm_block_q4_0;
typedef struct {
    sdmm_half d, m;
    uint8_t qs[16]; /* as Q4_0's; value d*q + m */
} sdmm_block_q4_1;
typedef struct {
    sdmm_half d;
    uint8_t qh[4];  /* bit v: the fifth bit of value v */
    uint8_t qs[16]; /* low 4 bits: values v (low nibble) and v + 16 (high) */
} sdmm_block_q5_0;
typedef struct {
    sdmm_half d, m;
    uint8_t qh[4];  /* as Q5_0's; value d*q + m */
    uint8_t qs[16];
} sdmm_block_q5_1;

typedef struct {
    sdmm_half d;
    int8_t qs[32];
} sdmm_block_q8_0;

/* IQ4_XS: value d*(ls - 32)*kvalues[q] for 4-bit indices q, a 6-bit ls per 32 values (the low 4
 * bits in scales_l, nibble j % 2 of byte j / 2; the high 2 in scales_h, bits 2j) */
typedef struct {
    sdmm_half d;
    uint16_t scales_h;
    uint8_t scales_l[4];
    uint8_t qs[128]; /* sub-block j (32 values): 16 bytes, values l (low nibble), l + 16 (high) */
} sdmm_block_iq4_xs;
/* IQ4_NL: value d*kvalues[q], a 32-value block */
typedef struct {
    sdmm_half d;
    uint8_t qs[16]; /* values v (low nibble) and v + 16 (high) */
} sdmm_block_iq4_nl;
/* The IQ4 types' 16 values (ggml-common.h's kvalues_iq4nl) */
#define SDMM_KVALUES_IQ4NL {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113}

/* Q4_K, 16 rows, one super-block: 2,368 bytes (16 ggml blocks: 2,304). Quants are unsigned
 * 0..15; value = d*sc*q - dmin*m. */
typedef struct {
    sdmm_half d[SDMM_R], dmin[SDMM_R];
    uint8_t sc[8][SDMM_R];   /* sub-block j (32 values) scale of row r */
    uint8_t m[4][SDMM_R][2]; /* mins of sub-blocks 2i and 2i+1 of row r (an int16 pair per lane) */
    /* sub-block j, load c (0..3): byte 4r+t = q(r, 32j+4c+t) | q(r, 32j+16+4c+t) << 4 */
    uint8_t qs[8][4][64];
} sdmm_q4k_r16;

/* Q5_K, 16 rows, one super-block: 2,880 bytes (16 ggml blocks: 2,816). Q4_K's group for the
 * low 4 bits, then the fifth bits; quants 0..31, value = d*sc*q - dmin*m. */
typedef struct {
    sdmm_q4k_r16 lo;
    /* sub-block j: byte 4r+t bit c = hi1(32j+4c+t), bit 4+c = hi1(32j+16+4c+t) (Q5_0's qh) */
    uint8_t qh[8][64];
} sdmm_q5k_r16;

/* Q6_K, 16 rows, one super-block: 3,360 bytes (16 ggml blocks: 3,360). Quants are stored
 * unsigned 0..63; value = d*sc*(q - 32). Q3_K (value d*sc*(q - 4), q 0..7) is packed into it
 * with its quants stored as q + 28: the same value, at 1.9x Q3_K's bytes. */
typedef struct {
    sdmm_half d[SDMM_R];
    int8_t sc[16][SDMM_R]; /* sub-block j (16 values) scale of row r */
    /* sub-block j: ql[j][0] byte 4r+t = lo4(16j+t) | lo4(16j+8+t) << 4,
     *              ql[j][1] byte 4r+t = lo4(16j+4+t) | lo4(16j+12+t) << 4,
     *              qh[j]    byte 4r+t = hi2(16j+t) | hi2(16j+4+t) << 2 | hi2(16j+8+t) << 4
     *                                   | hi2(16j+12+t) << 6 */
    uint8_t ql[16][2][64];
    uint8_t qh[16][64];
} sdmm_q6k_r16;

/* Q2_K, 16 rows, one super-block: 1,600 bytes (16 ggml blocks: 1,344). Quants 0..3; value =
 * d*sc*q - dmin*m, a scale and a min per 16 values. */
typedef struct {
    sdmm_half d[SDMM_R], dmin[SDMM_R];
    uint8_t sc[16][SDMM_R];   /* sub-block j (16 values) scale of row r, 0..15 */
    uint8_t m[8][SDMM_R][2];  /* mins of sub-blocks 2i and 2i+1 of row r (an int16 pair per lane) */
    /* sub-block j: byte 4r+t = q(16j+t) | q(16j+4+t) << 2 | q(16j+8+t) << 4 | q(16j+12+t) << 6 */
    uint8_t qs[16][64];
} sdmm_q2k_r16;

/* IQ4_XS, 16 rows, one super-block: 2,208 bytes (16 ggml blocks: 2,176). 4-bit indices into
 * the IQ4 values (SDMM_KVALUES_IQ4NL), looked up in registers; value = d*sc*kvalues[q]. */
typedef struct {
    sdmm_half d[SDMM_R];
    int8_t sc[8][SDMM_R]; /* sub-block j (32 values) scale of row r, ls - 32: -32..31 */
    uint8_t qs[8][4][64]; /* as Q4_K's: byte 4r+t = q(32j+4c+t) | q(32j+16+4c+t) << 4 */
} sdmm_iq4xs_r16;

/* F16 and BF16, 16 rows, one block of 32 values: 1,024 bytes (16 rows of 32 values: 1,024).
 * w[c][r]: value c of row r, its 16-bit pattern as stored. */
typedef struct {
    uint16_t w[32][SDMM_R];
} sdmm_f16_r16;

/* Q4_0, 16 rows, one block of 32 values: 288 bytes (16 ggml blocks: 288). Quants are unsigned
 * 0..15; value = d*(q - 8). */
typedef struct {
    sdmm_half d[SDMM_R];
    uint8_t qs[4][64]; /* load c: byte 4r+t = lo4(4c+t) | lo4(16+4c+t) << 4 */
} sdmm_q4_0_r16;

/* Q4_1, 16 rows, one block of 32 values: 320 bytes (16 ggml blocks: 320). Quants 0..15; value =
 * d*q + m. */
typedef struct {
    sdmm_half d[SDMM_R], m[SDMM_R];
    uint8_t qs[4][64]; /* as Q4_0's */
} sdmm_q4_1_r16;

/* Q5_0, 16 rows, one block of 32 values: 352 bytes (16 ggml blocks: 352). Quants are unsigned
 * 0..31; value = d*(q - 16). */
typedef struct {
    sdmm_half d[SDMM_R];
    /* qh byte 4r+t: bit c = hi1(4c+t), bit 4+c = hi1(16+4c+t), for loads c = 0..3 */
    uint8_t qh[64];
    /* load c: byte 4r+t = lo4(4c+t) | lo4(16+4c+t) << 4 */
    uint8_t qs[4][64];
} sdmm_q5_0_r16;

/* Q5_1, 16 rows, one block of 32 values: 384 bytes (16 ggml blocks: 384). Q5_0's group, the
 * quants unsigned 0..31 (value d*q + m), and the mins after it. */
typedef struct {
    sdmm_q5_0_r16 q;
    sdmm_half m[SDMM_R];
} sdmm_q5_1_r16;

/* IQ4_NL, 16 rows, one block of 32 values: 288 bytes (16 ggml blocks: 288). Q4_0's group, its
 * 4-bit quants indices into the IQ4 values; value = d*kvalues[q]. */
typedef sdmm_q4_0_r16 sdmm_iq4nl_r16;

/* Q8_0, 16 rows, one block of 32 values: 544 bytes (16 ggml blocks: 544). Quants are stored
 * offset to unsigned, q + 128 (vpdpbusd's unsigned operand); value = d*q. */
typedef struct {
    sdmm_half d[SDMM_R];
    uint8_t qs[8][64]; /* load c: byte 4r+t = q(4c+t) + 128 */
} sdmm_q8_0_r16;

/* One super-block of one activation row: Q8_K quants and the sums the kernels need. 448 bytes. */
typedef struct {
    int8_t qs[SDMM_QK];
    int32_t nb16[16]; /* -32 * (sum of quants 16j..16j+15): Q6_K's offset, folded into the sum */
    int16_t b32[8];   /* sum of quants 32j..32j+31: Q4_K's mins, IQ4_XS's offset */
    float d;          /* Q8_K scale */
    /* nb16[j] split as AVX2's Q6_K kernel sums in 16 bits (sdmm-simd.h): the low int16 -32 *
     * (sum of quants 16j + 0, 1, 4, 5, 8, 9, 12, 13), the high one the rest's (|.| < 2^15) */
    uint32_t o16[16];
    int16_t b16[16]; /* sum of quants 16j..16j+15: Q2_K's mins */
    uint8_t pad_[12];
} sdmm_act;

/* One 32-value block of one activation row, for the 32-value types: quants, their sum (the
 * weights' offsets, 16 and 128, folded into the integer sum; Q5_1's mins times it) and the
 * scale. 64 bytes. */
typedef struct {
    int8_t qs[32];
    int32_t sum;
    float d;
    uint8_t pad_[24];
} sdmm_act32;

/* One 32-value block of one activation row for the float weight types: the values rounded to
 * the weight's type (F16 or BF16, as ggml rounds them), held as floats. 128 bytes. */
typedef struct {
    float x[32];
} sdmm_actf;

/* kernel: y[i*ldy + 16*g + r] = dot(weight row 16*g + r, activation row i) for groups g <
 * ngroups, activation rows i < b (a is an array of the type's activation blocks, sdmm_act or
 * sdmm_act32, and a[s*b + i] is row i's block s: a block's rows side by side, so a tile reaches
 * them all from one pointer) and 16*g + r < n_valid (the lanes past it, padding rows, are not
 * stored). w points at group 0, groups are nsb blocks long. */
typedef void (*sdmm_kernel_fn)(const void * w, int nsb, int ngroups, int n_valid, const void * a,
                               int b, float * y, size_t ldy);

/* --- repacking (at model load) and activation quantization (per matmul) --- */
int sdmm_supported_type(int type);
int sdmm_block_cols(int type);     /* values per block: 256 (K-quants, IQ4_XS), 32 (the others) */
size_t sdmm_group_bytes(int type); /* one group of 16 rows, one block */
size_t sdmm_act_bytes(int type);   /* one activation block: sdmm_act, sdmm_act32 or sdmm_actf */
size_t sdmm_packed_size(int type, int64_t n, int64_t k);
/* src: n rows of k values in ggml's blocks; dst: sdmm_packed_size bytes */
void sdmm_pack(int type, const void * src, int64_t n, int64_t k, void * dst);
/* one row of k floats -> k / sdmm_block_cols(type) activation blocks, block s at out[s * stride]
 * (counted in blocks) */
void sdmm_quantize_row(int type, const float * x, int64_t k, void * out, size_t stride);

/* --- kernels --- */
/* can this CPU run sdmm's path `isa` (enum sd_isa), and was it compiled in: every feature of
 * the path's list (sd-isa.h; AVX-512 needs VNNI here) */
int sdmm_isa_supported(int isa);
/* the path the buffer type uses (sd_isa_select: $SPECDEC_MM_ISA, else the best); -1 if the
 * named path cannot run here */
int sdmm_isa_selected(void);
sdmm_kernel_fn sdmm_kernel(int type, int isa);

#define SDMM_KERNEL_DECL_(name) \
    void name(const void *, int, int, int, const void *, int, float *, size_t);
#define SDMM_KERNELS_DECL_(isa)                                                              \
    SDMM_KERNEL_DECL_(sdmm_kernel_q4k_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_q5k_##isa)         \
    SDMM_KERNEL_DECL_(sdmm_kernel_q6k_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_q4_0_##isa)        \
    SDMM_KERNEL_DECL_(sdmm_kernel_q4_1_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_q5_0_##isa)       \
    SDMM_KERNEL_DECL_(sdmm_kernel_q5_1_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_q8_0_##isa)       \
    SDMM_KERNEL_DECL_(sdmm_kernel_q2k_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_iq4xs_##isa)       \
    SDMM_KERNEL_DECL_(sdmm_kernel_iq4nl_##isa) SDMM_KERNEL_DECL_(sdmm_kernel_f16_##isa)       \
    SDMM_KERNEL_DECL_(sdmm_kernel_bf16_##isa)
SDMM_KERNELS_DECL_(ref) SDMM_KERNELS_DECL_(avx2) SDMM_KERNELS_DECL_(avxvnni)
SDMM_KERNELS_DECL_(avx512)
#undef SDMM_KERNELS_DECL_
#undef SDMM_KERNEL_DECL_

/* The int8 peak the kernels are measured against, in MACs per second on the calling thread, of
 * the path they run (sdmm_isa_selected): independent vpdpbusd chains (AVX-512 VNNI, AVX-VNNI)
 * or vpmaddubsw chains (AVX2); 0 for the scalar reference. */
double sdmm_peak_macs(long iters);
double sdmm_avx512_peak_macs(long iters);
double sdmm_avxvnni_peak_macs(long iters);
double sdmm_avx2_peak_macs(long iters);

/* One-call matmul for tests and benchmarks (single-threaded): y[i*n + j] = W[j] . x[i] for
 * packed weights W (n x k) and float activations x (b x k); returns 0, or -1 if the type or the
 * path is not available here. */
int sdmm_matmul(int type, int isa, const void * packed, int64_t n, int64_t k, const float * x,
                int64_t b, float * y);

#ifdef __cplusplus
}
#endif
