"""sdfa's walks as a pass lays them out, on this tree's sources beside another commit's.

One pass's attention over every layer of a Qwen2.5-1.5B-shaped cache (28 layers, 2 KV heads of
d = 128, llama.cpp's layout: a cell holds both heads' q8_0 K rows, and both heads' f16 V rows,
the cells padded to a multiple of 256 and masked past the depth), two threads each walking one
head and meeting at a barrier per layer, as ggml's threads do; 6 rows a walk for a single step
(a KV head's query heads), 64 for a prompt's walks. Before each pass both threads stream 256
MiB, as a step's weights pass through the caches between two attentions. The harness (C,
OpenMP) is compiled with sdfa's sources of the working tree and of `--against` (read from git),
`-O3 -march=native`; the trees and paths are alternated, the best of `--reps` passes of 6 rows
kept per run (a wider walk's runs take as many rows' worth, at least 2 passes), the median over
`--rounds` printed, in ms a pass.

    python scripts/sdfa_walks.py --against 4533a7c --depths 600,1500 --rounds 8 --reps 12

Needs a C compiler with OpenMP (gcc); measures one CPU's sdfa, not a step: run it alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE = "src/specdec/backends/native"
PATHS = {"avx2": 1, "avx512": 3}  # enum sd_isa (sd-isa.h)

HARNESS = r"""
#include "sdfa.h"
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}
int main(int argc, char ** argv) {
    const int depth = atoi(argv[1]), reps = atoi(argv[2]);
    const int isa = atoi(argv[3]), rows = atoi(argv[4]);
    const int n_kv = (depth + 255) / 256 * 256; /* llama.cpp's cells, the tail masked */
    const int d = 128, L = 28, H = 2;
    const size_t kr = d / 32 * 34, ks = kr * H, vs = 2 * d * H, junk_bytes = (size_t) 256 << 20;
    char * k[28];
    char * v[28];
    float * q = malloc(sizeof(float) * d * rows * H);
    float * out = malloc(sizeof(float) * d * rows * H);
    srand(1);
    for (int l = 0; l < L; l++) {
        k[l] = malloc(ks * n_kv);
        v[l] = malloc(vs * n_kv);
        for (size_t i = 0; i < ks * n_kv; i++) k[l][i] = (char) rand();
        for (int p = 0; p < n_kv * H; p++)
            for (int c = 0; c < d / 32; c++) {
                const uint16_t h = 0x2400 + (rand() & 0xff);
                memcpy(k[l] + p * kr + c * 34, &h, 2);
            }
        uint16_t * vh = (uint16_t *) v[l];
        for (size_t i = 0; i < vs * n_kv / 2; i++) vh[i] = 0x3000 + (rand() & 0x3ff);
    }
    for (int i = 0; i < d * rows * H; i++) q[i] = (rand() / (float) RAND_MAX - 0.5f) * 6;
    uint16_t * mask = calloc(n_kv, 2);
    for (int p = depth; p < n_kv; p++) mask[p] = 0xFC00;
    char * junk = malloc(junk_bytes);
    double best = 1e9;
    for (int r = 0; r < reps; r++) {
#pragma omp parallel num_threads(2)
        {
            const size_t t = omp_get_thread_num();
            for (size_t i = t * junk_bytes / 2; i < (t + 1) * junk_bytes / 2; i += 64) junk[i] += 1;
        }
        const double t0 = now();
        int bad = 0;
#pragma omp parallel num_threads(2) reduction(| : bad)
        {
            const int h = omp_get_thread_num();
            for (int l = 0; l < L; l++) {
                bad |= sdfa_attend(isa, d, n_kv, 0.088f, k[l] + h * kr, ks,
                                   (const uint16_t *) (v[l] + h * 2 * d), vs, q + h * rows * d,
                                   mask, rows, rows, 64, out + h * rows * d);
#pragma omp barrier
            }
        }
        if (bad) return 2;
        const double t = now() - t0;
        best = t < best ? t : best;
    }
    printf("%.3f\n", best * 1e3);
    return 0;
}
"""


def _sources(rev: str | None, into: Path) -> Path:
    """sdfa's C sources of the working tree, or of commit `rev` written into `into`."""
    if rev is None:
        return ROOT / NATIVE
    names = subprocess.run(
        ["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{NATIVE}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    for name in names:
        show = ["git", "-C", str(ROOT), "show", f"{rev}:{NATIVE}/{name}"]
        blob = subprocess.run(show, check=True, capture_output=True).stdout
        (into / name).write_bytes(blob)
    return into


def _build(src: Path, harness: Path, out: Path) -> Path:
    files = [str(src / f) for f in ("sdfa.c", "sdfa-avx2.c", "sdfa-avx512.c")]
    cmd = ["cc", "-O3", "-march=native", "-fopenmp", "-ffp-contract=off", f"-I{src}"]
    subprocess.run([*cmd, "-o", str(out), str(harness), *files, "-lm"], check=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--against", required=True, help="the commit to compare with (str)")
    ap.add_argument("--depths", default="600,1500", help="cached positions, comma-separated")
    ap.add_argument("--rows", default="6,64", help="rows a walk, comma-separated (6: a step)")
    ap.add_argument("--paths", default="avx512,avx2", help="sdfa paths, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10, help="passes a run, for 6-row walks")
    args = ap.parse_args()
    depths = [int(x) for x in args.depths.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    paths = args.paths.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "old").mkdir()
        harness = t / "harness.c"
        harness.write_text(HARNESS)
        trees = {
            "tree": _build(_sources(None, t), harness, t / "tree"),
            args.against: _build(_sources(args.against, t / "old"), harness, t / "old.bin"),
        }
        runs: dict[tuple[str, str, int, int], list[float]] = {}
        for _ in range(args.rounds):
            for depth in depths:
                for r in rows:
                    for path in paths:
                        for name, exe in trees.items():
                            reps = str(max(2, args.reps * 6 // r))
                            cmd = [str(exe), str(depth), reps, str(PATHS[path]), str(r)]
                            ms = float(subprocess.run(cmd, check=True, capture_output=True,
                                                      text=True).stdout)  # fmt: skip
                            runs.setdefault((name, path, r, depth), []).append(ms)
    print("ms a pass (28 layers, 2 threads), median of rounds [min, max]")
    for (name, path, r, depth), ms in sorted(runs.items(), key=lambda kv: kv[0][1:] + kv[0][:1]):
        med = statistics.median(ms)
        print(f"{path:>7} rows {r:>2} depth {depth:>5} {name:>10}: {med:8.2f} "
              f"[{min(ms):.2f}, {max(ms):.2f}]")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
