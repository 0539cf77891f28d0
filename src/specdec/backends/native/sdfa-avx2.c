/* sdfa kernel for AVX2 + FMA: 8 query rows in the lanes of one ymm for the scores and the
 * softmax, each row's output in d/8 ymm for the V sum. The arithmetic is sdfa.h's, operation for
 * operation (sdfa.c's reference spells it out), so it gives the AVX-512 kernel's bits. */
#include "sdfa.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))

#    if defined(__clang__)
#        pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#    else
#        pragma GCC push_options
#        pragma GCC target("avx2,fma,f16c")
#    endif

#    include <immintrin.h>
#    include <math.h>
#    include <string.h>

#    define W 8
#    define INLINE static inline __attribute__((always_inline))

typedef struct {
    uint16_t d;
    int8_t qs[32];
} q8_0_block;

INLINE float h2f(uint16_t h) {
    return _cvtsh_ss(h);
}

/* sdfa's exp (sdfa.c: sdfa_exp), lane by lane */
INLINE __m256 exp8(__m256 x) {
    const __m256 ok = _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693359375f), x);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(ok, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

void sdfa_kernel_avx2(const sdfa_tile * t) {
    const int d = t->d, R = t->rows, nblk = (t->n_kv + SDFA_P - 1) / SDFA_P, nv = d / 8;
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
    __m256 M = _mm256_set1_ps(-INFINITY), S = _mm256_setzero_ps();
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
                const __m256 dk = _mm256_set1_ps(h2f(k[c].d));
                for (int e = 0; e < 4; e++) {
                    const __m128i q8 = _mm_loadl_epi64((const __m128i *) (k[c].qs + 8 * e));
                    const __m256 f = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                    _mm256_store_ps(kf[j] + 32 * c + 8 * e, _mm256_mul_ps(f, dk));
                }
            }
            const uint16_t * v = (const uint16_t *) ((const char *) t->v + (size_t) p * t->v_stride);
            for (int c = 0; c < nv; c++) {
                _mm256_store_ps(vf[j] + 8 * c, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (v + 8 * c))));
            }
            for (int r = 0; r < W; r++) {
                mv[j][r] = r < R && t->mask[r] ? h2f(t->mask[r][p]) : 0.0f;
            }
        }
        /* scores: 16 positions' dot products side by side, each summed over i in order */
        __m256 s[SDFA_P];
        for (int j = 0; j < SDFA_P; j++) {
            s[j] = _mm256_setzero_ps();
        }
        for (int i = 0; i < d; i++) {
            const __m256 qv = _mm256_load_ps(qt[i]);
            for (int j = 0; j < SDFA_P; j++) {
                s[j] = _mm256_fmadd_ps(qv, _mm256_set1_ps(kf[j][i]), s[j]);
            }
        }
        const __m256 scale = _mm256_set1_ps(t->scale);
        __m256 mb = _mm256_fmadd_ps(s[0], scale, _mm256_load_ps(mv[0]));
        s[0] = mb;
        for (int j = 1; j < SDFA_P; j++) {
            s[j] = _mm256_fmadd_ps(s[j], scale, _mm256_load_ps(mv[j]));
            mb = _mm256_max_ps(s[j], mb);
        }
        const __m256 Mn = _mm256_max_ps(mb, M);
        const __m256 some = _mm256_cmp_ps(Mn, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m256 a = _mm256_blendv_ps(_mm256_set1_ps(1.0f), exp8(_mm256_sub_ps(M, Mn)), some);
        S = _mm256_mul_ps(S, a);
        for (int j = 0; j < SDFA_P; j++) {
            const __m256 pv = _mm256_and_ps(some, exp8(_mm256_sub_ps(s[j], Mn)));
            S = _mm256_add_ps(S, pv);
            _mm256_store_ps(pj[j], pv);
        }
        _mm256_store_ps(alpha, a);
        M = Mn;
        /* values: each row's d outputs in d/8 lane-vectors, summed over j in order */
        for (int r = 0; r < R; r++) {
            __m256 o[SDFA_MAX_D / 8];
            const __m256 ar = _mm256_set1_ps(alpha[r]);
            for (int c = 0; c < nv; c++) {
                o[c] = _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * c), ar);
            }
            for (int j = 0; j < SDFA_P; j++) {
                const __m256 pr = _mm256_set1_ps(pj[j][r]);
                for (int c = 0; c < nv; c++) {
                    o[c] = _mm256_fmadd_ps(pr, _mm256_load_ps(vf[j] + 8 * c), o[c]);
                }
            }
            for (int c = 0; c < nv; c++) {
                _mm256_store_ps(acc[r] + 8 * c, o[c]);
            }
        }
    }
    _Alignas(64) float Ss[W];
    _mm256_store_ps(Ss, S);
    for (int r = 0; r < R; r++) {
        const __m256 inv = _mm256_set1_ps(Ss[r] == 0.0f ? 0.0f : 1.0f / Ss[r]);
        for (int c = 0; c < nv; c++) {
            _mm256_storeu_ps(t->out[r] + 8 * c, _mm256_mul_ps(_mm256_load_ps(acc[r] + 8 * c), inv));
        }
    }
}

#    if defined(__clang__)
#        pragma clang attribute pop
#    else
#        pragma GCC pop_options
#    endif

#endif /* x86-64 */
