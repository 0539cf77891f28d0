// ggml-cpu's extra buffer type for sdmm's kernels (sdmm-buft.cpp).
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// nullptr when sdmm is off ($SPECDEC_MM=0) or cannot run on this CPU
ggml_backend_buffer_type_t ggml_backend_sdmm_buffer_type(void);

// the instruction path sdmm's buffer type runs (enum sd_isa), -1 when it is off; for specdec's
// Python side (backends/llamacpp.py: kernels(), the cost store's key)
int sdmm_buffer_isa(void);

// FLASH_ATTN_EXT through sdfa (sdfa.h) where its inputs are a q8_0 K, an f16 V and an f32 Q with
// no sinks, ALiBi or softcap, and sdfa is on; false: ggml computes the op as it would without.
// Called by every thread of the op (specdec's patch to ops.cpp).
bool ggml_sdfa_forward(const struct ggml_compute_params * params, struct ggml_tensor * dst);

// the path sdfa runs (enum sd_isa, its own: sdfa_isa_selected), -1 when it is off
// ($SPECDEC_FA=0, or sdmm off)
int sdfa_op_isa(void);

#ifdef __cplusplus
}
#endif
