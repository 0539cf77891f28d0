/* sdmm kernels for AVX2 + FMA (CPUs without AVX-512 VNNI): sdmm-simd.h's kernels on 8-lane ymm
 * registers, a 16-row group as two halves. vpdpbusd is maddubs + madd(1): the same 32-bit sums
 * (no saturation: |2 * 63 * 127| < 2^15), so every output has the AVX-512 path's bits. */
#include "sd-common.h"
#include "sdmm.h"

#if SD_X86
SD_TARGET_PUSH_PATH(SD_FEATURES_AVX2)

#    define SD_VL 8
#    define SDMM_TILE 4 /* 16 ymm registers: 4 rows' sums besides a sub-block's 8 weight vectors */
#    include "sdmm-simd.h"

SDMM_KERNEL(sdmm_kernel_q4k_avx2, SDMM_TYPE_Q4_K)
SDMM_KERNEL(sdmm_kernel_q5k_avx2, SDMM_TYPE_Q5_K)
SDMM_KERNEL(sdmm_kernel_q6k_avx2, SDMM_TYPE_Q6_K)
SDMM_KERNEL(sdmm_kernel_q4_0_avx2, SDMM_TYPE_Q4_0)
SDMM_KERNEL(sdmm_kernel_q4_1_avx2, SDMM_TYPE_Q4_1)
SDMM_KERNEL(sdmm_kernel_q5_0_avx2, SDMM_TYPE_Q5_0)
SDMM_KERNEL(sdmm_kernel_q5_1_avx2, SDMM_TYPE_Q5_1)
SDMM_KERNEL(sdmm_kernel_q8_0_avx2, SDMM_TYPE_Q8_0)

SD_TARGET_POP
#endif /* x86-64 */
