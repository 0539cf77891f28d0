"""llama.cpp backend (GGUF, quantized) behind the SpecModel contract, on the low-level C API.

Why not `llama_cpp.Llama`: rejection sampling needs full-vocabulary logits at every drafted
position, and `Llama(logits_all=True)` gets them by keeping an [n_ctx, V] float buffer (2.5 GB for
V = 151936, n_ctx = 4096) and re-tokenizing through its own helpers. Here a `llama_batch` flags
every token for output, and only the new rows are copied out with `llama_get_logits_ith`; the
logits buffer llama.cpp keeps is [n_batch, V].

Rollback is one call, as in llama.cpp's common/speculative: `llama_memory_seq_rm(mem, seq, n, -1)`.

Slots (`n_seq` > 1, a server's --parallel): one context holds n_seq sequences, each in a KV
stream of its own (llama.cpp's non-unified cache: n_ctx cells per sequence), so a sequence's
cells start at 0 and lie in position order exactly as they would alone, and sdfa reads a row's
cache the same way in company: its logits are the same bits (tests/core/test_slots.py). One
`llama_decode` over tokens of several sequences is one pass over the weights only if every
sequence brings the same number of tokens and their ids are consecutive (llama.cpp splits a
multi-stream batch into ubatches of equal tokens per sequence, over a run of sequence ids);
otherwise llama.cpp splits it, correctly but with one pass per piece.

Numerics, measured on CPU (the contract tests pin them): the logits of a position must not depend
on how the tokens were batched, or a verify batch of K+1 tokens disagrees with one-token-at-a-time
decoding and greedy speculative output drifts from greedy plain output at near-ties. What buys
that batch invariance:
  * flash attention ON. Without it KQ runs through matmul kernels picked by batch size, and a
    short batch differs from single tokens (the team measured up to ~1.0 on real text).
  * K cache in q8_0 (V stays f16). With llama.cpp's default f16 K, ggml's flash attention takes
    other code paths for a single query once the cache spans >= 512 cells (split-KV across
    threads: from position 256 on we measured a 1.75 logit difference vs a batch) and for long
    batches (tiled prompt processing: 2.6 vs token by token). A quantized K sends every shape
    through one kernel: prefill, verify and single-token logits were bit-identical in all our
    runs. Measured cost: ~3% per decoded token (22.1 vs 21.4 ms, smollm2, 1 thread); top-1
    agreement with the fp32 HF model on 300 positions of real text was 96.7% (94.7% with f32 KV).
  * matmuls that compute a row alike in any batch. Per-row weight types (Q4_1, Q5_0, Q5_1, Q8_0:
    ROW_INVARIANT_TYPES) are, in ggml's own kernels. K-quants are not: found op by op with
    llama.cpp's eval callback (`specdec invariance`), weights repacked at load (Q4_K) are
    multiplied by a GEMM for batches and a GEMV for single rows, and K-quants that are not
    repacked (Q6_K) take a tiled GEMM once a batch has >= 8 rows. specdec's build adds sdmm
    (native/sdmm.h, docs/kernels.md): an extra buffer type ahead of ggml's that takes every 2-D
    Q3_K, Q4_K, Q5_K and Q6_K weight and multiplies it with one kernel for every batch size, b = 1
    included, whose rows are bit-identical by construction -- and faster than ggml's on verify
    batches. It takes Q4_0 and the per-row types Q4_1, Q5_0, Q5_1 and Q8_0 too, for speed:
    ggml's kernels for those are already invariant but read the weights at a third of sdmm's
    rate. The list is weights.SDMM_TYPES.

So a file whose matmul weights are all SDMM_TYPES or ROW_INVARIANT_TYPES (both Qwen GGUFs,
smollm2) is batch-invariant in the default mode: `batch_invariant` is True, greedy speculative
output equals greedy target-only output, and `deterministic=True` costs nothing (it checks that
this holds). For any other file `deterministic=True` falls back to ggml's slow invariant paths:
repacking off (`use_extra_bufts = false`, verified from llama.cpp's buffer report) and the tiled
matmul off. On a CPU with AMX, llama.cpp's AMX buffer type (after sdmm's) is invariant as well.

llama.cpp reads the tiled switch (GGML_CPU_TILED_MM) once per process, at its first matmul, so
the first model a process loads decides it for all (unless the caller set it): on, as in stock
llama.cpp, for a default-mode model, off for a deterministic model that needs the slow paths. Such
a model cannot follow a default one in the same process; the error says so.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from specdec.backends.cores import governor, pace, usable_cores
from specdec.backends.llamacpp_kernels import check_sdmm_env, sdfa_isa, sdmm_isa, source_digest
from specdec.backends.llamacpp_lib import bindings, load_log
from specdec.backends.weights import (
    ROW_INVARIANT_TYPES,
    SDMM_TYPES,
    invariant_by_construction,
    matmul_weight_types,
    not_invariant_warning,
)
from specdec.core.checks import check_int
from specdec.core.device import get_device
from specdec.core.model import SpecModel, SpecModelError

if TYPE_CHECKING:
    from specdec.backends.llamacpp_ops import OpCapture, OpTimer

log = logging.getLogger(__name__)

DEFAULT_N_CTX = 4096
# Largest batch per llama_decode call. Every position needs its logits, so llama.cpp reserves an
# [n_batch, V] float32 output buffer: 512 x 151936 x 4 B = 311 MB for Qwen. Longer extends (prompt
# prefills) are split into n_batch-sized calls.
DEFAULT_N_BATCH = 512
_SEQ = 0  # the model's own sequence id; its slots (n_seq > 1) are 1 .. n_seq - 1
# ggml_type of the K cache: q8_0, for batch invariance (module docstring). Pass type_k=1 (f16) for
# llama.cpp's default.
DEFAULT_TYPE_K = 8  # GGML_TYPE_Q8_0
LLAMA_VOCAB_TYPE_SPM = 1  # llama.h's enum llama_vocab_type
#: llama.cpp's switch for its tiled K-quant GEMM (batches of >= 8 rows), read once per process:
#: the first model sets it, on for the default mode, off for deterministic (module docstring).
TILED_MM_ENV = "GGML_CPU_TILED_MM"
_tiled_set_by = ""  # the mode of the model that set TILED_MM_ENV, if specdec set it


#: A sequence's cells in a multi-sequence context come in multiples of this (llama.cpp pads)
CELL_PAD = 256
#: Sequences a llama.cpp context holds at most (LLAMA_MAX_SEQ, src/llama-cparams.h): past it
#: the context fails to initialize with no reason given.
MAX_SEQ = 256
#: The share of the memory available at load that KV caches may take (the rest: the weights'
#: pages, logits buffers, the process).
KV_MEMORY_SHARE = 0.8


def _available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cost_key(model: LlamaCppModel) -> str:
    """What this model's verify-cost curve v(b) depends on, as a name (backends.costs keeps
    k="auto"'s curves under it): the GGUF content, build, thread count and numerics setting.
    The build is the llama-cpp-python version, the CPU kernels compiled in (a -march=native
    build of the same version runs batched passes 15-25% faster on an AVX-512 host) and the
    sources of specdec's own kernels (a change to sdmm moves the whole curve)."""
    import zlib

    import llama_cpp

    from specdec.backends.tokenizer import gguf_cache_key

    c = model._cparams
    parts = [
        gguf_cache_key(model.path),
        f"lcp{llama_cpp.__version__}",
        f"cpu{zlib.crc32(llama_cpp.llama_print_system_info()) & 0xFFFF:04x}",
        f"t{c.n_threads}",
        f"b{model.n_batch}",
        f"k{c.type_k}",
        f"fa{int(c.flash_attn_type)}",
        "det" if model.deterministic else "def",
        f"tiled{os.environ.get(TILED_MM_ENV, '1')}",
        f"mm{sdmm_isa() or 'off'}",
        f"fa{sdfa_isa() or 'off'}",
        f"src{source_digest() or 'none'}",
    ]
    return "-".join(parts)


def _load_model(llama: Any, path: Path, mparams: Any) -> tuple[Any, dict[str, float]]:
    """llama_model_load_from_file, and the MiB of weights llama.cpp put in each of its extra
    buffer types (SDMM, CPU_REPACK, AMX: weights laid out for another kernel), read from its own
    buffer report: where the weights went, and the check that `use_extra_bufts` reached it."""
    with load_log() as lines:
        model = llama.llama_model_load_from_file(str(path).encode("utf-8"), mparams)
    extra: dict[str, float] = {}
    for line in lines:  # "load_tensors:   CPU_REPACK model buffer size =    28.05 MiB"
        head, sep, size = line.partition(" model buffer size =")
        buft = head.split()[-1] if sep and head.split() else "CPU"
        if buft not in ("CPU", "CPU_Mapped"):
            extra[buft] = extra.get(buft, 0.0) + float(size.split()[0])
    return model, extra


def _set_tiled_switch(mode: str) -> None:
    """The first model of the process sets llama.cpp's tiled switch for its mode, unless the
    caller set it (module docstring)."""
    global _tiled_set_by
    if TILED_MM_ENV not in os.environ:
        os.environ[TILED_MM_ENV] = "0" if mode == "deterministic" else "1"
        _tiled_set_by = mode


def _check_deterministic_switches(
    name: str, n_gpu_layers: int, flash_attn: bool, type_k: int, slow: bool
) -> None:
    """Refuse a deterministic load whose settings would bring a batch-dependent path back.
    `slow`: it needs ggml's slow paths (the tiled matmul off) rather than sdmm."""
    why = None
    if slow and os.environ.get(TILED_MM_ENV, "0") not in ("0", ""):
        value = os.environ[TILED_MM_ENV]
        why = f"{TILED_MM_ENV}={value} turns llama.cpp's tiled matmul on; unset it"
        if _tiled_set_by == "default":
            why = (
                "a default-mode model loaded earlier in this process turned llama.cpp's tiled "
                "matmul on, and llama.cpp reads that switch once per process; load the "
                f"deterministic model first (or in a process of its own), or set {TILED_MM_ENV}=0 "
                "before the first model loads"
            )
    elif n_gpu_layers != 0:
        why = "it is defined for the CPU backend only; load with n_gpu_layers=0 (--device cpu)"
    elif not flash_attn or type_k != DEFAULT_TYPE_K:
        why = "it needs flash attention with a q8_0 K cache (the defaults); drop those overrides"
    if why is not None:
        raise SpecModelError(f"{name}: deterministic mode is not available: {why}")


class LlamaCppModel(SpecModel):
    """A GGUF model in llama.cpp with one KV sequence, or `n_seq` of them (`slots`)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        tokenizer: Any = None,
        name: str | None = None,
        n_ctx: int | None = None,
        n_batch: int = DEFAULT_N_BATCH,
        n_threads: int | None = None,
        n_gpu_layers: int = 0,
        flash_attn: bool = True,
        type_k: int = DEFAULT_TYPE_K,
        deterministic: bool = False,
        n_seq: int = 1,
        repack: bool | None = None,
        op_capture: OpCapture | OpTimer | None = None,
    ) -> None:
        super().__init__()
        check_int("n_seq", n_seq, 1, error=SpecModelError)
        if n_seq > MAX_SEQ:
            raise SpecModelError(
                f"llama.cpp holds at most {MAX_SEQ} sequences in a context, {n_seq} were asked "
                f"for; run at most {MAX_SEQ} at once (specdec serve --parallel)"
            )
        self.n_seq = n_seq
        llama = self._llama = bindings()
        path = Path(path)
        self.name = name or f"llamacpp:{path.name}"
        self.path = path
        self.tokenizer = tokenizer
        self.deterministic = deterministic
        self._model = self._ctx = self._scratch = self._batch = None
        self._slots: list[SpecModel] = [self]
        check_sdmm_env()
        self.weight_types = matmul_weight_types(path)
        self.sdmm = sdmm_isa() if repack is not False else None
        invariant_math = n_gpu_layers == 0 and flash_attn and type_k == DEFAULT_TYPE_K
        # The default mode is invariant for this file (module docstring); if not, deterministic
        # mode takes ggml's slow invariant paths: no repacked weights, no tiled matmul.
        covered = invariant_math and invariant_by_construction(self.weight_types, self.sdmm)
        slow = deterministic and not covered
        _set_tiled_switch("deterministic" if slow else "default")
        if deterministic:
            _check_deterministic_switches(self.name, n_gpu_layers, flash_attn, type_k, slow)

        self._model, self.extra_mib = self._load_weights(path, n_gpu_layers, repack, slow)
        self.repacked_mib = sum(self.extra_mib.values())
        self.batch_invariant = slow or (covered and self._weights_where_expected())
        if invariant_math and not covered and not deterministic:  # say so, once, at load
            log.warning(not_invariant_warning(self.name, self.weight_types, self.sdmm))
        if deterministic:
            self._check_placement(slow)
        vocab = llama.llama_model_get_vocab(self._model)
        # llama.cpp's logits are exactly n_vocab wide (the GGUF's token list, padding included).
        self.vocab_size = int(llama.llama_vocab_n_tokens(vocab))
        self.n_ctx, self.n_batch = self._context_size(n_ctx, n_batch)
        if tokenizer is not None:
            self._check_tokenizer(vocab, tokenizer)
        self._cparams = self._context_params(n_threads, flash_attn, type_k, op_capture)
        # None: the pool follows the cores other work leaves free (backends.cores)
        self._adaptive = n_threads is None
        self._op_capture = op_capture  # keeps the callback alive with the context
        self.kv_bytes = self.n_seq * self._kv_bytes_per_seq(type_k)
        try:
            self._check_memory()
            self._ctx = self._new_context()
        except SpecModelError:
            self.close()
            raise
        self._batch = llama.llama_batch_init(self.n_batch, 0, 1)
        offload = n_gpu_layers != 0 and bool(llama.llama_supports_gpu_offload())
        self.device = torch.device("cuda" if offload else "cpu")

    def _kv_bytes_per_seq(self, type_k: int) -> int:
        """Bytes of one sequence's KV cache (n_ctx cells): K in q8_0 (34 bytes per 32 values)
        or f16, V in f16, per layer and KV head; head size n_embd / n_head."""
        llama, m = self._llama, self._model
        n_layer, n_head = llama.llama_model_n_layer(m), llama.llama_model_n_head(m)
        n_head_kv, n_embd = llama.llama_model_n_head_kv(m), llama.llama_model_n_embd(m)
        k_per_value = 34 / 32 if type_k == DEFAULT_TYPE_K else 2.0
        values = n_layer * n_head_kv * (n_embd // max(1, n_head))
        return int(self.n_ctx * values * (k_per_value + 2.0))

    def _check_memory(self) -> None:
        """Refuse sequences whose KV caches would not fit the memory available now, before
        llama.cpp allocates them: 64 slots once took 4.9 GB and 20 s at start, unannounced."""
        avail = _available_bytes()
        if avail is not None and self.kv_bytes > KV_MEMORY_SHARE * avail:
            gib = 1 << 30
            raise SpecModelError(
                f"{self.name}: {self.n_seq} sequences of {self.n_ctx} tokens need "
                f"{self.kv_bytes / gib:.1f} GiB of KV cache, more than {KV_MEMORY_SHARE:.0%} of "
                f"the {avail / gib:.1f} GiB available; run fewer at once (specdec serve "
                "--parallel) or with a shorter context (n_ctx; specdec serve --ctx-size)"
            )

    def _load_weights(
        self, path: Path, n_gpu_layers: int, repack: bool | None, slow: bool
    ) -> tuple[Any, dict[str, float]]:
        """The llama_model and the MiB llama.cpp put in each extra buffer type (repacked)."""
        mparams = self._llama.llama_model_default_params()
        mparams.n_gpu_layers = n_gpu_layers
        # Repacked weights are multiplied one way for batches and another for single rows.
        if repack and slow:
            raise SpecModelError(f"{self.name}: deterministic mode needs repack off")
        mparams.use_extra_bufts = not slow if repack is None else repack
        model, extra_mib = _load_model(self._llama, path, mparams)
        if not model:
            raise SpecModelError(
                f"llama.cpp could not load {path} (unsupported architecture or damaged file); "
                "check the file, or try the hf: backend"
            )
        return model, extra_mib

    def _check_placement(self, slow: bool) -> None:
        """A deterministic load: every matmul weight where its invariant kernel reads it."""
        if not self.batch_invariant:
            where = ", ".join(f"{k} {v:.1f} MiB" for k, v in self.extra_mib.items()) or "none"
            self.close()
            raise SpecModelError(
                f"{self.name}: deterministic mode expected every matmul weight "
                f"({', '.join(sorted(self.weight_types))}) in a batch-invariant kernel, but "
                f"llama.cpp placed them otherwise (extra buffers: {where}); this "
                "llama-cpp-python is not specdec's build (make venv builds it)"
            )
        if slow and self.repacked_mib:
            self.close()
            raise SpecModelError(
                f"{self.name}: deterministic mode asked llama.cpp not to repack weights, but "
                f"{self.repacked_mib:.1f} MiB were repacked; this llama-cpp-python build ignores "
                "use_extra_bufts (use the pinned llama-cpp-python 0.3.36)"
            )

    def _context_size(self, n_ctx: int | None, n_batch: int) -> tuple[int, int]:
        """(n_ctx, n_batch): n_ctx within the trained positions, a batch no longer than it."""
        n_ctx_train = int(self._llama.llama_model_n_ctx_train(self._model))
        if n_ctx is None:
            n_ctx = min(DEFAULT_N_CTX, n_ctx_train)
        if not 1 <= n_ctx <= n_ctx_train or n_batch < 1:
            self.close()
            raise SpecModelError(
                f"{self.name}: need 1 <= n_ctx <= {n_ctx_train} (the positions the model was "
                f"trained for) and n_batch >= 1; got n_ctx={n_ctx}, n_batch={n_batch}"
            )
        if self.n_seq > 1:
            # llama.cpp pads each sequence's cells to a multiple of 256 (llama-context.cpp), and
            # a batch sized by the unpadded count once failed an assertion there (n_ctx 128)
            n_ctx = -(-n_ctx // CELL_PAD) * CELL_PAD
        return int(n_ctx), int(min(n_batch, n_ctx))

    def _context_params(
        self,
        n_threads: int | None,
        flash_attn: bool,
        type_k: int,
        op_capture: OpCapture | OpTimer | None,
    ) -> Any:
        llama = self._llama
        cparams = llama.llama_context_default_params()
        # n_ctx cells for each sequence, in a KV stream of its own (module docstring, slots)
        cparams.n_ctx = self.n_ctx * self.n_seq
        cparams.n_batch = cparams.n_ubatch = self.n_batch  # one physical pass per decode call
        cparams.n_seq_max = self.n_seq
        cparams.kv_unified = False
        cparams.n_threads = cparams.n_threads_batch = n_threads or usable_cores()
        cparams.flash_attn_type = (
            llama.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if flash_attn
            else llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        cparams.type_k = type_k
        cparams.no_perf = True
        if op_capture is not None:  # diagnostics only (study.run.invariance, study.run.profile)
            cparams.cb_eval = op_capture.callback
            cparams.cb_eval_user_data = None
        return cparams

    def _weights_where_expected(self) -> bool:
        """sdmm holds the K-quants (if the file has any) and no other kernel repacked anything
        but AMX, whose kernels are invariant too (docs/kernels.md). The per-row types sdmm also
        takes are invariant in ggml's kernels as well: sdmm may or may not hold them."""
        others = {k: v for k, v in self.extra_mib.items() if k not in ("SDMM", "AMX") and v}
        needs_sdmm = bool(self.weight_types & (SDMM_TYPES - ROW_INVARIANT_TYPES))
        return not others and (not needs_sdmm or self.extra_mib.get("SDMM", 0.0) > 0)

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        name: str | None = None,
        **kwargs: Any,
    ) -> LlamaCppModel:
        """Load a .gguf file; on a non-CPU `device` all layers are offloaded if llama.cpp can.

        kwargs: n_ctx, n_batch, n_threads, n_gpu_layers, flash_attn, type_k, deterministic (see
        the module docstring for why flash attention and a q8_0 K cache are the defaults, and
        what deterministic mode changes), n_seq (sequences the context holds, n_ctx each: the
        `slots` a server runs at once); for diagnostics, repack (None: off exactly when
        deterministic) and op_capture (an OpCapture or OpTimer).
        """
        from specdec.backends.registry import check_gguf_file
        from specdec.backends.tokenizer import load_tokenizer

        path = Path(path)
        # llama.cpp aborts the whole process on some damaged files; refuse them in Python first.
        check_gguf_file(path)
        dev = get_device(device)
        if dev.type != "cpu":
            kwargs.setdefault("n_gpu_layers", -1)
            if device is not None and not bindings().llama_supports_gpu_offload():
                log.warning("this llama.cpp build cannot offload to %s; running on the CPU", dev)
        tokenizer = load_tokenizer(path)  # the same cached conversion HFModel uses
        return cls(path, tokenizer=tokenizer, name=name, **kwargs)

    def _check_tokenizer(self, vocab: Any, tokenizer: Any) -> None:
        """Ids go to llama.cpp untranslated, so its vocabulary must read them as the HF tokenizer
        does: compare every id's token text (~0.2 s for 150k tokens). In a SentencePiece
        vocabulary a space is spelled '▁'; some GGUFs keep raw spaces in a few tokens (Gemma 3's
        runs of spaces, ids 138-167) that transformers' conversion spells with '▁': the same
        token, so the two spellings compare equal there."""
        n = self.vocab_size
        spm = self._llama.llama_vocab_type(vocab) == LLAMA_VOCAB_TYPE_SPM
        hf_texts = tokenizer.convert_ids_to_tokens(list(range(min(n, len(tokenizer)))))
        for i, hf_text in enumerate(hf_texts):
            text = self._llama.llama_vocab_get_text(vocab, i).decode("utf-8", "replace")
            if text != hf_text and not (spm and text.replace(" ", "\u2581") == hf_text):
                self.close()
                raise SpecModelError(
                    f"{self.name}: token id {i} is {text!r} to llama.cpp but {hf_text!r} to the HF "
                    f"tokenizer ({len(tokenizer)} tokens, llama.cpp has {n}); the tokenizer does "
                    "not belong to this GGUF file"
                )

    def _new_context(self, n_seq: int | None = None) -> Any:
        """A context on the weights with the model's settings, for `n_seq` sequences (None: the
        model's n_seq)."""
        cparams = self._cparams
        if n_seq is not None and n_seq != self.n_seq:
            cparams = type(cparams).from_buffer_copy(cparams)
            cparams.n_ctx, cparams.n_seq_max = self.n_ctx * n_seq, n_seq
        ctx = self._llama.llama_init_from_model(self._model, cparams)
        if not ctx:
            raise SpecModelError(
                f"llama.cpp could not create a context of {self.n_ctx} tokens for {self.name} "
                "(out of memory?); pass a smaller n_ctx or n_batch"
            )
        return ctx

    # ---------------------------------------------------------------------------- contract
    def _decode(
        self, ctx: Any, segments: list[tuple[int, int, list[int]]], logits: bool = True
    ) -> list[torch.Tensor]:
        """Run each (seq, start, ids) segment at positions start.. of sequence seq in `ctx`, in
        one batch (n_batch tokens per llama_decode call); per segment [n, V] float32 CPU logits,
        every row (or an empty [0, V] tensor when `logits` is False: no output layer, no copy).

        On failure every segment's positions >= its start are removed again, so the caches are
        as they were.
        """
        llama, batch, V = self._llama, self._batch, self.vocab_size
        tokens = [(j, seq, start + i, t) for j, (seq, start, ids) in enumerate(segments)
                  for i, t in enumerate(ids)]  # fmt: skip
        outs = [np.empty((len(ids) if logits else 0, V), dtype=np.float32) for *_, ids in segments]
        rows = [0] * len(segments)
        try:
            for lo in range(0, len(tokens), self.n_batch):
                chunk = tokens[lo : lo + self.n_batch]
                batch.n_tokens = len(chunk)
                n = governor().threads()  # measured with a fixed pool too: /metrics, doctor
                if self._adaptive:
                    llama.llama_set_n_threads(ctx, n, n)
                for i, (_, seq, pos, tok) in enumerate(chunk):
                    batch.token[i] = tok
                    batch.pos[i] = pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = logits  # full-vocabulary logits at every position
                t0 = time.perf_counter()
                rc = llama.llama_decode(ctx, batch)
                seconds = time.perf_counter() - t0
                threads = n if self._adaptive else self._cparams.n_threads
                pace().record(self.name, len(chunk), seconds, threads)
                if rc != 0:
                    raise SpecModelError(
                        f"{self.name}: llama_decode failed with code {rc} at cache position "
                        f"{chunk[0][2]} (1 = no room in the KV cache; a larger n_ctx may help)"
                    )
                for i, (j, *_) in enumerate(chunk if logits else ()):
                    row = llama.llama_get_logits_ith(ctx, i)  # float* into llama's [n_batch, V]
                    outs[j][rows[j]] = np.ctypeslib.as_array(row, shape=(V,))
                    rows[j] += 1
        except BaseException:
            # Includes KeyboardInterrupt: drop whatever earlier chunks appended, then re-raise.
            for seq, start, _ in segments:
                llama.llama_memory_seq_rm(llama.llama_get_memory(ctx), seq, start, -1)
            raise
        return [torch.from_numpy(o) for o in outs]  # each [n, V] float32, CPU

    def _extend(self, ids: list[int]) -> torch.Tensor:
        return self._decode(self._ctx, [(_SEQ, self.n_cached, ids)])[0]

    def _prefill(self, ids: list[int]) -> None:
        self._decode(self._ctx, [(_SEQ, self.n_cached, ids)], logits=False)

    def _truncate(self, n: int) -> None:
        self._seq_rm(_SEQ, n)

    def _save_state(self) -> tuple[Any, int]:
        return self._save_seq(_SEQ)

    def _restore_state(self, state: Any) -> None:
        self._restore_seq(_SEQ, state)

    def _save_seq(self, seq: int) -> tuple[Any, int]:
        """Sequence `seq`'s KV cells, copied out of the context (llama_state_seq_get_data)."""
        llama = self._llama
        size = int(llama.llama_state_seq_get_size(self._ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        got = int(llama.llama_state_seq_get_data(self._ctx, buf, size, seq))
        if got != size:
            raise SpecModelError(f"{self.name}: llama.cpp copied {got} of {size} state bytes")
        return buf, size

    def _restore_seq(self, seq: int, buf: Any) -> None:
        """`buf` (from _save_seq of any sequence) into the empty sequence `seq`."""
        llama = self._llama
        if int(llama.llama_state_seq_set_data(self._ctx, buf, len(buf), seq)) != len(buf):
            self._seq_rm(seq, 0)
            raise SpecModelError(
                f"{self.name}: llama.cpp could not restore a saved cache of {len(buf)} bytes "
                "(no room in the KV cache?)"
            )

    def _seq_rm(self, seq: int, n: int) -> None:
        mem = self._llama.llama_get_memory(self._ctx)
        if not self._llama.llama_memory_seq_rm(mem, seq, n, -1):
            # Only recurrent/hybrid memories refuse a partial removal; attention KV never does.
            raise SpecModelError(
                f"{self.name}: llama.cpp cannot roll this model's memory back to {n} tokens "
                "(recurrent state); speculative decoding needs a rollback-capable model"
            )

    # ------------------------------------------------------------------------------- slots
    def _make_slots(self, n: int) -> list[SpecModel]:
        if n > self.n_seq:
            raise SpecModelError(
                f"{self.name}: {n} slots asked of a context made for {self.n_seq} sequences; "
                f"load the model with n_seq={n} (specdec serve --parallel {n})"
            )
        while len(self._slots) < n:
            self._slots.append(_Slot(self, len(self._slots)))
        return self._slots[:n]

    def _extend_slots(self, calls: list[tuple[SpecModel, list[int]]]) -> list[torch.Tensor]:
        # Its slots are sequences of one context: one llama_decode for all, in sequence-id
        # order, as llama.cpp's stream split wants them (module docstring).
        order = sorted(range(len(calls)), key=lambda i: _seq_of(calls[i][0]))
        segments = [(_seq_of(calls[i][0]), calls[i][0].n_cached, calls[i][1]) for i in order]
        logits = self._decode(self._ctx, segments)
        out: list[torch.Tensor] = [torch.empty(0)] * len(calls)
        for i, x in zip(order, logits, strict=True):
            out[i] = x
        return out

    def _forward(self, ids: list[int]) -> torch.Tensor:
        # A second context on the same weights, made on first use: evaluating in the main context
        # and re-prefilling the old tokens afterwards would leave the cache holding the same
        # tokens under other batch shapes. Costs one more KV cache and logits buffer.
        if self._scratch is None:
            self._scratch = self._new_context(n_seq=1)
        try:
            return self._decode(self._scratch, [(_SEQ, 0, ids)])[0]
        finally:
            self._llama.llama_memory_clear(self._llama.llama_get_memory(self._scratch), True)

    def close(self) -> None:
        llama = self._llama
        if self._batch is not None:
            llama.llama_batch_free(self._batch)
            self._batch = None
        for attr in ("_scratch", "_ctx"):
            if getattr(self, attr):
                llama.llama_free(getattr(self, attr))
                setattr(self, attr, None)
        if self._model:  # after its contexts: llama.cpp frees a model's contexts first
            llama.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        # Interpreter shutdown may have torn the bindings down already; nothing to free then.
        if getattr(self, "_llama", None) is not None:
            self.close()


def _seq_of(m: SpecModel) -> int:
    return m.seq if isinstance(m, _Slot) else _SEQ


class _Slot(SpecModel):
    """Sequence `seq` of its owner's context (LlamaCppModel.slots): a cache of its own on the
    owner's weights; its extends can share the owner's passes (core.model.extend_together)."""

    def __init__(self, owner: LlamaCppModel, seq: int) -> None:
        super().__init__()
        self.owner, self.seq = owner, seq  # type: ignore[assignment]
        self.name = f"{owner.name}#{seq}"
        self.vocab_size, self.n_ctx, self.device = owner.vocab_size, owner.n_ctx, owner.device
        self.tokenizer, self.batch_invariant = owner.tokenizer, owner.batch_invariant

    def _extend(self, ids: list[int]) -> torch.Tensor:
        return self.owner._decode(self.owner._ctx, [(self.seq, self.n_cached, ids)])[0]

    def _prefill(self, ids: list[int]) -> None:
        self.owner._decode(self.owner._ctx, [(self.seq, self.n_cached, ids)], logits=False)

    def _truncate(self, n: int) -> None:
        self.owner._seq_rm(self.seq, n)

    def _save_state(self) -> tuple[Any, int]:
        return self.owner._save_seq(self.seq)

    def _restore_state(self, state: Any) -> None:
        self.owner._restore_seq(self.seq, state)

    def _forward(self, ids: list[int]) -> torch.Tensor:
        return self.owner.forward(ids)
