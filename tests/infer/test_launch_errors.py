"""A launcher's environment that cannot form its process group, through the commands that form one (``evaluate``,
``score``, ``embed``, ``score-variants``), ``ds4sci info`` and ``ds4sci bench``: one line naming the launcher and the
variable, exit status 2, no traceback, and no process group attempted (each environment is rank 0's, so the line is
printed at once). The resolver's own cases are tested in tests/distributed/test_launch.py; here, the command path."""
import pytest
import torch

from ds4sci.cli import main
from ds4sci.data import NucleotideTokenizer
from ds4sci.io.export import export_consolidated
from ds4sci.models.genslm import GenSLM
from ds4sci.models.genslm import GenSLMConfig

# (environment, what the line names): one per launcher, a missing, a malformed and an out-of-range variable
ENVIRONMENTS = {
    "slurm, no task count": ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"},
                             "slurm launch: SLURM_STEP_NUM_TASKS / SLURM_NTASKS is not set"),
    "mpich, a size that is not a number": ({"PMI_RANK": "0", "PMI_SIZE": "two"},
                                           "mpi launch: PMI_SIZE='two' is not an integer >= 1"),
    "open mpi, a local rank past the local size": (
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
        "mpi launch: OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2"),
    "torchrun, no master": ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "29500"},
                            "torchrun launch: MASTER_ADDR is not set"),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A tiny nucleotide export, a FASTA file and a VCF naming its record."""
    root = tmp_path_factory.mktemp("launch_errors")
    torch.manual_seed(0)
    tok = NucleotideTokenizer()
    cfg = GenSLMConfig.preset("debug", vocab_size=tok.vocab_size, max_position_embeddings=32)
    export = export_consolidated(GenSLM(cfg).state_dict(), cfg, tok, root / "export")
    (root / "x.fa").write_text(">a\n" + "ACGT" * 8 + "\n")
    (root / "x.vcf").write_text("##fileformat=VCFv4.2\n#CHROM\tPOS\tID\tREF\tALT\na\t3\t.\tG\tA\n")
    return {"export": str(export), "fasta": str(root / "x.fa"), "vcf": str(root / "x.vcf"), "out": str(root / "out")}


@pytest.fixture
def started(monkeypatch):
    """The benchmark ``ds4sci bench comm-volume`` runs, replaced by a list of its starts (none is expected)."""
    from ds4sci.bench import comm_volume

    starts = []
    monkeypatch.setattr(comm_volume, "run", starts.append)
    return starts


def _argv(command, files):
    export, fasta, out = files["export"], files["fasta"], files["out"]
    return {"evaluate": ["evaluate", export, "--fasta", fasta],
            "score": ["score", export, "--fasta", fasta, "--out", out],
            "embed": ["embed", export, "--fasta", fasta, "--out", out + ".npz"],
            "score-variants": ["score-variants", export, "--reference", fasta, "--vcf", files["vcf"], "--out", out],
            "info": ["info"],
            "bench": ["bench", "comm-volume", "--out", out]}[command]


@pytest.mark.parametrize("environment", list(ENVIRONMENTS))
def test_a_bad_launch_environment_is_one_line_naming_launcher_and_variable(environment, files, started, monkeypatch,
                                                                          capsys):
    variables, message = ENVIRONMENTS[environment]
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    for command in ("evaluate", "score", "embed", "score-variants", "info", "bench"):
        assert main(_argv(command, files)) == 2, command
        captured = capsys.readouterr()
        assert captured.err == f"ds4sci {command}: error: {message}\n", (command, captured.err)
        if command == "info":  # the report first, its launch row naming the same error
            assert f"error: {message}" in captured.out
        else:
            assert captured.out == ""
    assert started == []


def test_bench_under_a_launch_of_several_processes_is_refused(files, started, monkeypatch, capsys):
    """``ds4sci bench`` starts its own processes: under ``mpiexec -n 2`` (rank 0's environment, the master agreed
    without MPI) it would run twice into one ``--out``, so it is refused in one line naming the launch, before the
    benchmark starts."""
    for name, value in {"PMI_RANK": "0", "PMI_SIZE": "2", "PALS_LOCAL_RANKID": "0", "PALS_LOCAL_SIZE": "2",
                        "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    assert main(_argv("bench", files)) == 2
    assert capsys.readouterr().err == ("ds4sci bench: error: this mpi launch has 2 processes: ds4sci bench starts the "
                                       "processes a benchmark needs itself, run it as one process\n")
    assert started == []
