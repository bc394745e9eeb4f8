"""The launch resolver on faked environments (no processes): each launcher's variables, SLURM's compressed host and
tasks-per-node lists, precedence, a lone process, and every missing or malformed variable as one error naming it."""
import dataclasses

import pytest

from ds4sci.distributed.launch import Launch
from ds4sci.distributed.launch import LaunchError
from ds4sci.distributed.launch import expand_nodelist
from ds4sci.distributed.launch import expand_tasks_per_node
from ds4sci.distributed.launch import launch_rank
from ds4sci.distributed.launch import resolve_launch

TORCHRUN = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_WORLD_SIZE": "2",
            "MASTER_ADDR": "node01", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "job"}
DEEPSPEED = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_SIZE": "2", "CROSS_SIZE": "2",
             "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "3",
         "SLURM_STEP_TASKS_PER_NODE": "2(x3),1", "SLURM_JOB_NODELIST": "node[01-02,07],gpu-a[1]",
         "SLURM_JOB_ID": "4321"}
MPICH = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_ADDR": "x3001"}
PALS = {"PMI_RANK": "3", "PMI_SIZE": "4", "PALS_LOCAL_RANKID": "1", "PALS_LOCAL_SIZE": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "host0", "MASTER_PORT": "1234"}


def _no_mpi():
    raise AssertionError("the MPI master was asked for although the environment names it")


def test_each_launcher_resolves_rank_world_local_nodes_and_master(tmp_path):
    assert resolve_launch(TORCHRUN, _no_mpi) == Launch("torchrun", 5, 8, 1, 4, 2, "node01", 29400)
    assert resolve_launch(DEEPSPEED, _no_mpi) == Launch("torchrun", 2, 4, 0, 2, 2, "10.0.0.1", 29500)
    # srun: the node's task count from the compressed list, the master the first host, the port from the job id
    assert resolve_launch(SLURM, _no_mpi) == Launch("slurm", 6, 7, 0, 1, 4, "node01", 20000 + 4321 % 10000)
    assert resolve_launch({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NTASKS": "8",
                           "SLURM_NODEID": "", "SLURM_LOCALID": "1", "MASTER_ADDR": "m", "MASTER_PORT": "7"},
                          _no_mpi) == Launch("slurm", 6, 8, 1, 2, 4, "m", 7)
    assert resolve_launch(MPICH, _no_mpi) == Launch("mpi", 3, 4, 1, 2, 2, "x3001", 29500)
    assert resolve_launch(OPENMPI, _no_mpi) == Launch("mpi", 1, 2, 1, 2, 1, "host0", 1234)
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\nx3001.hsn.cm\nx3001.hsn.cm\nx3002.hsn.cm\n")  # PBS: one line per rank slot
    assert resolve_launch({**PALS, "PBS_NODEFILE": str(nodefile)}, _no_mpi) == Launch("mpi", 3, 4, 1, 2, 2,
                                                                                     "x3001.hsn.cm", 29500)
    # neither MASTER_ADDR nor PBS_NODEFILE: agreed over MPI
    assert resolve_launch(PALS, lambda: "rank0-host").master_addr == "rank0-host"


def test_a_lone_process_and_a_launch_of_one():
    assert resolve_launch({}, _no_mpi) == Launch("none", 0, 1, 0, 1, 1, "127.0.0.1", 0)
    assert resolve_launch({"RANK": "0", "WORLD_SIZE": "1"}, _no_mpi) == Launch("torchrun", 0, 1, 0, 1, 1,
                                                                              "127.0.0.1", 0)
    assert resolve_launch({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, _no_mpi).world_size == 1
    assert resolve_launch({"PMI_RANK": "0", "PMI_SIZE": "1"}, _no_mpi).world_size == 1


def test_torchrun_variables_win_over_an_enclosing_srun_and_slurm_over_its_pmi():
    """``srun torchrun``: each worker inherits its task's SLURM_* but is one of torchrun's processes; ``srun --mpi``
    sets PMI_RANK beside SLURM_PROCID."""
    assert resolve_launch({**SLURM, **TORCHRUN}, _no_mpi).launcher == "torchrun"
    assert resolve_launch({**PALS, **SLURM}, _no_mpi).launcher == "slurm"
    assert resolve_launch({**OPENMPI, **TORCHRUN}, _no_mpi).launcher == "torchrun"


def test_the_exported_variables_resolve_to_the_same_process():
    launch = resolve_launch(SLURM, _no_mpi)
    environ = {}
    launch.export(environ)
    assert environ == {"RANK": "6", "WORLD_SIZE": "7", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                       "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "node01", "MASTER_PORT": "24321"}
    assert resolve_launch(environ, _no_mpi) == dataclasses.replace(launch, launcher="torchrun")
    assert launch.describe() == "slurm: rank 6 of 7, local 0 of 1, 4 node(s), master node01:24321"


def test_compressed_host_and_tasks_per_node_lists():
    assert expand_nodelist("node[01-04,07],gpu-a[1-2]") == ["node01", "node02", "node03", "node04", "node07",
                                                            "gpu-a1", "gpu-a2"]
    assert expand_nodelist("localhost") == ["localhost"]
    assert expand_nodelist("nid[009-010]") == ["nid009", "nid010"]
    assert expand_nodelist("r[1-2]-n[3,5]") == ["r1-n3", "r1-n5", "r2-n3", "r2-n5"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    for bad in ("node[1-", "a,,b", "n[3-1]", "n]", "", "n[]", "n[a]", "n[1]x[", "a b"):
        with pytest.raises(ValueError):
            expand_nodelist(bad)
    for bad in ("", "2(x0)", "0", "2(3)", "x", "2,,1"):
        with pytest.raises(ValueError):
            expand_tasks_per_node(bad)


# (environment, the variable and value its one-line error names)
BROKEN = [
    ({**TORCHRUN, "WORLD_SIZE": ""}, "torchrun launch: WORLD_SIZE is not set"),
    ({**TORCHRUN, "WORLD_SIZE": "eight"}, "torchrun launch: WORLD_SIZE='eight' is not an integer >= 1"),
    ({**TORCHRUN, "WORLD_SIZE": "0"}, "torchrun launch: WORLD_SIZE='0' is not an integer >= 1"),
    ({**TORCHRUN, "RANK": ""}, "torchrun launch: RANK is not set"),
    ({**TORCHRUN, "RANK": "-1"}, "torchrun launch: RANK='-1' is not an integer >= 0"),
    ({**TORCHRUN, "RANK": "8"}, "torchrun launch: RANK=8 is not below WORLD_SIZE=8"),
    ({**TORCHRUN, "LOCAL_RANK": ""}, "torchrun launch: LOCAL_RANK is not set"),
    ({**TORCHRUN, "LOCAL_RANK": "4"}, "torchrun launch: LOCAL_RANK=4 is not below LOCAL_WORLD_SIZE=4"),
    ({**TORCHRUN, "LOCAL_WORLD_SIZE": "four"}, "torchrun launch: LOCAL_WORLD_SIZE='four' is not an integer >= 1"),
    ({**TORCHRUN, "GROUP_WORLD_SIZE": "0"}, "torchrun launch: GROUP_WORLD_SIZE='0' is not an integer >= 1"),
    ({**TORCHRUN, "MASTER_ADDR": " "}, "torchrun launch: MASTER_ADDR is not set"),
    ({**TORCHRUN, "MASTER_PORT": ""}, "torchrun launch: MASTER_PORT is not set"),
    ({**TORCHRUN, "MASTER_PORT": "29x"}, "torchrun launch: MASTER_PORT='29x' is not an integer >= 1"),
    ({**DEEPSPEED, "LOCAL_SIZE": "-2"}, "torchrun launch: LOCAL_SIZE='-2' is not an integer >= 1"),
    ({**SLURM, "SLURM_NTASKS": ""}, "slurm launch: SLURM_STEP_NUM_TASKS / SLURM_NTASKS is not set"),
    ({**SLURM, "SLURM_NTASKS": "7.0"}, "slurm launch: SLURM_NTASKS='7.0' is not an integer >= 1"),
    ({**SLURM, "SLURM_PROCID": "x"}, "slurm launch: SLURM_PROCID='x' is not an integer >= 0"),
    ({**SLURM, "SLURM_PROCID": "7"}, "slurm launch: SLURM_PROCID=7 is not below SLURM_NTASKS=7"),
    ({**SLURM, "SLURM_LOCALID": ""}, "slurm launch: SLURM_LOCALID is not set"),
    ({**SLURM, "SLURM_LOCALID": "1"}, "slurm launch: SLURM_LOCALID=1 is not below SLURM_STEP_TASKS_PER_NODE[3]=1"),
    ({**SLURM, "SLURM_NODEID": ""}, "slurm launch: SLURM_NODEID is not set"),
    ({**SLURM, "SLURM_NODEID": "4"}, "slurm launch: SLURM_NODEID=4 is not below the number of nodes=4"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": ""},
     "slurm launch: SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE is not set"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(3)"},
     "slurm launch: SLURM_STEP_TASKS_PER_NODE='2(3)' is not a tasks-per-node list like '2(x3),1'"),
    ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2),1"},
     "slurm launch: SLURM_STEP_TASKS_PER_NODE='2(x2),1' adds up to 5 tasks, SLURM_NTASKS=7"),
    ({**SLURM, "SLURM_JOB_NODELIST": ""},
     "slurm launch: SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (or MASTER_ADDR) is not set"),
    ({**SLURM, "SLURM_JOB_NODELIST": "node[01-"}, "slurm launch: SLURM_JOB_NODELIST='node[01-' is not a host list"),
    ({**SLURM, "SLURM_JOB_ID": "job"}, "slurm launch: SLURM_JOB_ID='job' is not an integer >= 0"),
    ({**SLURM, "MASTER_PORT": "0"}, "slurm launch: MASTER_PORT='0' is not an integer >= 1"),
    ({**MPICH, "PMI_SIZE": ""}, "mpi launch: PMI_SIZE is not set"),
    ({**MPICH, "PMI_SIZE": "four"}, "mpi launch: PMI_SIZE='four' is not an integer >= 1"),
    ({**MPICH, "PMI_RANK": "4"}, "mpi launch: PMI_RANK=4 is not below PMI_SIZE=4"),
    ({**MPICH, "MPI_LOCALRANKID": ""}, "mpi launch: PALS_LOCAL_RANKID / MPI_LOCALRANKID is not set"),
    ({**MPICH, "MPI_LOCALNRANKS": ""}, "mpi launch: PALS_LOCAL_SIZE / MPI_LOCALNRANKS is not set"),
    ({**MPICH, "MPI_LOCALRANKID": "2"}, "mpi launch: MPI_LOCALRANKID=2 is not below MPI_LOCALNRANKS=2"),
    ({**PALS, "PALS_LOCAL_SIZE": "0"}, "mpi launch: PALS_LOCAL_SIZE='0' is not an integer >= 1"),
    ({**PALS, "PBS_NODEFILE": "/nonexistent/nodefile"},
     "mpi launch: PBS_NODEFILE='/nonexistent/nodefile' cannot be read (No such file or directory)"),
    (PALS, "mpi launch: MASTER_ADDR is not set, nor PBS_NODEFILE, and mpi4py is not installed to agree on one"),
    ({**MPICH, "MASTER_PORT": "p"}, "mpi launch: MASTER_PORT='p' is not an integer >= 1"),
    ({**OPENMPI, "OMPI_COMM_WORLD_SIZE": ""}, "mpi launch: OMPI_COMM_WORLD_SIZE is not set"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_RANK": "x"},
     "mpi launch: OMPI_COMM_WORLD_LOCAL_RANK='x' is not an integer >= 0"),
    ({**OPENMPI, "OMPI_COMM_WORLD_LOCAL_SIZE": ""}, "mpi launch: OMPI_COMM_WORLD_LOCAL_SIZE is not set"),
]


@pytest.mark.parametrize("environ, message", BROKEN, ids=[m.split(": ")[1].split(" ")[0] for _, m in BROKEN])
def test_a_missing_or_malformed_variable_is_one_error_naming_launcher_variable_and_value(environ, message):
    """Never a world of one when the launcher says more than one process."""
    with pytest.raises(LaunchError) as err:
        resolve_launch(environ, lambda: None)
    assert str(err.value).startswith(message) and "\n" not in str(err.value), str(err.value)


def test_an_empty_pbs_nodefile_is_named(tmp_path):
    nodefile = tmp_path / "nodefile"
    nodefile.write_text("\n")
    with pytest.raises(LaunchError, match=f"mpi launch: PBS_NODEFILE='{nodefile}' names no host"):
        resolve_launch({**PALS, "PBS_NODEFILE": str(nodefile)}, _no_mpi)


def test_info_shows_the_resolved_launch_or_its_error(monkeypatch):
    from ds4sci.commands import info

    for name in [*SLURM, *TORCHRUN, *PALS, *OPENMPI, "SLURM_STEP_NUM_TASKS", "SLURM_TASKS_PER_NODE"]:
        monkeypatch.delenv(name, raising=False)
    for name, value in OPENMPI.items():
        monkeypatch.setenv(name, value)
    assert info.launch() == dataclasses.asdict(Launch("mpi", 1, 2, 1, 2, 1, "host0", 1234))
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "")
    assert info.launch() == "error: mpi launch: OMPI_COMM_WORLD_LOCAL_SIZE is not set"


def test_the_rank_that_speaks_is_read_before_anything_is_checked():
    assert launch_rank({}) == 0 and launch_rank({"RANK": "3"}) == 3 and launch_rank({"RANK": "x"}) == 0
    assert [launch_rank(env) for env in (TORCHRUN, {**SLURM, **TORCHRUN}, SLURM, MPICH, PALS, OPENMPI)] == [5, 5, 6, 3,
                                                                                                             3, 1]
