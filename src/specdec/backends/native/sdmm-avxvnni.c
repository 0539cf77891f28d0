/* sdmm kernels for AVX-VNNI (vpdpbusd on ymm, without AVX-512: Intel's client cores from Alder
 * Lake on): sdmm-simd.h's kernels on 8-lane ymm registers, a 16-row group as two halves, each
 * 4 columns of a sub-block one vpdpbusd as on AVX-512; and the int8 peak they are measured
 * against. The same 32-bit sums, so every output has the other paths' bits. */
#include "sd-common.h"
#include "sdmm.h"

#if SD_BUILDS_AVXVNNI /* sd-isa.h */
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
SDMM_KERNEL(sdmm_kernel_q2k_avxvnni, SDMM_TYPE_Q2_K)
SDMM_KERNEL(sdmm_kernel_iq4xs_avxvnni, SDMM_TYPE_IQ4_XS)
SDMM_KERNEL(sdmm_kernel_iq4nl_avxvnni, SDMM_TYPE_IQ4_NL)
SDMM_KERNEL(sdmm_kernel_f16_avxvnni, SDMM_TYPE_F16)
SDMM_KERNEL(sdmm_kernel_bf16_avxvnni, SDMM_TYPE_BF16)

SDMM_PEAK(sdmm_avxvnni_peak_macs, dpbusd)

SD_TARGET_POP
#endif /* SD_BUILDS_AVXVNNI */
