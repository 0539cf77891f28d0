/* sdmm kernels for AVX2 + FMA (CPUs without AVX-512 VNNI): sdmm-simd.h's kernels on 8-lane ymm
 * registers, a 16-row group as two halves, and the int8 peak they are measured against. A
 * sub-block's products are maddubs's 16-bit pairs (no saturation: |2 * 63 * 127| < 2^15),
 * summed in 16 bits where the sum fits and widened by one madd (SD_DOT16): the same 32-bit sums
 * as vpdpbusd, so every output has the AVX-512 path's bits. */
#include "sd-common.h"
#include "sdmm.h"

#include <time.h>

#if SD_X86
SD_TARGET_PUSH_PATH_BELOW_AVX512(SD_FEATURES_AVX2)

#    define SD_VL 8
/* 8 rows a tile: their sums spill, but a sub-block's weights, unpacked once per tile, serve
 * twice as many rows as in 4-row tiles (the 16 ymm registers hold 4 rows' sums beside the 8
 * weight vectors); measured faster from 8 rows on (docs/kernels.md) */
#    define SDMM_TILE 8
#    include "sdmm-simd.h"

SDMM_KERNEL(sdmm_kernel_q4k_avx2, SDMM_TYPE_Q4_K)
SDMM_KERNEL(sdmm_kernel_q5k_avx2, SDMM_TYPE_Q5_K)
SDMM_KERNEL(sdmm_kernel_q6k_avx2, SDMM_TYPE_Q6_K)
SDMM_KERNEL(sdmm_kernel_q4_0_avx2, SDMM_TYPE_Q4_0)
SDMM_KERNEL(sdmm_kernel_q4_1_avx2, SDMM_TYPE_Q4_1)
SDMM_KERNEL(sdmm_kernel_q5_0_avx2, SDMM_TYPE_Q5_0)
SDMM_KERNEL(sdmm_kernel_q5_1_avx2, SDMM_TYPE_Q5_1)
SDMM_KERNEL(sdmm_kernel_q8_0_avx2, SDMM_TYPE_Q8_0)

/* The int8 peak of this path on this core: 12 independent chains through vpmaddubsw (each
 * result the next one's unsigned input, so nothing is hoisted; 12 cover its latency times its
 * throughput, 5 x 2 on Intel's cores, 3 x 2 on AMD's, in 13 of the 16 registers), 32 u8 x s8
 * multiply-accumulates each. Its kernels widen and sum on other ports, so this is their
 * ceiling. Returns MACs per second over `iters` x 24 x 32 of them. */
double sdmm_avx2_peak_macs(long iters) {
#    define SD_CHAINS_(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#    define SD_INIT_(i) __m256i acc##i = _mm256_set1_epi8((char) (i + 1));
#    define SD_STEP_(i) acc##i = _mm256_maddubs_epi16(acc##i, y);
#    define SD_SINK_(i) sink = _mm256_xor_si256(sink, acc##i);
    SD_CHAINS_(SD_INIT_)
    __m256i y = _mm256_set1_epi8(3);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
        SD_CHAINS_(SD_STEP_)
        SD_CHAINS_(SD_STEP_)
        __asm__ volatile("" : "+x"(y)); /* one new input per pass */
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    __m256i sink = _mm256_setzero_si256();
    SD_CHAINS_(SD_SINK_)
    __asm__ volatile("" : : "x"(sink));
#    undef SD_CHAINS_
#    undef SD_INIT_
#    undef SD_STEP_
#    undef SD_SINK_
    const double s = (double) (t1.tv_sec - t0.tv_sec) + 1e-9 * (double) (t1.tv_nsec - t0.tv_nsec);
    return (double) iters * 24.0 * 32.0 / s;
}

SD_TARGET_POP
#endif /* x86-64 */
