"""Counting activations: the bytes autograd saves for backward (tests/ is on sys.path through its conftest.py)."""
import torch


class SavedBytes:
    """The bytes autograd saves for backward while active, each storage once, the model's parameters left out (they
    are model state): ``with SavedBytes(model) as saved: model(...)``, then ``saved.total``. :meth:`pack` also counts
    tensors kept out of autograd's sight (a reentrant checkpoint's inputs)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages = {}  # storage address -> bytes
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in self.params:
            self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def __enter__(self) -> "SavedBytes":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
