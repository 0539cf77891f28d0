/* sdmm kernels for AVX2 + FMA (CPUs without AVX-512 VNNI): sdmm-simd.h's kernels on 8-lane ymm
 * registers, a 16-row group as two halves, and the int8 peak they are measured against. A
 * sub-block's products are maddubs's 16-bit pairs (no saturation: |2 * 63 * 127| < 2^15),
 * summed in 16 bits where the sum fits and widened by one madd (SD_DOT16): the same 32-bit sums
 * as vpdpbusd, so every output has the AVX-512 path's bits. */
#include "sd-common.h"
#include "sdmm.h"

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
SDMM_KERNEL(sdmm_kernel_q2k_avx2, SDMM_TYPE_Q2_K)
SDMM_KERNEL(sdmm_kernel_iq4xs_avx2, SDMM_TYPE_IQ4_XS)
SDMM_KERNEL(sdmm_kernel_iq4nl_avx2, SDMM_TYPE_IQ4_NL)
SDMM_KERNEL(sdmm_kernel_f16_avx2, SDMM_TYPE_F16)
SDMM_KERNEL(sdmm_kernel_bf16_avx2, SDMM_TYPE_BF16)

SDMM_PEAK(sdmm_avx2_peak_macs, maddubs)

SD_TARGET_POP
#endif /* x86-64 */
