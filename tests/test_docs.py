"""The documentation site: ``mkdocs build --strict`` passes, and its generated references cover the code.

The strict build fails on a broken link, an unresolved API reference, a page left out of the navigation or a
docstring griffe cannot read; ``docs/hooks.py`` generates the command-line and config references from the parsers
and dataclasses, and refuses an option or key without a help text.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _hooks():
    spec = importlib.util.spec_from_file_location("ds4sci_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_strict_build(tmp_path):
    """One strict build (about a minute on 2 shared cores); the generated pages hold every command and key."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    config = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    api = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    assert "ds4sci bench layouts" in cli and "--print-config" in cli
    assert "parallel.ulysses" in config and "train.timeout_s" in config
    assert "evoformer_attention" in api and "MSARowAttentionWithPairBias" in api


def test_cli_reference_has_every_option():
    """Every option of every command (benchmarks included) is on the page, with its help."""
    from ds4sci.cli import build_parser
    from ds4sci.cli_args import LazyParser

    page = _hooks().cli_page()

    def walk(parser: argparse.ArgumentParser, name: str) -> int:
        assert f"`{name}`" in page, name
        if isinstance(parser, LazyParser):
            parser.load()  # a benchmark's options: its module imported
        count = 0
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                count += sum(walk(child, f"{name} {sub}") for sub, child in action.choices.items())
            elif action.option_strings and action.help not in (None, argparse.SUPPRESS) and action.dest != "help":
                assert f"`{', '.join(action.option_strings)}`" in page, (name, action.option_strings)
                count += 1
        return count

    assert walk(build_parser(), "ds4sci") > 100


def test_option_without_help_fails_the_build():
    parser = argparse.ArgumentParser(prog="ds4sci x")
    parser.add_argument("--documented", help="has help")
    parser.add_argument("--bare")
    with pytest.raises(ValueError, match=r"ds4sci x: options without a help text: --bare"):
        _hooks().option_rows(parser, "ds4sci x")


def test_config_reference_has_every_key():
    from ds4sci.train.config import Config
    from ds4sci.train.config import known_keys

    page = _hooks().config_page()
    cfg = Config()
    for key in known_keys():
        assert f"| `{key}` |" in page, key
    assert f"| `train.steps` | `{cfg.train.steps}` |" in page


def test_planner_reference_has_every_term(monkeypatch):
    """Every term of both planners' breakdowns is on the page with its description; a term added to the dataclass
    without one (or a description of no term) stops the build, naming it."""
    import dataclasses

    from ds4sci.commands import plan_evoformer
    from ds4sci.planning.evoformer import EvoformerMemory
    from ds4sci.planning.genslm import Memory

    hooks = _hooks()
    page = hooks.planner_page()
    for cls in (Memory, EvoformerMemory):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` | " in page, (cls.__name__, f.name)
    terms = dict(plan_evoformer.TERMS)
    del terms["exit"]
    terms["spill"] = "a term of no field"
    monkeypatch.setattr(plan_evoformer, "TERMS", terms)
    with pytest.raises(ValueError, match=r"ds4sci plan-evoformer: terms without a description: exit; described but "
                                         r"not terms: spill"):
        hooks.planner_page()
