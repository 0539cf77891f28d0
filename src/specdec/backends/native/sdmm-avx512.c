/* sdmm kernels for AVX-512 with VNNI (vpdpbusd): sdmm-simd.h's kernels on 16-lane zmm registers,
 * one lane per weight row of a 16-row group; and the int8 peak they are measured against. */
#include "sd-common.h"
#include "sdmm.h"

#if SD_BUILDS_AVX512_VNNI /* sd-isa.h */
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
SDMM_KERNEL(sdmm_kernel_q2k_avx512, SDMM_TYPE_Q2_K)
SDMM_KERNEL(sdmm_kernel_iq4xs_avx512, SDMM_TYPE_IQ4_XS)
SDMM_KERNEL(sdmm_kernel_iq4nl_avx512, SDMM_TYPE_IQ4_NL)
SDMM_KERNEL(sdmm_kernel_f16_avx512, SDMM_TYPE_F16)
SDMM_KERNEL(sdmm_kernel_bf16_avx512, SDMM_TYPE_BF16)

SDMM_PEAK(sdmm_avx512_peak_macs, dpbusd)

SD_TARGET_POP
#endif /* SD_BUILDS_AVX512_VNNI */
