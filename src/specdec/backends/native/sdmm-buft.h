// ggml-cpu's extra buffer type for sdmm's kernels (sdmm-buft.cpp).
#pragma once

#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// nullptr when sdmm is off ($SPECDEC_MM=0) or cannot run on this CPU
ggml_backend_buffer_type_t ggml_backend_sdmm_buffer_type(void);

// the instruction path sdmm's buffer type runs (enum sdmm_isa), -1 when it is off; for specdec's
// Python side (backends/llamacpp.py: kernels(), the cost store's key)
int sdmm_buffer_isa(void);

#ifdef __cplusplus
}
#endif
