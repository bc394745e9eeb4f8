"""Fine-tuning from existing weights (``model.init_from``) and ``ds4sci.load_model``: ds4sci exports, Hugging Face
GPT-NeoX directories written by transformers, GenSLM-style Lightning checkpoints, and every refusal naming its cause."""
import json
import pathlib
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ds4sci
from ds4sci.cli import main
from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.infer.evaluate import windows
from ds4sci.io.export import export_consolidated
from ds4sci.io.weights import load_into
from ds4sci.io.weights import load_weights
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import lm_loss
from ds4sci.train.config import load_config
from ds4sci.train.init_from import initial_model

from fork_checks import run_in_fork  # tests/ is on sys.path (its conftest.py)

ROOT = Path(__file__).resolve().parents[2]
CDS = ROOT / "examples" / "data" / "NZ_CP040672.1_cds_100.fna"
SEQ = 64
ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # added to this process's in the trainings' processes
# GenSLM's architecture file layout (its GPT-NeoX config.json, old key names), at a tiny size
GENSLM_ARCH = {
    "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "vocab_size": 69, "hidden_size": 32,
    "num_attention_heads": 4, "num_hidden_layers": 2, "intermediate_size": 128, "max_position_embeddings": 128,
    "hidden_act": "gelu_fast", "rotary_pct": 0.5, "rotary_emb_base": 500, "layer_norm_eps": 1e-5,
    "tie_word_embeddings": False, "use_parallel_residual": True, "torch_dtype": "float32",
}


class Opaque:
    """Any class a safe load must refuse to construct."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A learned-position nucleotide GenSLM trained a few Adam steps on CDS windows, exported; with its mean loss on
    those windows and a fresh model's."""
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=SEQ,
                              position_embedding="learned")
    data = windows(cfg, tok, str(CDS))
    batch = {k: torch.stack([data[i][k] for i in range(32)]) for k in ("input_ids", "position_ids")}

    def loss(model):
        with torch.no_grad():
            return lm_loss(model(batch["input_ids"], batch["position_ids"]), batch["input_ids"]).item()

    torch.manual_seed(0)
    model = GenSLM(cfg)
    fresh = loss(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(10):
        rows = slice(8 * (step % 4), 8 * (step % 4) + 8)
        lm_loss(model(batch["input_ids"][rows], batch["position_ids"][rows]), batch["input_ids"][rows]).backward()
        opt.step()
        opt.zero_grad()
    out = tmp_path_factory.mktemp("trained") / "export"
    export_consolidated(model.state_dict(), cfg, tok, out)
    return out, loss(model.eval()), fresh


def _hf_model(arch=GENSLM_ARCH, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig.from_dict(arch)).eval()
    with torch.no_grad():
        for p in hf.parameters():  # non-trivial values everywhere (biases and norms too)
            p.add_(0.05 * torch.randn_like(p))
    return hf


def _same_logits(model, hf):
    ids = torch.randint(5, 69, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(ids, torch.arange(24).expand(2, 24)), hf(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # a training through the command line (in a forked process: tests/fork_checks.py)
def test_fine_tune_from_an_export_through_the_cli(trained, tmp_path):
    """The run starts where the export stopped (its first loss is the export's, far below a fresh model's) and,
    at a negligible learning rate, exports the same weights again, learned position table included."""
    export, trained_loss, fresh_loss = trained
    out = tmp_path / "ft"
    sets = [f"data.fasta={CDS}", "data.split=region", f"data.seq_len={SEQ}", "train.steps=1", "train.log_every=1",
            "train.micro_batch_size=8", "train.eval_batches=1", "train.progress=false", f"train.out_dir={out}",
            "optim.lr=1e-9", "optim.min_lr=0", "optim.warmup_steps=0", "optim.weight_decay=0",
            f"model.init_from={export}"]
    run = run_in_fork(["train", *[a for s in sets for a in ("--set", s)]], tmp_path, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    first = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1 and abs(first["loss"] - trained_loss) < 0.1, (first, trained_loss)
    assert json.loads((out / "export" / "config.json").read_text())["trained_length"] == SEQ  # data.seq_len
    assert fresh_loss - first["loss"] > 0.5, (first, fresh_loss)
    before, after = load_file(str(export / "model.safetensors")), load_file(str(out / "export" / "model.safetensors"))
    assert set(before) == set(after) and "embed_pos.weight" in after
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_hugging_face_gpt_neox_directory(layout, tmp_path):
    hf = _hf_model()
    hf.save_pretrained(tmp_path, max_shard_size="40KB" if layout == "sharded" else "5GB")
    if layout == "sharded":
        assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
    if layout == "bin":  # transformers 5 writes safetensors only; < 5 wrote the state dict's pickle under this name
        (tmp_path / "model.safetensors").unlink()
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model, config, tokenizer = ds4sci.load_model(tmp_path)
    assert tokenizer.kind == "codon" and not model.training
    assert (config.hidden_size, config.rotary_pct, config.rotary_base) == (32, 0.5, 500.0)
    _same_logits(model, hf)
    # a Hugging Face tokenizer.json beside the weights must map tokens to GenSLM's ids
    vocab = {t: i for i, t in enumerate(CodonTokenizer().vocab)}
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}))
    ds4sci.load_model(tmp_path)
    vocab["GGC"], vocab["GCC"] = vocab["GCC"], vocab["GGC"]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": vocab}}))
    with pytest.raises(ValueError, match="token -> id map differs from ds4sci's codon tokenizer"):
        ds4sci.load_model(tmp_path)


def test_genslm_lightning_checkpoint(tmp_path):
    """GenSLM's layout: the GPT-NeoX model as the LightningModule's ``model``, its architecture in the
    hyper-parameters beside pathlib paths (which a safe load accepts), other Lightning state around it."""
    hf = _hf_model()
    ckpt = {"state_dict": {f"model.{k}": v for k, v in hf.state_dict().items()}, "epoch": 1, "global_step": 10,
            "hyper_parameters": {"model_architecture": GENSLM_ARCH, "tokenizer_file": pathlib.Path("/x/codon.json")}}
    torch.save(ckpt, tmp_path / "genslm.pt")
    model, config, tokenizer = ds4sci.load_model(tmp_path / "genslm.pt")
    assert tokenizer.kind == "codon" and config.num_layers == 2
    _same_logits(model, hf)
    # a bare GPT-NeoX state dict keeps no config: the weights load into a model built from preset / overrides
    torch.save(hf.state_dict(), tmp_path / "bare.bin")
    state, config, kind = load_weights(tmp_path / "bare.bin")
    assert config is None and kind == "codon" and "embed_in.weight" in state
    with pytest.raises(ValueError, match="keeps no model config"):
        ds4sci.load_model(tmp_path / "bare.bin")
    over = ("{hidden_size: 32, num_heads: 4, num_layers: 2, intermediate_size: 128, rotary_pct: 0.5, rotary_base: 500, "
            "activation: gelu_tanh}")
    cfg = load_config(None, [f"model.init_from={tmp_path / 'bare.bin'}", "data.tokenizer=codon", "data.seq_len=64",
                             f"model.overrides={over}"])
    _same_logits(initial_model(cfg, CodonTokenizer()).eval(), hf)


def test_hugging_face_configs_are_checked_before_any_layer_is_built(tmp_path, capsys):
    """A GPT-NeoX config.json's values are checked under its own key names, and against the tensors' shapes (from
    the safetensors header, or a PyTorch file's memory-mapped tensors) before a model is built; a GenSLM
    checkpoint's hyper-parameters likewise. Each refusal is one error line."""
    hf = _hf_model()
    hf.save_pretrained(tmp_path)
    config = tmp_path / "config.json"
    arch = json.loads(config.read_text())
    cases = [
        ({"num_hidden_layers": 3}, "num_hidden_layers=3 but model.safetensors holds layers 0-1 (2 layers)"),
        ({"vocab_size": 10}, "vocab_size=10 but model.safetensors holds 'embed_in.weight' of shape (69, 32)"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers=2.5: expected an integer, got float"),
        ({"num_attention_heads": 0}, "num_attention_heads=0: must be >= 1"),
        ({"layer_norm_eps": float("nan")}, "layer_norm_eps=nan: must be a finite number in (0, inf)"),
        ({"rope_parameters": {**arch["rope_parameters"], "partial_rotary_factor": 2}},
         "rope_parameters.partial_rotary_factor=2: must be a finite number in [0, 1]"),
    ]
    capsys.readouterr()  # save_pretrained's progress bar
    for edit, why in cases:
        config.write_text(json.dumps({**arch, **edit}))
        assert main(["evaluate", str(tmp_path), "--fasta", str(CDS)]) == 2
        assert capsys.readouterr().err == f"ds4sci evaluate: error: {config}: {why}\n", edit
    config.write_text(json.dumps({**arch, "use_parallel_residual": "yes"}))  # transformers' own check: one line
    assert main(["evaluate", str(tmp_path), "--fasta", str(CDS)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"ds4sci evaluate: error: {config}: ") and "use_parallel_residual" in err, err
    assert err.count("\n") == 1, err
    (tmp_path / "model.safetensors").unlink()
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    config.write_text(json.dumps({**arch, "intermediate_size": 64}))
    with pytest.raises(ValueError, match=r"config.json: intermediate_size=64 but pytorch_model.bin holds "
                                         r"'layers.0.mlp.dense_h_to_4h.weight' of shape \(128, 32\)"):
        load_weights(tmp_path)
    ckpt = {"state_dict": {f"model.{k}": v for k, v in hf.state_dict().items()},
            "hyper_parameters": {"model_architecture": {**GENSLM_ARCH, "num_hidden_layers": 3}}}
    torch.save(ckpt, tmp_path / "genslm.pt")
    with pytest.raises(ValueError, match=r"genslm.pt \(hyper_parameters.model_architecture\): num_hidden_layers=3 but "
                                         r"its state_dict holds layers 0-1 \(2 layers\)$"):
        load_weights(tmp_path / "genslm.pt")
    ckpt["hyper_parameters"]["model_architecture"]["num_hidden_layers"] = 2.0
    torch.save(ckpt, tmp_path / "genslm.pt")
    with pytest.raises(ValueError, match=r"genslm.pt \(hyper_parameters.model_architecture\): num_hidden_layers=2.0: "
                                         r"expected an integer, got float$"):
        load_weights(tmp_path / "genslm.pt")


def test_load_model_and_initial_model_from_an_export(trained):
    export, trained_loss, _ = trained
    model, config, tokenizer = ds4sci.load_model(export)
    assert tokenizer.kind == "nucleotide" and config.position_embedding == "learned"
    cfg = load_config(None, [f"model.init_from={export}", f"data.seq_len={SEQ}", "model.overrides.dropout=0.1",
                             "model.preset=25M"])  # the export's config replaces the preset; overrides apply on top
    fine = initial_model(cfg, NucleotideTokenizer())
    assert fine.config == GenSLMConfig(**{**config.to_dict(), "dropout": 0.1})
    for (name, a), b in zip(model.state_dict().items(), fine.state_dict().values()):
        assert torch.equal(a, b), name


def test_refusals_name_the_cause(trained, tmp_path, capsys):
    export, _, _ = trained
    # shapes: an override that changes a tensor
    cfg = load_config(None, [f"model.init_from={export}", f"data.seq_len={SEQ}",
                             "model.overrides.intermediate_size=128"])
    with pytest.raises(ValueError, match=r"tensor 'layers.0.mlp.dense_h_to_4h.weight' has shape \(256, 64\) in the "
                                         r"source but \(128, 64\) in the model"):
        initial_model(cfg, NucleotideTokenizer())
    # missing / unexpected keys: a rotary model into a learned one
    with pytest.raises(ValueError, match=r"missing embed_pos.weight, unexpected none"):
        load_into(GenSLM(GenSLMConfig.preset("debug", position_embedding="learned")),
                  GenSLM(GenSLMConfig.preset("debug")).state_dict(), "src")
    # vocabularies: the run's tokenizer, a bare state dict's embedding size, a vocabulary ds4sci has no tokenizer for
    with pytest.raises(ValueError, match="weights are for the nucleotide tokenizer but data.tokenizer='codon'"):
        initial_model(load_config(None, [f"model.init_from={export}", f"data.seq_len={SEQ}", "data.tokenizer=codon"]),
                      CodonTokenizer())
    with pytest.raises(ValueError, match=r"'embed_in.weight' has shape \(10, 64\).*vocabulary: 10 ids in the source, "
                                         r"69 in the model"):
        load_into(GenSLM(GenSLMConfig.preset("debug")),
                  GenSLM(GenSLMConfig.preset("debug", vocab_size=10)).state_dict(), "src")
    _hf_model({**GENSLM_ARCH, "vocab_size": 71}).save_pretrained(tmp_path / "v71")
    with pytest.raises(ValueError, match="a vocabulary of 71 ids matches no ds4sci tokenizer"):
        load_weights(tmp_path / "v71")
    # files: missing, of another model type, unsafe pickles, not a state dict
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        load_weights(tmp_path / "nope")
    (tmp_path / "mamba").mkdir()
    (tmp_path / "mamba" / "config.json").write_text('{"model_type": "mamba"}')
    with pytest.raises(ValueError, match=r"model_type='mamba', expected one of \['gpt_neox', 'llama'\]"):
        load_weights(tmp_path / "mamba")
    torch.save({"state_dict": {"model.embed_in.weight": torch.zeros(69, 4)}, "hyper_parameters": {"x": Opaque()}},
               tmp_path / "unsafe.ckpt")
    with pytest.raises(ValueError, match=rf"unsafe.ckpt: holds a {re.escape(Opaque.__module__)}.Opaque object, which "
                                         r"the safe loader \(torch.load\(weights_only=True\)\) refuses"):
        load_weights(tmp_path / "unsafe.ckpt")
    torch.save({"state_dict": {"w": [1, 2]}}, tmp_path / "list.pt")
    with pytest.raises(ValueError, match="not a state dict"):
        load_weights(tmp_path / "list.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"junk.pt: not a readable PyTorch file \(Unsupported operand"):
        load_weights(tmp_path / "junk.pt")
    # the command line: one line, exit status 2
    capsys.readouterr()
    assert main(["train", "--set", f"model.init_from={tmp_path / 'nope'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"ds4sci train: error: model.init_from='{tmp_path / 'nope'}': no such file or directory", err


@pytest.mark.slow  # a training through the command line (in a forked process: tests/fork_checks.py)
def test_fine_tune_from_a_hugging_face_directory_through_the_cli(tmp_path):
    """A run from a ``save_pretrained`` GPT-NeoX directory starts from its weights: each logged loss is the
    transformers model's own loss on that step's batch (a micro-batch holds the whole, tiny training set, so the
    trainer's sample order does not matter), far below a fresh model's, and at a negligible learning rate the export
    holds the same weights."""
    from ds4sci.data import collate
    from ds4sci.models.genslm import from_gpt_neox_state_dict
    from ds4sci.models.genslm import shift_labels
    from ds4sci.models.genslm import token_loss
    from ds4sci.train.launch import load_data

    out, hf_dir = tmp_path / "ft", tmp_path / "hf"
    sets = [f"data.fasta={CDS}", "data.tokenizer=codon", "data.split=region", f"data.seq_len={SEQ}",
            f"data.max_train_tokens={8 * SEQ}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=2",
            "train.log_every=1", "train.eval_batches=1", "train.progress=false",
            f"train.out_dir={out}", "optim.lr=1e-9", "optim.min_lr=0", "optim.warmup_steps=0", "optim.weight_decay=0"]
    _, train_ds, *_ = load_data(load_config(None, sets))  # the run reads the same token cache
    n = len(train_ds)  # 512 tokens of genes, each one's last window padded
    assert 8 <= n <= 16, n
    sets.append(f"train.micro_batch_size={n}")
    batch = collate([train_ds[i] for i in range(n)])
    ids, pos, targets = batch["input_ids"], batch["position_ids"], shift_labels(batch["labels"])

    def hf_loss(hf):
        return token_loss(hf(input_ids=ids, position_ids=pos).logits, targets)

    hf, fresh = _hf_model(seed=1), _hf_model(seed=2)
    opt = torch.optim.Adam(hf.parameters(), lr=1e-2)
    for _ in range(15):  # weights a fresh model could not have: a loss far below a fresh one's
        hf_loss(hf).backward()
        opt.step()
        opt.zero_grad()
    hf.eval().save_pretrained(hf_dir)
    with torch.no_grad():
        want, fresh_loss = hf_loss(hf).item(), hf_loss(fresh).item()
        model, _, _ = ds4sci.load_model(hf_dir)
        assert token_loss(model(ids, pos), targets).item() == pytest.approx(want, rel=1e-5)
    assert fresh_loss - want > 0.5, (want, fresh_loss)

    argv = ["train", *[a for s in [*sets, f"model.init_from={hf_dir}"] for a in ("--set", s)]]
    run = run_in_fork(argv, tmp_path, env=ENV, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [(r["step"], r["loss"]) for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
              if "loss" in r]
    assert [s for s, _ in losses] == [1, 2], losses
    for step, loss in losses:  # step 2 sees the same windows, through weights moved by ~1e-9
        assert loss == pytest.approx(want, rel=1e-5), (step, loss, want)
    before = from_gpt_neox_state_dict(hf.state_dict())
    after = load_file(str(out / "export" / "model.safetensors"))
    assert set(after) == set(before)
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=1e-6, msg=name)
