"""embed --layer K (block K's output, 0 the embeddings, default the final norm) and --per-token (every token's
float32 state, one .npz member per record id, written record by record); --ulysses/--ring refused without a launch
that fits them."""
import argparse

import numpy as np
import pytest
import torch

from ds4sci.cli import main
from ds4sci.cli_args import CommandError
from ds4sci.cli_args import check_parallel
from ds4sci.data import FastaRecord
from ds4sci.infer.embed import embed_records
from ds4sci.infer.embed import save_token_embeddings
from ds4sci.infer.embed import token_embeddings

SEQ = "ACGTTGCA" * 5  # 40 tokens: windows [0, 32) and, with stride 8, [8, 40) owning tokens 32-39


def _records(*sequences):
    return [FastaRecord(f"r{i}", "", s) for i, s in enumerate(sequences)]


def _manual_states(model, ids: torch.Tensor, positions: torch.Tensor, layer):
    """``[T, hidden]`` by hand: embeddings, then ``layer`` blocks (all and the final norm when None)."""
    with torch.no_grad():
        x = model.embed_in(ids[None]) + model.embed_pos(positions[None])
        for block in model.layers[: layer]:
            x = block(x, positions[None], None)
        return (x if layer is not None else model.final_layer_norm(x))[0]


def _window_states(model, tok, layer):
    """The states each token of SEQ gets from the window that owns it (seq_len 32, stride 8)."""
    ids = torch.from_numpy(tok.encode(SEQ))
    first = _manual_states(model, ids[:32], torch.arange(32), layer)
    second = _manual_states(model, ids[8:], torch.arange(32), layer)[24:]
    return torch.cat([first, second]).numpy()


@pytest.mark.parametrize("layer", [0, 1, 2, None])
def test_layer_is_the_output_of_that_block(tiny, layer):
    model, cfg, tok = tiny
    want = _window_states(model, tok, layer)  # [40, hidden]
    names, got = embed_records(model, tok, _records(SEQ), stride=8, batch_size=3, layer=layer)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got[0], want.mean(0), rtol=1e-5, atol=1e-6)
    (name, states), = token_embeddings(model, tok, _records(SEQ), stride=8, batch_size=1, layer=layer)
    assert name == "r0" and states.dtype == np.float32 and states.shape == (40, cfg.hidden_size)
    np.testing.assert_allclose(states, want, rtol=1e-5, atol=1e-6)
    if layer is not None:  # the layers differ from each other and from the final norm
        assert not np.allclose(want, _window_states(model, tok, None), atol=1e-3)
    with pytest.raises(ValueError, match=r"stop_after=3 must be a block index in 0\.\.2"):
        model(torch.zeros(1, 4, dtype=torch.long), torch.arange(4)[None], stop_after=3)


def test_per_token_file_is_written_record_by_record(tiny, tmp_path):
    model, cfg, tok = tiny
    path = tmp_path / "tokens.npz"
    sizes = []

    def watched(items):
        for item in items:  # the writer must have put the previous record in the file before it asks for this one
            sizes.append(path.stat().st_size)
            yield item

    records = _records(SEQ, "GATTACA", "ACGT" * 30)
    expected = dict(token_embeddings(model, tok, records, stride=8))
    assert save_token_embeddings(path, watched(token_embeddings(model, tok, records, stride=8))) == 3
    # each record's float32 array [tokens, hidden] (40 * 64 * 4 bytes for the first) lands before the next is read
    assert sizes[1] - sizes[0] >= 40 * cfg.hidden_size * 4 and sizes[2] - sizes[1] >= 7 * cfg.hidden_size * 4
    with np.load(path) as arrays:
        assert list(arrays.keys()) == ["r0", "r1", "r2"]
        for key, value in expected.items():
            assert arrays[key].dtype == np.float32 and arrays[key].shape == (len(records[int(key[1])].sequence), 64)
            np.testing.assert_array_equal(arrays[key], value)
    with pytest.raises(ValueError, match="record id 'x' appears twice"):
        save_token_embeddings(tmp_path / "dup.npz", [("x", expected["r0"]), ("x", expected["r1"])])


def test_duplicate_ids_are_refused(tiny):
    model, cfg, tok = tiny
    twice = [FastaRecord("a", "", "ACGT"), FastaRecord("b", "", "GG"), FastaRecord("a", "", "TTT")]
    with pytest.raises(ValueError, match="record id 'a' appears twice"):
        embed_records(model, tok, twice)
    with pytest.raises(ValueError, match="record id 'a' appears twice"):
        list(token_embeddings(model, tok, twice))


def test_embed_cli_layer_and_per_token(tiny, tmp_path, capsys):
    from ds4sci.io.export import export_consolidated

    model, cfg, tok = tiny
    export = export_consolidated(model.state_dict(), cfg, tok, tmp_path / "export")
    fasta = tmp_path / "x.fa"
    fasta.write_text(f">a\n{SEQ}\n>b\nGATTACA\n")
    common = ["embed", str(export), "--fasta", str(fasta), "--stride", "8"]
    assert main([*common, "--layer", "1", "--per-token", "--out", str(tmp_path / "t.npz")]) == 0
    assert main([*common, "--layer", "1", "--out", str(tmp_path / "m.npz")]) == 0
    with np.load(tmp_path / "t.npz") as tokens, np.load(tmp_path / "m.npz") as means:
        assert list(tokens.keys()) == ["a", "b"] and list(means["ids"]) == ["a", "b"]
        np.testing.assert_allclose(tokens["a"], _window_states(model, tok, 1), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(means["embeddings"], [tokens["a"].mean(0), tokens["b"].mean(0)], rtol=1e-5,
                                   atol=1e-6)
    capsys.readouterr()
    assert main([*common, "--layer", "3", "--out", str(tmp_path / "x.npz")]) == 2
    assert "ds4sci embed: error: --layer 3: the model has blocks 0..2 (0: the embeddings)" in capsys.readouterr().err
    assert main([*common, "--ulysses", "2", "--out", str(tmp_path / "x.npz")]) == 2
    assert ("--ulysses 2 x --ring 1 = 2 sequence ranks do not divide the 1 process(es) of this launch: run it under "
            "torchrun --nproc-per-node with a multiple of that") in capsys.readouterr().err


def test_parallel_degrees_are_checked_against_the_launch_and_the_heads():
    class Config:
        num_heads = 4

    check_parallel(argparse.Namespace(ulysses=2, ring=3), Config, 12)
    with pytest.raises(CommandError, match=r"--ulysses 2 x --ring 2 = 4 sequence ranks do not divide the 6 "
                                           r"process\(es\) of this launch: launch a multiple of 4 processes"):
        check_parallel(argparse.Namespace(ulysses=2, ring=2), Config, 6)
    with pytest.raises(CommandError, match="--ulysses 3 must divide the model's 4 attention heads"):
        check_parallel(argparse.Namespace(ulysses=3, ring=1), Config, 3)
