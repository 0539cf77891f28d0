"""llama.cpp's tools as the peer (study/engines/anchor_build.py, anchors.py): built as users
build it, started as documented.

Building and running llama-server is a benchmark (minutes of compile), not a test; these check
what decides whether that comparison is fair and what a user sees when something is missing.
"""

from __future__ import annotations

import dataclasses
import shutil
import threading
from pathlib import Path

import pytest

from specdec.backends import llamacpp_build
from specdec.study.engines import anchor_build, anchors, endpoint, ik_source

ROOT = Path(__file__).resolve().parents[2]


def test_the_peer_is_built_with_cmakes_defaults_and_the_wheel_natively() -> None:
    """The peer is llama.cpp as its users build it: no flag that picks ggml's kernels (CMake's
    default is GGML_NATIVE=ON), only the upstream fixes; specdec's wheel is -march=native from
    the same source, so both run the same kernels."""
    assert not [f for f in anchor_build.CMAKE_FLAGS if f.startswith("-DGGML_")]
    assert llamacpp_build.KERNEL_FLAGS["native"] == ("-DGGML_NATIVE=ON",)
    fixes = llamacpp_build.patch_files(fixes_only=True)
    assert fixes and all(p.name.startswith("fix-") for p in fixes)
    assert set(fixes) <= set(llamacpp_build.patch_files())
    makefile = (ROOT / "Makefile").read_text()
    assert "-m specdec.backends.llamacpp_build install" in makefile


def test_the_build_key_changes_with_flags_and_patches(monkeypatch, tmp_path) -> None:
    key = anchor_build.build_key()
    monkeypatch.setattr(
        anchor_build, "CMAKE_FLAGS", (*anchor_build.CMAKE_FLAGS, "-DGGML_NATIVE=OFF")
    )
    assert anchor_build.build_key() != key
    monkeypatch.undo()
    (tmp_path / "fix-more.patch").write_text("x")
    monkeypatch.setattr(llamacpp_build, "PATCHES", tmp_path)
    assert anchor_build.build_key() != key


def test_the_twin_is_the_same_tools_with_specdecs_kernels(tmp_path, monkeypatch) -> None:
    """The "same kernels" twin: its own key and directory (every patch and sdmm's sources go
    into it, and only into it), its modes named twin-<mode>, run on its own binary."""
    assert anchor_build.build_key("twin") != anchor_build.build_key()
    assert anchor_build.anchor_dir("twin") != anchor_build.anchor_dir()
    assert "twin-" in anchor_build.anchor_dir("twin").name
    native = llamacpp_build.native_files()
    assert native and not set(native) & set(anchor_build._sources("stock"))
    assert set(native) <= set(anchor_build._sources("twin"))
    assert anchors.method_name("twin-ngram-mod") == "llama-server-twin-ngram-mod"
    assert anchors.method_name("twin-none") == "llama-server-twin"
    assert anchors.method_name("ngram-mod") == "llama-server-ngram-mod"
    anchors.check_modes(["twin-none", "twin-ngram-mod", "ngram-mod"], "llamacpp:a", "llamacpp:b")
    with pytest.raises(ValueError, match="the draft must be a llamacpp"):
        anchors.check_modes(["twin-draft"], "llamacpp:a", "hf:b")
    srv = anchors.server_for("twin-ngram-mod", Path("t.gguf"), None)
    assert srv.peer == "twin" and srv.mode == "twin-ngram-mod"
    assert srv.args[-2:] == ("--spec-type", "ngram-mod")
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build --peer twin"):
        srv.command()


def test_the_avx2_class_is_stock_and_the_twin_built_for_avx2(tmp_path, monkeypatch) -> None:
    """stock-avx2, twin-avx2 and ik-avx2: the same sources as stock, the twin and ik (fixes;
    every patch and sdmm; ik_llama.cpp's sdist or selected upstream tree), built with ggml's
    AVX2 kernels and no AVX-512 whatever the host, each in a directory of its own; the twin's
    processes run sdmm's AVX2 path. Their modes are avx2-<mode>, twin-avx2-<mode> and
    ik-avx2-<mode>, the longest prefix naming the build."""
    for peer, base in (("stock-avx2", "stock"), ("twin-avx2", "twin"), ("ik-avx2", "ik")):
        p = anchors.PEERS[peer]
        assert "-DGGML_NATIVE=OFF" in p.cmake and "-DGGML_AVX512=OFF" in p.cmake
        assert "-DGGML_AVX2=ON" in p.cmake
        assert anchor_build._sources(peer) == anchor_build._sources(base)
        assert anchor_build.build_key(peer) != anchor_build.build_key(base)
        assert anchor_build.anchor_dir(peer) != anchor_build.anchor_dir(base)
    assert dict(anchors.PEERS["twin-avx2"].env) == {"SPECDEC_MM_ISA": "avx2"}
    assert not anchors.PEERS["stock-avx2"].env
    assert anchors.split_peer("twin-avx2-ngram-mod") == ("ngram-mod", "twin-avx2")
    assert anchors.split_peer("avx2-none") == ("none", "stock-avx2")
    assert anchors.split_peer("twin-none") == ("none", "twin")
    assert anchors.split_peer("ik-avx2-suffix") == ("suffix", "ik-avx2")
    assert anchors.PEERS["ik-avx2"].ik and "-DGGML_AVXVNNI=OFF" in anchors.PEERS["ik-avx2"].cmake
    assert anchors.method_name("ik-avx2-ngram-mod") == "ik-llama-server-avx2-ngram-mod"
    assert anchors.plain_mode("ik-avx2-suffix") == "ik-avx2-none"
    assert anchors.method_name("avx2-ngram-mod") == "llama-server-avx2-ngram-mod"
    assert anchors.method_name("twin-avx2-none") == "llama-server-twin-avx2"
    assert anchors.plain_mode("twin-avx2-ngram-mod") == "twin-avx2-none"
    anchors.check_modes(["avx2-none", "twin-avx2-ngram-mod"], "llamacpp:a", "llamacpp:b")
    srv = anchors.server_for("twin-avx2-none", Path("t.gguf"), None)
    assert srv.peer == "twin-avx2"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build --peer twin-avx2"):
        srv.command()


def test_ik_llama_cpp_is_a_named_peer_with_its_users_best_settings(tmp_path, monkeypatch) -> None:
    """ik_llama.cpp: its own pinned sdist, key and directory, no patches of ours; its modes
    named ik-<mode> (draft and suffix only on an upstream build: the sdist's --spec-type has
    neither), run with --run-time-repack and specdec's numerics, its key in a file (it reads
    none from the environment) and its web UI off in its own spelling."""
    assert anchor_build.build_key("ik") not in (
        anchor_build.build_key(),
        anchor_build.build_key("twin"),
    )
    assert anchor_build.anchor_dir("ik").name.startswith(
        f"ik_llama.cpp-{anchors.PEERS['ik'].version}-"
    )
    assert anchor_build._sources("ik") == []
    with pytest.raises(anchors.AnchorError, match="unknown peer 'vllm'"):
        anchor_build.build_key("vllm")
    assert anchors.method_name("ik-none") == "ik-llama-server"
    assert anchors.method_name("ik-ngram-mod") == "ik-llama-server-ngram-mod"
    anchors.check_modes(["ik-none", "ik-ngram-mod", "ngram-mod"], "llamacpp:a", "llamacpp:b")
    with pytest.raises(ValueError, match=r"ik-draft, ik-suffix need.*--peer ik --src DIR"):
        anchors.check_modes(["ik-draft", "ik-suffix"], "llamacpp:a", "llamacpp:b")
    # a recorded bench config read back names them without running them: no build asked for
    anchors.check_modes(["ik-suffix"], "llamacpp:a", "llamacpp:b", built=False)
    with pytest.raises(ValueError, match=r"unknown llama-server mode.*twin-suffix"):
        anchors.check_modes(["twin-suffix"], "llamacpp:a", "llamacpp:b")
    srv = anchors.server_for("ik-ngram-mod", Path("/m/t.gguf"), None)
    srv.exe, srv.port, srv.key_file = Path("/bin/ik-server"), 1234, Path("/tmp/k")
    cmd = srv.command()
    assert srv.peer == "ik" and "--run-time-repack" in cmd and "--no-webui" not in cmd
    assert cmd[cmd.index("--webui") + 1] == "none"
    assert cmd[cmd.index("--api-key-file") + 1] == "/tmp/k" and srv.key not in cmd
    assert cmd[cmd.index("-fa") + 1] == "on" and cmd[cmd.index("-ctk") + 1] == "q8_0"
    assert cmd[-2:] == ["--spec-type", "ngram-mod"]
    # a gate compares a mode with its own build's plain server, not another build's
    assert anchors.plain_mode("ik-ngram-mod") == "ik-none"
    assert anchors.plain_mode("twin-ngram-mod") == "twin-none"
    assert anchors.plain_mode("ngram-mod") == anchors.plain_mode("lookup") == "none"
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build --peer ik"):
        anchor_build.binary("llama-server", "ik")


def test_ik_source_gets_its_build_info_written(tmp_path, monkeypatch) -> None:
    """The sdist's tree cannot generate common/build-info.cpp (no .git, no generator script):
    the build writes it, and refuses an sdist that is not the pinned one."""
    import io
    import tarfile

    ik = anchors.PEERS["ik"]
    top = f"ik_llama_cpp_python-{ik.version}/vendor/ik_llama.cpp/common"
    sdist = tmp_path / "ik.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        data = b"int LLAMA_BUILD_NUMBER = @BUILD_NUMBER@;\n"
        info = tarfile.TarInfo(f"{top}/build-info.cpp.in")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    with pytest.raises(anchors.AnchorError, match="is not the pinned ik-llama-cpp-python"):
        anchor_build._source("ik", sdist, tmp_path / "w0", lambda s: None)
    pinned = dataclasses.replace(ik, sdist_sha256=llamacpp_build._sha256(sdist))
    monkeypatch.setitem(anchors.PEERS, "ik", pinned)
    src = anchor_build._source("ik", sdist, tmp_path / "w1", lambda s: None)
    written = (src / "common" / "build-info.cpp").read_text()
    assert "LLAMA_BUILD_NUMBER = 0;" in written and "LLAMA_COMMIT" in written
    assert "@" not in written


def _ik_tree(root: Path) -> Path:
    """The smallest tree ik_source.check_tree takes for ik_llama.cpp's."""
    for rel in ("CMakeLists.txt", "common/build-info.cpp.in", "examples/server/x.cpp"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    (root / "ggml" / "src" / "iqk").mkdir(parents=True)
    return root


def test_ik_from_its_upstream_source_is_a_build_of_its_own(tmp_path, monkeypatch) -> None:
    """An upstream tree is keyed by its commit (passed, or its checkout's HEAD, plus its
    changes) or, without one, by its files' names and sizes (never its build directories):
    a sdist build and an upstream build, or two commits, never share a directory. The last
    ik build made or found is the one the ik modes run on."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    tree = _ik_tree(tmp_path / "ik")
    with pytest.raises(anchors.AnchorError, match=r"not an ik_llama\.cpp source tree.*iqk"):
        anchor_build.build(peer="ik", src=tmp_path, progress=lambda s: None)
    sid = ik_source.identify(tree)["source_id"]
    assert sid.startswith("tree-")
    (tree / "build").mkdir()
    (tree / "build" / "CMakeCache.txt").write_text("x")
    (tree / ".git").mkdir()  # not a checkout git can read: no commit, and left out
    assert ik_source.identify(tree)["source_id"] == sid
    (tree / "common" / "new.cpp").write_text("x")
    assert ik_source.identify(tree)["source_id"] != sid
    shutil.rmtree(tree / ".git")
    with pytest.raises(anchors.AnchorError, match="--commit must be a git commit id"):
        anchor_build.build(peer="ik", src=tree, commit="main", progress=lambda s: None)
    a, b = "8337e4cd3861406fc04e0854b1409cd1b027fbc9", "1794846f7351ba405b3ab0b3654f8c9f9f387d01"
    origin = ik_source.identify(tree, a.upper())
    assert origin["source_id"] == f"git-{a}" and origin["commit"] == a
    sdist_key = anchor_build.build_key("ik", None)
    keys = {
        sdist_key,
        anchor_build.build_key("ik", f"git-{a}"),
        anchor_build.build_key("ik", f"git-{b}"),
    }
    assert len(keys) == 3 and anchor_build.build_key("ik") == sdist_key  # nothing selected yet
    up = anchor_build.anchor_dir("ik", f"git-{a}")
    assert up.name.startswith("ik_llama.cpp-git-8337e4cd3861-")
    assert anchor_build.anchor_dir("ik").name.startswith("ik_llama.cpp-0.1.5-")
    # a found build is selected; a sdist build (made or found) selects the sdist again
    for t in anchors.PEERS["ik"].targets:
        (up / "bin").mkdir(parents=True, exist_ok=True)
        (up / "bin" / t).write_text("x")
    (up / "manifest.json").write_text("{}")
    assert anchor_build.build(peer="ik", src=tree, commit=a, progress=lambda s: None) == up / "bin"
    assert anchor_build.ik_source() == f"git-{a}" and anchor_build.anchor_dir("ik") == up
    assert anchor_build.binary("llama-server", "ik") == up / "bin" / "llama-server"
    anchors.check_modes(["ik-draft", "ik-suffix"], "llamacpp:a", "llamacpp:b")
    shutil.rmtree(up)
    with pytest.raises(anchors.AnchorError, match=f"--peer ik --src {tree} --commit {a}"):
        anchor_build.binary("llama-server", "ik")
    sd = anchor_build.anchor_dir("ik", None)
    for t in anchors.PEERS["ik"].targets:
        (sd / "bin").mkdir(parents=True, exist_ok=True)
        (sd / "bin" / t).write_text("x")
    (sd / "manifest.json").write_text("{}")
    anchor_build.build(peer="ik", progress=lambda s: None)
    assert anchor_build.ik_source() is None and anchor_build.anchor_dir("ik") == sd
    for bad, match in (
        ({"peer": "stock", "src": tree}, "pass --peer ik"),
        ({"peer": "ik", "src": tree, "sdist": tmp_path / "x.tar.gz"}, "two sources"),
        ({"peer": "ik", "commit": a}, "pass --src DIR"),
    ):
        with pytest.raises(anchors.AnchorError, match=match):
            anchor_build.build(progress=lambda s: None, **bad)


def test_ik_source_id_reads_a_checkouts_commit_and_its_changes(tmp_path) -> None:
    import subprocess

    tree = _ik_tree(tmp_path / "ik")
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    clean = ik_source.identify(tree)
    assert clean["source_id"] == f"git-{head.strip()}" and clean["dirty"] is None
    (tree / "CMakeLists.txt").write_text("changed")
    dirty = ik_source.identify(tree)
    assert dirty["source_id"].startswith(f"git-{head.strip()}-dirty-")
    (tree / "CMakeLists.txt").write_text("changed again")
    assert ik_source.identify(tree)["source_id"] != dirty["source_id"]


def test_an_upstream_tree_is_copied_with_its_build_info_and_recorded(tmp_path) -> None:
    """The copy leaves the tree untouched and its .git and build directories out (its CMake
    then never regenerates build-info.cpp, written with the commit); the manifest says where
    the build came from."""
    tree = _ik_tree(tmp_path / "ik")
    (tree / "build").mkdir()
    (tree / "build" / "CMakeCache.txt").write_text("x")
    (tree / ".git").mkdir()
    (tree / "spm-headers").mkdir()
    (tree / "spm-headers" / "ggml.h").symlink_to("../CMakeLists.txt")
    origin = ik_source.identify(tree, "8337e4cd3861406fc04e0854b1409cd1b027fbc9")
    src = anchor_build._source("ik", None, tmp_path / "w", lambda s: None, origin)
    assert not (src / ".git").exists() and not (src / "build").exists()
    assert (src / "spm-headers" / "ggml.h").is_symlink()
    info = (src / "common" / "build-info.cpp").read_text()
    assert 'LLAMA_COMMIT = "8337e4cd3861";' in info and "@" not in info
    assert not (tree / "common" / "build-info.cpp").exists()
    made = anchor_build._manifest("ik", 2, 1.0, origin)
    assert made["source"]["kind"] == "upstream" and made["source"]["commit"] == origin["commit"]
    assert made["version"] == origin["source_id"] and made["sdist_sha256"] is None
    assert anchor_build._manifest("ik", 2, 1.0)["source"]["kind"] == "sdist"


def test_ik_modes_map_to_its_own_flags_and_one_slot_for_speculation(tmp_path) -> None:
    """Upstream's draft mode names its type (--model-draft alone drops the draft model) and
    suffix decoding is its own; speculation is served on one slot, so a speculative ik mode
    refuses -np > 1 before anything starts, and ik-none serves several."""
    draft = anchors.server_for("ik-draft", Path("/m/t.gguf"), Path("/m/d.gguf"))
    assert draft.args[-4:] == ("--spec-type", "draft", "--model-draft", "/m/d.gguf")
    assert anchors.server_for("ik-suffix", Path("t"), None).args[-2:] == ("--spec-type", "suffix")
    assert anchors.server_for("draft", Path("t"), Path("d")).args[-4:-2] == (
        "--spec-type",
        "draft-simple",
    )
    assert anchors.method_name("ik-suffix") == "ik-llama-server-suffix"
    srv = anchors.server_for("ik-ngram-mod", tmp_path / "m.gguf", None)
    srv.parallel, srv.exe = 4, tmp_path / "never-run"
    with pytest.raises(anchors.AnchorError, match=r"one slot only.*ik-none"):
        with srv:
            pass
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    plain = anchors.server_for("ik-none", tmp_path / "m.gguf", None)
    plain.parallel, plain.exe, plain.startup_s = 4, fake, 10
    with pytest.raises(anchors.AnchorError, match=r"exited \(1\)"):
        with plain:
            pass


def test_the_cli_builds_ik_from_a_source_tree(tmp_path, monkeypatch, capsys) -> None:
    from specdec.cli import main as cli

    calls = []
    monkeypatch.setattr(anchor_build, "build", lambda **kw: calls.append(kw) or tmp_path / "bin")
    argv = ["anchors", "build", "--peer", "ik", "--src", str(tmp_path), "--jobs", "2"]
    assert cli.main(argv) == 0
    assert calls[-1]["src"] == tmp_path and calls[-1]["peer"] == "ik" and calls[-1]["jobs"] == 2
    assert calls[-1]["commit"] is None and calls[-1]["sdist"] is None
    assert cli.main([*argv, "--commit", "abc1234"]) == 0 and calls[-1]["commit"] == "abc1234"
    assert capsys.readouterr().out.strip().endswith("bin")
    assert cli.main(["anchors", "build", "--src", str(tmp_path)]) == 2
    assert "pass --peer ik" in capsys.readouterr().err
    assert cli.main(["anchors", "build", "--peer", "ik", "--commit", "abc1234"]) == 2
    assert "pass --src DIR" in capsys.readouterr().err
    assert len(calls) == 2
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    assert cli.main(["anchors", "path", "--peer", "ik"]) == 2
    assert "specdec anchors build --peer ik" in capsys.readouterr().err


def test_ik_server_gets_its_key_in_a_private_file_removed_at_stop(tmp_path) -> None:
    fake = tmp_path / "llama-server"
    seen = tmp_path / "seen"
    fake.write_text(
        '#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = --api-key-file ] && '
        f'{{ stat -c %a "$2" > {seen}; cat "$2" >> {seen}; }}; shift; done\nexit 1\n'
    )
    fake.chmod(0o755)
    srv = anchors.LlamaServer(tmp_path / "m.gguf", exe=fake, startup_s=10, peer="ik")
    with pytest.raises(anchors.AnchorError, match=r"exited \(1\)"):
        with srv:
            pass
    mode, key = seen.read_text().split()
    assert mode == "600" and key == srv.key
    assert srv.key_file is not None and not srv.key_file.exists()


def test_a_build_collects_its_tools_and_every_shared_library(tmp_path) -> None:
    """llama.cpp writes its libraries beside the tools; ik_llama.cpp leaves each in its own
    directory (libmtmd.so under examples/mtmd/): the tools' $ORIGIN rpath needs all of them."""
    build, dest = tmp_path / "build", tmp_path / "bin"
    for rel in (
        "bin/llama-server",
        "bin/libggml.so",
        "src/libllama.so",
        "examples/mtmd/libmtmd.so",
    ):
        (build / rel).parent.mkdir(parents=True, exist_ok=True)
        (build / rel).write_text(rel)
    (build / "src" / "libllama.so.0").symlink_to("libllama.so")
    (build / "src" / "CMakeFiles" / "x.so.d").mkdir(parents=True)
    dest.mkdir()
    anchor_build._collect(build, dest, ["llama-server"])
    names = {p.name for p in dest.iterdir()}
    assert names == {"llama-server", "libggml.so", "libllama.so", "libllama.so.0", "libmtmd.so"}
    assert (dest / "libllama.so.0").is_symlink()


def test_missing_binary_names_the_build_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build"):
        anchor_build.binary("llama-server")


def test_build_without_a_compiler_says_what_to_install(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path))
    monkeypatch.setattr(anchor_build.shutil, "which", lambda name: None)
    with pytest.raises(anchors.AnchorError, match="cmake, git and a C\\+\\+ compiler"):
        anchor_build.build(progress=lambda s: None)
    assert not (tmp_path / "anchors").exists()


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
    from specdec.study.run.bench_settings import BenchConfig, Peers

    peers = Peers(compare="llama-server", llama_server=("none",))
    with pytest.raises(ValueError, match="the target must be a llamacpp: model"):
        BenchConfig("custom", "hf:a", "hf:b", peers=peers)
    with pytest.raises(ValueError, match="at least one llama-server mode"):
        BenchConfig("custom", "llamacpp:a", "llamacpp:b", peers=Peers(compare="llama-server"))
    assert cli.main(["gate", "--config", "all_gguf", "--llama-server", "ngram-moo"]) == 2
    assert "unknown llama-server mode" in capsys.readouterr().err
    assert cli.main(["gate", "--endpoint", "http://127.0.0.1:1"]) == 2
    assert "needs both --endpoint and --endpoint-baseline" in capsys.readouterr().err
    bad_url = ["gate", "--config", "all_gguf", "--endpoint", "localhost:1"]
    assert cli.main([*bad_url, "--endpoint-baseline", "http://127.0.0.1:1"]) == 2
    assert "is not an http(s) URL" in capsys.readouterr().err


# ------------------------------------------------------------------------------ llama-lookup
_REPORT = """
encoded  512 tokens in    9.250 seconds, speed:   55.351 t/s
decoded  301 tokens in   10.500 seconds, speed:   28.667 t/s

n_draft      = 16
n_predict    = 301
n_drafted    = 640
t_draft_flat = 0.40 ms
t_draft      = 12.00 ms, 18.75 us per token, 53333.33 tokens per second
n_accept     = 250
accept       = 39.062%
"""


def _fake_lookup(tmp_path: Path, answer: str, rc: int = 0) -> Path:
    """A stand-in for llama-lookup: echoes the prompt (its file less the newline -f drops) and
    an answer on stdout, the closing report on stderr, and records its arguments."""
    exe = tmp_path / "llama-lookup"
    (tmp_path / "report.txt").write_text(_REPORT)
    (tmp_path / "answer.txt").write_text(answer)
    exe.write_text(
        "#!/bin/sh\n"
        f'echo "$@" > {tmp_path}/args.txt\n'
        'while [ "$1" != "-f" ]; do shift; done\n'
        f'printf "\\n\\n"; head -c -1 "$2"; cat {tmp_path}/answer.txt; printf "\\n\\n"\n'
        f"cat {tmp_path}/report.txt >&2\n"
        f"exit {rc}\n"
    )
    exe.chmod(0o755)
    return exe


def test_llama_lookup_runs_once_per_prompt_and_reads_its_report(tmp_path) -> None:
    exe = _fake_lookup(tmp_path, "def f():\n    return 1\n")
    with anchors.LlamaLookup(tmp_path / "t.gguf", exe=exe) as tool:
        r = tool.run("<|im_start|>user\nhi<|im_end|>\n", max_tokens=300, temperature=0.0, seed=7)
    assert r["text"] == "def f():\n    return 1\n"  # the echoed prompt and blank lines removed
    assert (r["prompt_tokens"], r["generated"], r["drafted"], r["accepted"]) == (512, 301, 640, 250)
    assert r["prefill_s"] == 9.25 and r["decode_s"] == 10.5
    args = (tmp_path / "args.txt").read_text().split()
    assert args[args.index("-n") + 1] == "299"  # it samples one more than -n
    assert args[args.index("--seed") + 1] == "7" and args[args.index("--top-k") + 1] == "0"
    assert args[args.index("-ctk") + 1] == "q8_0"  # the numerics of the servers and our backend
    assert anchors.method_name("lookup") == "llama-lookup"


def test_llama_lookup_failures_are_clear(tmp_path, monkeypatch) -> None:
    with pytest.raises(anchors.AnchorError, match=r"(?s)exited \(3\).*n_accept"):
        anchors.LlamaLookup(tmp_path / "t.gguf", exe=_fake_lookup(tmp_path, "x", rc=3)).run(
            "p", 8, 0.0, 0
        )
    with pytest.raises(anchors.AnchorError, match="printed no drafted, accepted line"):
        anchors.parse_lookup_report(_REPORT.replace("n_drafted", "x").replace("n_accept", "y"))
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "empty"))
    with pytest.raises(anchors.AnchorError, match="specdec anchors build"):
        with anchors.LlamaLookup(tmp_path / "t.gguf"):
            pass
    # a tool mode is for the bench: the gate, which needs a server, refuses it by name
    anchors.check_modes(["ngram-mod", "lookup"], "llamacpp:a", "llamacpp:b", tools=True)
    with pytest.raises(ValueError, match=r"lookup: `specdec bench` only"):
        anchors.check_modes(["lookup"], "llamacpp:a", "llamacpp:b")


def test_bench_runs_llama_lookup_on_the_templated_prompt(tmp_path) -> None:
    """The bench's runner gives llama-lookup the task's chat-templated prompt as text and turns
    its report into a RUN record; a prompt that tokenizes differently is a recorded failure."""
    from specdec.study.engines import endpoint
    from specdec.study.run import bench_settings, methods

    class Tok:  # ids are characters: the round trip is exact
        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    prompt = "<|im_start|>user\nhi<|im_end|>\n"
    exe = _fake_lookup(tmp_path, "ok")
    (tmp_path / "report.txt").write_text(_REPORT.replace(" 512 tokens", f" {len(prompt)} tokens"))
    cfg = bench_settings.BenchConfig(
        "custom", "mock:vocab=300", "mock:vocab=300", max_new_tokens=300
    )
    tool = anchors.LlamaLookup(tmp_path / "t.gguf", exe=exe)
    run = methods.tool_runner(cfg, "llama-lookup", tool, Tok())
    task = methods.Task([ord(c) for c in prompt], 0, None, None, text="hi")
    rec = run(task)
    assert rec["generated"] == 301 and rec["tokens"] == [ord("o"), ord("k")]
    assert rec["wall_s"] == pytest.approx(19.75) and rec["prefill_s"] == 9.25
    assert rec["tokens_per_s"] == pytest.approx(301 / 19.75)
    with pytest.raises(endpoint.EndpointError, match=rf"read {len(prompt)} .* bench has 5"):
        run(methods.Task([ord(c) for c in "hello"], 0, None, None, text="hi"))


# ------------------------------------------------------------------------------ whose port is it
class _Impostor:
    """Anything on a port that answers 200 to every GET, key or not."""

    def __init__(self) -> None:
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: object) -> None:
                pass

            def do_GET(self) -> None:
                body = b'{"data": [{"id": "impostor"}]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.slow
def test_a_taken_port_is_retried_and_an_impostor_is_never_trusted(monkeypatch) -> None:
    """Between free_port() and the bind another process can take the port, and whatever then
    answered /health was taken for the server (issue 21, item 10)."""
    impostor = _Impostor()
    try:
        fixed = anchors.SpecdecServer(Path(), (), target="mock:vocab=48,seed=0", port=impostor.port)
        fixed.startup_s = 60
        with pytest.raises(anchors.AnchorError, match=r"taken|another process"):
            with fixed:
                pass
        ports = iter([impostor.port, anchors.free_port()])
        monkeypatch.setattr(anchors, "free_port", lambda: next(ports))
        srv = anchors.SpecdecServer(Path(), (), target="mock:vocab=48,seed=0")
        srv.startup_s = 60
        with srv:
            assert srv.port != impostor.port
            with endpoint.Client(srv.endpoint()) as c:
                assert c.model() == "mock:vocab=48,seed=0"
    finally:
        impostor.close()
