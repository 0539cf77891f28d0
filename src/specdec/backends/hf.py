"""Hugging Face backend: any causal LM behind the SpecModel contract.

The KV cache is one `DynamicCache`; rollback crops it in place, so truncate costs no recompute.
A forward pass that raises midway (out of memory on a long prompt, Ctrl-C) has appended the new
positions to some layers but not others: `_extend`/`_prefill` crop every layer back to the
length before the call, so the cache is exactly as it was (as the llama.cpp backend does).
A model directory loads its safetensors weights; one with only pickled weights (pytorch_model.bin,
which unpickling can turn into code execution) is refused unless allow_pickle=True or
$SPECDEC_ALLOW_PICKLE=1.
A .gguf file loads through transformers' GGUF reader, which dequantizes every tensor (fp32 on the
CPU by default): the logits are those of the dequantized weights, close to but not bit-equal to
llama.cpp's quantized kernels on the same file.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from specdec.core.device import get_device
from specdec.core.model import SpecModel, SpecModelError

# Upper bound on the default context window: some configs advertise 128k+ positions, and a
# context check should catch a runaway prompt long before memory does. Pass n_ctx to go higher.
HF_MAX_DEFAULT_N_CTX = 32768
# Weight files that torch.load unpickles (transformers' pytorch_model*.bin, and loose checkpoints).
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def default_dtype(device: torch.device) -> torch.dtype:
    # fp32 on the CPU: half-precision CPU matmuls are slow, and fp32 keeps a token's logits within
    # ~1e-4 whatever the batch shape (tests/backends/test_contract.py). fp16 on accelerators (the
    # paper).
    return torch.float32 if device.type == "cpu" else torch.float16


def _parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(found, torch.dtype):
        raise SpecModelError(f"unknown dtype {dtype!r}; use float32, float16 or bfloat16")
    return found


def _weights_kwargs(path: Path, allow_pickle: bool) -> dict[str, Any]:
    """from_pretrained kwargs that load a model directory's safetensors, never its pickles,
    unless the caller opted in; raises SpecModelError for a pickle-only directory."""
    if any(path.glob("*.safetensors")) or (path / "model.safetensors.index.json").is_file():
        return {"use_safetensors": True}  # also when pickles sit beside them: never fall back
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if not pickles:
        return {}  # no weights we know of: transformers says what it looked for
    allow_pickle = allow_pickle or os.environ.get("SPECDEC_ALLOW_PICKLE") == "1"
    if not allow_pickle:
        raise SpecModelError(
            f"{path} holds only pickled weights ({', '.join(pickles[:3])}); loading a pickle can "
            "run arbitrary code. Convert them once where you trust the file, e.g. "
            "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir) writes "
            "model.safetensors, or opt in with allow_pickle=True (load_model) or "
            "SPECDEC_ALLOW_PICKLE=1"
        )
    return {"use_safetensors": False}


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig

    if path.is_dir():
        return AutoConfig.from_pretrained(path)
    from specdec.backends.tokenizer import load_conversion

    # Reading a GGUF's metadata through transformers parses the whole vocabulary (seconds); the
    # config is cached beside the converted tokenizer so later loads parse the file only once.
    def convert(out: Path) -> None:
        AutoConfig.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)

    return load_conversion("configs", path, convert, AutoConfig.from_pretrained)


@contextmanager
def _one_tensor_name_map() -> Iterator[None]:
    """transformers' GGUF loader asks gguf for a TensorNameMap once per submodule (~400 times for
    a 30-layer model, each rebuilding every name pattern: most of a small model's load); the map
    is a function of (arch, n_blocks) alone, so it is built once per load."""
    import gguf

    build = gguf.get_tensor_name_map
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(build)
    try:
        yield
    finally:
        gguf.get_tensor_name_map = build


class HFModel(SpecModel):
    """A transformers causal LM with one DynamicCache (batch size 1)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any = None,
        *,
        name: str = "hf",
        n_ctx: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        self.device = next(model.parameters()).device
        # The logit width is the output layer's row count, which can exceed len(tokenizer).
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        text_cfg = model.config.get_text_config()
        max_pos = getattr(text_cfg, "max_position_embeddings", None)
        if n_ctx is None:
            n_ctx = min(max_pos or HF_MAX_DEFAULT_N_CTX, HF_MAX_DEFAULT_N_CTX)
        elif max_pos is not None and n_ctx > max_pos:
            raise SpecModelError(
                f"{name}: n_ctx={n_ctx} exceeds the model's max_position_embeddings={max_pos}; "
                f"pass n_ctx <= {max_pos}"
            )
        self.n_ctx = int(n_ctx)
        self.cache = self._new_cache()

    @classmethod
    def load(
        cls,
        path: str | os.PathLike[str],
        *,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        n_ctx: int | None = None,
        n_threads: int | None = None,
        name: str | None = None,
        allow_pickle: bool = False,
    ) -> HFModel:
        """Load a model directory or a .gguf file (dequantized) onto `device`.

        A directory's weights must be safetensors unless `allow_pickle` (see the module docstring).
        """
        from transformers import AutoModelForCausalLM

        from specdec.backends.tokenizer import load_tokenizer

        path = Path(path)
        dev = get_device(device)
        dtype = _parse_dtype(dtype) or default_dtype(dev)
        weights = _weights_kwargs(path, allow_pickle) if path.is_dir() else {}
        if n_threads is not None:
            torch.set_num_threads(n_threads)  # process-wide: torch has no per-model thread pool
        config = _load_config(path)
        kw: dict[str, Any] = {"config": config, "dtype": dtype}
        if path.is_dir():
            model = AutoModelForCausalLM.from_pretrained(path, **kw, **weights)
        else:
            with _one_tensor_name_map():
                model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kw)
        model = model.to(dev)
        return cls(model, load_tokenizer(path), name=name or f"hf:{path.name}", n_ctx=n_ctx)

    # ---------------------------------------------------------------------------- contract
    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        # Sliding-window layers forget states past the window unless told to keep them for a
        # later crop; rollback needs them. A no-op for plain full-attention layers.
        if hasattr(cache, "activate_past_recording"):
            cache.activate_past_recording()
        return cache

    def _logits(self, ids: list[int], cache: Any, keep: int = 0) -> torch.Tensor:
        """[n, V] float32 CPU logits (keep=0), or only the last `keep` rows."""
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, n]
        out = self.model(
            input_ids=input_ids,
            past_key_values=cache,
            use_cache=cache is not None,
            logits_to_keep=keep,
        )
        return out.logits[0].float().cpu()  # [n or keep, V] float32, CPU

    def _cached_logits(self, ids: list[int], keep: int = 0) -> torch.Tensor:
        """`_logits` on the cache; if the pass raises, the cache is put back as it was."""
        try:
            return self._logits(ids, self.cache, keep)
        except BaseException:  # includes KeyboardInterrupt: roll back, then re-raise
            self._roll_back(self.n_cached)
            raise

    @torch.inference_mode()
    def _extend(self, ids: list[int]) -> torch.Tensor:
        return self._cached_logits(ids)

    @torch.inference_mode()
    def _prefill(self, ids: list[int]) -> None:
        self._cached_logits(ids, keep=1)  # the output layer for one row instead of n

    def _truncate(self, n: int) -> None:
        if n == 0:
            self.cache = self._new_cache()  # drops the tensors instead of keeping empty views
            return
        # Negative = number of positions to drop: the spelling transformers 5.x accepts (it
        # refuses a positive absolute length).
        self.cache.crop(n - self.n_cached)

    def _roll_back(self, n: int) -> None:
        """Crop every layer to its first n positions after a pass that raised midway.

        Not `cache.crop`: that drops one count from every layer, but the layers after the failing
        one never received the new positions, so each is cropped by its own length.
        """
        if n == 0:
            self.cache = self._new_cache()
            return
        for layer in self.cache.layers:
            extra = layer.get_seq_length() - n
            if extra > 0:
                layer.crop(-extra)

    @torch.inference_mode()
    def _forward(self, ids: list[int]) -> torch.Tensor:
        return self._logits(ids, None)

    def close(self) -> None:
        self.cache = None
        self.model = None
