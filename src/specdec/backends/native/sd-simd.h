/* sd-simd: SD_VL-lane vectors under one set of names, so that sdmm's and sdfa's SIMD kernels are
 * written once (sdmm-simd.h, sdfa-simd.h) and compiled twice: by the AVX-512 files with SD_VL 16
 * (zmm) and by the AVX2 files with SD_VL 8 (ymm), each after its SD_TARGET_PUSH (sd-common.h).
 * Why one body: the kernels' contract is that every path gives every lane the same operations in
 * the same order (sdmm.h, sdfa.h); two copies of a kernel could drift apart, one cannot.
 *
 * Each name does one operation on every lane, the same on both widths, so a lane's bits do not
 * depend on the width. Where AVX2 lacks AVX-512's instruction, its stand-in gives the same bits:
 *   vi_dpbusd (u8 x s8, 4 products summed into a 32-bit lane): maddubs + madd(1); exact, as the
 *     kernels' products never saturate maddubs's int16 (sdmm-avx2.c); with SD_AVXVNNI defined
 *     (sdmm-avxvnni.c), AVX-VNNI's vpdpbusd on ymm;
 *   vi_dpwssd (s16 x s16, 2 products summed into a 32-bit lane): madd + add;
 *   vmask: a comparison's lanes as a mask register (AVX-512) or as all-ones floats (AVX2), used
 *     only through vf_blend and vf_maskz.
 * SD_DOT16 (AVX2): a kernel may sum maddubs's 16-bit pairs in 16 bits and widen them once, with
 * a madd that multiplies by the scale too (vi_maddubs, vi_add16, vi_madd16), instead of a
 * vi_dpbusd per 4 columns: half the multiplies, and the same integer wherever the whole 16-bit
 * sum fits (sdmm-simd.h says where it does). */
#pragma once

#include "sd-common.h"

#include <immintrin.h>
#include <string.h>

#if SD_VL == 16
typedef __m512 vfloat;
typedef __m512i vint;
typedef __mmask16 vmask;
#    define SD_DOT16 0

#    define vf_zero() _mm512_setzero_ps()
#    define vf_set1(x) _mm512_set1_ps(x)
#    define vf_load(p) _mm512_load_ps(p) /* 64-byte aligned */
#    define vf_store(p, v) _mm512_store_ps(p, v)
#    define vf_storeu(p, v) _mm512_storeu_ps(p, v)
#    define vf_add(a, b) _mm512_add_ps(a, b)
#    define vf_sub(a, b) _mm512_sub_ps(a, b)
#    define vf_mul(a, b) _mm512_mul_ps(a, b)
#    define vf_max(a, b) _mm512_max_ps(a, b)
#    define vf_fmadd(a, b, c) _mm512_fmadd_ps(a, b, c)   /* a*b + c, one rounding */
#    define vf_fnmadd(a, b, c) _mm512_fnmadd_ps(a, b, c) /* c - a*b, one rounding */
#    define vf_round(a) _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#    define vf_ge(a, b) _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ)
#    define vf_ne(a, b) _mm512_cmp_ps_mask(a, b, _CMP_NEQ_OQ)
#    define vf_blend(m, a, b) _mm512_mask_blend_ps(m, a, b) /* b where m, else a */
#    define vf_maskz(m, a) _mm512_maskz_mov_ps(m, a)        /* a where m, else +0 */
#    define vf_from_i32(v) _mm512_cvtepi32_ps(v)
#    define vf_to_i32(a) _mm512_cvtps_epi32(a) /* rounding to nearest */
#    define vf_as_bits(v) _mm512_castsi512_ps(v)
/* SD_VL f16 at p */
#    define vf_from_f16(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (p)))
/* SD_VL bf16 at p (exact: a bf16 is a float's high half) */
#    define vf_from_bf16(p) \
        _mm512_castsi512_ps(_mm512_slli_epi32( \
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *) (p))), 16))
/* SD_VL int8 at p */
#    define vf_from_i8(p) \
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (p))))

#    define vi_zero() _mm512_setzero_si512()
#    define vi_set1_8(x) _mm512_set1_epi8(x)
#    define vi_set1_32(x) _mm512_set1_epi32(x)
#    define vi_load(p) _mm512_loadu_si512(p) /* 4 * SD_VL bytes */
#    define vi_and(a, b) _mm512_and_si512(a, b)
#    define vi_or(a, b) _mm512_or_si512(a, b)
#    define vi_xor(a, b) _mm512_xor_si512(a, b)
/* the 16 bytes at p in every 128-bit lane; byte i of each lane of t at the index byte i (0..15) */
#    define vi_bcast128(p) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *) (p)))
#    define vi_lut16(t, i) _mm512_shuffle_epi8(t, i)
#    define vi_srli16(a, n) _mm512_srli_epi16(a, n)
#    define vi_slli16(a, n) _mm512_slli_epi16(a, n)
#    define vi_slli32(a, n) _mm512_slli_epi32(a, n)
#    define vi_add32(a, b) _mm512_add_epi32(a, b)
#    define vi_sub32(a, b) _mm512_sub_epi32(a, b)
#    define vi_mullo32(a, b) _mm512_mullo_epi32(a, b)
#    define vi_dpbusd(acc, u8, s8) _mm512_dpbusd_epi32(acc, u8, s8)
#    define vi_dpwssd(acc, a, b) _mm512_dpwssd_epi32(acc, a, b)
/* SD_VL bytes at p, one per 32-bit lane; 2 * SD_VL bytes at p, one per 16-bit lane */
#    define vi_u8_to_32(p) _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *) (p)))
#    define vi_i8_to_32(p) _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *) (p)))
#    define vi_u8_to_16(p) _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) (p)))

SD_INLINE void vf_store_lanes(float * p, vfloat v, int n) { /* the first n lanes, n >= 1 */
    _mm512_mask_storeu_ps(p, n >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << n) - 1), v);
}

#elif SD_VL == 8
typedef __m256 vfloat;
typedef __m256i vint;
typedef __m256 vmask;
#    ifdef SD_AVXVNNI /* sdmm-avxvnni.c: AVX2 with vpdpbusd on ymm */
#        define SD_DOT16 0
#    else
#        define SD_DOT16 1
#    endif

#    define vf_zero() _mm256_setzero_ps()
#    define vf_set1(x) _mm256_set1_ps(x)
#    define vf_load(p) _mm256_load_ps(p) /* 32-byte aligned */
#    define vf_store(p, v) _mm256_store_ps(p, v)
#    define vf_storeu(p, v) _mm256_storeu_ps(p, v)
#    define vf_add(a, b) _mm256_add_ps(a, b)
#    define vf_sub(a, b) _mm256_sub_ps(a, b)
#    define vf_mul(a, b) _mm256_mul_ps(a, b)
#    define vf_max(a, b) _mm256_max_ps(a, b)
#    define vf_fmadd(a, b, c) _mm256_fmadd_ps(a, b, c)
#    define vf_fnmadd(a, b, c) _mm256_fnmadd_ps(a, b, c)
#    define vf_round(a) _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#    define vf_ge(a, b) _mm256_cmp_ps(a, b, _CMP_GE_OQ)
#    define vf_ne(a, b) _mm256_cmp_ps(a, b, _CMP_NEQ_OQ)
#    define vf_blend(m, a, b) _mm256_blendv_ps(a, b, m)
#    define vf_maskz(m, a) _mm256_and_ps(m, a)
#    define vf_from_i32(v) _mm256_cvtepi32_ps(v)
#    define vf_to_i32(a) _mm256_cvtps_epi32(a)
#    define vf_as_bits(v) _mm256_castsi256_ps(v)
#    define vf_from_f16(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p)))
#    define vf_from_bf16(p) \
        _mm256_castsi256_ps(_mm256_slli_epi32( \
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) (p))), 16))
#    define vf_from_i8(p) \
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (p))))

#    define vi_zero() _mm256_setzero_si256()
#    define vi_set1_8(x) _mm256_set1_epi8(x)
#    define vi_set1_32(x) _mm256_set1_epi32(x)
#    define vi_load(p) _mm256_loadu_si256((const __m256i *) (p))
#    define vi_and(a, b) _mm256_and_si256(a, b)
#    define vi_or(a, b) _mm256_or_si256(a, b)
#    define vi_xor(a, b) _mm256_xor_si256(a, b)
#    define vi_bcast128(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) (p)))
#    define vi_lut16(t, i) _mm256_shuffle_epi8(t, i)
#    define vi_abs8(a) _mm256_abs_epi8(a)       /* |a| per byte: 128 for -128 */
#    define vi_sign8(a, s) _mm256_sign_epi8(a, s) /* a with s's sign per byte, 0 where s is 0 */
#    define vi_srli16(a, n) _mm256_srli_epi16(a, n)
#    define vi_slli16(a, n) _mm256_slli_epi16(a, n)
#    define vi_slli32(a, n) _mm256_slli_epi32(a, n)
#    define vi_add32(a, b) _mm256_add_epi32(a, b)
#    define vi_sub32(a, b) _mm256_sub_epi32(a, b)
#    define vi_mullo32(a, b) _mm256_mullo_epi32(a, b)
#    if defined(SD_AVXVNNI) && defined(SD_AVXVNNI_EVEX)
#        define vi_dpbusd(acc, u8, s8) _mm256_dpbusd_epi32(acc, u8, s8) /* tests: sd-isa.h */
#    elif defined(SD_AVXVNNI)
#        define vi_dpbusd(acc, u8, s8) _mm256_dpbusd_avx_epi32(acc, u8, s8)
#    else
#        define vi_dpbusd(acc, u8, s8) \
            _mm256_add_epi32(acc, \
                             _mm256_madd_epi16(_mm256_maddubs_epi16(u8, s8), _mm256_set1_epi16(1)))
#    endif
#    define vi_dpwssd(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#    define vi_maddubs(u8, s8) _mm256_maddubs_epi16(u8, s8) /* u8 x s8 pairs, saturated to s16 */
#    define vi_add16(a, b) _mm256_add_epi16(a, b)           /* wraps */
#    define vi_madd16(a, b) _mm256_madd_epi16(a, b)         /* s16 x s16 pairs summed in s32 */
#    define vi_u8_to_32(p) _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *) (p)))
#    define vi_i8_to_32(p) _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *) (p)))
#    define vi_u8_to_16(p) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *) (p)))

SD_INLINE void vf_store_lanes(float * p, vfloat v, int n) {
    if (n >= 8) {
        _mm256_storeu_ps(p, v);
    } else {
        float tmp[8];
        _mm256_storeu_ps(tmp, v);
        memcpy(p, tmp, (size_t) n * sizeof(float));
    }
}

#else
#    error "sd-simd.h: define SD_VL as 16 (AVX-512) or 8 (AVX2)"
#endif

/* v as the compiler must take it: it may not merge the arithmetic before this point with the
 * arithmetic after it. GCC rewrites a tree of integer adds as one serial chain (integer adds
 * reassociate); kept halves stay two chains, half as long. */
#define vi_keep(v) __asm__("" : "+x"(v))

SD_INLINE vint vi_bcast32(const void * p) { /* the 4 bytes at p in every 32-bit lane */
    int32_t v;
    memcpy(&v, p, 4);
    return vi_set1_32(v);
}
