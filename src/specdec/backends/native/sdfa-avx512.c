/* sdfa kernel for AVX-512 with VNNI: sdfa-simd.h's kernel on 16-lane zmm registers, 16 query
 * rows to a tile, the scores' integer dots in vpdpbusd. */
#include "sd-common.h"
#include "sdfa.h"

#if SD_BUILDS_AVX512_VNNI /* sd-isa.h */
SD_TARGET_PUSH_PATH(SD_FEATURES_AVX512_VNNI)

#    define SD_VL 16
#    include "sdfa-simd.h"

void sdfa_kernel_avx512(const sdfa_walk * t) {
    sdfa_kernel_simd(t);
}

SD_TARGET_POP
#endif /* SD_BUILDS_AVX512_VNNI */
