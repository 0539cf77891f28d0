/* sdfa kernel for AVX-512: sdfa-simd.h's kernel on 16-lane zmm registers, 16 query rows to a
 * tile. */
#include "sd-common.h"
#include "sdfa.h"

#if SD_X86
SD_TARGET_PUSH("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")

#    define SD_VL 16
#    include "sdfa-simd.h"

void sdfa_kernel_avx512(const sdfa_tile * t) {
    sdfa_kernel_simd(t);
}

SD_TARGET_POP
#endif /* x86-64 */
