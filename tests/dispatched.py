"""A dispatch mode that records the ATen and custom ops run while it is active, by name: for
tests that say which ops a call makes (custom ops seen as such, no tensor made for nothing)."""

from torch.utils._python_dispatch import TorchDispatchMode


class Dispatched(TorchDispatchMode):
    """The ops dispatched while it is active, in order (``ops``: names such as
    ``aten.zeros.default``)."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))
