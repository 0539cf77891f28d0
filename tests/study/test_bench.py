"""The benchmark harness: artifacts that validate and agree with their own rows, the interleaved
order, Ctrl-C keeping finished rows, the sweep, flag validation, and (model-marked) real-model
smoke runs including transformers' assisted generation as the anchor.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

import specdec.study.run.bench as bench
import specdec.study.run.bench_settings as bench_settings
from specdec.backends import registry
from specdec.backends.mock import MockModel
from specdec.cli.main import main
from specdec.core.config import SpecConfig, Warp
from specdec.core.generate import generate
from specdec.study.artifacts import provenance, read, runs, write_json
from specdec.study.present.tables import format_table
from specdec.study.run import methods
from specdec.study.run import prompts as prompt_set
from specdec.study.run.bench import run_bench
from specdec.study.run.bench_settings import BenchConfig, Peers, bench_config
from specdec.study.run.sweep import format_sweep_table, run_sweep

V = 48
TARGET_SPEC, DRAFT_SPEC = f"mock:vocab={V},seed=0", f"mock:vocab={V},seed=1"
MOCK_CLI = ["--draft", DRAFT_SPEC, "--target", TARGET_SPEC, "--no-progress"]


@pytest.fixture
def models(pair) -> tuple[MockModel, MockModel]:
    """conftest's mock pair as run_bench takes it: (draft, target)."""
    target, draft = pair
    return draft, target


def _cfg(**kw) -> BenchConfig:
    settings = dict(spec=SpecConfig("model", 3), n_prompts=5, warmup=2, max_new_tokens=12)
    return BenchConfig("mock", DRAFT_SPEC, TARGET_SPEC, **{**settings, **kw})


def _load(path: Path) -> dict:
    art = json.loads(path.read_text())
    read(art)
    return art


# ------------------------------------------------------------------------------ end to end
def test_bench_artifact_validates_and_matches_its_rows(models, tmp_path) -> None:
    cfg = _cfg()
    art = run_bench(cfg, tmp_path, progress=False, models=models).to_json()
    on_disk = _load(tmp_path / "bench_mock_k3_t0.8.json")
    assert on_disk["complete"] is True
    assert on_disk["rows"] == art["rows"] and on_disk["aggregates"] == art["aggregates"]

    rows = art["rows"]
    assert len(rows) == cfg.n_prompts - cfg.warmup
    assert [r["index"] for r in rows] == [2, 3, 4]
    assert [r["seed"] for r in rows] == [2, 3, 4]  # per-prompt seed = prompt index
    # Interleaved, alternating order: even index -> baseline first.
    assert [r["order"] for r in rows] == ["base-first", "spec-first", "base-first"]
    assert rows[1]["sequence"] == ["speculative", "baseline"]

    agg = art["aggregates"]
    spec = [r["speculative"] for r in rows]
    base = [r["baseline"] for r in rows]
    drafted = sum(r["drafted"] for r in spec)
    assert agg["speculative"]["acceptance_rate"] == pytest.approx(
        sum(r["accepted"] for r in spec) / drafted
    )
    for i, rate in enumerate(agg["speculative"]["positional_acceptance"]):
        acc = sum(r["accepted_per_pos"][i] for r in spec)
        assert rate == pytest.approx(acc / sum(r["drafted_per_pos"][i] for r in spec))
    assert len(agg["speculative"]["positional_acceptance"]) == cfg.spec.k
    assert agg["speculative"]["tokens_per_round"] == pytest.approx(
        sum(r["generated"] for r in spec) / sum(r["rounds"] for r in spec)
    )
    means = {
        m: sum(r[m]["tokens_per_s"] for r in rows) / len(rows) for m in ("baseline", "speculative")
    }
    assert agg["baseline"]["tok_s_mean"] == pytest.approx(means["baseline"])
    assert agg["speedup"] == pytest.approx(means["speculative"] / means["baseline"])
    ms = agg["speculative"]["ms_per_token"]
    gen = sum(r["generated"] for r in spec)
    # the latency split's "verify" is the target's passes, the prompt's prefill included
    target_s = sum(r["verify_s"] + r["prefill_s"] for r in spec)
    assert ms["verify"] == pytest.approx(1000 * target_s / gen)
    assert sum(ms.values()) == pytest.approx(1000 * sum(r["wall_s"] for r in spec) / gen)
    assert agg["baseline"]["acceptance_rate"] is None  # nothing drafted
    assert agg["baseline"]["tokens_per_round"] == 1.0
    assert all(r["generated"] == cfg.max_new_tokens for r in base)  # mocks have no stop ids
    assert agg["peak_rss_mb"] > 0

    # The rows are what generate() gives for that prompt and seed: nothing else leaks in.
    ids = bench._prompt_ids(None, prompt_set.load_prompts(3)[2].text, V)
    assert rows[0]["prompt_tokens"] == len(ids)
    again = generate(models[1], ids, max_new_tokens=12, warp=Warp(temperature=0.8), seed=2)
    assert rows[0]["baseline"]["tokens"] == again.tokens

    table = format_table(art)
    assert "mock" in table and f"{agg['speedup']:.2f}x" in table


def test_greedy_bench_speculative_tokens_equal_baseline(models, tmp_path) -> None:
    cfg = _cfg(spec=SpecConfig("model", 4), warp=Warp(temperature=0.0))
    art = run_bench(cfg, tmp_path, progress=False, models=models).to_json()
    for row in art["rows"]:
        assert row["speculative"]["tokens"] == row["baseline"]["tokens"]
    assert (tmp_path / "bench_mock_k4_t0.json").is_file()


def test_ctrl_c_keeps_finished_rows(models, tmp_path, monkeypatch) -> None:
    cfg = _cfg(n_prompts=6, warmup=1)
    calls = {"n": 0}

    def interrupted_generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 2 * (cfg.warmup + 2):  # two methods per prompt; 2 recorded prompts done
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(methods, "generate", interrupted_generate)
    with pytest.raises(KeyboardInterrupt):
        run_bench(cfg, tmp_path, progress=False, models=models, tag="cc")
    art = _load(tmp_path / "bench_mock_k3_t0.8_cc.json")
    assert art["complete"] is False
    assert [r["index"] for r in art["rows"]] == [1, 2]
    assert art["aggregates"]["baseline"]["n"] == 2
    assert "(partial)" in format_table(art)


def test_sweep_on_mock(models, tmp_path) -> None:
    summary = run_sweep(
        _cfg(n_prompts=3, warmup=1), [1, 2], tmp_path, progress=False, models=models
    )
    on_disk = _load(tmp_path / "sweep_mock_t0.8.json")
    assert on_disk["schema"] == "specdec.sweep/1" and on_disk["complete"] is True
    assert on_disk["ks"] == [1, 2] and "k" not in on_disk["config"]
    assert [p.k for p in summary.points] == [1, 2]
    for p in on_disk["points"]:
        art = _load(tmp_path / p["artifact"])
        assert art["config"]["k"] == p["k"]
        assert p["speedup"] == pytest.approx(art["aggregates"]["speedup"])
        assert p["acceptance_rate"] == art["aggregates"]["speculative"]["acceptance_rate"]
        assert len(p["positional_acceptance"]) == p["k"]
    assert "speedup" in format_sweep_table(summary)


# ----------------------------------------------------------------------------------- the CLI
def test_cli_bench_and_sweep_on_mock_specs(tmp_path, capsys) -> None:
    args = ["--prompts", "3", "--warmup", "1", "--max-new-tokens", "6", "--out", str(tmp_path)]
    assert main(["bench", *MOCK_CLI, *args, "-k", "2", "-t", "0"]) == 0
    out = capsys.readouterr().out
    assert "custom" in out and "wrote" in out
    art = _load(tmp_path / "bench_custom_k2_t0.json")
    assert art["config"]["name"] == "custom" and art["config"]["temperature"] == 0
    assert main(["sweep", *MOCK_CLI, *args, "--k", "1,3"]) == 0
    assert _load(tmp_path / "sweep_custom_t0.8.json")["ks"] == [1, 3]


def test_cli_ctrl_c_exits_130_and_keeps_rows(tmp_path, monkeypatch) -> None:
    calls = {"n": 0}

    def interrupted_generate(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 4:  # prompts 0 (warm-up) and 1 finished
            raise KeyboardInterrupt
        return generate(*args, **kwargs)

    monkeypatch.setattr(methods, "generate", interrupted_generate)
    argv = [
        "bench",
        *MOCK_CLI,
        "--prompts",
        "4",
        "--warmup",
        "1",
        "--max-new-tokens",
        "4",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 130
    art = _load(tmp_path / "bench_custom_k4_t0.8.json")
    assert art["complete"] is False and len(art["rows"]) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--config", "smoke", "-k", "0"], "K must be >= 1"),
        (
            ["bench", "--config", "smoke", "--prompts", "0"],
            "prompts must be an integer in [1, 128]",
        ),
        (
            ["bench", "--config", "smoke", "--prompts", "129"],
            "prompts must be an integer in [1, 128]",
        ),
        (["bench", "--config", "smoke", "--prompts", "2", "--warmup", "2"], "must be < prompts"),
        (["bench", "--config", "smoke", "--warmup", "-1"], "warmup must be an integer >= 0"),
        (["bench", "--config", "smoke", "-t", "-1"], "temperature must be"),
        (["bench", "--config", "smoke", "--top-p", "1.5"], "top_p must be in (0, 1]"),
        (["bench", "--config", "smoke", "--top-k", "0"], "top_k must be an integer >= 1"),
        (["bench", "--config", "smoke", "--min-p", "2"], "min_p must be in [0, 1]"),
        (["bench", "--config", "smoke", "--typical-p", "1.5"], "typical_p must be in (0, 1]"),
        (["bench", "--config", "smoke", "--typical-p", "0"], "typical_p must be in (0, 1]"),
        (
            ["bench", "--config", "smoke", "--max-new-tokens", "0"],
            "max_new_tokens must be an integer >= 1",
        ),
        (["bench", "--config", "nope"], "unknown config 'nope'"),
        (["bench"], "give --config NAME"),
        (["bench", "--draft", DRAFT_SPEC], "give both --draft and --target"),
        (["bench", "--config", "smoke", *MOCK_CLI], "already fixes the pair"),
        (["bench", "--draft", "gpt:x", "--target", TARGET_SPEC], "unknown backend 'gpt'"),
        (["bench", "--config", "smoke", "--tag", "a/b"], "--tag 'a/b'"),
        (["bench", "--config", "smoke", "--compare", "hf-assisted"], "must use the hf backend"),
        (["bench", "--config", "smoke", "--compare", "vllm"], "invalid choice: 'vllm'"),
        (["bench", "--config", "smoke", "-k", "two"], "expected an int >= 1, 'auto' or 'schedule'"),
        (["bench", "--config", "smoke", "--variants", "ngram:4"], "must be DRAFTER:K"),
        (
            ["bench", "--config", "smoke", "--category", "coding,nope"],
            "unknown prompt category 'nope'; choose from explanation, code_editing",
        ),
        (["sweep", "--config", "smoke", "--category", "poetry"], "unknown prompt category"),
        (
            ["bench", "--config", "smoke", "--category", "coding", "--prompts", "14"],
            "prompts (of categories coding) must be an integer in [1, 13], got 14",
        ),
        (["sweep", "--config", "smoke", "--k", "1,x"], "comma-separated integers"),
        (["sweep", "--config", "smoke", "--k", "0,2"], "every K must be an integer >= 1"),
    ],
)
def test_bad_flags_fail_fast_with_a_clear_message(argv, message, capsys) -> None:
    assert main(argv) != 0
    assert message in capsys.readouterr().err


def test_hf_assisted_refuses_a_non_hf_pair(models, tmp_path) -> None:
    with pytest.raises(ValueError, match="both models must use the hf backend"):
        _cfg(peers=Peers(compare="hf-assisted"))
    hf_assisted = Peers(compare="hf-assisted")
    cfg = BenchConfig("x", "hf:a", "hf:b", n_prompts=2, warmup=0, peers=hf_assisted)
    with pytest.raises(ValueError, match="transformers models"):
        run_bench(cfg, tmp_path, progress=False, models=models)  # mocks are not HFModels


def test_bench_config() -> None:
    c = bench_config("smoke", spec=SpecConfig("model", 2))
    assert (c.name, c.draft, c.target, c.spec.k) == ("smoke", *bench_settings.CONFIGS["smoke"], 2)
    assert bench_config(None, DRAFT_SPEC, TARGET_SPEC).name == "custom"
    assert bench_config("custom", DRAFT_SPEC, TARGET_SPEC).name == "custom"
    with pytest.raises(ValueError, match="custom"):
        bench_config("custom")


#: The artifact's config block as BenchConfig wrote it when its fields were flat (asdict): these
#: keys, in this order. present/ and the committed results read them.
OLD_CONFIG_KEYS = (
    "name, draft, target, k, temperature, top_k, top_p, n_prompts, warmup, max_new_tokens, "
    "compare, device, drafter, k_max, p_min, deterministic, variants, categories, endpoint, "
    "endpoint_baseline, endpoint_model, endpoint_api, llama_server, served"
).split(", ")


def test_the_config_block_is_flat_and_round_trips() -> None:
    cfg = BenchConfig(
        "all_gguf",
        "llamacpp:qwen2.5-coder-0.5b",
        "llamacpp:qwen2.5-coder-1.5b",
        spec=SpecConfig("prediction", "auto", k_max=12, p_min=0.25),
        warp=Warp(0.0, top_k=40, top_p=0.9),
        n_prompts=5,
        warmup=1,
        max_new_tokens=512,
        device="cpu",
        deterministic=True,
        variants=("lookup:auto", "wrong-prediction:auto"),
        categories=("rewrite",),
        peers=Peers(compare="llama-server", llama_server=("none", "ngram-mod"), served=True),
    )
    block = cfg.to_json()
    assert list(block) == OLD_CONFIG_KEYS
    assert block == {
        "name": "all_gguf",
        "draft": "llamacpp:qwen2.5-coder-0.5b",
        "target": "llamacpp:qwen2.5-coder-1.5b",
        "k": "auto",
        "temperature": 0.0,
        "top_k": 40,
        "top_p": 0.9,
        "n_prompts": 5,
        "warmup": 1,
        "max_new_tokens": 512,
        "compare": "llama-server",
        "device": "cpu",
        "drafter": "prediction",
        "k_max": 12,
        "p_min": 0.25,
        "deterministic": True,
        "variants": ("lookup:auto", "wrong-prediction:auto"),
        "categories": ("rewrite",),
        "endpoint": None,
        "endpoint_baseline": None,
        "endpoint_model": None,
        "endpoint_api": "chat",
        "llama_server": ("none", "ngram-mod"),
        "served": True,
    }
    assert BenchConfig.from_json(json.loads(json.dumps(block))) == cfg
    # every setting has one key, and the key names its field in the record that holds it
    later = {key for key, _ in bench_settings.LATER_WARP_KEYS}
    assert later == {"min_p", "typical_p"}  # Warp's fields past the first three
    assert {key for key, _ in bench_settings.CONFIG_KEYS} == set(OLD_CONFIG_KEYS) | later
    records = {"": BenchConfig, "spec": SpecConfig, "warp": Warp, "peers": Peers}
    for key, part in bench_settings.CONFIG_KEYS:
        assert key in {f.name for f in dataclasses.fields(records[part])}, (key, part)
    # a block from before a flag takes its default; what is no setting is refused
    assert BenchConfig.from_json({"name": "x", "draft": DRAFT_SPEC, "target": TARGET_SPEC}) == (
        BenchConfig("x", DRAFT_SPEC, TARGET_SPEC)
    )
    with pytest.raises(ValueError, match="not a bench setting: kk"):
        BenchConfig.from_json({**block, "kk": 1})


def test_warp_fields_without_an_old_key_are_written_when_set() -> None:
    """min_p and typical_p (Warp's fields the first artifacts had no key for) follow the old
    keys, only when set: a block without them ran with them off, and reads back so."""
    cfg = _cfg(warp=Warp(0.7, typical_p=0.9, min_p=0.05))
    block = cfg.to_json()
    assert list(block) == [*OLD_CONFIG_KEYS, "min_p", "typical_p"]
    assert (block["min_p"], block["typical_p"]) == (0.05, 0.9)
    assert BenchConfig.from_json(json.loads(json.dumps(block))) == cfg
    off = _cfg(warp=Warp(0.7, typical_p=0.9)).to_json()
    assert "min_p" not in off and off["typical_p"] == 0.9


def test_the_sampling_flags_are_warps_fields(tmp_path) -> None:
    """`specdec bench` and `specdec generate` have one flag per Warp field (cli.args), named
    after it: --min-p and --typical-p reach the bench's Warp, and the artifact."""
    from specdec.cli.bench import _config_from
    from specdec.cli.main import build_parser

    for command in (["bench", *MOCK_CLI], ["generate", "--target", TARGET_SPEC, "hi"]):
        args = build_parser().parse_args([*command, "--min-p", "0.05", "--typical-p", "0.9"])
        assert (args.min_p, args.typical_p) == (0.05, 0.9)
        for f in dataclasses.fields(Warp):
            assert hasattr(args, f.name), (command[0], f.name)
    args = build_parser().parse_args(["bench", *MOCK_CLI, "--typical-p", "0.9", "-t", "1"])
    cfg = _config_from(args, args.k, None)
    assert cfg.warp == Warp(1.0, typical_p=0.9)
    argv = ["--prompts", "2", "--warmup", "0", "--max-new-tokens", "4", "--out", str(tmp_path)]
    assert main(["bench", *MOCK_CLI, *argv, "-t", "1", "--typical-p", "0.9", "-k", "2"]) == 0
    (path,) = tmp_path.glob("bench_*.json")
    assert _load(path)["config"]["typical_p"] == 0.9


def test_the_committed_artifacts_config_blocks_read_back_byte_for_byte() -> None:
    """Every bench artifact committed (results/, the test fixtures): its config block, read into
    a BenchConfig and written again, is the same JSON, key for key."""
    root = Path(__file__).parents[1]
    paths = [*(root.parent / "results").rglob("bench_*.json"), *(root / "fixtures").rglob("*.json")]
    n = 0
    for path in paths:
        art = json.loads(path.read_text())
        if art.get("schema") != "specdec.bench/1":
            continue
        block = {k: v for k, v in art["config"].items() if k != "engines"}
        again = BenchConfig.from_json(art["config"]).to_json()
        assert json.dumps(again) == json.dumps(block), path
        n += 1
    assert n >= 4


def test_config_defaults_are_what_an_old_artifact_ran_with() -> None:
    """scripts/migrate_artifacts.py fills a key an artifact predates with its default."""
    assert bench_settings.config_defaults() == {
        "k": 4,
        "temperature": 0.8,
        "top_k": None,
        "top_p": None,
        "n_prompts": 30,
        "warmup": 2,
        "max_new_tokens": 128,
        "compare": None,
        "device": None,
        "drafter": "model",
        "k_max": None,
        "p_min": None,
        "deterministic": False,
        "variants": (),
        "categories": (),
        "endpoint": None,
        "endpoint_baseline": None,
        "endpoint_model": None,
        "endpoint_api": "chat",
        "llama_server": (),
        "served": False,
    }
    assert list(bench_settings.config_defaults()) == OLD_CONFIG_KEYS[3:]


def test_a_bench_names_its_drafter() -> None:
    with pytest.raises(ValueError, match="a bench names its drafter"):
        _cfg(spec=SpecConfig(k=2))  # drafter None: target-only, no speculative method


def test_the_latency_split_stacks_the_prefill_on_verify() -> None:
    """ms_per_token's "verify" is the target's passes, the prompt prefill included."""
    run = {"draft_s": 1.0, "verify_s": 2.0, "prefill_s": 0.5, "sampling_s": 0.25, "other_s": 0.1}
    split = runs.phase_seconds(run)
    assert split == {"draft": 1.0, "verify": 2.5, "sampling": 0.25, "other": 0.1}


def test_write_json_is_atomic_and_compact(tmp_path) -> None:
    path = tmp_path / "a" / "x.json"
    obj = {"tokens": [1, 2, 3], "nested": {"xs": [0.5, -1e-05]}, "s": "[1,\n 2]", "path": "p"}
    write_json(path, obj)
    text = path.read_text()
    assert "[1, 2, 3]" in text and "[0.5, -1e-05]" in text
    assert json.loads(text) == {k: v for k, v in obj.items() if k != "path"}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temp file left behind


# -------------------------------------------------------------------------- real models
@pytest.mark.model
def test_cli_smoke_config(tmp_path) -> None:
    argv = [
        "bench",
        "--config",
        "smoke",
        "--prompts",
        "2",
        "--warmup",
        "1",
        "-k",
        "2",
        "--max-new-tokens",
        "8",
        "--out",
        str(tmp_path),
        "--no-progress",
    ]
    assert main(argv) == 0
    art = _load(tmp_path / "bench_smoke_k2_t0.8.json")
    assert art["complete"] and len(art["rows"]) == 1
    models = art["models"]
    assert (models["draft"]["backend"], models["target"]["backend"]) == ("hf", "llamacpp")
    assert models["target"]["sha256"] == registry.MODELS["smollm2-135m"].sha256
    row = art["rows"][0]
    assert 1 <= row["speculative"]["generated"] <= 8 and row["prompt_tokens"] > 10


def test_hf_assisted_matches_our_greedy_baseline(smol_hf, tmp_path) -> None:
    """transformers' assisted generation, greedy, on the same prompt: the same tokens as our
    target-only baseline (both fp32 on the CPU; a near-tie in the logits could in principle
    flip an argmax between batch shapes, which this tiny case does not hit). The draft is a
    copy of the session's model (a module of its own: the method counts rounds and drafts with
    forward hooks on each), not a second load from the GGUF file."""
    import copy

    from specdec.backends.hf import HFModel

    draft = HFModel(copy.deepcopy(smol_hf.model), smol_hf.tokenizer, name=smol_hf.name)
    model_spec = "hf:smollm2-135m"
    cfg = bench_config(
        None,
        model_spec,
        model_spec,
        spec=SpecConfig("model", 3),
        warp=Warp(temperature=0.0),
        n_prompts=1,
        warmup=0,
        max_new_tokens=8,
        peers=Peers(compare="hf-assisted"),
    )
    art = run_bench(cfg, tmp_path, progress=False, models=(draft, smol_hf)).to_json()
    read(art)
    row = art["rows"][0]
    hf = row["hf_assisted"]
    assert hf["tokens"] == row["baseline"]["tokens"] == row["speculative"]["tokens"]
    assert hf["generated"] == len(hf["tokens"]) and hf["ttft_s"] is None
    # Same model on both sides: every draft is accepted, so K is honoured exactly.
    assert hf["acceptance_rate"] == 1.0 and hf["drafted"] == 6 and hf["rounds"] == 2
    agg = art["aggregates"]
    assert agg["hf_assisted"]["n"] == 1 and agg["speedup_hf_assisted"] > 0


def test_model_block_hashes_local_files(tmp_path) -> None:
    f = tmp_path / "m.gguf"
    f.write_bytes(b"not really a model")
    block = provenance.model_block(f"llamacpp:{f}", MockModel(V))
    assert block.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
    assert provenance.model_block(TARGET_SPEC, MockModel(V)).sha256 is None


def test_variants_and_categories_in_one_run(models, tmp_path) -> None:
    """Issue 5's comparison tables: several speculative methods on the same prompts, with
    speedups per prompt category, all from one interleaved run."""
    variants = ("lookup:auto", "model:2")
    cfg = _cfg(spec=SpecConfig("model", "auto"), variants=variants, n_prompts=4, warmup=1)
    art = run_bench(cfg, tmp_path, progress=False, models=models).to_json()
    read(art)
    assert art["variants"] == ["lookup-kauto", "model-k2"]
    for row in art["rows"]:
        assert set(row["variants"]) == {"lookup-kauto", "model-k2"}
        assert set(row["sequence"]) == {"baseline", "speculative", "lookup-kauto", "model-k2"}
    agg = art["aggregates"]
    for v in ("lookup-kauto", "model-k2"):
        runs = [r["variants"][v] for r in art["rows"]]
        mean = sum(r["tokens_per_s"] for r in runs) / len(runs)
        assert agg["variants"][v]["tok_s_mean"] == pytest.approx(mean)
        assert agg["variants"][v]["speedup"] == pytest.approx(mean / agg["baseline"]["tok_s_mean"])
    cats = agg["by_category"]
    assert set(cats) == {r["category"] for r in art["rows"]}
    for c, by_method in cats.items():
        assert by_method["baseline"]["speedup"] == pytest.approx(1.0)
        assert by_method["baseline"]["n"] == sum(r["category"] == c for r in art["rows"])
    assert "lookup-kauto" in format_table(art)


def test_category_filter_runs_the_first_prompts_of_those_categories(models, tmp_path) -> None:
    cats = ("reasoning", "coding")
    cfg = _cfg(categories=cats, n_prompts=4, warmup=1, max_new_tokens=4)
    art = run_bench(cfg, tmp_path, progress=False, models=models).to_json()
    on_disk = _load(tmp_path / "bench_mock_k3_t0.8_cat-reasoning-coding.json")  # not the full run's
    assert on_disk["config"]["categories"] == list(cats)
    want = [p.id for p in prompt_set.load_prompts() if p.category in cats][:4]  # file order
    assert [r["prompt_id"] for r in art["rows"]] == want[1:]  # after the warm-up prompt
    assert {r["category"] for r in art["rows"]} <= set(cats)
    assert set(art["aggregates"]["by_category"]) <= set(cats)
    # An artifact without the field (written before the filter existed) still validates.
    del on_disk["config"]["categories"]
    read(on_disk)
    with pytest.raises(ValueError, match="unknown prompt category 'poetry'; choose from"):
        _cfg(categories=("poetry",))


def test_cli_category_caps_the_default_prompt_count(tmp_path) -> None:
    from specdec.cli.bench import _config_from
    from specdec.cli.main import build_parser

    def cfg(*argv: str) -> BenchConfig:
        args = build_parser().parse_args(["bench", *MOCK_CLI, *argv])
        return _config_from(args, args.k, None)

    assert cfg().n_prompts == 30 and cfg().categories == ()
    c = cfg("--category", "coding, reasoning")  # 13 prompts each
    assert c.categories == ("coding", "reasoning") and c.n_prompts == 26
    assert cfg("--category", "howto").n_prompts == 12  # fewer than the default 30
    assert cfg("--category", "howto", "--prompts", "5").n_prompts == 5
    args = ["--category", "creative", "--prompts", "3", "--warmup", "1", "--max-new-tokens", "3"]
    assert main(["sweep", *MOCK_CLI, *args, "--k", "2", "--out", str(tmp_path)]) == 0
    summary = _load(tmp_path / "sweep_custom_t0.8_cat-creative.json")
    assert summary["config"]["categories"] == ["creative"]
    art = _load(tmp_path / summary["points"][0]["artifact"])
    assert {r["category"] for r in art["rows"]} == {"creative"}


@pytest.mark.model
def test_rewrite_tasks_with_the_prediction_drafter(smol_llamacpp, tmp_path) -> None:
    """The rewrite category end to end on a real model: each task's prediction (its original
    file) is tokenized with the target's tokenizer and drafted from; greedy output equals
    target-only (smollm2 is batch-invariant); the wrong-prediction leg gets another task's file
    and still reproduces target-only exactly. Fixed K, so drafting does not depend on timing
    (smollm2 is too small to copy a file: few drafts are accepted, and that is not tested)."""
    model_spec = "llamacpp:smollm2-135m"
    cfg = bench_config(
        None,
        model_spec,
        model_spec,
        spec=SpecConfig("prediction", 8),
        warp=Warp(temperature=0.0),
        categories=("rewrite",),
        n_prompts=2,
        warmup=0,
        max_new_tokens=48,
        variants=("lookup:8", "wrong-prediction:8"),
    )
    art = run_bench(cfg, tmp_path, progress=False, models=(smol_llamacpp, smol_llamacpp))
    rows = art.to_json()["rows"]
    assert [r["category"] for r in rows] == ["rewrite", "rewrite"]
    for r in rows:
        base = r["baseline"]["tokens"]
        assert r["speculative"]["tokens"] == base
        assert all(v["tokens"] == base for v in r["variants"].values())
    for method in ("speculative", "wrong-prediction-k8"):
        runs = [
            r["speculative"] if method == "speculative" else r["variants"][method] for r in rows
        ]
        drafted = [
            sum(v for s, v in run["drafted_by_source"].items() if "prediction" in s) for run in runs
        ]
        assert all(d > 0 for d in drafted), (method, drafted)
        assert all(
            run["accepted_prediction_tokens"] + run["rejected_prediction_tokens"] == d
            for run, d in zip(runs, drafted, strict=True)
        )


def test_cli_compare_llama_server_reads_its_modes_and_concurrency_plans_its_servers() -> None:
    """`bench --compare llama-server` takes --llama-server-modes (it once refused every mode
    before reading them); --concurrency C plans specdec's servers at --parallel 1 and C and
    each llama-server at -np C with C times the context."""
    from specdec.cli.bench import _config_from
    from specdec.cli.main import build_parser
    from specdec.study.run import together

    gguf = ["--draft", "llamacpp:smollm2-135m", "--target", "llamacpp:smollm2-135m"]
    argv = ["bench", *gguf, "--compare", "llama-server", "--llama-server-modes", "none,ngram-mod"]
    args = build_parser().parse_args([*argv, "--serve", "--drafter", "lookup", "-k", "auto"])
    cfg = _config_from(args, args.k, args.compare)
    assert cfg.peers.llama_server == ("none", "ngram-mod") and cfg.peers.served
    plan = together.servers(cfg, 4)
    names = [n for n, *_ in plan]
    assert names == ["served-p1", "served-p4", "served-lookup-p1", "served-lookup-p4",
                     "llama-server-np4", "llama-server-ngram-mod-np4"]  # fmt: skip
    assert plan[1][1].args[-2:] == ("--parallel", "4") and "-np" not in plan[1][1].command()
    assert [pred for *_, pred in plan] == [False] * 6  # --drafter lookup: no prediction sent
    args = build_parser().parse_args([*argv, "--serve", "--drafter", "prediction", "-k", "auto"])
    sent = {
        n: pred for n, _, pred in together.servers(_config_from(args, args.k, args.compare), 2)
    }  # the speculative method's requests alone
    assert sent == {"served-p1": False, "served-p2": False, "served-prediction-p1": True,
                    "served-prediction-p2": True, "llama-server-np2": False,
                    "llama-server-ngram-mod-np2": False}  # fmt: skip
    # the command as planned, with the binary named rather than looked up: no build is needed
    llama = dataclasses.replace(plan[-1][1], exe=Path("llama-server")).command()
    assert llama[llama.index("-np") + 1] == "4" and llama[llama.index("-c") + 1] == "16384"
    with pytest.raises(ValueError, match="multiple of it"):
        together.run_together(dataclasses.replace(cfg, n_prompts=6), 4, "/nonexistent")


def test_together_summary_counts_answers_equal_to_the_first_methods() -> None:
    from specdec.study.run.together import summarize

    def row(method: str, texts: list[str], tps: float) -> dict:
        reqs = [{"prompt_id": f"p{i}", "text": t, "wall_s": 1.0} for i, t in enumerate(texts)]
        return {"method": method, "repeat": 0, "group": 0, "errors": 0, "tokens_per_s": tps,
                "slowest_s": 2.0, "requests": reqs}  # fmt: skip

    rows = [row("a", ["x", "y"], 10.0), row("b", ["x", "z"], 40.0)]
    s = summarize(rows, ["a", "b"])
    assert s["a"]["same_answers"] == 2 and s["b"]["same_answers"] == 1
    assert s["b"]["tokens_per_s"] == 40.0 and s["b"]["answers"] == 2
