"""The OpenAI-compatible server, in the order a request flows through it:

    protocol  request models, `validate_request(req, n_ctx, vocab) -> GenParams`, error bodies,
              response records (no app, no engine: testable alone)
    text      TextAssembler: committed tokens -> text deltas (incremental decoding, stop strings)
    metrics   counters and histograms, Prometheus rendering, labels from fixed sets only
    engine    the worker thread that owns the models, the bounded queue, typed events
              (Start, Delta, Done, Failed)
    app       thin routes, `create_app`, `serve`

Imports only specdec.core and specdec.backends (tests/test_layout.py keeps that true).
"""
