"""What a rank's DeepSpeed start-up imports: DeepSpeed's ZeRO optimizer check imports its Muon optimizer, whose
``torch.compile`` decorators import TorchInductor (seconds of CPU per process); ``initialize_deepspeed`` keeps them
from compiling. Each check runs in a fresh worker (``run_workers``: torch and torch._dynamo preloaded, not
Inductor, not DeepSpeed)."""
import os
import re
import sys
from pathlib import Path

import pytest

from ds4sci.spawn import run_workers

INDUCTOR = "torch._inductor.compile_fx"
ENV = {"DS_ACCELERATOR": "cpu"}
ROOT = Path(__file__).resolve().parents[2]


def _muon_import_loads_inductor(rank, world_size) -> bool:
    os.environ.pop("TORCHDYNAMO_DISABLE", None)
    assert INDUCTOR not in sys.modules
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401

    return INDUCTOR in sys.modules


def _engine_start(rank, world_size, before: str | None) -> tuple[bool, str | None]:
    import torch

    from ds4sci.train.engine import init_distributed
    from ds4sci.train.engine import initialize_deepspeed

    init_distributed()  # as a rank does before its engine (DeepSpeed's communication backend, no CPU shm op)
    if before is not None:
        os.environ["TORCHDYNAMO_DISABLE"] = before
    assert INDUCTOR not in sys.modules
    model = torch.nn.Linear(4, 4)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    engine, *_ = initialize_deepspeed(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config,
                                      dist_init_required=False)
    assert engine.zero_optimization_stage() == 2
    return INDUCTOR in sys.modules, os.environ.get("TORCHDYNAMO_DISABLE")


def test_deepspeeds_muon_import_compiles_with_inductor():
    """The dependency's behaviour the workaround exists for (deepspeed 0.19): when this fails, DeepSpeed no longer
    compiles at that import and ``initialize_deepspeed`` can become a plain ``deepspeed.initialize``."""
    assert run_workers(_muon_import_loads_inductor, 1, env=ENV) == [True]


@pytest.mark.parametrize("before", [None, "0"])
def test_the_engine_starts_without_inductor_and_restores_the_environment(before):
    assert run_workers(_engine_start, 1, before, env=ENV) == [(False, before)]


def test_every_engine_starts_through_initialize_deepspeed():
    call = re.compile(r"(?<!`)\bdeepspeed\.initialize\(")  # a call, not a docstring's ``deepspeed.initialize(...)``
    calls = [str(path.relative_to(ROOT)) for path in (ROOT / "ds4sci").rglob("*.py") if call.search(path.read_text())]
    assert calls == ["ds4sci/train/engine.py"]
