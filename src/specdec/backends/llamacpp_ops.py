"""Diagnostics on llama.cpp's graph: every op's output (`OpCapture`, for `specdec invariance`)
or its time (`OpTimer`, for `specdec profile`), through the eval callback a
backends.llamacpp.LlamaCppModel takes as `op_capture`."""

from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np

from specdec.backends.llamacpp_lib import bindings, ggml_lib


class OpCapture:
    """A copy of every float32 op output llama.cpp computes while `recording` is True, through its
    eval callback (ggml_backend_sched_eval_callback, what the llama-eval-callback example uses).

    `tensors[name]` lists one array per evaluation, `name` being the graph node's name and op,
    e.g. "Qcur-3|MUL_MAT" (layer 3). A 2-D node (the usual [n_tokens, n] activation) comes back
    as [n_tokens, n]. `weight_types[name]` is the ggml type of a MUL_MAT's weight (its src[0]).
    Diagnostics only: asking for every node makes the scheduler compute the graph node by node,
    which is slow (the outputs are the same: the probe compares the logits too).
    """

    def __init__(self) -> None:
        llama = bindings()
        self.recording = False
        self.tensors: dict[str, list[np.ndarray]] = {}
        self.weight_types: dict[str, str] = {}
        self._ggml = _ggml_base()
        self.callback = llama.ggml_backend_sched_eval_callback(self._on_eval)

    def _on_eval(self, t: int, ask: bool, _user: Any) -> bool:
        head = _TensorHead.from_address(t)
        if ask:  # True: "give me this tensor once it is computed"
            return self.recording and head.type == _GGML_TYPE_F32
        g = self._ggml
        if head.type != _GGML_TYPE_F32 or not g.ggml_is_contiguous(t):
            return True
        n = g.ggml_nbytes(t)
        data = np.empty(n // 4, dtype=np.float32)
        g.ggml_backend_tensor_get(t, data.ctypes.data, 0, n)
        ne = [int(x) for x in head.ne]
        shape = (ne[1], ne[0]) if ne[2] == ne[3] == 1 else tuple(reversed(ne))
        key = f"{g.ggml_get_name(t).decode()}|{g.ggml_op_desc(t).decode()}"
        self.tensors.setdefault(key, []).append(data.reshape(shape))
        if key.endswith("|MUL_MAT") and head.src[0]:
            weight = _TensorHead.from_address(head.src[0])
            self.weight_types[key] = g.ggml_type_name(weight.type).decode()
        return True  # go on computing


class OpTimer:
    """Wall time of every node llama.cpp computes while `recording` is True, through the same
    eval callback as OpCapture: asking for every node makes the scheduler compute the graph one
    node per call, so the time from one node's callback to the next is that node's compute plus
    a fixed launch cost (measured on the graph's no-op nodes, views and reshapes: see
    study.run.profile). Call `begin()` just before the pass; `nodes` then lists, in graph order,
    (node name, op, weight name, weight type, seconds); the first node's time includes the
    graph's build and input upload. Diagnostics only.
    """

    def __init__(self) -> None:
        llama = bindings()
        self.recording = False
        self.nodes: list[tuple[str, str, str | None, str | None, float]] = []
        self._ggml = _ggml_base()
        self._t = 0.0
        self.callback = llama.ggml_backend_sched_eval_callback(self._on_eval)

    def begin(self) -> None:
        self.nodes, self._t = [], time.perf_counter()

    def _on_eval(self, t: int, ask: bool, _user: Any) -> bool:
        if ask:
            return self.recording
        now = time.perf_counter()
        g, head = self._ggml, _TensorHead.from_address(t)
        weight = weight_type = None
        if g.ggml_op_desc(t) == b"MUL_MAT" and head.src[0]:
            weight = g.ggml_get_name(head.src[0]).decode()
            weight_type = g.ggml_type_name(_TensorHead.from_address(head.src[0]).type).decode()
        name, op = g.ggml_get_name(t).decode(), g.ggml_op_desc(t).decode()
        self.nodes.append((name, op, weight, weight_type, now - self._t))
        self._t = time.perf_counter()  # the bookkeeping above is not the next node's time
        return True


_GGML_TYPE_F32 = 0


class _TensorHead(ctypes.Structure):
    """The leading fields of `struct ggml_tensor` (ggml.h, GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS
    64, GGML_MAX_SRC 10) up to its sources."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
    ]


def _ggml_base() -> Any:
    """ggml's tensor accessors from the libggml-base shipped beside libllama."""
    lib = ggml_lib("base")
    for fn, res, args in (
        ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_op_desc", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
        ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
        ("ggml_type_name", ctypes.c_char_p, [ctypes.c_int]),
        ("ggml_backend_tensor_get", None, [ctypes.c_void_p] * 2 + [ctypes.c_size_t] * 2),
    ):
        getattr(lib, fn).restype = res
        getattr(lib, fn).argtypes = args
    return lib
