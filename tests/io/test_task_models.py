"""Fine-tuned task models out of ds4sci: ``predict`` equals the model's forward, and ``export-hf`` writes classifiers
whose logits equal transformers' AutoModelForSequenceClassification / AutoModelForTokenClassification (and peft's
PeftModel for a LoRA adapter); a head transformers cannot express is refused, naming why."""
import math

import pytest
import torch

from ds4sci.data import NucleotideTokenizer
from ds4sci.infer.predict import predict_records
from ds4sci.io.export import export_consolidated
from ds4sci.io.export_hf_task import export_task_hf
from ds4sci.io.task_model import load_task_model
from ds4sci.io.task_model import write_task_files
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig
from ds4sci.models.genslm import GenSLMForTask
from ds4sci.models.genslm import TaskSpec
from ds4sci.train.lora import LoraSpec
from ds4sci.train.lora import adapter_state_dict
from ds4sci.train.lora import apply_lora

TOK = NucleotideTokenizer()
LLAMA = dict(mlp="swiglu", norm="rmsnorm", parallel_residual=False, rotary_pct=1.0, bias=False)


def _task_model(tmp, spec, lora=None, seed=0, **shape):
    """A task model folder with non-trivial weights everywhere (head, adapters), as a fine-tuning run exports it."""
    torch.manual_seed(seed)
    config = GenSLMConfig.preset("debug", vocab_size=TOK.vocab_size, **shape)
    base = GenSLM(config)
    with torch.no_grad():
        for p in base.parameters():
            p.add_(0.05 * torch.randn_like(p))
    export_consolidated(base.state_dict(), config, TOK, tmp / "base")
    if lora is not None:
        apply_lora(base, lora)
    model = GenSLMForTask(base, spec)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name or name.startswith("head."):
                p.copy_(0.2 * torch.randn_like(p))
    folder = tmp / "task"
    if lora is None:
        export_consolidated(base.state_dict(), config, TOK, folder)
    write_task_files(folder, spec, model.head.state_dict(), lora, str(tmp / "base") if lora else None,
                     adapter_state_dict(base) if lora else None)
    return folder, model.eval()


SEQS = [("a", "ACGTACGGTTAC"), ("b", "GGGCA"), ("c", "TTAGCATGCAAGT")]


def _padded():
    ids = [torch.from_numpy(TOK.encode(s)) for _, s in SEQS]
    T = max(len(i) for i in ids)
    batch = torch.full((len(ids), T), TOK.pad_id)
    mask = torch.zeros(len(ids), T, dtype=torch.bool)
    for r, i in enumerate(ids):
        batch[r, : len(i)], mask[r, : len(i)] = i, True
    return batch, mask, torch.arange(T).expand(len(ids), T)


@pytest.mark.parametrize("kind,pooling", [("multiclass", "attention"), ("token", "mean")])
def test_predict_equals_the_forward(tmp_path, kind, pooling):
    spec = TaskSpec(kind, 3, pooling, labels=("x", "y", "z"))
    folder, model = _task_model(tmp_path, spec, lora=LoraSpec(r=2, targets=("attention", "mlp")))
    loaded, tok = load_task_model(folder)
    rows = list(predict_records(loaded, tok, SEQS, batch_size=2))
    for rid, seq in SEQS:  # each record alone, unpadded: the model's own forward
        ids = torch.from_numpy(TOK.encode(seq))[None]
        with torch.no_grad():
            want = spec.predictions(model(ids, torch.arange(ids.shape[1])[None], torch.ones_like(ids, dtype=bool)))
        got = torch.tensor([r["values"] for r in rows if r["id"] == rid])
        torch.testing.assert_close(got, want.reshape(got.shape), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape,kind,lora", [("neox", "binary", "adapter"), ("llama", "regression", None),
                                             ("neox", "token", None), ("llama", "multilabel", "merge"),
                                             ("llama", "binary", "adapter")])
def test_export_hf_logits_equal_transformers(tmp_path, shape, kind, lora):
    transformers = pytest.importorskip("transformers")
    spec = TaskSpec(kind, 2 if kind != "token" else 3, "last", target_mean=(1.0, 2.0) if kind == "regression" else (),
                    target_std=(2.0, 0.5) if kind == "regression" else ())
    folder, model = _task_model(tmp_path, spec, lora=LoraSpec(r=2, targets=("attention", "mlp")) if lora else None,
                                **(LLAMA if shape == "llama" else {}))
    out = export_task_hf(folder, tmp_path / "hf", merge=lora == "merge")
    auto = (transformers.AutoModelForTokenClassification if kind == "token"
            else transformers.AutoModelForSequenceClassification)
    hf = auto.from_pretrained(out).eval()
    if lora == "adapter":
        from peft import PeftModel

        hf = PeftModel.from_pretrained(hf, out / "adapter").eval()
    ids, mask, pos = _padded()
    with torch.no_grad():
        want = model(ids, pos, mask)
        got = hf(input_ids=ids, attention_mask=mask.long()).logits
    if kind == "token":
        got, want = got[mask], want[mask]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert not math.isclose(float(want.abs().max()), 0.0)


def test_export_hf_refuses_what_transformers_cannot_express(tmp_path):
    folder, _ = _task_model(tmp_path, TaskSpec("binary", 2, "mean"))
    with pytest.raises(ValueError, match="pool the last non-padding token only"):
        export_task_hf(folder, tmp_path / "hf")


def test_merge_writes_a_plain_export_with_the_adapter_models_logits(tmp_path, capsys):
    from ds4sci.cli import main
    from ds4sci.io.export import read_trained_length
    from ds4sci.io.task_model import read_task_meta
    from ds4sci.io.weights import load_model

    spec = TaskSpec("multiclass", 3, "attention")
    folder, model = _task_model(tmp_path, spec, lora=LoraSpec(r=2, targets=("attention", "mlp")), **LLAMA)
    assert main(["merge", str(folder), str(tmp_path / "merged")]) == 0
    merged, _ = load_task_model(tmp_path / "merged")
    assert read_task_meta(tmp_path / "merged") == (spec, None, None)  # a full fine-tune's folder
    ids, mask, pos = _padded()
    model.eval()  # as the merged model is read: both run inference's attention kernel
    with torch.no_grad():
        # fp32: W + s B A merged against x W + s (x A) B, through two layers; 1.4e-6 apart on a logit of 0.02
        torch.testing.assert_close(merged(ids, pos, mask), model(ids, pos, mask), rtol=1e-5, atol=2e-6)
        lm, _, _ = load_model(tmp_path / "merged")  # the language model ds4sci score and embed read
        torch.testing.assert_close(lm(ids, pos), model.model(ids, pos), rtol=1e-4, atol=1e-5)  # fp32 merge
    assert read_trained_length(tmp_path / "merged") == read_trained_length(tmp_path / "base")
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "merged"), str(tmp_path / "again")]) == 2  # nothing to merge
    assert main(["merge", str(folder), str(tmp_path / "merged")]) == 2  # not empty
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no LoRA adapters to merge" in err[0] and "not empty; pass --overwrite" in err[1], err
