"""MkDocs hook: the reference pages that are read from the code at build time.

``reference/cli.md`` walks the ``ds4sci`` argument parsers (:func:`ds4sci.cli.build_parser`, every command, every
benchmark) and ``reference/config.md`` the training config dataclasses (:mod:`ds4sci.train.config`, the source of
``ds4sci train --print-config``); ``reference/planner.md`` the terms of the planners' memory breakdowns
(``ds4sci plan``'s and ``ds4sci plan-evoformer``'s ``TERMS``, checked against the fields of
:class:`ds4sci.planning.genslm.Memory` and :class:`ds4sci.planning.evoformer.EvoformerMemory`). Nothing is copied
into ``docs/``: an option or key added to the code appears on the next build, and one without a help text (a
planner term without a description) stops the build (:func:`cli_page`, :func:`config_page`, :func:`planner_page`
raise), so ``make docs`` and ``tests/test_docs.py`` fail.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

GENERATED = ("reference/cli.md", "reference/config.md", "reference/planner.md")


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
    from ds4sci.cli_args import LazyParser

    lines = ["# Command line", "",
             "Generated from `ds4sci.cli.build_parser` when the site is built: every command, every option, its help "
             "and its default (`ds4sci COMMAND --help` prints the same).", ""]

    def walk(parser: argparse.ArgumentParser, name: str, depth: int) -> None:
        if isinstance(parser, LazyParser):
            parser.load()  # a benchmark's options are added when its module is imported
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


def term_rows(terms: dict[str, str], fields: list[str], name: str) -> list[str]:
    """One table row per term of a planner's breakdown (``terms``: name -> description) in the order of ``fields``
    (its dataclass's); raises ``ValueError`` naming every field without a description and every description of no
    field."""
    missing = [f for f in fields if not terms.get(f)]
    unknown = [t for t in terms if t not in fields]
    if missing or unknown:
        raise ValueError(f"{name}: terms without a description: {', '.join(missing) or 'none'}; described but not "
                         f"terms: {', '.join(unknown) or 'none'}")
    return [f"| `{f}` | {_cell(terms[f])} |" for f in fields]


def planner_page() -> str:
    """Markdown for the terms of both planners' memory breakdowns, each with what it stands for."""
    from ds4sci.commands import plan
    from ds4sci.commands import plan_evoformer
    from ds4sci.planning.evoformer import EvoformerMemory
    from ds4sci.planning.genslm import Memory

    genslm = {**plan.TERMS, "total": "the sum of the terms, counting the larger of a2a_staging and ring_buffers "
              "(alive one after the other within a layer)",
              "host_activations": "not on the GPU: the checkpointed inputs host offload keeps in host memory "
              "(activation_checkpointing.cpu); not in the total"}
    header = ["| term | what it is |", "| --- | --- |"]
    return "\n".join([
        "# The planners' terms", "",
        "Generated from `ds4sci.commands.plan.TERMS` and `ds4sci.commands.plan_evoformer.TERMS`, checked against the "
        "fields of `ds4sci.planning.genslm.Memory` and `ds4sci.planning.evoformer.EvoformerMemory` when the site is "
        "built: a term added to a planner without a description stops the build. Bytes per GPU; how each is counted "
        "and its source: [how the planners count](../explanation/planner.md); what to run: [pick a layout with the "
        "planner](../how-to/planner.md).", "",
        "## `ds4sci plan` (GenSLM)", "",
        "The memory of a layout by term, as `ds4sci plan` prints it (`Memory of layout #1 by term`) and `plan.json` "
        "records it.", "",
        *header, *term_rows(genslm, [f.name for f in dataclasses.fields(Memory)], "ds4sci plan"), "",
        "## `ds4sci plan-evoformer` (Evoformer and Pairformer trunks)", "",
        "The memory per GPU by term, the columns of the table `ds4sci plan-evoformer` prints.", "",
        *header, *term_rows(plan_evoformer.TERMS, [f.name for f in dataclasses.fields(EvoformerMemory)],
                            "ds4sci plan-evoformer"), ""])


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
    for uri, page in zip(GENERATED, (cli_page, config_page, planner_page)):
        files.append(File.generated(config, uri, content=page()))
    return files
