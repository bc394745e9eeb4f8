"""The memory-measurement harness and report helpers shared by the ``ds4sci bench`` memory benchmarks."""
import json

import pytest
import torch

from ds4sci.bench import memory
from ds4sci.bench.report import markdown_table
from ds4sci.bench.report import write_report


def test_saved_for_backward_counts_unique_storages():
    x = torch.randn(1000, requires_grad=True)  # 4000 B
    with memory.saved_for_backward() as saved:
        y = (x * x).exp()  # mul saves x twice (one storage), exp saves its 4000 B result
    assert saved.bytes == 8000
    y.sum().backward()  # the hooks hand the tensors back unchanged
    torch.testing.assert_close(x.grad, 2 * x.detach() * (x.detach() ** 2).exp())
    with memory.saved_for_backward() as nothing:
        with torch.no_grad():
            x.exp()
    assert nothing.bytes == 0


def test_peak_memory_on_the_cpu_sees_a_transient_allocation():
    with memory.PeakMemory("cpu") as peak:
        big = torch.ones(16 * 2**20)  # 64 MiB, touched, then freed inside the block
        del big
    assert 60 * 2**20 <= peak.bytes < 200 * 2**20
    assert memory.proc_status_bytes("VmHWM") >= memory.proc_status_bytes("VmRSS") > 0
    assert "VmHWM" in memory.peak_method("cpu") and memory.peak_method("cuda") == "torch.cuda.max_memory_allocated"


def test_subprocess_failure_names_the_call_and_carries_stderr():
    with pytest.raises(RuntimeError, match=r"(?s)proc_status_bytes\('NoSuchField',\) failed.*NoSuchField not found"):
        memory.run_in_subprocess("ds4sci.bench.memory:proc_status_bytes", "NoSuchField")


def test_allocator_settings_are_reported(monkeypatch):
    for name in list(memory.allocator_settings()):
        monkeypatch.delenv(name)
    assert memory.allocator_settings() == {}
    assert "defaults" in memory.describe_allocator({})
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    monkeypatch.setenv("MALLOC_UNRELATED", "x")  # glibc's variables end with "_"
    assert memory.allocator_settings() == {"MALLOC_MMAP_THRESHOLD_": "65536"}
    assert memory.describe_allocator(memory.allocator_settings()) == "Allocator: MALLOC_MMAP_THRESHOLD_=65536."


def test_report_files(tmp_path):
    lines = markdown_table(("a", "b"), [(1, "x"), (2.5, "y")])
    assert lines == ["| a | b |", "| --- | --- |", "| 1 | x |", "| 2.5 | y |"]
    path = write_report(tmp_path / "new", "thing", {"k": [1, 2]}, "\n".join(lines) + "\n")
    assert path == tmp_path / "new" / "thing.json" and json.loads(path.read_text()) == {"k": [1, 2]}
    assert (tmp_path / "new" / "thing.md").read_text().startswith("| a | b |\n")
