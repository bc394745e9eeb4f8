"""The inference commands' process groups, refused like training's when a Ulysses group would span nodes: before the
process group forms, naming the ``--ulysses``/``--ring`` that keep it inside a node (no process is started)."""
import pytest

from ds4sci.infer.parallel import ShardedForward

TWO_NODES = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2",
             "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # torchrun --nnodes 2 --nproc-per-node 2; no store


def test_a_ulysses_group_across_nodes_is_refused_before_the_process_group(tiny, monkeypatch):
    from ds4sci.infer import parallel

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)  # an earlier test's group may still be up
    for key, value in TWO_NODES.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda *a, **k: pytest.fail("a group was started"))
    with pytest.raises(ValueError) as err:
        ShardedForward.from_world(tiny[0], ulysses=4)
    assert str(err.value) == ("ulysses=4 groups would span nodes on 2 node(s) x 2 process(es) per node; --ulysses 2 "
                              "--ring 2 keeps them inside a node on the same 4 processes")
