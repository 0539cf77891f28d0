/* sdmm kernels for AVX2 + FMA (CPUs without AVX-512 VNNI): the AVX-512 kernels' arithmetic on
 * 8-lane ymm registers, a 16-row group as two halves. vpdpbusd is maddubs + madd(1): the same
 * 32-bit sums (no saturation: |2 * 63 * 127| < 2^15), so every output has the AVX-512 path's
 * bits. Compiled for these instructions whatever the build's flags. */
#include "sdmm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#    if defined(__clang__)
#        pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#    else
#        pragma GCC push_options
#        pragma GCC target("avx2,fma,f16c")
#    endif

#    include <immintrin.h>
#    include <string.h>

#    define TILE 4 /* 16 ymm registers: 4 rows' sums and partial sums besides the weights */
#    define INLINE static inline __attribute__((always_inline))

INLINE void prefetch_block(const void * blk, size_t size) {
    for (size_t l = 0; l < size; l += 64) {
        _mm_prefetch((const char *) blk + SDMM_PREFETCH_BYTES + l, _MM_HINT_T0);
    }
}

INLINE __m256i bcast32(const void * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* u8 x s8, 4 products per 32-bit lane: what vpdpbusd computes */
INLINE __m256i dot4(__m256i acc, __m256i w, __m256i a, __m256i ones) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
}

INLINE void store_lanes(float * y, __m256 v, int valid) { /* valid: lanes to store, 1..8 */
    if (valid >= 8) {
        _mm256_storeu_ps(y, v);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(y, tmp, (size_t) valid * sizeof(float));
    }
}

/* half h (rows 8h..8h+7) of a group */
INLINE void q4k_tile(const sdmm_q4k_r16 * w, int nsb, const sdmm_act * a, const int NT, float * y,
                     size_t ldy, int h, int valid) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    __m256 facc[TILE];
    for (int t = 0; t < NT; t++) {
        facc[t] = _mm256_setzero_ps();
    }
    for (int s = 0; s < nsb; s++) {
        const sdmm_q4k_r16 * blk = w + s;
        prefetch_block(blk, sizeof(*blk));
        __m256i sumi[TILE];
        for (int t = 0; t < NT; t++) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 8; j++) {
            __m256i acc[TILE];
            for (int t = 0; t < NT; t++) {
                acc[t] = _mm256_setzero_si256();
            }
            for (int c = 0; c < 4; c++) {
                const __m256i L = _mm256_loadu_si256((const __m256i *) (blk->qs[j][c] + 32 * h));
                const __m256i lo = _mm256_and_si256(L, m4);
                const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(L, 4), m4);
                for (int t = 0; t < NT; t++) {
                    const int8_t * q = a[(size_t) t * nsb + s].qs + 32 * j + 4 * c;
                    acc[t] = dot4(acc[t], lo, bcast32(q), ones);
                    acc[t] = dot4(acc[t], hi, bcast32(q + 16), ones);
                }
            }
            const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (blk->sc[j] + 8 * h)));
            for (int t = 0; t < NT; t++) {
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_mullo_epi32(acc[t], sc));
            }
        }
        __m256i m[4];
        for (int i = 0; i < 4; i++) {
            m[i] = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) (blk->m[i][8 * h])));
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (blk->d + 8 * h)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (blk->dmin + 8 * h)));
        for (int t = 0; t < NT; t++) {
            const sdmm_act * A = a + (size_t) t * nsb + s;
            __m256i summ = _mm256_setzero_si256();
            for (int i = 0; i < 4; i++) {
                summ = _mm256_add_epi32(summ, _mm256_madd_epi16(m[i], bcast32(&A->b32[2 * i])));
            }
            const __m256 da = _mm256_set1_ps(A->d);
            facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_mul_ps(d, da), facc[t]);
            facc[t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(summ), _mm256_mul_ps(dmin, da), facc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        store_lanes(y + (size_t) t * ldy + 8 * h, facc[t], valid);
    }
}

INLINE void q6k_tile(const sdmm_q6k_r16 * w, int nsb, const sdmm_act * a, const int NT, float * y,
                     size_t ldy, int h, int valid) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 facc[TILE];
    for (int t = 0; t < NT; t++) {
        facc[t] = _mm256_setzero_ps();
    }
    for (int s = 0; s < nsb; s++) {
        const sdmm_q6k_r16 * blk = w + s;
        prefetch_block(blk, sizeof(*blk));
        __m256i sumi[TILE];
        for (int t = 0; t < NT; t++) {
            sumi[t] = _mm256_setzero_si256();
        }
        for (int j = 0; j < 16; j++) {
            const __m256i L0 = _mm256_loadu_si256((const __m256i *) (blk->ql[j][0] + 32 * h));
            const __m256i L1 = _mm256_loadu_si256((const __m256i *) (blk->ql[j][1] + 32 * h));
            const __m256i H = _mm256_loadu_si256((const __m256i *) (blk->qh[j] + 32 * h));
            const __m256i w0 = _mm256_or_si256(_mm256_and_si256(L0, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
            const __m256i w1 = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                               _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
            const __m256i w2 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                               _mm256_and_si256(H, m30));
            const __m256i w3 = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                               _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
            const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (blk->sc[j] + 8 * h)));
            for (int t = 0; t < NT; t++) {
                const sdmm_act * A = a + (size_t) t * nsb + s;
                const int8_t * q = A->qs + 16 * j;
                __m256i acc = _mm256_set1_epi32(A->nb16[j]);
                acc = dot4(acc, w0, bcast32(q), ones);
                acc = dot4(acc, w1, bcast32(q + 4), ones);
                acc = dot4(acc, w2, bcast32(q + 8), ones);
                acc = dot4(acc, w3, bcast32(q + 12), ones);
                sumi[t] = _mm256_add_epi32(sumi[t], _mm256_mullo_epi32(acc, sc));
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (blk->d + 8 * h)));
        for (int t = 0; t < NT; t++) {
            const __m256 da = _mm256_set1_ps(a[(size_t) t * nsb + s].d);
            facc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sumi[t]), _mm256_mul_ps(d, da), facc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        store_lanes(y + (size_t) t * ldy + 8 * h, facc[t], valid);
    }
}

#    define TILE_CASES(fn, W, nsb, A, nt, Y, ldy, h, valid)                                      \
        switch (nt) {                                                                          \
            case 1: fn(W, nsb, A, 1, Y, ldy, h, valid); break;                                 \
            case 2: fn(W, nsb, A, 2, Y, ldy, h, valid); break;                                 \
            case 3: fn(W, nsb, A, 3, Y, ldy, h, valid); break;                                 \
            default: fn(W, nsb, A, 4, Y, ldy, h, valid); break;                                \
        }

#    define KERNEL(name, group_t, tile)                                                          \
        void name(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a, int b, \
                  float * y, size_t ldy) {                                                     \
            const group_t * groups = (const group_t *) w;                                      \
            for (int g = 0; g < ngroups; g++) {                                                \
                for (int h = 0; h < 2; h++) {                                                  \
                    const int valid = n_valid - g * SDMM_R - 8 * h;                            \
                    if (valid <= 0) {                                                          \
                        break;                                                                 \
                    }                                                                          \
                    const int ntiles = (b + TILE - 1) / TILE, base = b / ntiles,               \
                              extra = b % ntiles;                                              \
                    for (int t = 0, i = 0, nt; t < ntiles; t++, i += nt) {                     \
                        nt = base + (t < extra);                                               \
                        TILE_CASES(tile, groups + (size_t) g * nsb, nsb, a + (size_t) i * nsb, \
                                   nt, y + (size_t) i * ldy + g * SDMM_R, ldy, h, valid);      \
                    }                                                                          \
                }                                                                              \
            }                                                                                  \
        }

KERNEL(sdmm_kernel_q4k_avx2, sdmm_q4k_r16, q4k_tile)
KERNEL(sdmm_kernel_q6k_avx2, sdmm_q6k_r16, q6k_tile)

#    if defined(__clang__)
#        pragma clang attribute pop
#    else
#        pragma GCC pop_options
#    endif

#endif /* x86-64 */
