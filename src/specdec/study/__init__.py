"""The study: how specdec is measured, and how the measurements are kept and shown.

Four rooms, read in this order:

    artifacts/  the JSON artifacts' schema: one module per kind, each a typed record (bench.py,
                gate.py, ...; kinds.py reads any of them), what they share (base.py), the RUN
                records inside a bench (runs.py), and the blocks every artifact carries
                (provenance.py: machine, versions, models)
    engines/    the engines measured beside specdec's own loop: any OpenAI-compatible server
                (endpoint.py, reading streamed answers with stream.py), stock llama.cpp built
                as its users build it and ik_llama.cpp (anchor_build.py builds them, anchors.py
                serves them, peers.py, ik_source.py), and transformers' assisted generation
                (hf_assisted.py)
    run/        what a `specdec <command>` measures and writes: bench and sweep (throughput),
                microbench, doctor and profile (cost curves), gate and invariance (exactness),
                replay, and the vendored prompts (run/data/)
    present/    what is read back: scan (every artifact under a directory), the figures, REPORT.md
                and the terminal tables' number formats

Imports run one way (tests/test_layout.py): artifacts/ imports no other room; engines/ and
present/ may import artifacts/; run/ may import all three. Nothing here imports serve/ or cli/.
"""
