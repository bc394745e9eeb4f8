"""The researcher's command line: codon prompts, numeric option checks, one error line per mistake."""
import pytest
import torch

from ds4sci.cli import main
from ds4sci.data import CodonTokenizer
from ds4sci.data import NucleotideTokenizer
from ds4sci.data import read_fasta
from ds4sci.infer.generate import read_prompt
from ds4sci.io.export import export_consolidated
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

CONTEXT = 32


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """A tiny codon export and a tiny nucleotide export (context of 32 tokens) and a FASTA file."""
    root = tmp_path_factory.mktemp("cli")
    torch.manual_seed(0)
    out = {}
    for name, tok in (("codon", CodonTokenizer()), ("nucleotide", NucleotideTokenizer())):
        cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=CONTEXT,
                                  position_embedding="learned")
        out[name] = str(export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / name))
    out["fasta"] = str(root / "x.fa")
    (root / "x.fa").write_text(">a\n" + "ACGT" * 12 + "\n")
    return out


def one_error(capsys, needles, out=""):
    """stderr is one ``ds4sci ...: error: ...`` line (plus argparse's usage) holding every needle; no traceback;
    stdout is ``out``."""
    captured = capsys.readouterr()
    assert captured.out == out
    err = captured.err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("prompt, needles", [("ATGAAACG", ["length 8", "multiple of 3", "'CG'"]),
                                             ("AT", ["length 2", "multiple of 3", "'AT'"])])
def test_codon_prompt_not_whole_codons_is_one_error(exports, capsys, prompt, needles):
    assert main(["generate", exports["codon"], "--prompt", prompt, "--num-tokens", "2"]) == 2
    one_error(capsys, needles)
    with pytest.raises(ValueError, match="multiple of 3"):
        read_prompt(CodonTokenizer(), prompt)


def test_codon_prompt_with_n_keeps_every_base(exports, capsys):
    tok = CodonTokenizer()
    text, ids = read_prompt(tok, "ATGNNNAAA")
    assert text == "ATGNNNAAA" and ids == [tok.token_to_id["ATG"], tok.unk_id, tok.token_to_id["AAA"]]
    assert main(["generate", exports["codon"], "--prompt", "ATGNNNAAA", "--num-tokens", "3"]) == 0
    seq = capsys.readouterr().out.splitlines()[1]
    assert seq.startswith("ATGNNNAAA") and len(seq) == 9 + 3 * 3


@pytest.mark.parametrize("kind", ["codon", "nucleotide"])
def test_prompt_follows_the_training_data_rule(tmp_path, kind):
    # training: read_fasta (data.iupac="n": lowercase up, U -> T, R Y S W K M B D H V -> N), then tokenizer.encode
    raw = "atgRYuNNacgtTAG"[: 15 if kind == "codon" else 14]
    tok = CodonTokenizer() if kind == "codon" else NucleotideTokenizer()
    (tmp_path / "p.fa").write_text(">p\n" + raw + "\n")
    trained = next(read_fasta(tmp_path / "p.fa")).sequence
    text, ids = read_prompt(tok, raw)
    assert text == trained and ids == tok.encode(trained).tolist()
    assert text.startswith("ATGNNTNN")


def test_generated_output_starts_with_the_prompt(exports, capsys):
    for name, prompt in (("codon", "ATGAAA"), ("nucleotide", "acgun")):
        assert main(["generate", exports[name], "--prompt", prompt, "--num-tokens", "4", "--temperature", "0"]) == 0
        assert capsys.readouterr().out.splitlines()[1].startswith(prompt.upper().replace("U", "T"))


# (command, option, values it refuses, what its error says)
BAD_NUMBERS = [
    ("generate", "--num-tokens", ["-5", "0", "x"], "positive integer"),
    ("generate", "--num-sequences", ["0"], "positive integer"),
    ("generate", "--temperature", ["-1", "nan"], ">= 0"),
    ("generate", "--top-k", ["-1"], ">= 0"),
    ("generate", "--top-p", ["0", "1.5"], "(0, 1]"),
    ("evaluate", "--seq-len", ["0", "-3"], "positive integer"),
    ("evaluate", "--batch-size", ["0"], "positive integer"),
]


@pytest.mark.parametrize("command, option, value, needle",
                         [(command, option, value, needle) for command, option, values, needle in BAD_NUMBERS
                          for value in values])
def test_numeric_options_are_checked(exports, capsys, command, option, value, needle):
    extra = ["--fasta", exports["fasta"]] if command == "evaluate" else []
    with pytest.raises(SystemExit) as exc:
        main([command, exports["nucleotide"], *extra, option, value])
    assert exc.value.code == 2
    one_error(capsys, [option, needle, value])


def test_seq_len_beyond_context_names_both_numbers(exports, capsys):
    assert main(["evaluate", exports["nucleotide"], "--fasta", exports["fasta"], "--seq-len", "100000"]) == 2
    one_error(capsys, ["--seq-len 100000", f"context of {CONTEXT}"])
    assert main(["evaluate", exports["nucleotide"], "--fasta", exports["fasta"], "--seq-len", str(CONTEXT),
                 "--batch-size", "1"]) == 0
    assert "bits_per_base" in capsys.readouterr().out


def test_num_tokens_beyond_context_is_one_error(exports, capsys):
    assert main(["generate", exports["codon"], "--prompt", "ATG", "--num-tokens", str(CONTEXT)]) == 2
    one_error(capsys, [f"num_tokens={CONTEXT}", f"context of {CONTEXT}"])


def test_missing_export_is_one_error(tmp_path, capsys):
    assert main(["evaluate", str(tmp_path / "nope"), "--fasta", str(tmp_path / "x.fa")]) == 2
    one_error(capsys, ["nope", "no such file or directory"])


def test_info_lists_every_backend_of_each_component(monkeypatch, capsys):
    import json

    from ds4sci.commands import info
    from ds4sci.kernels import triton_evoformer  # noqa: F401
    from ds4sci.kernels import triton_local_attention  # noqa: F401
    from ds4sci.kernels.backends import EvoformerBackend
    from ds4sci.kernels.backends import LocalBackend

    # The kernel modules are imported above, under conftest's TRITON_INTERPRET=1: @triton.jit reads the variable when a
    # kernel is defined, so a first import by info.backends() below, with the variable unset, would leave compiled
    # kernels behind for every later test of this process.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(info, "_flash_installed", lambda: False)
    table = info.backends(cuda=False)
    assert list(table["evoformer_attention"]) == [b.value for b in EvoformerBackend] == ["auto", "triton", "torch",
                                                                                         "reference"]
    assert list(table["genslm_local_attention"]) == [b.value for b in LocalBackend] == ["auto", "chunked", "triton",
                                                                                        "flash", "sdpa"]
    for rows in table.values():
        for name, row in rows.items():
            assert row["why"] and "not described" not in row["why"], name
    evo, local = table["evoformer_attention"], table["genslm_local_attention"]
    for row in evo["triton"], local["triton"]:
        assert not row["usable"] and "no CUDA device" in row["why"] and "TRITON_INTERPRET=1" in row["why"]
    assert not local["flash"]["usable"] and "not installed" in local["flash"]["why"]
    assert all(r["usable"] for r in (evo["torch"], evo["reference"], local["chunked"], local["sdpa"]))
    assert "torch" in evo["auto"]["why"] and "chunked" in local["auto"]["why"]

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    table = info.backends(cuda=False)
    assert table["evoformer_attention"]["triton"]["usable"] and table["genslm_local_attention"]["triton"]["usable"]
    monkeypatch.setattr(info, "_flash_installed", lambda: True)
    assert not info.backends(cuda=False)["genslm_local_attention"]["flash"]["usable"]
    table = info.backends(cuda=True)
    assert table["genslm_local_attention"]["flash"]["usable"] and table["evoformer_attention"]["triton"]["usable"]
    assert info._triton_status("ds4sci.kernels.no_such_kernel", True) == (
        False, "does not import (ModuleNotFoundError: No module named 'ds4sci.kernels.no_such_kernel')")

    monkeypatch.delenv("TRITON_INTERPRET")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "evoformer_attention backends:" in out and "genslm_local_attention backends:" in out
    assert any(line.split()[:2] == ["chunked", "yes"] for line in out.splitlines())
    assert main(["info", "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)["backends"]) == {"evoformer_attention", "genslm_local_attention"}


def test_help_imports_no_heavy_module():
    import subprocess
    import sys

    code = ("import sys\nfrom ds4sci.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit as e:\n"
            "    assert e.code == 0\n"
            "heavy = sorted(m for m in ('torch', 'deepspeed', 'triton', 'numpy') if m in sys.modules)\n"
            "print(heavy)\nsys.exit(bool(heavy))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "generate" in proc.stdout and "evaluate" in proc.stdout


def test_command_in_skips_top_level_option_values():
    from ds4sci.cli import build_parser
    from ds4sci.cli import command_in

    assert command_in(["--log-level", "info", "generate", "x"]) == "generate"
    assert command_in(["--log-level=debug", "info"]) == "info"
    assert command_in(["--local_rank", "0", "train", "c.yaml"]) == "train"
    assert command_in(["--help"]) is None and command_in(["nonsense"]) is None
    args = build_parser([command_in(["--log-level", "info", "evaluate", "ex", "--fasta", "f"])]).parse_args(
        ["--log-level", "info", "evaluate", "ex", "--fasta", "f"])
    assert args.command == "evaluate" and args.log_level == "INFO" and args.batch_size == 8


def test_a_users_error_is_one_line_once_per_launch(monkeypatch, capsys):
    """Rank 0 (or a lone process) prints the error line; another rank waits for the launcher to stop it (rank 0 met
    the same error) and, still running after the wait, prints its own error naming its rank."""
    from ds4sci import cli

    monkeypatch.setattr(cli, "ERROR_WAIT_S", 0.01)
    for rank, who in ((None, "ds4sci train"), ("0", "ds4sci train"), ("1", "ds4sci train (rank 1)")):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        cli.report_error("train", ValueError("bad value 7"))
        assert capsys.readouterr().err == f"{who}: error: bad value 7\n"


def test_device_auto_is_this_process_gpu_when_cuda_is_there(monkeypatch):
    from ds4sci.infer import parallel

    assert parallel.inference_device("auto") == torch.device("cpu") == parallel.inference_device("cpu")
    with pytest.raises(ValueError, match="--device cuda: this machine has 0 CUDA device"):
        parallel.inference_device("cuda")
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    torchrun = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert parallel.inference_device("auto") == torch.device("cuda", 1)  # torchrun's local rank
    assert parallel.inference_device("cuda:0") == torch.device("cuda", 0)
    assert chosen == [torch.device("cuda", 1), torch.device("cuda", 0)]  # made current, as NCCL needs
    for name in torchrun:
        monkeypatch.delenv(name)
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1",
             "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "node[1-2]"}
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    assert parallel.inference_device("auto") == torch.device("cuda", 1)  # srun's local rank, not its global one
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 CUDA device\(s\)"):
        parallel.inference_device("cuda:2")
    for bad in ("gpu", "cuda:x", "mps"):
        with pytest.raises(ValueError, match=f"--device '{bad}': expected auto, cpu, cuda or cuda:N"):
            parallel.inference_device(bad)


@pytest.mark.parametrize("command", ["score", "embed", "evaluate", "generate", "score-variants"])
def test_device_without_cuda_is_one_error(exports, capsys, command):
    extra = {"score": ["--fasta", exports["fasta"], "--out", "-"], "embed": ["--fasta", exports["fasta"], "--out", "x"],
             "evaluate": ["--fasta", exports["fasta"]], "generate": [],
             "score-variants": ["--reference", exports["fasta"], "--vcf", "v.vcf", "--out", "-"]}[command]
    assert main([command, exports["nucleotide"], "--device", "cuda", *extra]) == 2
    one_error(capsys, ["--device cuda: this machine has 0 CUDA device"])
