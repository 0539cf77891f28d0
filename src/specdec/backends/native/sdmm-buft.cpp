// The SDMM extra buffer type: ggml-cpu's hook for sdmm (sdmm.h). Weights of the types sdmm
// multiplies (sdmm.h's list) that llama.cpp places in this buffer are repacked at load, and
// every MUL_MAT on them -- one token or a verify batch or a prompt -- runs sdmm's kernel, so a
// row's logits do not depend on the batch it was computed in. Registered by specdec's patch to
// ggml-cpu.cpp ahead of the other extra buffer types (CPU_REPACK, AMX), so these weights take
// this path and no other; $SPECDEC_MM=0 leaves it out (stock llama.cpp's kernels).
#include "sdmm-buft.h"

#include "ggml-backend-impl.h"
#include "ggml-cpu-impl.h"
#include "ggml-cpu.h"
#include "ggml-impl.h"
#include "sdfa.h"
#include "sdmm.h"
#include "traits.h"

#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#    include <sys/mman.h>
#endif

static_assert(SDMM_TYPE_Q3_K == GGML_TYPE_Q3_K, "sdmm.h's Q3_K id is ggml's");
static_assert(SDMM_TYPE_Q4_K == GGML_TYPE_Q4_K, "sdmm.h's Q4_K id is ggml's");
static_assert(SDMM_TYPE_Q5_K == GGML_TYPE_Q5_K, "sdmm.h's Q5_K id is ggml's");
static_assert(SDMM_TYPE_Q6_K == GGML_TYPE_Q6_K, "sdmm.h's Q6_K id is ggml's");
static_assert(SDMM_TYPE_Q4_0 == GGML_TYPE_Q4_0, "sdmm.h's Q4_0 id is ggml's");
static_assert(SDMM_TYPE_Q4_1 == GGML_TYPE_Q4_1, "sdmm.h's Q4_1 id is ggml's");
static_assert(SDMM_TYPE_Q5_0 == GGML_TYPE_Q5_0, "sdmm.h's Q5_0 id is ggml's");
static_assert(SDMM_TYPE_Q5_1 == GGML_TYPE_Q5_1, "sdmm.h's Q5_1 id is ggml's");
static_assert(SDMM_TYPE_Q8_0 == GGML_TYPE_Q8_0, "sdmm.h's Q8_0 id is ggml's");
static_assert(SDMM_TYPE_Q2_K == GGML_TYPE_Q2_K, "sdmm.h's Q2_K id is ggml's");
static_assert(SDMM_TYPE_IQ4_XS == GGML_TYPE_IQ4_XS, "sdmm.h's IQ4_XS id is ggml's");
static_assert(SDMM_TYPE_IQ4_NL == GGML_TYPE_IQ4_NL, "sdmm.h's IQ4_NL id is ggml's");
static_assert(SDMM_TYPE_F16 == GGML_TYPE_F16, "sdmm.h's F16 id is ggml's");
static_assert(SDMM_TYPE_BF16 == GGML_TYPE_BF16, "sdmm.h's BF16 id is ggml's");

namespace sdmm_ggml {

// The quantized rows of the activations (sdmm_act or sdmm_act32 blocks), padded to a cache line.
static size_t act_bytes(const ggml_tensor * op) {
    const ggml_tensor * src1 = op->src[1];
    const int type = op->src[0]->type;
    const int64_t rows = src1->ne[1] * src1->ne[2] * src1->ne[3];
    return GGML_PAD((size_t) rows * (size_t) (src1->ne[0] / sdmm_block_cols(type)) *
                        sdmm_act_bytes(type),
                    64);
}

// With fewer activation rows than threads (a single step) each thread quantizes them all into a
// copy of its own and multiplies at once: a row per thread in turn would leave the others
// waiting at a barrier for thread 0's. Otherwise one copy, written by every thread before any
// thread multiplies. The same bits either way (one quantization function).
static bool own_copies(const ggml_tensor * op, int n_threads) {
    const ggml_tensor * src1 = op->src[1];
    return src1->ne[1] * src1->ne[2] * src1->ne[3] < n_threads;
}

static size_t work_bytes(const ggml_tensor * op, int n_threads) {
    return act_bytes(op) * (own_copies(op, n_threads) ? (size_t) n_threads : 1) + 64;
}

class tensor_traits : public ggml::cpu::tensor_traits {
    bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
        size = work_bytes(op, n_threads);
        return true;
    }

    bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
        if (op->op != GGML_OP_MUL_MAT) {
            return false;
        }
        const ggml_tensor * src0 = op->src[0];
        const ggml_tensor * src1 = op->src[1];
        const int type = src0->type;
        const int64_t k = src0->ne[0], n = src0->ne[1], nsb = k / sdmm_block_cols(type);
        const int64_t b = src1->ne[1] * src1->ne[2] * src1->ne[3];
        const int ith = params->ith, nth = params->nth;
        GGML_ASSERT(params->wsize >= work_bytes(op, nth));
        GGML_ASSERT(ggml_is_contiguous(op) && op->nb[1] == (size_t) n * sizeof(float));
        const bool own = own_copies(op, nth);
        char * acts = (char *) GGML_PAD((uintptr_t) params->wdata, 64) +
                      (own ? (size_t) ith * act_bytes(op) : 0);
        const size_t block_bytes = sdmm_act_bytes(type);

        // 1. quantize the activation rows (rows are independent), each super-block's rows side by
        // side (sdmm.h): all of them into this thread's copy, or a row per thread in turn
        for (int64_t i = own ? 0 : ith; i < b; i += own ? 1 : nth) {
            const int64_t i1 = i % src1->ne[1], i2 = (i / src1->ne[1]) % src1->ne[2];
            const int64_t i3 = i / (src1->ne[1] * src1->ne[2]);
            const char * row = (const char *) src1->data + i1 * src1->nb[1] + i2 * src1->nb[2] +
                               i3 * src1->nb[3];
            sdmm_quantize_row(type, (const float *) row, k, acts + (size_t) i * block_bytes,
                              (size_t) b);
        }
        if (!own) {
            ggml_barrier(params->threadpool);
        }

        // 2. each thread takes a contiguous range of 16-row groups with all activation rows:
        // a row's whole dot product stays in one thread, in one lane
        const int64_t ngroups = (n + SDMM_R - 1) / SDMM_R;
        const int64_t g0 = ngroups * ith / nth, g1 = ngroups * (ith + 1) / nth;
        if (g0 < g1) {
            const sdmm_kernel_fn kernel = sdmm_kernel(type, sdmm_isa_selected());
            GGML_ASSERT(kernel != nullptr);
            const char * w = (const char *) src0->data + g0 * nsb * sdmm_group_bytes(type);
            kernel(w, (int) nsb, (int) (g1 - g0), (int) (n - g0 * SDMM_R), acts, (int) b,
                   (float *) op->data + g0 * SDMM_R, (size_t) n);
        }
        return true;
    }
};

static tensor_traits traits;

static bool weight_ok(const ggml_tensor * t) {
    return sdmm_supported_type(t->type) && t->ne[0] % sdmm_block_cols(t->type) == 0 &&
           t->ne[2] == 1 && t->ne[3] == 1 && ggml_is_contiguous(t);
}

class extra_buffer_type : ggml::cpu::extra_buffer_type {
    bool supports_op(ggml_backend_dev_t, const ggml_tensor * op) override {
        const ggml_tensor * src0 = op->src[0];
        const ggml_tensor * src1 = op->src[1];
        return op->op == GGML_OP_MUL_MAT && src0->buffer &&
               src0->buffer->buft == ggml_backend_sdmm_buffer_type() && weight_ok(src0) &&
               src1->type == GGML_TYPE_F32 && src1->nb[0] == sizeof(float) &&
               (!src1->buffer || ggml_backend_buft_is_host(src1->buffer->buft));
    }

    ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
        if (op->op == GGML_OP_MUL_MAT && op->src[0]->buffer &&
            op->src[0]->buffer->buft == ggml_backend_sdmm_buffer_type()) {
            return (ggml::cpu::tensor_traits *) op->src[0]->extra;
        }
        return nullptr;
    }
};

}  // namespace sdmm_ggml

static enum ggml_status sdmm_buffer_init_tensor(ggml_backend_buffer_t, ggml_tensor * tensor) {
    tensor->extra = (void *) &sdmm_ggml::traits;
    return GGML_STATUS_SUCCESS;
}

static void sdmm_buffer_set_tensor(ggml_backend_buffer_t, ggml_tensor * tensor, const void * data,
                                   size_t offset, size_t size) {
    // llama.cpp's loader writes a weight whole; a part could not be repacked
    GGML_ASSERT(offset == 0 && size == ggml_nbytes(tensor));
    GGML_ASSERT(sdmm_ggml::weight_ok(tensor));
    sdmm_pack(tensor->type, data, tensor->ne[1], tensor->ne[0], tensor->data);
}

static const char * sdmm_buffer_type_get_name(ggml_backend_buffer_type_t) {
    return "SDMM";
}

static ggml_backend_buffer_t sdmm_buffer_type_alloc_buffer(ggml_backend_buffer_type_t buft,
                                                           size_t size) {
    ggml_backend_buffer_t buffer = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
    if (buffer == nullptr) {
        return nullptr;
    }
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    // The weights are streamed once per pass: 2 MiB pages spare the TLB a miss every 4 KiB.
    const uintptr_t base = (uintptr_t) ggml_backend_buffer_get_base(buffer);
    const uintptr_t lo = (base + (2u << 20) - 1) & ~(uintptr_t) ((2u << 20) - 1);
    const uintptr_t hi = (base + size) & ~(uintptr_t) ((2u << 20) - 1);
    if (hi > lo) {
        madvise((void *) lo, hi - lo, MADV_HUGEPAGE);
    }
#endif
    buffer->buft = buft;
    buffer->iface.init_tensor = sdmm_buffer_init_tensor;
    buffer->iface.set_tensor = sdmm_buffer_set_tensor;
    buffer->iface.get_tensor = nullptr;
    buffer->iface.cpy_tensor = nullptr;
    return buffer;
}

static size_t sdmm_buffer_type_get_alignment(ggml_backend_buffer_type_t) {
    return 64;
}

static size_t sdmm_buffer_type_get_alloc_size(ggml_backend_buffer_type_t, const ggml_tensor * tensor) {
    return sdmm_supported_type(tensor->type)
               ? sdmm_packed_size(tensor->type, tensor->ne[1], tensor->ne[0])
               : ggml_nbytes(tensor);
}

// On unless $SPECDEC_MM=0. The scalar reference path is slow: it runs only when
// $SPECDEC_MM_ISA=ref asks for it (tests), never as the fallback of a CPU without AVX2.
static bool sdmm_enabled() {
    const char * off = getenv("SPECDEC_MM");
    const char * isa = getenv("SPECDEC_MM_ISA");
    if (off != nullptr && strcmp(off, "0") == 0) {
        return false;
    }
    if (sdmm_isa_selected() < 0) {
        GGML_LOG_WARN("sdmm: SPECDEC_MM_ISA=%s names a path this CPU cannot run; sdmm is off\n", isa);
        return false;
    }
    return sdmm_isa_selected() > SD_ISA_REF || (isa != nullptr && *isa != '\0');
}

ggml_backend_buffer_type_t ggml_backend_sdmm_buffer_type(void) {
    static ggml_backend_buffer_type buft = {
        /* .iface   = */ {
            /* .get_name       = */ sdmm_buffer_type_get_name,
            /* .alloc_buffer   = */ sdmm_buffer_type_alloc_buffer,
            /* .get_alignment  = */ sdmm_buffer_type_get_alignment,
            /* .get_max_size   = */ nullptr,
            /* .get_alloc_size = */ sdmm_buffer_type_get_alloc_size,
            /* .is_host        = */ nullptr,
        },
        /* .device  = */ ggml_backend_reg_dev_get(ggml_backend_cpu_reg(), 0),
        /* .context = */ new sdmm_ggml::extra_buffer_type(),
    };
    static const bool enabled = sdmm_enabled();
    return enabled ? &buft : nullptr;
}

int sdmm_buffer_isa(void) {
    return ggml_backend_sdmm_buffer_type() != nullptr ? sdmm_isa_selected() : -1;
}

// ---------------------------------------------------------------------------------- attention

// sdfa runs with sdmm's buffer type (both off at $SPECDEC_MM=0: stock llama.cpp's kernels), on
// the path its own dispatch picks (sdfa.c; $SPECDEC_FA=0 leaves ggml's attention).
int sdfa_op_isa(void) {
    static const int isa = [] {
        const char * off = getenv("SPECDEC_FA");
        const bool on = (off == nullptr || strcmp(off, "0") != 0) && sdmm_buffer_isa() >= 0;
        return on ? sdfa_isa_selected() : -1;
    }();
    return isa;
}

static bool sdfa_takes(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    float max_bias = 0.0f, softcap = 0.0f;
    memcpy(&max_bias, (const float *) dst->op_params + 1, sizeof(float));
    memcpy(&softcap, (const float *) dst->op_params + 2, sizeof(float));
    const int64_t d = k->ne[0];
    return q->type == GGML_TYPE_F32 && k->type == GGML_TYPE_Q8_0 && v->type == GGML_TYPE_F16 &&
           (mask == nullptr || (mask->type == GGML_TYPE_F16 && mask->nb[0] == sizeof(uint16_t))) &&
           dst->src[4] == nullptr && max_bias == 0.0f && softcap == 0.0f && v->ne[0] == d &&
           q->ne[0] == d && d % 32 == 0 && d <= SDFA_MAX_D && k->ne[3] == q->ne[3] &&
           v->ne[3] == q->ne[3] && k->ne[2] == v->ne[2] && q->ne[2] % k->ne[2] == 0 &&
           q->nb[0] == sizeof(float) && v->nb[0] == sizeof(uint16_t) &&
           dst->type == GGML_TYPE_F32 && dst->nb[0] == sizeof(float);
}

bool ggml_sdfa_forward(const ggml_compute_params * params, ggml_tensor * dst) {
    const int isa = sdfa_op_isa();
    if (isa < 0 || !sdfa_takes(dst)) {
        return false;
    }
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    const ggml_tensor * v = dst->src[2];
    const ggml_tensor * mask = dst->src[3];
    float scale = 1.0f;
    memcpy(&scale, (const float *) dst->op_params + 0, sizeof(float));
    const sdfa_kernel_fn kernel = sdfa_kernel(isa);
    GGML_ASSERT(kernel != nullptr);
    // Rows sharing a KV head of one stream (its query heads, for every token of the pass in
    // that stream: llama.cpp's sequences with a KV cache each, --parallel) walk its cache
    // together, up to SDFA_MAX_ROWS at a time, in walks short enough that every thread has one
    // where the rows allow (in whole tiles of 16, the widest path's); walks go to the threads in
    // contiguous ranges. A row's output never depends on its walk, nor on the other streams:
    // each stream's cells start at 0, as they would alone.
    const int64_t n_tokens = q->ne[1], n_kv_head = k->ne[2], group = q->ne[2] / k->ne[2];
    const int64_t rows = n_tokens * group, heads = q->ne[3] * n_kv_head;
    const int64_t per_head = (params->nth + heads - 1) / heads;  // walks each head needs
    const int64_t even = ((rows + per_head - 1) / per_head + 15) / 16 * 16;
    const int64_t w = even < SDFA_MAX_ROWS ? even : SDFA_MAX_ROWS;
    const int64_t walks = (rows + w - 1) / w, units = heads * walks;
    const int64_t u0 = units * params->ith / params->nth, u1 = units * (params->ith + 1) / params->nth;
    for (int64_t u = u0; u < u1; u++) {
        const int64_t s = u / (n_kv_head * walks), g = u / walks % n_kv_head, r0 = (u % walks) * w;
        sdfa_walk t = {};
        t.d = (int) k->ne[0];
        t.n_kv = (int) k->ne[1];
        t.scale = scale;
        t.k = (const char *) k->data + g * k->nb[2] + s * k->nb[3];
        t.k_stride = k->nb[1];
        t.v = (const uint16_t *) ((const char *) v->data + g * v->nb[2] + s * v->nb[3]);
        t.v_stride = v->nb[1];
        t.rows = (int) (rows - r0 < w ? rows - r0 : w);
        for (int r = 0; r < t.rows; r++) {
            const int64_t tok = (r0 + r) / group, head = g * group + (r0 + r) % group;
            t.q[r] = (const float *) ((const char *) q->data + tok * q->nb[1] + head * q->nb[2] +
                                      s * q->nb[3]);
            t.mask[r] = mask == nullptr
                            ? nullptr
                            : (const uint16_t *) ((const char *) mask->data + tok * mask->nb[1] +
                                                  (head % mask->ne[2]) * mask->nb[2] +
                                                  (s % mask->ne[3]) * mask->nb[3]);
            // dst is [d, heads, tokens, streams]: the permuted layout ggml's kernel writes
            t.out[r] = (float *) ((char *) dst->data + (head + tok * dst->ne[1]) * dst->nb[1] +
                                  s * dst->nb[3]);
        }
        kernel(&t);
    }
    return true;
}
