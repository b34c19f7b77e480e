"""Runs a callback right after a module is first imported.

A ``sys.meta_path`` finder that wraps the loader of one module: once the module has executed,
the callback runs (and the finder removes itself). ``import torch_moe`` registers its Inductor
lowerings this way when ``torch._inductor.lowering`` loads, and its DTensor support when
``torch.distributed.tensor`` does, so that processes that never compile or never use DTensor
do not pay for importing them.
"""

import importlib.abc
import importlib.machinery
import sys
from typing import Callable


class _CallAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable[[], None]):
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback()

        spec.loader = _Loader()
        return spec


def call_after_import(name: str, callback: Callable[[], None]) -> None:
    """Runs ``callback`` now if module ``name`` is imported, else right after its first import.
    Asking again for the same module and callback before that import does nothing."""
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _CallAfterImport) and f.name == name and f.callback == callback
                 for f in sys.meta_path):
        sys.meta_path.insert(0, _CallAfterImport(name, callback))
