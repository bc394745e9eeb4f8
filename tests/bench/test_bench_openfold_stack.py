"""``ds4sci bench openfold-stack``'s report carries, beside every step time, the machine (CPU model, cores), the date
and the load average at the start and at the end of each path's run. The run itself (OpenFold3 in subprocesses):
tests/integrations/test_openfold.py."""
import datetime

from ds4sci.bench import openfold_stack
from ds4sci.bench.report import MIB
from ds4sci.bench.report import describe_load
from ds4sci.bench.report import describe_machine
from ds4sci.bench.report import load_average
from ds4sci.bench.report import machine


def test_machine_and_load():
    info = machine()
    assert info["cpu"] and info["cores"] >= info["usable_cores"] >= 1
    assert datetime.datetime.fromisoformat(info["date"]).tzinfo is not None
    load = load_average()
    assert len(load) == 3 and all(x >= 0 for x in load)
    assert describe_load([0.5, 1, 2], [2.25, 1, 2]) == "0.50 -> 2.25"
    assert describe_machine({"cpu": "Some CPU", "cores": 1, "usable_cores": 1, "date": "2026-01-02T03:04:05+00:00"}) \
        == "Some CPU, 1 core (1 usable), 2026-01-02T03:04:05+00:00"


def _report():
    cfg = openfold_stack.default_config(threads=1, device="cpu")
    host = {"cpu": "Test CPU @ 2.0GHz", "cores": 2, "usable_cores": 2, "date": "2026-11-26T00:00:00+00:00"}
    return {
        "config": cfg, "machine": host, "peak_method": "VmHWM - VmRSS", "allocator": {},
        "load": {"default": {"start": [0.75, 1.3, 1.66], "end": [2.0, 1.5, 1.7]},
                 "ds4sci": {"start": [2.0, 1.5, 1.7], "end": [3.5, 2.0, 1.8]}},
        "results": {mode: {"peak_bytes": 100 * MIB, "saved_bytes": 50 * MIB, "seconds": s}
                    for mode, s in (("default", 9.16), ("ds4sci", 6.05))},
        "peak_ratio": 1.0, "saved_ratio": 1.0, "relative_diff": {"m": 1e-7, "z": 1e-7, "param_grads": 1e-5},
    }


def test_markdown_puts_machine_date_and_load_beside_the_times(tmp_path):
    text = openfold_stack.markdown(_report())
    assert "Timed on Test CPU @ 2.0GHz, 2 cores (2 usable), 2026-11-26T00:00:00+00:00 with 1 torch thread;" in text
    assert "waiting for one of the 2 cores" in text
    assert "| step time (s) | load average (1 min) start -> end |" in text
    assert "| default | 100.0 | 50.0 | 9.16 | 0.75 -> 2.00 |" in text
    assert "| ds4sci | 100.0 | 50.0 | 6.05 | 2.00 -> 3.50 |" in text
    openfold_stack.plot(_report(), tmp_path / "openfold_stack.png")
    assert (tmp_path / "openfold_stack.png").read_bytes()[:4] == b"\x89PNG"
