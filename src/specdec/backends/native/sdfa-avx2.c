/* sdfa kernel for AVX2 + FMA: sdfa-simd.h's kernel on 8-lane ymm registers, 8 query rows to a
 * tile; it gives the AVX-512 kernel's bits. */
#include "sd-common.h"
#include "sdfa.h"

#if SD_X86
SD_TARGET_PUSH_PATH_BELOW_AVX512(SD_FEATURES_AVX2)

#    define SD_VL 8
#    include "sdfa-simd.h"

void sdfa_kernel_avx2(const sdfa_walk * t) {
    sdfa_kernel_simd(t);
}

SD_TARGET_POP
#endif /* x86-64 */
