"""Model backends and `load_model`, the one way the rest of specdec gets a SpecModel.

Spec strings are BACKEND:NAME_OR_PATH:

    llamacpp:smollm2-135m          registry name -> cached .gguf, run by llama.cpp (quantized)
    hf:qwen2.5-coder-0.5b          the same GGUF dequantized into a transformers model
    hf:/path/to/hf_model_dir       any local transformers causal-LM directory
    mock:vocab=48,seed=0           a deterministic MockModel (key=value pairs)

Backends import lazily: `mock:` needs neither transformers nor llama.cpp.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from specdec.backends.mock import MockModel
    from specdec.core.model import SpecModel

# Nothing heavy at import time: `specdec models list` imports the registry, and with it this
# package, and must not pay for torch. Each backend is imported when a spec names it.
BACKENDS = ("hf", "llamacpp", "mock")
_MOCK_KEYS = {"vocab": "vocab_size", "vocab_size": "vocab_size", "seed": "seed", "scale": "scale"}
_MOCK_KEYS |= {"n_ctx": "n_ctx", "name": "name"}

# The flags of load_model's settings, as every command that loads a model words them
# (cli.args, serve.config).
DEVICE_HELP = "cpu, cuda or mps for HF models (str; default: best available)"
THREADS_HELP = (
    "CPU threads per model, >= 1 (int; default: this process's cores, fewer while other work "
    "holds some: llama.cpp's barriers wait for a thread off its core). A number fixes the pool"
)
DETERMINISTIC_HELP = (
    "require batch-invariant llama.cpp numerics: a verify pass computes exactly the "
    "single-step logits, so greedy speculative output equals greedy target-only output. Free "
    "where specdec's kernels hold every weight (`specdec models inspect FILE` says it; e.g. "
    "the default models, Q5_K_M, Q4_0, Q8_0: the default mode is already invariant there); "
    "elsewhere ggml's slower invariant paths (flag; default off; docs/kernels.md)"
)

__all__ = ["BACKENDS", "load_model", "load_tokenizer_of", "parse_spec"]


def draft_spec(spec: str | None) -> str | None:
    """--draft as a model spec: None when not given or 'none' (any case): every command's and
    `specdec serve`'s rule."""
    return None if spec is None or spec.lower() == "none" else spec


def parse_spec(spec: str) -> tuple[str, str]:
    """'BACKEND:REST' -> (backend, rest), with an error that lists the valid backends."""
    from specdec.core.model import SpecModelError

    usage = (
        "expected BACKEND:NAME_OR_PATH with BACKEND one of "
        f"{', '.join(BACKENDS)} (e.g. llamacpp:smollm2-135m, hf:/path/to/model_dir, "
        "mock:vocab=48,seed=0)"
    )
    if not isinstance(spec, str) or ":" not in spec:
        raise SpecModelError(f"model spec {spec!r} has no backend prefix; {usage}")
    backend, rest = spec.split(":", 1)
    backend = backend.strip().lower()
    if backend not in BACKENDS:
        raise SpecModelError(f"unknown backend {backend!r} in model spec {spec!r}; {usage}")
    if not rest and backend != "mock":
        raise SpecModelError(f"model spec {spec!r} names no model; {usage}")
    return backend, rest


def _mock(args: str, kwargs: dict[str, Any]) -> MockModel:
    from specdec.backends.mock import MockModel
    from specdec.core.model import SpecModelError

    params: dict[str, Any] = {}
    for item in filter(None, (s.strip() for s in args.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in _MOCK_KEYS:
            raise SpecModelError(
                f"bad mock option {item!r}; use key=value pairs with keys "
                f"{', '.join(sorted(_MOCK_KEYS))} (e.g. mock:vocab=48,seed=0)"
            )
        target = _MOCK_KEYS[key]
        if target == "name":
            params[target] = value
            continue
        try:
            params[target] = float(value) if target == "scale" else int(value)
        except ValueError as e:
            raise SpecModelError(f"mock option {key}={value!r} is not a number") from e
    if kwargs.get("n_ctx") is not None:
        params.setdefault("n_ctx", int(kwargs["n_ctx"]))
    return MockModel(**params)


def load_model(spec: str, device: str | torch.device | None = None, **kwargs: Any) -> SpecModel:
    """Load a model from a spec string (see the module docstring).

    kwargs: n_ctx (context window; llama.cpp default 4096, HF default min(max positions, 32768)),
    dtype (HF only; fp32 on CPU by default), allow_pickle (HF directories only: load pickled
    weights when no safetensors exist), n_threads (default: all cores), deterministic (see
    below), plus backend-specific options (llama.cpp: n_batch, n_gpu_layers, flash_attn).

    deterministic=True asks for logits that do not depend on how tokens are batched, so a verify
    pass over K+1 tokens gives exactly the single-step logits and greedy speculative output is
    token-identical to greedy target-only output. llama.cpp: turns off the batch-dependent matmul
    paths (backends/llamacpp.py says which and why). mock: always true, nothing to change. hf:
    refused — fp32 matmuls on the CPU differ by ~1e-4 between batch shapes and there is no switch.
    Raises SpecModelError for a malformed spec, registry.ModelFetchError for a missing or unknown
    model, registry.CorruptModelError for a file that is not a complete GGUF.
    """
    backend, rest = parse_spec(spec)
    deterministic = bool(kwargs.pop("deterministic", False))
    if backend == "mock":
        return _mock(rest, kwargs)  # exact across batch shapes by construction
    if deterministic and backend == "hf":
        from specdec.core.model import SpecModelError

        raise SpecModelError(
            f"{spec!r}: deterministic mode is not available for the hf backend (fp32 matmuls on "
            "the CPU differ by ~1e-4 between batch shapes, with no switch to stop it); use a "
            "llamacpp: model, or drop deterministic"
        )

    from specdec.backends.registry import check_gguf_file, resolve
    from specdec.core.model import SpecModelError

    path = resolve(rest)
    if path.is_file():
        # transformers' reader and llama.cpp both fail badly (tracebacks deep in numpy, or an
        # abort) on a truncated file; this gives a Python error that says what is wrong.
        check_gguf_file(path)
    name = f"{backend}:{rest}"
    if backend == "hf":
        from specdec.backends.hf import HFModel

        return HFModel.load(path, device=device, name=name, **kwargs)
    from specdec.backends.llamacpp import LlamaCppModel

    if path.is_dir():
        raise SpecModelError(
            f"{spec!r}: llama.cpp needs a .gguf file, got the directory {path}; use hf:{rest} "
            "for a transformers model directory"
        )
    kwargs.pop("dtype", None)  # llama.cpp computes in the file's own quantization
    kwargs.pop("allow_pickle", None)  # HF directories only
    return LlamaCppModel.load(path, device=device, name=name, deterministic=deterministic, **kwargs)


def load_tokenizer_of(spec: str) -> Any:
    """The tokenizer `load_model(spec)` would give, without loading the weights (None for mock
    models): what a client of someone else's server tokenizes with."""
    backend, rest = parse_spec(spec)
    if backend == "mock":
        return None
    from specdec.backends.registry import resolve
    from specdec.backends.tokenizer import load_tokenizer

    return load_tokenizer(resolve(rest))
