"""``ds4sci plan``'s wording: the header names the preset's real parameter count (GenSLM's listed shapes with
GPT-NeoX's 4x MLP), ``--preset``'s help lists every count, and counts are pluralised."""
import pytest

from ds4sci import cli
from ds4sci.models.genslm.config import PRESETS
from ds4sci.models.genslm.config import GenSLMConfig
from ds4sci.models.genslm.config import describe_preset
from ds4sci.models.genslm.config import describe_presets

from cli_checks import refused  # tests/ is on sys.path (its conftest.py)


def _billions(name: str) -> str:
    return f"{GenSLMConfig.preset(name).num_parameters() / 1e9:.3g}B"


def test_header_names_the_real_count_of_the_25b_shape(capsys):
    assert cli.main(["plan", "--preset", "25B", "--top", "1"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert header.startswith("# plan: GenSLM's 25B shape (hidden 8192, 64 layers, 64 heads): ")
    assert f"{_billions('25B')} parameters with GPT-NeoX's 4x MLP, not 25B" in header
    assert _billions("25B") != "25B"


@pytest.mark.parametrize("name", PRESETS)
def test_describe_preset_explains_only_the_counts_unlike_their_names(name):
    text = describe_preset(name)
    assert ("not " + name in text) == (name in ("250M", "2.5B", "25B"))
    assert f"{GenSLMConfig.preset(name).hidden_size}," in text


def test_preset_help_lists_every_real_count():
    text = describe_presets()
    assert all(f'"{name}"' in text for name in PRESETS)
    assert f'"2.5B" ({_billions("2.5B")})' in text and "250M, 2.5B and 25B count more than their names" in text


def test_one_layout_is_singular(capsys):
    # debug at 8K on one GPU: pin every choice but the checkpointing mode none, so exactly one layout remains
    argv = ["plan", "--preset", "debug", "--seq-len", "8192", "--gpus-per-node", "1", "--zero-stage", "0",
            "--offload", "none", "--checkpointing", "none"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "\n1 layout fits (GiB: total per GPU" in out and "layouts fit" not in out


def test_errors_pluralise_layers(capsys):
    argv = ["plan", "--preset", "debug", "--set", "model.overrides.num_layers=1", "--pp", "2", "--gpus-per-node", "2"]
    assert "--pp=2: the model has only 1 layer\n" in refused(capsys, argv)


def test_plan_fits_120_columns_and_keeps_every_number(capsys):
    """A wide plan (25B on 64 GPUs: offload names, long step times) prints no line over 120 characters, and each
    listed layout's memory terms, total, bytes sent and time all appear in its two rows."""
    from ds4sci.commands.plan import markdown_rows
    from ds4sci.commands.plan import memory_rows

    assert cli.main(["plan", "--preset", "25B", "--seq-len", "65536", "--nodes", "8", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 120, out
    layouts = [line for line in out.splitlines() if line.startswith("| 1 |")]
    assert len(layouts) == 2  # layout #1 in the layout table and in the memory table
    cells = [cell.strip() for line in layouts for cell in line.strip("|").split("|")]
    assert len(cells) == len(markdown_rows([])[0]) + len(memory_rows([])[0]) == 27
