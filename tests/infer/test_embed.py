"""embed: the mean final hidden state over every window of a sequence, windows of all records batched together;
``ds4sci embed`` with --batch-size and --no-progress, and a bar only on a terminal."""
import numpy as np
import pytest
import torch

from ds4sci.data import FastaRecord
from ds4sci.infer.embed import embed_records


def _records(*sequences):
    return [FastaRecord(f"r{i}", "", s) for i, s in enumerate(sequences)]


def test_embed_is_mean_over_tokens(tiny):
    model, cfg, tok = tiny
    seq = "ACGTTGCA" * 5  # 40 tokens: two windows of the 32-token context
    ids = torch.from_numpy(tok.encode(seq))
    h1 = model(ids[None, :32], torch.arange(32)[None], return_hidden=True)[0]
    h2 = model(ids[None, 32:], torch.arange(8)[None], return_hidden=True)[0]
    expected = torch.cat([h1, h2]).mean(0).detach().numpy()
    # beside a short record, in every batching (a window padded at its end, windows of two records in one batch)
    for batch_size in (1, 2, 3, 8):
        names, got = embed_records(model, tok, _records(seq, "GATTACA"), batch_size=batch_size)
        assert names == ["r0", "r1"] and got.shape == (2, cfg.hidden_size)
        np.testing.assert_allclose(got[0], expected, rtol=1e-5, atol=1e-6)
        short = model(torch.from_numpy(tok.encode("GATTACA"))[None], torch.arange(7)[None], return_hidden=True)[0]
        np.testing.assert_allclose(got[1], short.mean(0).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="record 'r1': cannot embed an empty sequence"):
        embed_records(model, tok, _records("ACGT", ""))
    with pytest.raises(ValueError, match="no record to embed"):
        embed_records(model, tok, [])


def test_strided_embedding_takes_each_token_from_the_window_that_owns_it(tiny):
    model, cfg, tok = tiny
    seq = "ACGTTGCA" * 5  # 40 tokens; windows of 32 every 8: [0, 32) owns 0-31, [8, 40) owns 32-39
    ids = torch.from_numpy(tok.encode(seq))
    with torch.no_grad():
        h1 = model(ids[None, :32], torch.arange(32)[None], return_hidden=True)[0]
        h2 = model(ids[None, 8:], torch.arange(32)[None], return_hidden=True)[0, 24:]
        short = model(torch.from_numpy(tok.encode("GATTACA"))[None], torch.arange(7)[None], return_hidden=True)[0]
    names, got = embed_records(model, tok, _records(seq, "GATTACA"), stride=8, batch_size=3)
    np.testing.assert_allclose(got[0], torch.cat([h1, h2]).mean(0).numpy(), rtol=1e-5, atol=1e-6)
    # the second window's tokens 32-39 now see 24 tokens before them: a different embedding from stride 32's
    assert not np.allclose(got[0], embed_records(model, tok, _records(seq))[1][0], rtol=1e-3, atol=1e-4)
    for stride in (1, 8, 32):  # a record within one window: the same with any stride
        np.testing.assert_allclose(embed_records(model, tok, _records("GATTACA"), stride=stride)[1][0],
                                   short.mean(0).numpy(), rtol=1e-5, atol=1e-6)


def test_embed_cli_batch_size_and_progress(tiny, tmp_path, capsys, monkeypatch):
    import sys

    from ds4sci.cli import main
    from ds4sci.io.export import export_consolidated

    model, cfg, tok = tiny
    export = export_consolidated(model.state_dict(), cfg, tok, tmp_path / "export")
    fasta = tmp_path / "x.fa"
    fasta.write_text(">a\n" + "ACGT" * 20 + "\n>b\nGATTACA\n")
    arrays = {}
    for name, args in (("one", ["--batch-size", "1"]), ("eight", [])):
        out = tmp_path / f"{name}.npz"
        assert main(["embed", str(export), "--fasta", str(fasta), "--out", str(out), *args]) == 0
        assert "embed:" not in capsys.readouterr().err  # stderr is no terminal here: no bar
        arrays[name] = np.load(out)
    assert list(arrays["one"]["ids"]) == ["a", "b"]
    np.testing.assert_allclose(arrays["one"]["embeddings"], arrays["eight"]["embeddings"], rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # on a terminal: a bar, unless --no-progress
    assert main(["embed", str(export), "--fasta", str(fasta), "--out", str(tmp_path / "t.npz")]) == 0
    assert "embed: 100%" in capsys.readouterr().err
    assert main(["embed", str(export), "--fasta", str(fasta), "--out", str(tmp_path / "t.npz"), "--no-progress"]) == 0
    assert "embed:" not in capsys.readouterr().err
