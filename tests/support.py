"""What test modules share besides fixtures (conftest.py holds those; a module imports this, never
conftest): the thread count every model in the suite runs with, and the mock pair's shape."""

from __future__ import annotations

import os
from dataclasses import dataclass

from specdec.backends.cores import usable_cores

# Threads per model: every core this process may use (the library's default), as CI's box runs
# the suite alone; set SPECDEC_TEST_THREADS=1 where the box is shared. Both ggml and torch's
# OpenMP sync every op with spinning barriers, so a 2-thread pool with one core held by another
# process stalls at each barrier (docs/results.md has the numbers). No logits depend on the
# thread count here (llama.cpp: the matmuls split rows, never a sum; HF: fp32, checked within the
# contract tolerance). Exported, so that the tests' own subprocesses use the same count.
TEST_THREADS = int(os.environ.get("SPECDEC_TEST_THREADS") or 0) or usable_cores()
os.environ["SPECDEC_TEST_THREADS"] = str(TEST_THREADS)


@dataclass(frozen=True)
class PairSpec:
    """The `pair` fixture's mock models: vocabulary `v`, the target's logit scale (None:
    MockModel's default) and the Gaussian noise that makes the draft from the target."""

    v: int = 48
    scale: float | None = None
    noise: float = 0.7
