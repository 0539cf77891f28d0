/* sd-isa: the instruction paths of specdec's kernels (sdmm, sdfa) and the one place that says
 * which CPU features each path is compiled for. A kernel file compiles its path with
 * SD_TARGET_PUSH_PATH(list) (sd-common.h) and the dispatch checks the same list at run time
 * (SD_CPU_HAS), so no path runs on a CPU that lacks an instruction its compiler was allowed to
 * emit (a wider list at compile time than at run time is a SIGILL waiting for the right CPU). */
#pragma once

#include <stdlib.h>
#include <string.h>

/* the paths, in order of preference; Python's backends/llamacpp_kernels.py SDMM_ISAS names them.
 * AVX-VNNI is AVX2 with vpdpbusd on ymm (Intel's client cores from Alder Lake on): sdmm's kernels
 * use it, sdfa runs its AVX2 kernel there. */
enum sd_isa {
    SD_ISA_REF = 0,
    SD_ISA_AVX2 = 1,
    SD_ISA_AVXVNNI = 2,
    SD_ISA_AVX512 = 3,
    SD_ISA_COUNT = 4
};

/* SD_X86: the compiler can target x86-64's SIMD instruction sets function by function, so the
 * AVX2 and AVX-512 files build (and the dispatch offers them) whatever -march says. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#    define SD_X86 1
#else
#    define SD_X86 0
#endif

/* Which paths a build compiles: every one (a path's file sets its own instructions, so any x86-64
 * compiler builds them all), except in a build for this CPU alone (SD_NATIVE_BUILD: the build's
 * -march=native), which leaves out a path whose instructions -march did not grant: the CPU lacks
 * them, so the path could never run there (sd_isa_runs). Its compile time is saved (the AVX-512
 * files are a fifth of the library build's CPU time); the dispatch finds NULL in its place. */
#if SD_X86 && defined(SD_NATIVE_BUILD)
#    if defined(__AVXVNNI__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#        define SD_BUILDS_AVXVNNI 1
#    else
#        define SD_BUILDS_AVXVNNI 0
#    endif
#    if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
        defined(__AVX512DQ__) && defined(__AVX512VNNI__) && defined(__AVX2__) &&     \
        defined(__FMA__) && defined(__F16C__)
#        define SD_BUILDS_AVX512_VNNI 1
#    else
#        define SD_BUILDS_AVX512_VNNI 0
#    endif
#else
#    define SD_BUILDS_AVXVNNI SD_X86
#    define SD_BUILDS_AVX512_VNNI SD_X86
#endif

/* Feature lists, X(name) per feature in GCC's and clang's spelling (target attribute and
 * __builtin_cpu_supports take the same names). sdmm's and sdfa's AVX-512 paths multiply with
 * VNNI's vpdpbusd: an AVX-512 CPU without VNNI runs their AVX2 paths. */
#define SD_FEATURES_AVX2(X) X("avx2") X("fma") X("f16c")
#ifdef SD_AVXVNNI_EVEX
/* for tests only: the AVX-VNNI path's code with vpdpbusd's EVEX encoding (AVX-512 VNNI and VL,
 * the same operation), so that a CPU with AVX-512 VNNI and without AVX-VNNI runs it
 * (tests/backends/test_sdmm.py builds the kernels so) */
#    define SD_FEATURES_AVXVNNI(X) SD_FEATURES_AVX2(X) X("avx512vl") X("avx512vnni")
#else
#    define SD_FEATURES_AVXVNNI(X) SD_FEATURES_AVX2(X) X("avxvnni")
#endif
#define SD_FEATURES_AVX512(X) \
    SD_FEATURES_AVX2(X) X("avx512f") X("avx512bw") X("avx512vl") X("avx512dq")
#define SD_FEATURES_AVX512_VNNI(X) SD_FEATURES_AVX512(X) X("avx512vnni")

#if SD_X86
#    define SD_CPU_HAS_ITEM_(feature) &&__builtin_cpu_supports(feature)
/* 1 when this CPU has every feature of the list */
#    define SD_CPU_HAS(features) (__builtin_cpu_init(), 1 features(SD_CPU_HAS_ITEM_))
#else
#    define SD_CPU_HAS(features) 0
#endif

static inline const char * sd_isa_name(int isa) {
    static const char * const names[SD_ISA_COUNT] = {"ref", "avx2", "avxvnni", "avx512"};
    return isa >= 0 && isa < SD_ISA_COUNT ? names[isa] : "none";
}

/* The path a kernel runs, given which paths it can run here: the one $SPECDEC_MM_ISA names
 * (ref|avx2|avxvnni|avx512; it forces sdmm and sdfa alike, for tests) if set, -1 if that one
 * cannot run here; else the best one. */
static inline int sd_isa_select(int (*supported)(int isa)) {
    const char * env = getenv("SPECDEC_MM_ISA");
    if (env != NULL && *env != '\0') {
        for (int isa = SD_ISA_REF; isa < SD_ISA_COUNT; isa++) {
            if (strcmp(env, sd_isa_name(isa)) == 0) {
                return supported(isa) ? isa : -1;
            }
        }
        return -1;
    }
    int best = SD_ISA_REF;
    for (int isa = SD_ISA_REF; isa < SD_ISA_COUNT; isa++) {
        best = supported(isa) ? isa : best;
    }
    return best;
}

/* sd_isa_select, once per process: *selected starts at -2 (not chosen yet). */
static inline int sd_isa_select_once(int * selected, int (*supported)(int isa)) {
    if (*selected == -2) {
        *selected = sd_isa_select(supported);
    }
    return *selected;
}

/* Whether path `isa` runs on this CPU (and was built); the reference path runs everywhere. */
static inline int sd_isa_runs(int isa) {
    switch (isa) {
        case SD_ISA_REF:
            return 1;
        case SD_ISA_AVX2:
            return SD_CPU_HAS(SD_FEATURES_AVX2);
        case SD_ISA_AVXVNNI:
            return SD_BUILDS_AVXVNNI && SD_CPU_HAS(SD_FEATURES_AVXVNNI);
        case SD_ISA_AVX512:
            return SD_BUILDS_AVX512_VNNI && SD_CPU_HAS(SD_FEATURES_AVX512_VNNI);
        default:
            return 0;
    }
}
