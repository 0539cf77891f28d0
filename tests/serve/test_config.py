"""A server setting is declared once (serve.config.setting): the `specdec serve` parser, the
config's checks and the engine's settings derive from it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from specdec.backends.mock import MockModel
from specdec.cli import serve as cli_serve
from specdec.serve.config import ServeConfig, settings
from specdec.serve.engine import Engine


def _parser() -> argparse.ArgumentParser:
    """`specdec serve`'s parser."""
    sub = argparse.ArgumentParser().add_subparsers()
    cli_serve.add(sub)
    return sub.choices["serve"]


def _config(*argv: str) -> ServeConfig:
    """The config `specdec serve ARGV` would serve with (no key files given)."""
    args = _parser().parse_args(["--target", "mock:vocab=8", *argv])
    built: list[ServeConfig] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli_serve, "serve", lambda cfg: built.append(cfg) or 0)
        mp.delenv("SPECDEC_API_KEY", raising=False)
        assert args.func(args) == 0
    return built[0]


def test_every_declared_setting_is_a_flag_whose_default_is_the_fields() -> None:
    """No flag states a default of its own: parsing no flags gives ServeConfig's defaults."""
    assert _config() == ServeConfig(target="mock:vocab=8")
    flags = {o for a in _parser()._actions for o in a.option_strings}
    for f, s in settings():
        if s.cli:
            assert s.flag(f.name) in flags, f.name
            assert s.help and "(" in s.help, f"{f.name}: the help states type and default"


@pytest.mark.parametrize(
    ("argv", "field", "value"),
    [
        (["-np", "3"], "parallel", 3),
        (["--ctx-size", "64"], "ctx_size", 64),
        (["-k", "schedule"], "k", "schedule"),
        (["--draft", "None"], "draft", None),
        (["--no-prompt-cache"], "prompt_cache", False),
        (["--prompt-cache"], "prompt_cache", True),
        (["--allowed-host", "a", "--allowed-host", "b"], "allowed_hosts", ("a", "b")),
        (["--prefill-share", "0.5"], "prefill_share", 0.5),
        (["--draft-pool", "shared"], "draft_pool", "shared"),
        (["--deterministic"], "deterministic", True),
    ],
)
def test_a_flag_sets_its_field(argv: list[str], field: str, value: object) -> None:
    assert getattr(_config(*argv), field) == value


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"parallel": 0}, "--parallel must be >= 1, got 0"),
        ({"ctx_size": 8}, "--ctx-size must be >= 16, got 8"),
        ({"port": 70000}, "--port must be <= 65535"),
        ({"request_timeout": 0.0}, "--request-timeout must be > 0"),
        ({"cache_ram": -1}, "--cache-ram must be >= 0"),
        ({"draft_pool": "Key"}, "--draft-pool must be one of key, shared, off"),
        ({"threads": 0}, "--threads must be >= 1"),
        ({"k": 0}, "k"),
        ({"p_min": 1.0}, "p_min"),
    ],
)
def test_a_config_built_in_code_is_held_to_the_flags_rules(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(target="m", **kw)


def test_the_engine_takes_its_settings_from_the_one_record() -> None:
    cfg = ServeConfig(target="served-name", parallel=2, max_queue=5, prompt_cache=False,
                      max_running_per_key=1, prefill_share=0.25, k=3, drafter="lookup")  # fmt: skip
    engine = Engine(MockModel(16, seed=0), None, cfg)
    assert engine.models.model_id == "served-name"
    assert (engine.parallel, engine.max_queue) == (2, 5)
    assert engine.cycle.running_per_key == 1 and engine.cycle.prefill_share == 0.25
    assert not engine.cycle.prompt_cache and engine.cycle._store is None
    assert engine.models.defaults.config == cfg.spec_config()
    on = Engine(MockModel(16, seed=0), None, dataclasses.replace(cfg, prompt_cache=None))
    assert on.cycle.prompt_cache and on.cycle._store is not None  # the mock is batch-invariant
