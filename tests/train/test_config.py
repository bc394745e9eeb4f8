"""Training config: YAML + dotted ``--set`` overrides, typed coercion, validation errors naming key and value."""
import os

import pytest

from ds4sci.train.config import Config
from ds4sci.train.config import load_config
from ds4sci.train.engine import deepspeed_config
from ds4sci.train.engine import lr_lambda


def test_defaults_are_valid_and_yaml_plus_overrides_apply(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seq_len: 64\ntrain:\n  steps: 7\nzero:\n  stage: 2\n"
                    "model:\n  overrides: {num_layers: 3}\n")
    cfg = load_config(path, ["train.steps=9", "optim.betas=[0.8, 0.9]", "parallel.ulysses=2", "train.progress=false",
                             "model.overrides.position_embedding=learned", "optim.lr=3e-3"])
    assert cfg.data.seq_len == 64 and cfg.zero.stage == 2
    assert cfg.train.steps == 9 and cfg.optim.betas == (0.8, 0.9) and cfg.optim.lr == 3e-3
    assert cfg.parallel.ulysses == 2 and cfg.train.progress is False
    assert cfg.model.overrides == {"num_layers": 3, "position_embedding": "learned"}
    model = cfg.genslm_config(vocab_size=8, pad_token_id=3)
    assert model.num_layers == 3 and model.position_embedding == "learned"
    assert model.max_position_embeddings == 64  # a learned table has one row per window position
    default = Config()
    default.data.fasta, default.train.out_dir = map(os.path.abspath, (default.data.fasta, default.train.out_dir))
    assert load_config().to_dict() == default.to_dict()  # defaults, with paths from the working directory


def test_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = load_config(None, ["train.steps=3", "optim.betas=[0.9, 0.99]"])
    path = tmp_path / "resolved.yaml"
    path.write_text(cfg.to_yaml())
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.steps=0", "train.steps"),
        ("zero.stage=4", "zero.stage"),
        ("train.dtype=fp16", "train.dtype"),
        ("train.progress=maybe", "train.progress"),
        ("optim.lr=-1", "optim.lr"),
        ("optim.min_lr=1", "optim.min_lr"),
        ("optim.betas=[0.9]", "optim.betas"),
        ("optim.eps=0", "optim.eps"),
        ("data.tokenizer=protein", "data.tokenizer"),
        ("data.split=random", "data.split"),
        ("data.val_fraction=1.5", "data.val_fraction"),
        ("data.seq_len=30", "data.seq_len"),  # not divisible by ulysses=4 below
        ("parallel.ulysses=3", "parallel.ulysses"),  # does not divide the debug model's 4 heads
        ("parallel.layout=spiral", "parallel.layout"),
        ("model.overrides.no_such_field=1", "model"),
        ("model.preset=huge", "model"),
    ],
)
def test_errors_name_the_key_and_value(override, key):
    base = ["data.seq_len=96"] + (["parallel.ulysses=4"] if key == "data.seq_len" else [])
    with pytest.raises(ValueError) as err:
        load_config(None, base + [override])
    message = str(err.value)
    assert key in message, message
    assert override.split("=", 1)[1].strip("[]").split(",")[0] in message, message


def test_unknown_keys_are_named_with_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown config key 'train.stepz'.*'train.steps'"):
        load_config(None, ["train.stepz=3"])
    with pytest.raises(ValueError, match="unknown config key 'nosuch'"):
        load_config(None, ["nosuch.key=1"])


def test_cross_field_rules():
    with pytest.raises(ValueError, match="data.seq_len=52.*divisible by 8"):  # zigzag: 2 chunks per ring rank
        load_config(None, ["data.seq_len=52", "parallel.ring=2", "parallel.ulysses=2"])
    assert load_config(None, ["data.seq_len=52", "parallel.ulysses=2", "parallel.ring=2",
                              "parallel.layout=contiguous"]).parallel.dims().layout == "contiguous"
    with pytest.raises(ValueError, match="reverse complement breaks the reading frame"):
        load_config(None, ["data.tokenizer=codon", "data.reverse_complement=0.5"])
    with pytest.raises(ValueError, match="data.dataset='packed'"):
        load_config(None, ["data.dataset=packed", "parallel.ulysses=2", "model.overrides.position_embedding=learned"])
    with pytest.raises(ValueError, match="max_position_embeddings"):
        load_config(None, ["parallel.ulysses=2", "model.overrides.position_embedding=learned",
                           "model.overrides.max_position_embeddings=512"])
    with pytest.raises(ValueError, match="key=value"):
        load_config(None, ["train.steps"])
    with pytest.raises(ValueError, match="must be a mapping"):
        load_config(None, ["train=3"])


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(ValueError, match="top level must be a mapping"):
        load_config(path)


def test_lr_schedule_warmup_then_cosine_to_min():
    cfg = load_config(None, ["train.steps=20", "optim.warmup_steps=4", "optim.lr=1e-3", "optim.min_lr=1e-4"])
    f = lr_lambda(cfg)
    assert [f(s) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert f(4) == pytest.approx(1.0)
    assert f(12) == pytest.approx((1e-4 + 0.5 * 9e-4) / 1e-3)  # half way through the decay
    assert f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 30))


def test_deepspeed_config_mirrors_the_training_config():
    cfg = load_config(None, ["zero.stage=3", "train.grad_accum=4", "train.micro_batch_size=2",
                             "train.dtype=bf16", "optim.grad_clip=0.5"])
    ds = deepspeed_config(cfg, sp=2)
    assert ds["zero_optimization"] == {"stage": 3, "reduce_scatter": True}
    assert ds["gradient_accumulation_steps"] == 4 and ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["bf16"] == {"enabled": True} and ds["gradient_clipping"] == 0.5 and ds["sequence_parallel_size"] == 2


def test_cli_set_repeats_in_any_order_with_the_config_path():
    from ds4sci.cli import build_parser

    args = build_parser().parse_args(["train", "--set", "train.steps=3", "c.yaml", "--set", "optim.lr=0.1",
                                      "--set", "data.seq_len=8"])
    assert args.config == "c.yaml" and args.overrides == ["train.steps=3", "optim.lr=0.1", "data.seq_len=8"]
    cfg = load_config(None, args.overrides)
    assert (cfg.train.steps, cfg.optim.lr, cfg.data.seq_len) == (3, 0.1, 8)


def test_every_config_key_has_a_description():
    import dataclasses

    for section in dataclasses.fields(Config):
        assert section.metadata.get("help"), section.name
        for f in dataclasses.fields(getattr(Config(), section.name)):
            assert f.metadata.get("help"), f"{section.name}.{f.name} has no description"


def test_unknown_keys_suggest_the_nearest(tmp_path):
    with pytest.raises(ValueError, match=r"unknown config key 'train.stepz' \(did you mean 'train.steps'\?\)"):
        load_config(None, ["train.stepz=3"])
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  fastq: x.fa\n")
    with pytest.raises(ValueError, match=r"'data.fastq' \(did you mean 'data.fasta'\?\)"):
        load_config(path)
    with pytest.raises(ValueError, match=r"'num_layer' \(did you mean 'num_layers'\?\)"):
        load_config(None, ["model.overrides.num_layer=3"])


def test_paths_in_a_config_file_are_relative_to_its_folder(tmp_path, monkeypatch):
    sub = tmp_path / "configs"
    sub.mkdir()
    (tmp_path / "x.fasta").write_text(">a\nACGT\n")
    path = sub / "c.yaml"
    path.write_text("data:\n  fasta: ../x.fasta\ntrain:\n  out_dir: ../runs/r\n")
    elsewhere = tmp_path / "a" / "b"  # any working directory (one where ../x.fasta is another file)
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    cfg = load_config(path)
    assert cfg.data.fasta == str(tmp_path / "x.fasta") and cfg.train.out_dir == str(tmp_path / "runs" / "r")
    absolute = tmp_path / "abs.fa"
    path.write_text(f"data:\n  fasta: {absolute}\n")
    assert load_config(path).data.fasta == str(absolute)
    # --set paths (and defaults) are read from the working directory
    cfg = load_config(path, ["data.fasta=y.fa"])
    assert cfg.data.fasta == str(elsewhere / "y.fa")
    assert cfg.train.out_dir == str(elsewhere / "runs" / "train")


def test_example_configs_point_at_the_bundled_files(monkeypatch, tmp_path):
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(tmp_path)
    shipped = sorted((root / "examples" / "configs").glob("*.yaml"))
    assert {p.name for p in shipped} >= {"demo_ecoli_sp2.yaml", "codon_cds_sp2.yaml", "ecoli_sp2_offload_ac.yaml",
                                         "ecoli_tp2_u2.yaml", "ecoli_pp2_u2.yaml", "ecoli_usp_u2_r2.yaml"}
    for path in shipped:
        cfg = load_config(path)
        assert Path(cfg.data.fasta).is_file() and Path(cfg.data.fasta).parent == root / "examples" / "data"
        assert Path(cfg.train.out_dir).parent == root / "runs", path.name
        p = cfg.parallel  # the world its "Launch:" line names validates (degrees split the model)
        world = p.tp * p.ulysses * p.ring * p.pp * max(p.dp, 1)
        assert f"--nproc-per-node {world} " in path.read_text() or world == 1, path.name
        assert cfg.parallel.dims(world).world_size == world


def test_cli_print_config_round_trips_and_set_goes_before_the_path(tmp_path, capsys):
    import yaml

    from ds4sci.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("data:\n  seq_len: 64\n")
    assert main(["train", "--set", "train.steps=2", str(path), "--set", "optim.lr=0.01", "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = yaml.safe_load(text)
    assert printed["train"]["steps"] == 2 and printed["data"]["seq_len"] == 64 and printed["optim"]["lr"] == 0.01
    assert printed["zero"]["stage"] == 0 and printed["optim"]["betas"] == [0.9, 0.95]  # defaults filled in
    assert "# optimizer steps" in text  # descriptions as comments
    again = tmp_path / "printed.yaml"
    again.write_text(text)
    assert load_config(again).to_dict() == load_config(path, ["train.steps=2", "optim.lr=0.01"]).to_dict()
    assert main(["train", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["train"]["steps"] == Config().train.steps


NEW_KEYS = {  # every key of the zero / activation_checkpointing sections and the new parallel degrees
    "zero.stage": 3, "zero.offload_optimizer": "cpu", "zero.offload_param": "cpu", "zero.pin_memory": False,
    "activation_checkpointing.mode": "selective", "activation_checkpointing.cpu": True,
    "activation_checkpointing.tiled_mlp": True, "activation_checkpointing.mlp_tile": 256,
    "activation_checkpointing.tiled_loss": True, "activation_checkpointing.loss_tile": 512,
    "parallel.tp": 1, "parallel.pp": 1, "parallel.dp": 2,
}


def test_zero_checkpointing_and_degree_keys_round_trip_through_yaml_set_and_print_config(tmp_path, capsys):
    import yaml

    from ds4sci.cli import main

    sections: dict = {}
    for key, value in NEW_KEYS.items():
        section, leaf = key.split(".")
        sections.setdefault(section, {})[leaf] = value
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(sections))
    from_yaml = load_config(path)
    from_set = load_config(None, [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in NEW_KEYS.items()])
    for cfg in (from_yaml, from_set):
        for key, value in NEW_KEYS.items():
            section, leaf = key.split(".")
            assert getattr(getattr(cfg, section), leaf) == value, key
    assert from_yaml.to_dict() == from_set.to_dict()
    assert main(["train", str(path), "--print-config"]) == 0
    text = capsys.readouterr().out
    printed = yaml.safe_load(text)
    for key, value in NEW_KEYS.items():
        section, leaf = key.split(".")
        assert printed[section][leaf] == value, key
    assert "ZeRO-Offload" in text and "Korthikanti" in text  # descriptions as comments
    again = tmp_path / "printed.yaml"
    again.write_text(text)
    assert load_config(again).to_dict() == from_yaml.to_dict()
    assert load_config(path, ["zero.nvme_path=nv", "zero.offload_param=nvme"]).zero.nvme_path == os.path.abspath("nv")
    assert load_config().zero.nvme_path == ""  # an unset path stays unset (not resolved to the working directory)


@pytest.mark.parametrize(
    "overrides, named",
    [
        (["zero.offload_optimizer=cpu"], ["zero.offload_optimizer='cpu'", "zero.stage >= 1", "zero.stage=0"]),
        (["zero.stage=2", "zero.offload_param=cpu"], ["zero.offload_param='cpu'", "zero.stage=3", "zero.stage=2"]),
        (["zero.stage=3", "zero.offload_param=nvme"], ["zero.nvme_path=''", "zero.offload_param=nvme"]),
        (["zero.stage=3", "zero.offload_optimizer=nvme"], ["zero.nvme_path=''", "zero.offload_optimizer=nvme"]),
        (["zero.stage=2", "zero.offload_optimizer=nvme", "zero.nvme_path=/nv"],
         ["zero.offload_optimizer='nvme'", "zero.stage=3", "silently"]),
        (["zero.nvme_path=/nv"], ["zero.nvme_path='/nv'", "nothing is offloaded"]),
        (["zero.stage=1", "zero.offload_optimizer=gpu"], ["zero.offload_optimizer='gpu'", "none, cpu or nvme"]),
        (["zero.stage=5"], ["zero.stage=5"]),
        (["activation_checkpointing.mode=some"], ["activation_checkpointing.mode='some'"]),
        (["activation_checkpointing.cpu=true"], ["activation_checkpointing.cpu=True", "mode=none"]),
        (["activation_checkpointing.tiled_mlp=true", "activation_checkpointing.mlp_tile=0"],
         ["activation_checkpointing.mlp_tile=0", ">= 1 token"]),
        (["activation_checkpointing.mlp_tile=-8"], ["activation_checkpointing.mlp_tile=-8"]),
        (["activation_checkpointing.tiled_loss=true", "activation_checkpointing.loss_tile=0"],
         ["activation_checkpointing.loss_tile=0", ">= 1 token", "tiled_loss"]),
        (["parallel.tp=3", "data.seq_len=96"],
         ["parallel.tp=3", "tp=3 x ulysses=1 = 3 must divide the number of heads 4"]),
        (["parallel.tp=2", "model.overrides.intermediate_size=63"],
         ["parallel.tp=2", "tp=2 must divide the MLP width intermediate_size=63"]),
        (["parallel.pp=3"], ["parallel.pp=3", "pp=3 pipeline stages need at least 3 layers, the model has 2"]),
        (["parallel.dp=-1"], ["parallel.dp=-1"]),
    ],
)
def test_invalid_zero_checkpointing_and_degree_combinations_name_keys_and_values(overrides, named):
    with pytest.raises(ValueError) as err:
        load_config(None, overrides)
    for text in named:
        assert text in str(err.value), str(err.value)


def test_dp_must_match_what_the_world_size_leaves():
    from ds4sci.train.config import ParallelConfig

    assert ParallelConfig(ulysses=2, dp=2).dims(4).dp == 2 and ParallelConfig(ulysses=2).dims(6).dp == 3
    with pytest.raises(ValueError) as err:
        ParallelConfig(ulysses=2, dp=2).dims(6)
    for text in ("parallel.dp=2", "world size 6", "tp=1 x ulysses=2 x ring=1 x pp=1", "leaves dp=3"):
        assert text in str(err.value), str(err.value)
    with pytest.raises(ValueError, match="parallel.tp=2.*world size 3 is not a multiple of tp=2"):
        ParallelConfig(tp=2).dims(3)


def test_model_split_and_sequence_multiple_name_every_degree():
    with pytest.raises(ValueError, match=r"data.seq_len=30: must be divisible by 4 \(tp=1 x ulysses=2 x ring=2"):
        load_config(None, ["data.seq_len=30", "parallel.ulysses=2", "parallel.ring=2", "parallel.layout=contiguous"])
    with pytest.raises(ValueError, match=r"parallel.tp=1, parallel.ulysses=3.*must divide the number of heads 4"):
        load_config(None, ["data.seq_len=96", "parallel.ulysses=3"])


def test_deepspeed_config_carries_offload():
    cfg = load_config(None, ["zero.stage=3", "zero.offload_optimizer=cpu", "zero.offload_param=cpu",
                             "zero.pin_memory=false"])
    ds = deepspeed_config(cfg, sp=1)
    assert ds["zero_optimization"] == {"stage": 3, "reduce_scatter": True,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": False},
                                       "offload_param": {"device": "cpu", "pin_memory": False}}
    assert ds["zero_force_ds_cpu_optimizer"] is False  # torch AdamW stays the optimizer
    assert "zero_force_ds_cpu_optimizer" not in deepspeed_config(load_config(None, ["zero.stage=2"]), sp=1)


def test_nvme_offload_is_refused_before_the_engine_when_it_cannot_run(tmp_path):
    from ds4sci.train.engine import check_offload_support

    check_offload_support(load_config(None, ["zero.stage=3", "zero.offload_param=cpu"]))  # nothing to check
    missing = load_config(None, ["zero.stage=3", "zero.offload_param=nvme", f"zero.nvme_path={tmp_path / 'no'}"])
    with pytest.raises(ValueError, match="zero.offload_param=nvme: zero.nvme_path=.*not an existing folder"):
        check_offload_support(missing)
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        pytest.skip("DeepSpeed's async_io op can be built here: nvme offload is allowed")
    cfg = load_config(None, ["zero.stage=3", "zero.offload_optimizer=nvme", f"zero.nvme_path={tmp_path}"])
    with pytest.raises(ValueError, match="zero.offload_optimizer=nvme: NVMe offload needs DeepSpeed's async_io op"):
        check_offload_support(cfg)


@pytest.mark.parametrize("text, sets, needle", [
    ("data: {seq_len: [1\n", [], "c.yaml: not valid YAML (line 2, column 1)"),
    ("", ["train.steps=[1"], "--set train.steps: not valid YAML"),
    ("", ["model.overrides.hidden_size={"], "--set model.overrides.hidden_size: not valid YAML"),
    ("", ["optim.lr=true"], "optim.lr=True: expected a number"),
    ("", ["optim.betas=[0.9, 0.9"], "--set optim.betas: not valid YAML"),
])
def test_cli_config_mistakes_are_one_line(tmp_path, capsys, text, sets, needle):
    """A config file or --set value that is not YAML, or a bool for a number: one error line, exit 2, no traceback."""
    from ds4sci.cli import main

    path = tmp_path / "c.yaml"
    path.write_text(text)
    argv = ["train", str(path)] + [arg for item in sets for arg in ("--set", item)] + ["--print-config"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
