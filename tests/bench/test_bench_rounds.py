"""The benchmarks timed in rounds (``generate``, ``score-variants``, ``throughput``): the alternation of
:mod:`ds4sci.bench.rounds`, the torch threads given back, and the options they share."""
import pytest
import torch

from ds4sci.bench import rounds

from bench_checks import refused_in_one_line  # tests/bench/ is on sys.path


def _work(name: str, order: list[str]):
    def run() -> str:
        order.append(name)
        sum(range(20_000))  # some CPU time on both clocks
        return name.upper()

    return run


def test_alternate_reverses_the_order_every_round_and_checks_each():
    order, checked = [], []
    timed = rounds.alternate({"a": _work("a", order), "b": _work("b", order)}, {"a": 10, "b": 20}, 3, "items",
                             check=checked.append)
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert checked == [{"a": "A", "b": "B"}] * 3
    assert len(timed) == 3
    for r in timed:
        assert set(r) == set(rounds.CLOCKS)
        for rates in r.values():
            assert rates["a"] > 0 and rates["b"] > 0 and rates["ratio"] == pytest.approx(rates["a"] / rates["b"])


def test_torch_threads_are_given_back():
    threads = torch.get_num_threads()
    with pytest.raises(RuntimeError), rounds.torch_threads(threads + 1):
        assert torch.get_num_threads() == threads + 1
        raise RuntimeError
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("name", ["generate", "score-variants", "throughput"])
@pytest.mark.parametrize("argv, message", [
    (["--rounds", "0"], "--rounds=0: must be >= 1"),
    (["--hidden", "60", "--heads", "8"], "--hidden=60 is not divisible by --heads=8"),
])
def test_shared_options_refused_in_one_line(name, argv, message, tmp_path, capsys):
    assert refused_in_one_line(capsys, tmp_path, name, argv) == message
