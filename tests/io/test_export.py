"""The export writer streams tensors into safetensors shards (Hugging Face's index convention past a size) and the
readers (read_consolidated, ds4sci.load_model) take either form; a model read back gives the same logits."""
import json

import pytest
import torch

from ds4sci.data import Tokenizer
from ds4sci.io.export import INDEX
from ds4sci.io.export import ExportWriter
from ds4sci.io.export import export_consolidated
from ds4sci.io.export import read_consolidated
from ds4sci.io.weights import load_model
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

TOK = Tokenizer.from_name("nucleotide")
CFG = GenSLMConfig.preset("debug", vocab_size=TOK.vocab_size, pad_token_id=TOK.pad_id)


def _state():
    torch.manual_seed(0)
    return GenSLM(CFG).state_dict()


def test_sharded_export_reads_back_like_one_file(tmp_path):
    state = _state()
    largest = max(v.numel() * 4 for v in state.values())
    writer = ExportWriter(tmp_path / "sharded", CFG, TOK, max_shard_bytes=largest)
    for name, tensor in state.items():
        writer.add(name, tensor)
        assert writer.pending_bytes <= largest  # never more than one shard held
    out = writer.close()
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    index = json.loads((out / INDEX).read_text())
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert set(index["weight_map"]) == set(state) and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(v.numel() * 4 for v in state.values())
    back, config, tok = read_consolidated(out)
    assert config == CFG and tok.kind == "nucleotide" and back.keys() == state.keys()
    assert all(torch.equal(back[k], state[k]) for k in state)
    single = export_consolidated(state, CFG, TOK, tmp_path / "single")
    assert [p.name for p in single.glob("model*")] == ["model.safetensors"] and not (single / INDEX).exists()
    ids = torch.randint(0, TOK.vocab_size, (1, 12))
    pos = torch.arange(12)[None]
    assert torch.equal(load_model(out)[0](ids, pos), load_model(single)[0](ids, pos))
    with pytest.raises(ValueError, match="tensor 'embed_in.weight' was already added to this export"):
        writer.add("embed_in.weight", state["embed_in.weight"])
    # a new export into the sharded folder replaces it whole: no stale shard or index is left to be read
    export_consolidated(state, CFG, TOK, out)
    assert [p.name for p in out.glob("model*")] == ["model.safetensors"] and not (out / INDEX).exists()


def test_a_missing_or_truncated_shard_is_named(tmp_path):
    out = export_consolidated(_state(), CFG, TOK, tmp_path / "ex", max_shard_bytes=1)  # one tensor per shard
    shards = sorted(out.glob("model-*.safetensors"))
    shards[1].write_bytes(shards[1].read_bytes()[:50])
    with pytest.raises(ValueError, match=rf"{shards[1].name}: cannot be read, truncated or corrupt"):
        read_consolidated(out)
    shards[2].unlink()
    with pytest.raises(FileNotFoundError, match=rf"{shards[2].name} is missing \(named by {INDEX}\)"):
        read_consolidated(out)


def test_export_loading_names_the_missing_truncated_or_mismatched_file(tmp_path):
    export = export_consolidated(_state(), CFG, TOK, tmp_path / "export")
    assert load_model(export)[1] == CFG
    meta = json.loads((export / "config.json").read_text())
    meta["model"]["num_layers"] = CFG.num_layers + 1
    (export / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"config.json: num_layers={CFG.num_layers + 1} but model.safetensors holds "
                                         rf"layers 0-{CFG.num_layers - 1} \({CFG.num_layers} layers\)"):
        load_model(export)
    weights = export / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"model.safetensors: cannot be read, truncated or corrupt"):
        load_model(export)
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors is missing"):
        load_model(export)


def test_export_round_trip_same_logits(tmp_path):
    torch.manual_seed(0)
    cfg = GenSLMConfig.preset("debug", vocab_size=TOK.vocab_size, max_position_embeddings=32,
                              position_embedding="learned")
    model = GenSLM(cfg).eval()
    export_consolidated(model.state_dict(), cfg, TOK, tmp_path / "ex")
    again, cfg2, tok2 = load_model(tmp_path / "ex")
    ids = torch.randint(5, 9, (2, 16))
    pos = torch.arange(16).expand(2, 16)
    torch.testing.assert_close(again(ids, pos), model(ids, pos), rtol=0, atol=0)
    assert cfg2 == cfg and tok2.vocab == TOK.vocab
    (tmp_path / "ex" / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json is missing"):
        load_model(tmp_path / "ex")


@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_export_files_follow_the_umask(tmp_path, umask):
    """safetensors writes 0600; every file of an export (both writers, one shard or several) is 0666 & ~umask."""
    import os

    from ds4sci.io.export_hf import export_hf

    old = os.umask(umask)
    try:
        src = export_consolidated(_state(), CFG, TOK, tmp_path / "one")
        sharded = export_consolidated(_state(), CFG, TOK, tmp_path / "sharded", max_shard_bytes=4096)
        hf = export_hf(src, tmp_path / "hf")
    finally:
        os.umask(old)
    files = [p for d in (src, sharded, hf) for p in d.iterdir()]
    assert len(list(sharded.glob("model-*.safetensors"))) > 1 and any(p.parent == hf for p in files)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
