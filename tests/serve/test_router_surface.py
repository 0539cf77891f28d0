"""What a worker owes any router in front of it (the cluster's edge, llm-d's scheduler, nginx),
on a mock server: /health answering while every slot is busy and 503 once draining, the router's
gauges in /metrics, x-request-id echoed, 503s with Retry-After; and the cluster's pure parts
(the affinity key, the merged /metrics) without Ray. The edge's routing: test_front_door.py;
the cluster itself: test_cluster.py."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from serverkit import metric, mock_server, wait_for

from specdec.serve.edge import merge_metrics
from specdec.serve.errors import unavailable_error
from specdec.serve.front_door import AFFINITY_CHARS, affinity_key


def _chat(content: str) -> bytes:
    import json

    return json.dumps({"messages": [{"role": "user", "content": content}]}).encode()


def test_affinity_key_names_the_key_and_the_prompts_first_block() -> None:
    edit = "x" * AFFINITY_CHARS
    same = affinity_key("Bearer a", _chat(edit + " then one instruction"))
    assert same == affinity_key("Bearer a", _chat(edit + " then another"))
    assert same != affinity_key("Bearer b", _chat(edit + " then one instruction"))
    assert same != affinity_key("Bearer a", _chat("y" + edit))
    completion = b'{"prompt": "def f(x):"}'
    assert affinity_key("", completion) == affinity_key("", b'{"prompt": ["def f(x):"]}')
    assert affinity_key("", b'{"prompt": [1, 2, 3]}') is not None  # token ids
    deep = b"[" * 100_000 + b"]" * 100_000
    deep_content = b'{"messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for body in (b"not json", b"[1]", b'{"model": "m"}', b'{"messages": []}', deep, deep_content):
        assert affinity_key("Bearer a", body) is None, body


def test_merged_metrics_keep_each_family_once_with_a_replica_label() -> None:
    one = (
        "# HELP specdec_running Requests\n# TYPE specdec_running gauge\nspecdec_running 1\n"
        "# HELP specdec_running_total Ended\n# TYPE specdec_running_total counter\n"
        "specdec_running_total 7\n"
        "# HELP specdec_lat Latency\n# TYPE specdec_lat histogram\n"
        'specdec_lat_bucket{le="1.0"} 2\nspecdec_lat_sum 0.5\nspecdec_lat_count 2\n'
    )
    two = one.replace("specdec_running 1", "specdec_running 0")
    text = merge_metrics({"r1": one, "r2": two})
    lines = text.splitlines()
    assert lines.count("# TYPE specdec_running gauge") == 1
    assert 'specdec_running{replica="r1"} 1' in lines and 'specdec_running{replica="r2"} 0' in lines
    assert 'specdec_lat_bucket{replica="r2",le="1.0"} 2' in lines
    # a family whose name starts with another's keeps its own samples
    total = lines.index("# TYPE specdec_running_total counter")
    assert lines[total + 1 : total + 3] == [
        'specdec_running_total{replica="r1"} 7',
        'specdec_running_total{replica="r2"} 7',
    ]
    # a family's samples follow its own HELP/TYPE, not another's (Prometheus's text format)
    at = lines.index("# TYPE specdec_lat histogram")
    assert all(ln.startswith("specdec_lat") for ln in lines[at + 1 :])
    assert lines.index('specdec_running{replica="r2"} 0') < at


def test_health_answers_while_busy_and_503_while_draining() -> None:
    srv = mock_server(delay=0.05, parallel=1)
    try:
        body = {"model": "mock:vocab=48,seed=0", "prompt": [1, 2], "max_tokens": 60}
        busy = threading.Thread(target=srv.request, args=("POST", "/v1/completions", body))
        busy.start()
        deadline = time.monotonic() + 10
        while not srv.engine.busy:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.perf_counter()
        status, head, health = srv.request("GET", "/health", headers={"X-Request-Id": "abc-1"})
        assert status == 200 and health["status"] == "ok"
        assert time.perf_counter() - t0 < 1.0  # every slot busy, and it answers at once
        assert head["x-request-id"] == "abc-1"
        _, head, _ = srv.request("GET", "/health", headers={"X-Request-Id": "bad id\x01"})
        assert head["x-request-id"] != "bad id\x01" and len(head["x-request-id"]) == 32
        wait_for(lambda: srv.engine.models.kv_usage > 0, 10, "the prompt never reached the KV")
        text = srv.metrics()
        assert metric(text, "specdec:num_requests_running") == 1
        assert 0 < metric(text, "specdec:kv_cache_usage_perc") <= 1
        assert metric(text, "specdec:num_requests_waiting") == 0
        srv.engine.drain()
        status, head, health = srv.request("GET", "/health")
        assert status == 503 and health["status"] == "draining"
        busy.join(30)
    finally:
        srv.close()


def test_a_503_says_when_to_come_back() -> None:
    assert unavailable_error("stopping", "shutting_down").headers["Retry-After"] == "1"


def test_a_single_server_never_imports_ray() -> None:
    """Ray is the cluster extra's: `specdec serve` without --replicas runs without it."""
    code = (
        "import sys\n"
        "import specdec.cli.main, specdec.serve.launch, specdec.serve.app, specdec.serve.cluster\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout
