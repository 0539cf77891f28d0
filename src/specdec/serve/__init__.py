"""The OpenAI-compatible server, in the order a request flows through it:

    protocol  request models, `validate_request(req, n_ctx, vocab) -> GenParams`, error bodies,
              response records (no app, no engine: testable alone)
    text      TextAssembler: committed tokens -> text deltas (incremental decoding, stop strings)
    metrics   counters and histograms, Prometheus rendering, labels from fixed sets only
    requests  one request's record and its Status; the events the worker hands it
              (Start, Delta, Done, Failed)
    models    what the engine serves with: models and slots, tokenizer, grammars; `prepare`
    delivery  a round's tokens -> its Delta (text, origins, logprobs)
    cycle     the worker's cycle: admission into slots, the joint round, prefill, `finish`
    engine    the queue, admission (429s), the worker's lifecycle
    answers   events -> OpenAI's response records, whole or streamed
    app       thin routes, `create_app`, `serve`

Imports only specdec.core and specdec.backends (tests/test_layout.py keeps that true).
"""
