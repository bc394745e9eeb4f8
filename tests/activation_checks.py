"""Counting activations: the bytes autograd saves for backward (tests/ is on sys.path through its conftest.py)."""
import torch


class SavedBytes:
    """The bytes autograd saves for backward while active, each storage once, the model's parameters left out (they
    are model state): ``with SavedBytes(model) as saved: model(...)``, then ``saved.total``. :meth:`pack` also counts
    tensors kept out of autograd's sight (a reentrant checkpoint's inputs). :attr:`on_device` is what the recorded
    storages hold now: less than :attr:`total` once host offload has released some (each storage is identified by
    its C++ object, kept alive here, not by its address, which a released storage gives back for reuse)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}  # storage object id -> bytes when saved
        self._held = {}  # storage object id -> the storage
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage._cdata] = storage.nbytes()
            self._held[storage._cdata] = storage
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    @property
    def on_device(self) -> int:
        return sum(s.nbytes() for s in self._held.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
