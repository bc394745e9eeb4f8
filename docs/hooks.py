"""MkDocs hook: the reference pages that are read from the code at build time.

``reference/cli.md`` walks the ``ds4sci`` argument parsers (:func:`ds4sci.cli.build_parser`, every command, every
benchmark) and ``reference/config.md`` the training config dataclasses (:mod:`ds4sci.train.config`, the source of
``ds4sci train --print-config``). Nothing is copied into ``docs/``: an option or key added to the code appears on the
next build, and one without a help text stops the build (:func:`cli_page` raises), so ``make docs`` and
``tests/test_docs.py`` fail.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

GENERATED = ("reference/cli.md", "reference/config.md")


def _cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def option_rows(parser: argparse.ArgumentParser, name: str) -> list[str]:
    """One table row per argument of ``parser``; raises ``ValueError`` naming any argument without help."""
    rows, missing = [], []
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        flags = ", ".join(action.option_strings) or action.metavar or action.dest
        if not action.help:
            missing.append(flags)
            continue
        default = "" if action.default in (None, argparse.SUPPRESS) or not action.option_strings else action.default
        text = action.help % {"default": action.default} if "%(default)" in action.help else action.help
        rows.append(f"| `{_cell(flags)}` | {_cell(text)} | {'`' + _cell(default) + '`' if default != '' else ''} |")
    if missing:
        raise ValueError(f"{name}: options without a help text: {', '.join(missing)}")
    return rows


def cli_page() -> str:
    """Markdown for every command and option of ``ds4sci`` (raises ``ValueError`` on an option without help)."""
    from ds4sci.cli import build_parser

    lines = ["# Command line", "",
             "Generated from `ds4sci.cli.build_parser` when the site is built: every command, every option, its help "
             "and its default (`ds4sci COMMAND --help` prints the same).", ""]

    def walk(parser: argparse.ArgumentParser, name: str, depth: int) -> None:
        lines.extend([f"{'#' * depth} `{name}`", "", _cell(parser.description or ""), "",
                      "```text", parser.format_usage().strip(), "```", ""])
        rows = option_rows(parser, name)
        if rows:
            lines.extend(["| option | what | default |", "| --- | --- | --- |", *rows, ""])
        for sub, child in _subparsers(parser).items():
            walk(child, f"{name} {sub}", min(depth + 1, 4))

    walk(build_parser(), "ds4sci", 2)
    return "\n".join(lines)


def config_page() -> str:
    """Markdown for every training config key with its default and help, as ``--print-config`` shows them."""
    from ds4sci.train.config import Config

    cfg = Config()
    lines = ["# Training configuration", "",
             "Generated from the dataclasses of `ds4sci.train.config` when the site is built; `ds4sci train "
             "--print-config` prints the same keys as YAML. Set a key in the YAML file or with `--set "
             "section.key=value`; relative paths in a file are read from that file's folder.", ""]
    for section in dataclasses.fields(cfg):
        part = getattr(cfg, section.name)
        lines.extend([f"## `{section.name}`", "", _cell(section.metadata["help"]), "",
                      "| key | default | what |", "| --- | --- | --- |"])
        for f in dataclasses.fields(part):
            if not f.metadata.get("help"):
                raise ValueError(f"config key {section.name}.{f.name} has no help text")
            value = getattr(part, f.name)
            default = json.dumps(list(value) if isinstance(value, tuple) else value)
            lines.append(f"| `{section.name}.{f.name}` | `{_cell(default)}` | {_cell(f.metadata['help'])} |")
        lines.append("")
    return "\n".join(lines)


def api_source_tree() -> str:
    """A folder where ``ds4sci/`` holds the package and ``ds4sci/kernels``, ``ds4sci/models`` link to ``kernels/``
    and ``models/`` (setup.py's ``package_dir``), so mkdocstrings finds every public module by its import name."""
    root = Path(__file__).resolve().parents[1]
    tree = Path(tempfile.mkdtemp(prefix="ds4sci-api-")) / "ds4sci"
    tree.mkdir()
    for entry in (root / "ds4sci").iterdir():
        (tree / entry.name).symlink_to(entry)
    for name in ("kernels", "models"):
        (tree / name).symlink_to(root / name)
    return str(tree.parent)


@event_priority(100)  # before mkdocstrings' on_config builds its handlers
def on_config(config):
    config.plugins["mkdocstrings"].config["handlers"]["python"]["paths"] = [api_source_tree()]
    return config


def on_files(files, config):
    for uri, page in zip(GENERATED, (cli_page, config_page)):
        files.append(File.generated(config, uri, content=page()))
    return files
