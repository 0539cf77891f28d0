/* sdmm kernels for AVX-512 with VNNI (vpdpbusd): sdmm-simd.h's kernels on 16-lane zmm registers,
 * one lane per weight row of a 16-row group; and the int8 peak they are measured against. */
#include "sd-common.h"
#include "sdmm.h"

#include <time.h>

#if SD_X86
SD_TARGET_PUSH_PATH(SD_FEATURES_AVX512_VNNI)

#    define SD_VL 16
#    define SDMM_TILE 16 /* rows per tile: 16 sums and a sub-block's 8 weight vectors in registers */
#    include "sdmm-simd.h"

SDMM_KERNEL(sdmm_kernel_q4k_avx512, SDMM_TYPE_Q4_K)
SDMM_KERNEL(sdmm_kernel_q5k_avx512, SDMM_TYPE_Q5_K)
SDMM_KERNEL(sdmm_kernel_q6k_avx512, SDMM_TYPE_Q6_K)
SDMM_KERNEL(sdmm_kernel_q4_0_avx512, SDMM_TYPE_Q4_0)
SDMM_KERNEL(sdmm_kernel_q4_1_avx512, SDMM_TYPE_Q4_1)
SDMM_KERNEL(sdmm_kernel_q5_0_avx512, SDMM_TYPE_Q5_0)
SDMM_KERNEL(sdmm_kernel_q5_1_avx512, SDMM_TYPE_Q5_1)
SDMM_KERNEL(sdmm_kernel_q8_0_avx512, SDMM_TYPE_Q8_0)

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

SD_TARGET_POP
#endif /* x86-64 */
