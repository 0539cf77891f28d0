/* sd-common: what sdmm's and sdfa's C files share, written once: the exact fp16 -> fp32
 * conversion the scalar paths use, and how an instruction-set file compiles its functions for its
 * instructions whatever the build's flags (sdmm_kernel()/sdfa_kernel() run them only where the
 * CPU has them). Internal to native/: no public names. */
#pragma once

#include "sd-isa.h"

#include <stdint.h>
#include <string.h>

/* fp16 -> fp32, exact (every binary16 value is a binary32 value): the scalar paths' conversion;
 * the SIMD paths use F16C's, which agrees on every number. */
static inline float sd_h2f(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000) << 16;
    const uint32_t exp = (h >> 10) & 0x1f;
    const uint32_t man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13); /* inf, nan */
    } else if (exp != 0) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else { /* subnormal: normalize */
        int e = -1;
        uint32_t m = man;
        do {
            e++;
            m <<= 1;
        } while ((m & 0x400) == 0);
        bits = sign | ((uint32_t) (112 - e) << 23) | ((m & 0x3ff) << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

#if SD_X86
/* SD_TARGET_PUSH("avx2,fma,f16c") ... SD_TARGET_POP: every function between them, the inline
 * intrinsics wrappers included, is compiled for those instructions. No ';' after either (a
 * stray one at file scope is a -Wpedantic warning). A kernel file names its path's feature list
 * instead (SD_TARGET_PUSH_PATH, sd-isa.h), so that it and the run-time check cannot differ. */
#    define SD_PRAGMA_(...) _Pragma(#__VA_ARGS__)
#    if defined(__clang__)
#        define SD_TARGET_PUSH(isa) \
            SD_PRAGMA_(clang attribute push(__attribute__((target(isa))), apply_to = function))
#        define SD_TARGET_POP SD_PRAGMA_(clang attribute pop)
#    else
#        define SD_TARGET_PUSH(isa) SD_PRAGMA_(GCC push_options) SD_PRAGMA_(GCC target(isa))
#        define SD_TARGET_POP SD_PRAGMA_(GCC pop_options)
#    endif
/* "sse2" (x86-64's baseline) then ",avx2" ",fma" ...: one target string from a feature list */
#    define SD_TARGET_ITEM_(feature) "," feature
#    define SD_TARGET_PUSH_PATH(features) SD_TARGET_PUSH("sse2" features(SD_TARGET_ITEM_))
/* The same for a path below AVX-512 (AVX2): compiled without AVX-512 even where the build's
 * -march has it, so that its code is the code an AVX2 CPU runs (with -march=native on an
 * AVX-512 CPU the compiler would give it EVEX encodings and 32 registers, and a forced AVX2 run
 * there would measure another kernel than the one AVX2 users get). */
#    define SD_TARGET_PUSH_PATH_BELOW_AVX512(features) \
        SD_TARGET_PUSH("sse2" features(SD_TARGET_ITEM_) ",no-avx512f")
/* the kernels' helpers: inlined, so a tile's loops unroll over its constant size */
#    define SD_INLINE static inline __attribute__((always_inline))
#endif
