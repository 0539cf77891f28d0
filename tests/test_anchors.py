"""llama.cpp's tools as anchors (study/anchors.py): built like the wheel, started as documented.

Building and running llama-server is a benchmark (minutes of compile), not a test; these check
what decides whether that comparison is fair and what a user sees when something is missing.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.study import anchors

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_flags_match_the_wheel_build_in_the_makefile() -> None:
    """The anchor and specdec's backend must run the same ggml kernels: every flag that selects
    them is the one the Makefile gives the llama-cpp-python build."""
    makefile = (ROOT / "Makefile").read_text()
    cmake_args = re.search(r"export CMAKE_ARGS \?=(.*?)\n[^ ]", makefile, re.S).group(1)
    wheel_ggml = {f for f in cmake_args.split() if f.startswith("-DGGML_")}
    assert wheel_ggml == set(anchors.KERNEL_FLAGS)
    assert set(anchors.KERNEL_FLAGS) <= set(anchors.CMAKE_FLAGS)
    assert {f for f in anchors.CMAKE_FLAGS if f.startswith("-DGGML_")} == wheel_ggml


def test_missing_binary_names_the_build_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build"):
        anchors.binary("llama-server", version="0.3.36")


def test_build_without_a_compiler_says_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(anchors.shutil, "which", lambda name: None)
    with pytest.raises(anchors.AnchorError, match="cmake and a C\\+\\+ compiler"):
        anchors.build(version="0.3.36", progress=lambda s: None)
    assert not (tmp_path / "anchors" / "llama-cpp-python-0.3.36" / "bin").exists()


def test_modes_are_checked_before_anything_starts() -> None:
    anchors.check_modes(anchors.DEFAULT_MODES, "llamacpp:a", "llamacpp:b")
    with pytest.raises(ValueError, match=r"unknown llama-server mode.*ngram-moo"):
        anchors.check_modes(["ngram-moo"], "llamacpp:a", "llamacpp:b")
    with pytest.raises(ValueError, match="the draft must be a llamacpp: model"):
        anchors.check_modes(["draft"], "llamacpp:a", "hf:b")
    with pytest.raises(ValueError, match="the target must be"):
        anchors.check_modes(["none"], "hf:a", "llamacpp:b")


def test_server_command_runs_the_mode_with_specdecs_numerics() -> None:
    srv = anchors.server_for("draft", Path("/m/t.gguf"), Path("/m/d.gguf"))
    srv.exe, srv.port = Path("/bin/llama-server"), 1234
    cmd = srv.command()
    assert cmd[:3] == ["/bin/llama-server", "-m", "/m/t.gguf"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # loopback only
    assert cmd[cmd.index("--model-draft") + 1] == "/m/d.gguf"
    assert cmd[cmd.index("-fa") + 1] == "on" and cmd[cmd.index("-ctk") + 1] == "q8_0"
    ngram = anchors.server_for("ngram-mod", Path("/m/t.gguf"), None)
    assert ngram.args[-2:] == ("--spec-type", "ngram-mod")
    assert anchors.method_name("none") == "llama-server"
    assert anchors.method_name("ngram-map-k") == "llama-server-ngram-map-k"


def test_a_server_that_exits_while_starting_is_a_clear_error(tmp_path) -> None:
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(anchors.AnchorError, match=r"(?s)exited \(1\).*failed to load model"):
        with anchors.LlamaServer(tmp_path / "m.gguf", exe=fake, startup_s=10):
            pass


def test_bench_and_gate_refuse_bad_llama_server_settings_before_loading_anything(capsys) -> None:
    from specdec.cli import main as cli
    from specdec.study.bench import BenchConfig

    with pytest.raises(ValueError, match="the target must be a llamacpp: model"):
        BenchConfig("custom", "hf:a", "hf:b", compare="llama-server", llama_server=("none",))
    with pytest.raises(ValueError, match="at least one llama-server mode"):
        BenchConfig("custom", "llamacpp:a", "llamacpp:b", compare="llama-server")
    assert cli.main(["gate", "--config", "all_gguf", "--llama-server", "ngram-moo"]) == 2
    assert "unknown llama-server mode" in capsys.readouterr().err
    assert cli.main(["gate", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "needs both --endpoint and --endpoint-baseline" in capsys.readouterr().err
    bad_url = ["gate", "--config", "all_gguf", "--endpoint", "localhost:1"]
    assert cli.main([*bad_url, "--endpoint-baseline", "http://127.0.0.1:1"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err
