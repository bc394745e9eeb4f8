"""An export's config.json is untrusted input: each bad value is one ``ds4sci evaluate: error:`` line naming the file,
the key and the value, exit status 2, and a config that claims more than its weights hold (a billion layers) is
refused from the safetensors header before any layer is built."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from ds4sci.cli import main
from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.io.export import read_consolidated
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

from fork_checks import run_in_fork  # tests/ is on sys.path (its conftest.py)

FASTA = ">a\nACGTTGCAAGGCTTACACGTTG\n"


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A learned-position nucleotide export: 2 layers, hidden 64, MLP 256, 32 positions, 10 ids."""
    root = tmp_path_factory.mktemp("untrusted")
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32,
                              position_embedding="learned")
    (root / "x.fa").write_text(FASTA)
    return export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "export")


def _edited(export, tmp_path, **model):
    """A copy of ``export`` whose config.json has ``model``'s values under "model"."""
    out = shutil.copytree(export, tmp_path / "export")
    meta = json.loads((out / "config.json").read_text())
    meta["model"].update(model)
    (out / "config.json").write_text(json.dumps(meta))  # NaN and Infinity as Python's json writes them
    return out


def _evaluate_error(export, capsys) -> str:
    capsys.readouterr()
    assert main(["evaluate", str(export), "--fasta", str(export.parent.parent / "x.fa")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    return captured.err.strip()


@pytest.mark.parametrize("model, why", [
    ({"num_layers": 2.0}, "num_layers=2.0: expected an integer, got float"),
    ({"num_layers": 2.5}, "num_layers=2.5: expected an integer, got float"),
    ({"num_heads": True}, "num_heads=True: expected an integer, got bool"),
    ({"layer_norm_eps": float("nan")}, r"layer_norm_eps=nan: must be a finite number in (0, inf)"),
    ({"rotary_base": float("inf")}, r"rotary_base=inf: must be a finite number in (0, inf)"),
    ({"dropout": 1.5}, "dropout=1.5: must be a finite number in [0, 1]"),
    ({"hidden_size": 0}, "hidden_size=0: must be >= 1"),
    ({"num_heads": -4}, "num_heads=-4: must be >= 1"),
    ({"num_heads": 3}, "hidden_size=64 is not divisible by num_heads=3"),
    ({"position_embedding": "sinusoid"},
     "position_embedding='sinusoid': expected one of ('learned', 'rotary', 'alibi')"),
    ({"vocab_size": 11}, "vocab_size=11 but tokenizer.json has 10 ids"),
    # sizes the tensors contradict, read from the safetensors header
    ({"num_layers": 3}, "num_layers=3 but model.safetensors holds layers 0-1 (2 layers)"),
    ({"hidden_size": 128}, "hidden_size=128 but model.safetensors holds 'embed_in.weight' of shape (10, 64)"),
    ({"intermediate_size": 128},
     "intermediate_size=128 but model.safetensors holds 'layers.0.mlp.dense_h_to_4h.weight' of shape (256, 64)"),
    ({"max_position_embeddings": 10**12},
     "max_position_embeddings=1000000000000 but model.safetensors holds 'embed_pos.weight' of shape (32, 64)"),
])
def test_a_bad_config_value_is_one_error_line_naming_file_key_and_value(export, tmp_path, capsys, model, why):
    out = _edited(export, tmp_path, **model)
    assert _evaluate_error(out, capsys) == f"ds4sci evaluate: error: {out / 'config.json'}: {why}"


def test_a_vocabulary_the_embedding_does_not_have_is_refused(export, tmp_path, capsys):
    """Config and tokenizer agree (69 codon ids) but the tensors hold 10 rows; a rotary config for learned weights
    keeps a tensor the model would not have, a learned one for rotary weights lacks one."""
    out = _edited(export, tmp_path, vocab_size=69)
    CodonTokenizer().save(out / "tokenizer.json")
    assert _evaluate_error(out, capsys) == (f"ds4sci evaluate: error: {out / 'config.json'}: vocab_size=69 but "
                                            f"model.safetensors holds 'embed_in.weight' of shape (10, 64)")
    shutil.rmtree(out)
    out = _edited(export, tmp_path, position_embedding="rotary")
    assert "unexpected embed_pos.weight" in _evaluate_error(out, capsys)
    weights = GenSLM(GenSLMConfig.preset("debug", vocab_size=10)).state_dict()  # rotary: no embed_pos.weight
    export_consolidated(weights, GenSLMConfig.preset("debug", vocab_size=10), NucleotideTokenizer(), out)
    meta = json.loads((out / "config.json").read_text())
    meta["model"].update(position_embedding="learned", max_position_embeddings=10**12)
    (out / "config.json").write_text(json.dumps(meta))
    assert _evaluate_error(out, capsys) == (f"ds4sci evaluate: error: {out / 'config.json'}: position_embedding="
                                            f"'learned' but model.safetensors holds no tensor 'embed_pos.weight'")


def test_a_sharded_export_is_checked_across_its_shards(export, tmp_path):
    state = load_file(str(export / "model.safetensors"))
    cfg = GenSLMConfig.from_dict(json.loads((export / "config.json").read_text())["model"])
    out = export_consolidated(state, cfg, NucleotideTokenizer(), tmp_path / "sharded", max_shard_bytes=1)
    meta = json.loads((out / "config.json").read_text())
    meta["model"]["num_layers"] = 1
    (out / "config.json").write_text(json.dumps(meta))
    n = len(state)
    with pytest.raises(ValueError, match=rf"config.json: num_layers=1 but the shard set model-00001-of-{n:05d}."
                                         rf"safetensors .. model-{n:05d}-of-{n:05d}.safetensors holds layers 0-1 "
                                         r"\(2 layers\)$"):
        read_consolidated(out)


def _capped(argv: list[str]) -> int:
    """``ds4sci ARGV`` under an address-space cap of 1 GiB above what this process has mapped once the command's
    modules (and torch) are imported; prints the seconds from the command's start to its end."""
    import resource
    import time

    import ds4sci.commands.evaluate  # noqa: F401 - what the command imports: not timed
    import ds4sci.infer.evaluate  # noqa: F401
    import ds4sci.io.weights  # noqa: F401

    mapped = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 2**30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    start = time.perf_counter()
    code = main(argv)
    print(f"{time.perf_counter() - start:.3f}")
    return code


def test_a_billion_layers_are_refused_before_any_is_built(export, tmp_path):
    """Under an address-space cap of 1 GiB above what the process has mapped once the command's modules (and torch)
    are imported, which building layers would exhaust within seconds, the refusal comes at once (a lone process forked
    with torch imported: tests/fork_checks.py)."""
    out = _edited(export, tmp_path, num_layers=10**9)
    argv = ["evaluate", str(out), "--fasta", str(export.parent.parent / "x.fa")]
    run = run_in_fork(argv, os.getcwd(), main=_capped, env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert run.returncode == 2, run.stderr[-2000:]
    assert run.stderr == (f"ds4sci evaluate: error: {out / 'config.json'}: num_layers=1000000000 but "
                          f"model.safetensors holds layers 0-1 (2 layers)\n")
    assert float(run.stdout) < 5.0, run.stdout  # seconds from the command's start to its refusal


def test_a_huge_rotary_context_pads_windows_to_the_record_not_the_context(tmp_path, capsys):
    """No tensor bounds a rotary model's context: ``max_position_embeddings: 10**12`` evaluates a 22-base record
    with windows padded to its own length (padding to the context would ask numpy for terabytes), and the loss
    equals that of the same weights with a 32-token context."""
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    losses = []
    for context in (32, 10**12):
        cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=context)
        torch.manual_seed(0)
        out = export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, tmp_path / f"ctx{context}")
        (tmp_path / "x.fa").write_text(FASTA)
        assert main(["evaluate", str(out), "--fasta", str(tmp_path / "x.fa"), "--json"]) == 0
        losses.append(json.loads(capsys.readouterr().out)["loss"])
    assert losses[0] == losses[1]
