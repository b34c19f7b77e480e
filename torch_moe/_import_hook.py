"""Runs a callback right after a module is first imported.

A ``sys.meta_path`` finder that wraps the loader of one module: once the module has executed,
the callback runs (and the finder removes itself). ``import torch_moe`` registers its Inductor
lowerings this way when ``torch._inductor.lowering`` loads, and its DTensor support when
``torch.distributed.tensor`` does, so that processes that never compile or never use DTensor
do not pay for importing them.
"""

import importlib.abc
import sys
from typing import Callable


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """The finder of one module: wraps its loader so that ``callbacks`` run, in order, once
    the module has executed."""

    def __init__(self, name: str):
        self.name, self.callbacks = name, []

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        # the spec the other finders give (this one has left sys.meta_path)
        spec = next((found for finder in sys.meta_path
                     if (found := finder.find_spec(fullname, path, target)) is not None), None)
        if spec is None or spec.loader is None:
            return spec
        loader, callbacks = spec.loader, self.callbacks

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                for callback in callbacks:
                    callback()

        spec.loader = _Loader()
        return spec


def call_after_import(name: str, callback: Callable[[], None]) -> None:
    """Runs ``callback`` now if module ``name`` is imported, else right after its first import
    (after the callbacks asked for earlier). Asking again for the same module and callback
    before that import does nothing."""
    if name in sys.modules:
        callback()
        return
    finder = next((f for f in sys.meta_path if isinstance(f, _CallAfterImport) and f.name == name),
                  None)
    if finder is None:
        finder = _CallAfterImport(name)
        sys.meta_path.insert(0, finder)
    if callback not in finder.callbacks:
        finder.callbacks.append(callback)
