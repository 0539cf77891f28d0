/* sdmm kernels for AVX-VNNI (vpdpbusd on ymm, without AVX-512: Intel's client cores from Alder
 * Lake on): sdmm-simd.h's kernels on 8-lane ymm registers, a 16-row group as two halves, each
 * 4 columns of a sub-block one vpdpbusd as on AVX-512; and the int8 peak they are measured
 * against. The same 32-bit sums, so every output has the other paths' bits. */
#include "sd-common.h"
#include "sdmm.h"

#include <time.h>

#if SD_X86
#    ifdef SD_AVXVNNI_EVEX /* tests only (sd-isa.h): vpdpbusd's AVX-512 encoding */
SD_TARGET_PUSH_PATH(SD_FEATURES_AVXVNNI)
#    else
SD_TARGET_PUSH_PATH_BELOW_AVX512(SD_FEATURES_AVXVNNI)
#    endif

#    define SD_VL 8
#    define SD_AVXVNNI
#    define SDMM_TILE 4 /* 16 ymm registers: 4 rows' sums besides a sub-block's 8 weight vectors */
#    include "sdmm-simd.h"

SDMM_KERNEL(sdmm_kernel_q4k_avxvnni, SDMM_TYPE_Q4_K)
SDMM_KERNEL(sdmm_kernel_q5k_avxvnni, SDMM_TYPE_Q5_K)
SDMM_KERNEL(sdmm_kernel_q6k_avxvnni, SDMM_TYPE_Q6_K)
SDMM_KERNEL(sdmm_kernel_q4_0_avxvnni, SDMM_TYPE_Q4_0)
SDMM_KERNEL(sdmm_kernel_q4_1_avxvnni, SDMM_TYPE_Q4_1)
SDMM_KERNEL(sdmm_kernel_q5_0_avxvnni, SDMM_TYPE_Q5_0)
SDMM_KERNEL(sdmm_kernel_q5_1_avxvnni, SDMM_TYPE_Q5_1)
SDMM_KERNEL(sdmm_kernel_q8_0_avxvnni, SDMM_TYPE_Q8_0)

/* The int8 peak of this path on this core: 12 independent vpdpbusd chains (12 cover its
 * latency times its throughput on the CPUs that have it, in 14 of the 16 registers), 32
 * multiply-accumulates each. Returns MACs per second over `iters` x 24 x 32 of them. */
double sdmm_avxvnni_peak_macs(long iters) {
#    define SD_CHAINS_(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)
#    define SD_INIT_(i) vint acc##i = vi_set1_32(i);
#    define SD_STEP_(i) acc##i = vi_dpbusd(acc##i, x, y);
#    define SD_SINK_(i) sink = vi_add32(sink, acc##i);
    SD_CHAINS_(SD_INIT_)
    vint x = vi_set1_8(3);
    const vint y = vi_set1_8(5);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long it = 0; it < iters; it++) {
        SD_CHAINS_(SD_STEP_)
        SD_CHAINS_(SD_STEP_)
        __asm__ volatile("" : "+x"(x)); /* one new input per pass: nothing hoists the work */
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    vint sink = vi_zero();
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
