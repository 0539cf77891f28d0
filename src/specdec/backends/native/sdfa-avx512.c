/* sdfa kernel for AVX-512: 16 query rows in the lanes of one zmm for the scores and the softmax,
 * each row's output in d/16 zmm for the V sum. The arithmetic is sdfa.h's, operation for
 * operation (sdfa.c's reference spells it out). */
#include "sdfa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#    if defined(__clang__)
#        pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c"))), apply_to = function)
#    else
#        pragma GCC push_options
#        pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#    endif

#    include <immintrin.h>
#    include <math.h>
#    include <string.h>

#    define W 16
#    define INLINE static inline __attribute__((always_inline))

typedef struct {
    uint16_t d;
    int8_t qs[32];
} q8_0_block;

INLINE float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}

/* sdfa's exp (sdfa.c: sdfa_exp), lane by lane */
INLINE __m512 exp16(__m512 x) {
    const __mmask16 ok = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps(ok, y, _mm512_castsi512_ps(e));
}

void sdfa_kernel_avx512(const sdfa_tile * t) {
    const int d = t->d, R = t->rows, nblk = (t->n_kv + SDFA_P - 1) / SDFA_P, nv = d / 16;
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
    __m512 M = _mm512_set1_ps(-INFINITY), S = _mm512_setzero_ps();
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
            const q8_0_block * k = (const q8_0_block *) ((const char *) t->k + (size_t) p * t->k_stride);
            for (int c = 0; c < d / 32; c++) {
                const __m512 dk = _mm512_set1_ps(h2f(k[c].d));
                const __m256i q8 = _mm256_loadu_si256((const __m256i *) k[c].qs);
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q8)));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q8, 1)));
                _mm512_store_ps(kf[j] + 32 * c, _mm512_mul_ps(lo, dk));
                _mm512_store_ps(kf[j] + 32 * c + 16, _mm512_mul_ps(hi, dk));
            }
            const uint16_t * v = (const uint16_t *) ((const char *) t->v + (size_t) p * t->v_stride);
            for (int c = 0; c < nv; c++) {
                _mm512_store_ps(vf[j] + 16 * c, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (v + 16 * c))));
            }
            for (int r = 0; r < W; r++) {
                mv[j][r] = r < R && t->mask[r] ? h2f(t->mask[r][p]) : 0.0f;
            }
        }
        /* scores: 16 positions' dot products side by side, each summed over i in order */
        __m512 s[SDFA_P];
        for (int j = 0; j < SDFA_P; j++) {
            s[j] = _mm512_setzero_ps();
        }
        for (int i = 0; i < d; i++) {
            const __m512 qv = _mm512_load_ps(qt[i]);
            for (int j = 0; j < SDFA_P; j++) {
                s[j] = _mm512_fmadd_ps(qv, _mm512_set1_ps(kf[j][i]), s[j]);
            }
        }
        const __m512 scale = _mm512_set1_ps(t->scale);
        __m512 mb = _mm512_fmadd_ps(s[0], scale, _mm512_load_ps(mv[0]));
        s[0] = mb;
        for (int j = 1; j < SDFA_P; j++) {
            s[j] = _mm512_fmadd_ps(s[j], scale, _mm512_load_ps(mv[j]));
            mb = _mm512_max_ps(s[j], mb);
        }
        const __m512 Mn = _mm512_max_ps(mb, M);
        const __mmask16 some = _mm512_cmp_ps_mask(Mn, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 a = _mm512_mask_blend_ps(some, _mm512_set1_ps(1.0f), exp16(_mm512_sub_ps(M, Mn)));
        S = _mm512_mul_ps(S, a);
        for (int j = 0; j < SDFA_P; j++) {
            const __m512 pv = _mm512_maskz_mov_ps(some, exp16(_mm512_sub_ps(s[j], Mn)));
            S = _mm512_add_ps(S, pv);
            _mm512_store_ps(pj[j], pv);
        }
        _mm512_store_ps(alpha, a);
        M = Mn;
        /* values: each row's d outputs in d/16 lane-vectors, summed over j in order */
        for (int r = 0; r < R; r++) {
            __m512 o[SDFA_MAX_D / 16];
            const __m512 ar = _mm512_set1_ps(alpha[r]);
            for (int c = 0; c < nv; c++) {
                o[c] = _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), ar);
            }
            for (int j = 0; j < SDFA_P; j++) {
                const __m512 pr = _mm512_set1_ps(pj[j][r]);
                for (int c = 0; c < nv; c++) {
                    o[c] = _mm512_fmadd_ps(pr, _mm512_load_ps(vf[j] + 16 * c), o[c]);
                }
            }
            for (int c = 0; c < nv; c++) {
                _mm512_store_ps(acc[r] + 16 * c, o[c]);
            }
        }
    }
    _Alignas(64) float Ss[W];
    _mm512_store_ps(Ss, S);
    for (int r = 0; r < R; r++) {
        const __m512 inv = _mm512_set1_ps(Ss[r] == 0.0f ? 0.0f : 1.0f / Ss[r]);
        for (int c = 0; c < nv; c++) {
            _mm512_storeu_ps(t->out[r] + 16 * c, _mm512_mul_ps(_mm512_load_ps(acc[r] + 16 * c), inv));
        }
    }
}

#    if defined(__clang__)
#        pragma clang attribute pop
#    else
#        pragma GCC pop_options
#    endif

#endif /* x86-64 */
