"""Who started this process, and as which rank: :func:`resolve_launch` reads a launcher's environment into one
:class:`Launch` (rank, world, local rank and size, nodes, the rendezvous address), before any process group exists.

Launchers, first match wins: torchrun and DeepSpeed's launcher (``RANK``, ``WORLD_SIZE``, ...), SLURM's ``srun``
(``SLURM_PROCID``, ...; an ``srun torchrun`` job is torchrun's, whose variables come first), MPI's ``mpiexec``
(MPICH / PALS ``PMI_*``, Open MPI ``OMPI_COMM_WORLD_*``), and a lone process last. :meth:`Launch.export` writes the
result as torch's ``env://`` variables, so ``deepspeed.init_distributed`` and ``init_process_group`` form the group.

An environment that names more than one process but not everything the group needs stops with one
:class:`LaunchError` naming the launcher and the variable: it never falls back to a world of one (which would train
one copy per process into one folder). Pure functions of an environment mapping, torch-free; only the MPI master
address, when neither ``MASTER_ADDR`` nor ``$PBS_NODEFILE`` names it, needs a collective (:func:`master_over_mpi`).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re
import socket
from typing import Callable
from typing import Mapping

__all__ = ["Launch", "LaunchError", "expand_nodelist", "expand_tasks_per_node", "launch_rank", "master_over_mpi",
           "resolve_launch"]

#: torch's default rendezvous port, used where a launcher names no port.
DEFAULT_PORT = 29500


class LaunchError(ValueError):
    """A launcher's environment that cannot form the process group; the message names the launcher and variable."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """This process's place in the launch. ``launcher``: ``torchrun`` (also DeepSpeed's launcher and any ``RANK`` /
    ``WORLD_SIZE`` environment), ``slurm``, ``mpi``, ``none`` (a lone process), or ``process group`` (one formed
    before, by a test harness: :func:`ds4sci.train.engine.init_distributed`); ``master_port`` 0 lets a lone
    process's store bind any free port."""

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    nodes: int
    master_addr: str
    master_port: int

    def export(self, environ: dict | None = None) -> None:
        """Write the launch as torch's ``env://`` variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
        ``MASTER_PORT``) and torchrun's ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE`` (the nodes) into
        ``environ`` (``os.environ`` by default): read back, they resolve to this launch (as ``torchrun``'s)."""
        environ = os.environ if environ is None else environ
        environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=str(self.local_rank),
                       LOCAL_WORLD_SIZE=str(self.local_world_size), GROUP_WORLD_SIZE=str(self.nodes),
                       MASTER_ADDR=self.master_addr, MASTER_PORT=str(self.master_port))

    def describe(self) -> str:
        """One line: ``slurm: rank 3 of 8, local 1 of 4, 2 node(s), master node01:29500``."""
        return (f"{self.launcher}: rank {self.rank} of {self.world_size}, local {self.local_rank} of "
                f"{self.local_world_size}, {self.nodes} node(s), master {self.master_addr}:{self.master_port}")


class _Env:
    """Reads one launcher's variables, each failure one :class:`LaunchError` naming the launcher and variable."""

    def __init__(self, environ: Mapping[str, str], launcher: str):
        self.environ, self.launcher = environ, launcher

    def first(self, *names: str) -> str | None:
        """The name of the first of ``names`` that is set (non-empty), else None."""
        return next((name for name in names if self.environ.get(name, "").strip()), None)

    def error(self, name: str, problem: str) -> LaunchError:
        """``problem``: ``is not set`` or ``=VALUE ...``."""
        return LaunchError(f"{self.launcher} launch: {name}{'' if problem.startswith('=') else ' '}{problem}")

    def integer(self, *names: str, lowest: int = 0, default: int | None = None) -> int:
        """The first of ``names`` that is set, as an integer >= ``lowest``; ``default`` when none is set."""
        name = self.first(*names)
        if name is None:
            if default is not None:
                return default
            raise self.error(" / ".join(names), "is not set")
        value = self.environ[name].strip()
        if not re.fullmatch(r"\d+", value) or int(value) < lowest:
            raise self.error(name, f"={value!r} is not an integer >= {lowest}")
        return int(value)

    def below(self, value: int, name: str, bound: int, bound_name: str) -> int:
        """``value`` (read from ``name``), checked to be below ``bound``."""
        if value >= bound:
            raise self.error(name, f"={value} is not below {bound_name}={bound}")
        return value


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list, expanded: ``node[01-03,07],gpu-a[1-2]`` -> ``node01 node02 node03 node07 gpu-a1
    gpu-a2`` (zero padding kept; several bracket groups in one name multiply out).

    Raises:
        ValueError: not names and bracketed ranges separated by commas, or a range not ``N`` / ``N-M``, ``N <= M``.
    """
    name_pattern = r"(?:[^,\[\]\s]|\[[^\[\]]*\])+"  # a host name, its ranges in brackets
    if not re.fullmatch(f"{name_pattern}(?:,{name_pattern})*", nodelist.strip()):
        raise ValueError(f"not a host list: {nodelist!r}")
    hosts: list[str] = []
    for name in re.findall(name_pattern, nodelist.strip()):
        expanded = [""]
        for part in re.finditer(r"([^\[]*)(?:\[([^\]]*)\])?", name):
            tails = [""] if part[2] is None else _expand_ranges(part[2])
            expanded = [head + part[1] + tail for head in expanded for tail in tails]
        hosts.extend(expanded)
    return hosts


def _expand_ranges(ranges: str) -> list[str]:
    """``01-03,07`` -> ``01 02 03 07``."""
    out = []
    for part in ranges.split(","):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ValueError(f"bad range {part!r} in [{ranges}]")
        low, high = int(match[1]), int(match[2] or match[1])
        out.extend(str(i).zfill(len(match[1])) for i in range(low, high + 1))
    return out


def expand_tasks_per_node(tasks: str) -> list[int]:
    """SLURM's compressed tasks per node, expanded: ``2(x3),1`` -> ``[2, 2, 2, 1]``.

    Raises:
        ValueError: an item that is not ``N`` or ``N(xK)`` with ``N, K >= 1``.
    """
    counts: list[int] = []
    for item in tasks.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise ValueError(f"bad item {item!r}")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


@functools.cache
def master_over_mpi() -> str | None:
    """Rank 0's host name, broadcast over MPI (mpi4py) to every rank, as DeepSpeed's MPI discovery agrees on its
    master; None when mpi4py is not installed. Collective: every rank of the MPI world calls it (once; cached)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return None
    return MPI.COMM_WORLD.bcast(socket.gethostname(), root=0)


def resolve_launch(environ: Mapping[str, str] | None = None,
                   mpi_master: Callable[[], str | None] = master_over_mpi) -> Launch:
    """This process's :class:`Launch`, read from ``environ`` (``os.environ`` by default); ``mpi_master`` agrees on
    the MPI master address when the environment names none (faked by tests).

    Raises:
        LaunchError: the environment names more than one process, but a variable the group needs is missing or
            malformed (one line naming the launcher, the variable and its value).
    """
    environ = os.environ if environ is None else environ
    if any(environ.get(name, "").strip() for name in ("RANK", "WORLD_SIZE")):
        return _torchrun(_Env(environ, "torchrun"))
    if environ.get("SLURM_PROCID", "").strip():
        return _slurm(_Env(environ, "slurm"))
    for names in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if any(environ.get(name, "").strip() for name in names):
            return _mpi(_Env(environ, "mpi"), *names, mpi_master)
    return Launch("none", 0, 1, 0, 1, 1, "127.0.0.1", 0)


#: Each launcher's rank variable, in :func:`resolve_launch`'s order.
RANK_VARIABLES = ("RANK", "SLURM_PROCID", "PMI_RANK", "OMPI_COMM_WORLD_RANK")


def launch_rank(environ: Mapping[str, str] | None = None) -> int:
    """This process's rank as its launcher names it (the first of :data:`RANK_VARIABLES` set), read before anything
    is checked, for who speaks for a launch and who reports its errors; 0 alone, or when the value is malformed."""
    environ = os.environ if environ is None else environ
    value = next((environ[name].strip() for name in RANK_VARIABLES if environ.get(name, "").strip()), "0")
    return int(value) if value.isdigit() else 0


def _torchrun(env: _Env) -> Launch:
    """torchrun (``LOCAL_WORLD_SIZE``, ``GROUP_WORLD_SIZE``) and DeepSpeed's launcher (``LOCAL_SIZE``,
    ``CROSS_SIZE``), or any environment that sets ``RANK`` / ``WORLD_SIZE``; without a local size, one node."""
    world = env.integer("WORLD_SIZE", lowest=1)
    rank = env.below(env.integer("RANK"), "RANK", world, "WORLD_SIZE")
    if world == 1:  # a lone process under a launcher: what it does not name, the lone defaults fill in
        return Launch("torchrun", 0, 1, env.integer("LOCAL_RANK", default=0), 1, 1,
                      env.environ.get("MASTER_ADDR") or "127.0.0.1", env.integer("MASTER_PORT", default=0))
    local_world = env.integer("LOCAL_WORLD_SIZE", "LOCAL_SIZE", lowest=1, default=world)
    local = env.below(env.integer("LOCAL_RANK"), "LOCAL_RANK", local_world, "LOCAL_WORLD_SIZE")
    nodes = env.integer("GROUP_WORLD_SIZE", "CROSS_SIZE", lowest=1, default=-(-world // local_world))
    if not env.environ.get("MASTER_ADDR", "").strip():
        raise env.error("MASTER_ADDR", "is not set")
    return Launch("torchrun", rank, world, local, local_world, nodes, env.environ["MASTER_ADDR"].strip(),
                  env.integer("MASTER_PORT", lowest=1))


def _slurm(env: _Env) -> Launch:
    """``srun`` without torchrun: one task per process; the master is the first host of the step's node list."""
    world = env.integer("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", lowest=1)
    rank = env.below(env.integer("SLURM_PROCID"), "SLURM_PROCID", world, "SLURM_NTASKS")
    if world == 1:
        return Launch("slurm", 0, 1, 0, 1, 1, env.environ.get("MASTER_ADDR") or "127.0.0.1",
                      env.integer("MASTER_PORT", default=0))
    name = env.first("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if name is None:
        raise env.error("SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE", "is not set")
    try:
        per_node = expand_tasks_per_node(env.environ[name])
    except ValueError as err:
        raise env.error(name, f"={env.environ[name]!r} is not a tasks-per-node list like '2(x3),1' ({err})") from None
    if name == "SLURM_NTASKS_PER_NODE" and len(per_node) == 1:  # one count for every node
        per_node *= -(-world // per_node[0])
    if sum(per_node) != world:
        raise env.error(name, f"={env.environ[name]!r} adds up to {sum(per_node)} tasks, SLURM_NTASKS={world}")
    node = env.integer("SLURM_NODEID", default=0 if len(set(per_node)) == 1 else None)
    node = env.below(node, "SLURM_NODEID", len(per_node), "the number of nodes")
    local = env.below(env.integer("SLURM_LOCALID"), "SLURM_LOCALID", per_node[node], f"{name}[{node}]")
    master = env.environ.get("MASTER_ADDR", "").strip()
    if not master:
        name = env.first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if name is None:
            raise env.error("SLURM_STEP_NODELIST / SLURM_JOB_NODELIST (or MASTER_ADDR)", "is not set")
        try:
            master = expand_nodelist(env.environ[name])[0]
        except ValueError as err:
            raise env.error(name, f"={env.environ[name]!r} is not a host list ({err})") from None
    job = env.integer("SLURM_JOB_ID", default=-1)  # one port per job: two jobs sharing a node do not collide
    port = env.integer("MASTER_PORT", lowest=1, default=DEFAULT_PORT if job < 0 else 20000 + job % 10000)
    return Launch("slurm", rank, world, local, per_node[node], len(per_node), master, port)


def _mpi(env: _Env, rank_name: str, size_name: str, mpi_master: Callable[[], str | None]) -> Launch:
    """``mpiexec`` (MPICH / Cray PALS, Open MPI); the master from ``MASTER_ADDR``, ``$PBS_NODEFILE``'s first line,
    or rank 0's host name agreed over MPI."""
    world = env.integer(size_name, lowest=1)
    rank = env.below(env.integer(rank_name), rank_name, world, size_name)
    if world == 1:
        return Launch("mpi", 0, 1, 0, 1, 1, env.environ.get("MASTER_ADDR") or "127.0.0.1",
                      env.integer("MASTER_PORT", default=0))
    if rank_name == "PMI_RANK":
        local_names, size_names = ("PALS_LOCAL_RANKID", "MPI_LOCALRANKID"), ("PALS_LOCAL_SIZE", "MPI_LOCALNRANKS")
    else:
        local_names, size_names = ("OMPI_COMM_WORLD_LOCAL_RANK",), ("OMPI_COMM_WORLD_LOCAL_SIZE",)
    local_world = env.integer(*size_names, lowest=1)
    local = env.below(env.integer(*local_names), env.first(*local_names), local_world, env.first(*size_names))
    master = env.environ.get("MASTER_ADDR", "").strip()
    if not master and env.environ.get("PBS_NODEFILE", "").strip():
        path = env.environ["PBS_NODEFILE"]
        try:
            with open(path) as lines:
                master = next((line.strip() for line in lines if line.strip()), "")
        except OSError as err:
            raise env.error("PBS_NODEFILE", f"={path!r} cannot be read ({err.strerror})") from None
        if not master:
            raise env.error("PBS_NODEFILE", f"={path!r} names no host")
    if not master:
        master = mpi_master() or ""
    if not master:
        raise env.error("MASTER_ADDR", "is not set, nor PBS_NODEFILE, and mpi4py is not installed to agree on one")
    return Launch("mpi", rank, world, local, local_world, -(-world // local_world), master,
                  env.integer("MASTER_PORT", lowest=1, default=DEFAULT_PORT))
