/* sdmm kernels for AVX-512 with VNNI (vpdpbusd): one zmm lane per weight row of a 16-row group,
 * a tile of up to TILE activation rows per pass over the group's weights. Compiled for these
 * instructions whatever the build's flags; sdmm_kernel() runs them only where the CPU has them.
 * The per-lane arithmetic is sdmm.h's; sdmm.c's reference kernels spell it out. */
#include "sdmm.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#    if defined(__clang__)
#        pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c"))), apply_to = function)
#    else
#        pragma GCC push_options
#        pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx512dq,fma,f16c")
#    endif

#    include <immintrin.h>
#    include <string.h>
#    include <time.h>

#    define TILE 8 /* activation rows per pass: 8 sum and 8 float accumulators stay in registers */
#    define INLINE static inline __attribute__((always_inline))

INLINE void prefetch_block(const void * blk, size_t size) {
    for (size_t l = 0; l < size; l += 64) {
        _mm_prefetch((const char *) blk + SDMM_PREFETCH_BYTES + l, _MM_HINT_T0);
    }
}

INLINE __m512i bcast32(const void * p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

INLINE __mmask16 lanes(int valid) {
    return valid >= SDMM_R ? (__mmask16) 0xFFFF : (__mmask16) ((1u << valid) - 1);
}

INLINE void q4k_tile(const sdmm_q4k_r16 * w, int nsb, const sdmm_act * a, const int NT, float * y,
                     size_t ldy, __mmask16 mask) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512 facc[TILE];
    for (int t = 0; t < NT; t++) {
        facc[t] = _mm512_setzero_ps();
    }
    for (int s = 0; s < nsb; s++) {
        const sdmm_q4k_r16 * blk = w + s;
        prefetch_block(blk, sizeof(*blk));
        __m512i sumi[TILE];
        for (int t = 0; t < NT; t++) {
            sumi[t] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 8; j++) {
            __m512i acc[TILE];
            for (int t = 0; t < NT; t++) {
                acc[t] = _mm512_setzero_si512();
            }
            for (int c = 0; c < 4; c++) {
                const __m512i L = _mm512_loadu_si512(blk->qs[j][c]);
                const __m512i lo = _mm512_and_si512(L, m4);                         /* 32j+4c..   */
                const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(L, 4), m4);   /* 32j+16+4c..*/
                for (int t = 0; t < NT; t++) {
                    const int8_t * q = a[(size_t) t * nsb + s].qs + 32 * j + 4 * c;
                    acc[t] = _mm512_dpbusd_epi32(acc[t], lo, bcast32(q));
                    acc[t] = _mm512_dpbusd_epi32(acc[t], hi, bcast32(q + 16));
                }
            }
            const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) blk->sc[j]));
            for (int t = 0; t < NT; t++) {
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(acc[t], sc));
            }
        }
        __m512i m[4];
        for (int i = 0; i < 4; i++) {
            m[i] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) blk->m[i]));
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk->d));
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk->dmin));
        for (int t = 0; t < NT; t++) {
            const sdmm_act * A = a + (size_t) t * nsb + s;
            __m512i summ = _mm512_setzero_si512();
            for (int i = 0; i < 4; i++) {
                summ = _mm512_dpwssd_epi32(summ, m[i], bcast32(&A->b32[2 * i]));
            }
            const __m512 da = _mm512_set1_ps(A->d);
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[t]), _mm512_mul_ps(d, da), facc[t]);
            facc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(summ), _mm512_mul_ps(dmin, da), facc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        _mm512_mask_storeu_ps(y + (size_t) t * ldy, mask, facc[t]);
    }
}

INLINE void q6k_tile(const sdmm_q6k_r16 * w, int nsb, const sdmm_act * a, const int NT, float * y,
                     size_t ldy, __mmask16 mask) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i m30 = _mm512_set1_epi8(0x30);
    __m512 facc[TILE];
    for (int t = 0; t < NT; t++) {
        facc[t] = _mm512_setzero_ps();
    }
    for (int s = 0; s < nsb; s++) {
        const sdmm_q6k_r16 * blk = w + s;
        prefetch_block(blk, sizeof(*blk));
        __m512i sumi[TILE];
        for (int t = 0; t < NT; t++) {
            sumi[t] = _mm512_setzero_si512();
        }
        for (int j = 0; j < 16; j++) {
            const __m512i L0 = _mm512_loadu_si512(blk->ql[j][0]);
            const __m512i L1 = _mm512_loadu_si512(blk->ql[j][1]);
            const __m512i H = _mm512_loadu_si512(blk->qh[j]);
            /* quants 0..63 of values 16j+0..3, +4..7, +8..11, +12..15 of each row */
            const __m512i w0 = _mm512_or_si512(_mm512_and_si512(L0, m4),
                                                _mm512_and_si512(_mm512_slli_epi16(H, 4), m30));
            const __m512i w1 = _mm512_or_si512(_mm512_and_si512(L1, m4),
                                                _mm512_and_si512(_mm512_slli_epi16(H, 2), m30));
            const __m512i w2 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), m4),
                                                _mm512_and_si512(H, m30));
            const __m512i w3 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), m4),
                                                _mm512_and_si512(_mm512_srli_epi16(H, 2), m30));
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) blk->sc[j]));
            for (int t = 0; t < NT; t++) {
                const sdmm_act * A = a + (size_t) t * nsb + s;
                const int8_t * q = A->qs + 16 * j;
                __m512i acc = _mm512_set1_epi32(A->nb16[j]); /* the -32 offset, exact */
                acc = _mm512_dpbusd_epi32(acc, w0, bcast32(q));
                acc = _mm512_dpbusd_epi32(acc, w1, bcast32(q + 4));
                acc = _mm512_dpbusd_epi32(acc, w2, bcast32(q + 8));
                acc = _mm512_dpbusd_epi32(acc, w3, bcast32(q + 12));
                sumi[t] = _mm512_add_epi32(sumi[t], _mm512_mullo_epi32(acc, sc));
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) blk->d));
        for (int t = 0; t < NT; t++) {
            const __m512 da = _mm512_set1_ps(a[(size_t) t * nsb + s].d);
            facc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sumi[t]), _mm512_mul_ps(d, da), facc[t]);
        }
    }
    for (int t = 0; t < NT; t++) {
        _mm512_mask_storeu_ps(y + (size_t) t * ldy, mask, facc[t]);
    }
}

/* One switch per kernel turns the tile size into a constant, so each tile's loops unroll and
 * its accumulators live in registers. */
#    define TILE_CASES(fn, W, nsb, A, nt, Y, ldy, mask)                                          \
        switch (nt) {                                                                          \
            case 1: fn(W, nsb, A, 1, Y, ldy, mask); break;                                     \
            case 2: fn(W, nsb, A, 2, Y, ldy, mask); break;                                     \
            case 3: fn(W, nsb, A, 3, Y, ldy, mask); break;                                     \
            case 4: fn(W, nsb, A, 4, Y, ldy, mask); break;                                     \
            case 5: fn(W, nsb, A, 5, Y, ldy, mask); break;                                     \
            case 6: fn(W, nsb, A, 6, Y, ldy, mask); break;                                     \
            case 7: fn(W, nsb, A, 7, Y, ldy, mask); break;                                     \
            default: fn(W, nsb, A, 8, Y, ldy, mask); break;                                    \
        }

void sdmm_kernel_q4k_avx512(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a,
                            int b, float * y, size_t ldy) {
    const sdmm_q4k_r16 * groups = (const sdmm_q4k_r16 *) w;
    for (int g = 0; g < ngroups; g++) {
        const __mmask16 mask = lanes(n_valid - g * SDMM_R);
        /* b rows in ceil(b / TILE) tiles whose sizes differ by at most one */
        const int ntiles = (b + TILE - 1) / TILE, base = b / ntiles, extra = b % ntiles;
        for (int t = 0, i = 0, nt; t < ntiles; t++, i += nt) {
            nt = base + (t < extra);
            TILE_CASES(q4k_tile, groups + (size_t) g * nsb, nsb, a + (size_t) i * nsb, nt,
                       y + (size_t) i * ldy + g * SDMM_R, ldy, mask);
        }
    }
}

void sdmm_kernel_q6k_avx512(const void * w, int nsb, int ngroups, int n_valid, const sdmm_act * a,
                            int b, float * y, size_t ldy) {
    const sdmm_q6k_r16 * groups = (const sdmm_q6k_r16 *) w;
    for (int g = 0; g < ngroups; g++) {
        const __mmask16 mask = lanes(n_valid - g * SDMM_R);
        /* b rows in ceil(b / TILE) tiles whose sizes differ by at most one */
        const int ntiles = (b + TILE - 1) / TILE, base = b / ntiles, extra = b % ntiles;
        for (int t = 0, i = 0, nt; t < ntiles; t++, i += nt) {
            nt = base + (t < extra);
            TILE_CASES(q6k_tile, groups + (size_t) g * nsb, nsb, a + (size_t) i * nsb, nt,
                       y + (size_t) i * ldy + g * SDMM_R, ldy, mask);
        }
    }
}

/* The int8 multiply-accumulate peak of this core, measured the way the kernels use it: 16
 * independent vpdpbusd chains (enough to cover its latency on the CPUs measured). Returns
 * multiply-accumulates per second over `iters` x 16 x 64 of them; the ceiling that
 * `specdec`'s kernel benchmark reports sdmm's rate against. */
double sdmm_avx512_peak_macs(long iters) {
    __m512i acc[16];
    for (int i = 0; i < 16; i++) {
        acc[i] = _mm512_set1_epi32(i);
    }
    __m512i x = _mm512_set1_epi8(3);
    const __m512i y = _mm512_set1_epi8(5);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
        for (int i = 0; i < 16; i++) {
            acc[i] = _mm512_dpbusd_epi32(acc[i], x, y);
        }
        __asm__ volatile("" : "+v"(x)); /* one new input per pass: nothing hoists the work */
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    int32_t sink = 0;
    for (int i = 0; i < 16; i++) {
        sink += _mm512_reduce_add_epi32(acc[i]);
    }
    __asm__ volatile("" : : "r"(sink));
    const double s = (double) (t1.tv_sec - t0.tv_sec) + 1e-9 * (double) (t1.tv_nsec - t0.tv_nsec);
    return (double) iters * 16.0 * 64.0 / s;
}

#    if defined(__clang__)
#        pragma clang attribute pop
#    else
#        pragma GCC pop_options
#    endif

#endif /* x86-64 */
