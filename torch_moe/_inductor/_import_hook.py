"""Runs a callback right after a module is first imported.

A ``sys.meta_path`` finder that wraps the loader of one module: once the module has executed,
the callback runs (and the finder removes itself). Used to register Inductor lowerings without
importing Inductor in processes that never compile.
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
    if name in sys.modules:
        callback()
    elif not any(isinstance(f, _CallAfterImport) and f.name == name for f in sys.meta_path):
        sys.meta_path.insert(0, _CallAfterImport(name, callback))
