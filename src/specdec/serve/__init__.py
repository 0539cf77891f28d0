"""The OpenAI-compatible server, in the order a request flows through it:

    http_checks the door's checks, the app's and the cluster edge's alike: Host, response
                headers, the body's type, size and deadline, the operator's key on /metrics
    wire        the request bodies (pydantic models) and how a body is read into one: bounded
                JSON, the lists' shapes, strict types (no app, no engine: testable alone)
    validation  `validate_request(req, n_ctx, vocab) -> GenParams`: a parsed request checked
                against the models, a 400 naming the field
    gen_params  GenParams: what one generation runs with, carried whole to the worker
    text        TextAssembler: committed tokens -> text deltas (incremental decoding, stop strings)
    metrics     counters and histograms, Prometheus rendering, labels from fixed sets only
    requests    one request's record and its Status; the events the worker hands it
                (Start, Delta, Done, Failed)
    models      what the engine serves with: models and slots, tokenizer, grammars; `prepare`
    delivery    a round's tokens -> its Delta (text, origins, logprobs)
    cycle       the worker's cycle: admission into slots, the joint round, prefill, `finish`
    engine      the queue, admission (429s), the worker's lifecycle
    samples     a request's n samples in the engine: made, queued and released once (the
                routes' skeleton), their events merged
    answers     events -> OpenAI's response records, whole or streamed
    app         thin routes, `create_app`, `serve`

Imports only specdec.core and specdec.backends (tests/test_layout.py keeps that true).
"""
