/* sdfa: the scalar reference kernel, which spells out every lane's operations in the order the
 * SIMD kernels do them, and the dispatch. The contract is in sdfa.h. */
#include "sdfa.h"

#include "sd-common.h"

#include <float.h>
#include <math.h>
#include <string.h>

_Static_assert(sizeof(sdfa_block_q8_0) == 34, "ggml's block_q8_0 is 34 bytes");

/* sdfa's exp (sdfa.h: SDFA_EXP_*); the SIMD kernels do these operations per lane. */
static float sdfa_exp(float x) {
    if (!(x >= SDFA_EXP_MIN)) {
        return 0.0f;
    }
    const float n = nearbyintf(x * SDFA_EXP_LOG2E);
    float r = fmaf(n, -SDFA_EXP_LN2_HI, x);
    r = fmaf(n, -SDFA_EXP_LN2_LO, r);
    float y = SDFA_EXP_P5;
    y = fmaf(y, r, SDFA_EXP_P4);
    y = fmaf(y, r, SDFA_EXP_P3);
    y = fmaf(y, r, SDFA_EXP_P2);
    y = fmaf(y, r, SDFA_EXP_P1);
    y = fmaf(y, r, SDFA_EXP_P0);
    y = fmaf(y, r * r, r);
    y = y + 1.0f;
    const int32_t bits = ((int32_t) n + 127) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return y * two_n;
}

void sdfa_quantize_query(const float * q, int d, int8_t * qq, float * dq) {
    for (int c = 0; c < d / 32; c++) {
        float amax = 0.0f;
        int finite = 1;
        for (int i = 32 * c; i < 32 * c + 32; i++) {
            const float a = fabsf(q[i]);
            finite &= a <= FLT_MAX;
            amax = a > amax ? a : amax;
        }
        dq[c] = finite ? amax / 127.0f : NAN;
        const float id = finite && dq[c] != 0.0f ? 1.0f / dq[c] : 0.0f;
        for (int i = 32 * c; i < 32 * c + 32; i++) {
            qq[i] = (int8_t) nearbyintf(q[i] * id); /* |q * id| <= 127 up to rounding */
        }
    }
}

void sdfa_kernel_ref(const sdfa_walk * t) {
    const int d = t->d, nblk = (t->n_kv + SDFA_P - 1) / SDFA_P;
    for (int r = 0; r < t->rows; r++) {
        int8_t qq[SDFA_MAX_D];
        float dq[SDFA_MAX_D / 32];
        sdfa_quantize_query(t->q[r], d, qq, dq);
        float acc[SDFA_MAX_D] = {0};
        float M = -INFINITY, S = 0.0f;
        for (int b = 0; b < nblk; b++) {
            float s[SDFA_P];
            for (int j = 0; j < SDFA_P; j++) {
                const int p = b * SDFA_P + j;
                if (p >= t->n_kv) {
                    s[j] = -INFINITY;
                    continue;
                }
                const sdfa_block_q8_0 * k =
                    (const sdfa_block_q8_0 *) ((const char *) t->k + (size_t) p * t->k_stride);
                float dot = 0.0f;
                for (int c = 0; c < d / 32; c++) {
                    int32_t dot_c = 0; /* exact */
                    for (int i = 0; i < 32; i++) {
                        dot_c += (int32_t) qq[32 * c + i] * k[c].qs[i];
                    }
                    dot = fmaf((float) dot_c, dq[c] * sd_h2f(k[c].d), dot);
                }
                const float mv = t->mask[r] ? sd_h2f(t->mask[r][p]) : 0.0f;
                s[j] = fmaf(dot, t->scale, mv);
            }
            float mb = s[0];
            for (int j = 1; j < SDFA_P; j++) {
                mb = s[j] > mb ? s[j] : mb;
            }
            const float Mn = mb > M ? mb : M;
            const int none = Mn == -INFINITY; /* nothing unmasked yet: alpha 1, p 0 */
            const float alpha = none ? 1.0f : sdfa_exp(M - Mn);
            float p[SDFA_P];
            for (int j = 0; j < SDFA_P; j++) {
                p[j] = none ? 0.0f : sdfa_exp(s[j] - Mn);
            }
            S = S * alpha;
            for (int j = 0; j < SDFA_P; j++) {
                S = S + p[j];
            }
            for (int i = 0; i < d; i++) {
                acc[i] = acc[i] * alpha;
            }
            for (int j = 0; j < SDFA_P; j++) {
                const int pos = b * SDFA_P + j;
                const uint16_t * v = (const uint16_t *) ((const char *) t->v + (size_t) pos * t->v_stride);
                for (int i = 0; i < d; i++) { /* a position past the cache has v = 0 */
                    acc[i] = fmaf(p[j], pos < t->n_kv ? sd_h2f(v[i]) : 0.0f, acc[i]);
                }
            }
            M = Mn;
        }
        const float inv = S == 0.0f ? 0.0f : 1.0f / S;
        for (int i = 0; i < d; i++) { /* + 0: every zero leaves as +0 (sdfa.h) */
            t->out[r][i] = acc[i] * inv + 0.0f;
        }
    }
}

int sdfa_isa_supported(int isa) {
    return sd_isa_runs(isa);
}

int sdfa_isa_selected(void) {
    static int selected = -2;
    return sd_isa_select_once(&selected, sdfa_isa_supported);
}

sdfa_kernel_fn sdfa_kernel(int isa) {
    if (!sdfa_isa_supported(isa)) {
        return NULL;
    }
    switch (isa) {
        case SD_ISA_REF:
            return sdfa_kernel_ref;
#if SD_X86
        case SD_ISA_AVX2:
        case SD_ISA_AVXVNNI: /* its AVX2 kernel: sdfa has no AVX-VNNI (ymm vpdpbusd) one */
            return sdfa_kernel_avx2;
#endif
#if SD_BUILDS_AVX512_VNNI
        case SD_ISA_AVX512:
            return sdfa_kernel_avx512;
#endif
        default:
            return NULL;
    }
}

int sdfa_attend(int isa, int d, int n_kv, float scale, const void * k, size_t k_stride,
                const uint16_t * v, size_t v_stride, const float * q, const uint16_t * mask,
                int group, int rows, int walk, float * out) {
    const sdfa_kernel_fn kernel = sdfa_kernel(isa);
    if (kernel == NULL || d < 32 || d > SDFA_MAX_D || d % 32 != 0 || n_kv < 1 || rows < 1 ||
        group < 1 || walk < 1 || walk > SDFA_MAX_ROWS) {
        return -1;
    }
    for (int r0 = 0; r0 < rows; r0 += walk) {
        sdfa_walk t = {d, n_kv, scale, k, k_stride, v, v_stride, 0, {0}, {0}, {0}};
        t.rows = rows - r0 < walk ? rows - r0 : walk;
        for (int r = 0; r < t.rows; r++) {
            t.q[r] = q + (size_t) (r0 + r) * d;
            t.mask[r] = mask ? mask + (size_t) ((r0 + r) / group) * n_kv : NULL;
            t.out[r] = out + (size_t) (r0 + r) * d;
        }
        kernel(&t);
    }
    return 0;
}
