# Owner(s): ["module: moe"]
"""``torch_moe._import_hook.call_after_import``: what registers the Inductor lowerings and the
DTensor support of ``import torch_moe`` when their torch modules are first imported."""

import importlib
import pathlib
import sys
import tempfile

from torch.testing._internal.common_utils import run_tests, TestCase

from torch_moe._import_hook import _CallAfterImport, call_after_import


class TestCallAfterImport(TestCase):
    def setUp(self):
        super().setUp()
        self.dir = tempfile.TemporaryDirectory()
        root = pathlib.Path(self.dir.name)
        (root / "tm_probe_pkg").mkdir()
        (root / "tm_probe_pkg" / "__init__.py").write_text("")
        (root / "tm_probe_pkg" / "mod.py").write_text("VALUE = 3\n")
        sys.path.insert(0, self.dir.name)
        importlib.invalidate_caches()

    def tearDown(self):
        sys.path.remove(self.dir.name)
        for name in ("tm_probe_pkg.mod", "tm_probe_pkg"):
            sys.modules.pop(name, None)
        sys.meta_path[:] = [f for f in sys.meta_path
                            if not (isinstance(f, _CallAfterImport) and f.name.startswith("tm_probe"))]
        self.dir.cleanup()
        super().tearDown()

    def test_every_callback_runs_once_after_the_module_executed(self):
        ran = []

        def seen(tag):
            # the module has executed when a callback runs
            return lambda: ran.append((tag, sys.modules["tm_probe_pkg.mod"].VALUE))

        first, second = seen("first"), seen("second")
        call_after_import("tm_probe_pkg.mod", first)
        call_after_import("tm_probe_pkg.mod", second)
        call_after_import("tm_probe_pkg.mod", first)  # asked twice: runs once
        self.assertEqual(ran, [])
        import tm_probe_pkg.mod  # noqa: F401

        self.assertEqual(ran, [("first", 3), ("second", 3)])
        self.assertFalse(any(isinstance(f, _CallAfterImport) and f.name == "tm_probe_pkg.mod"
                             for f in sys.meta_path))
        call_after_import("tm_probe_pkg.mod", seen("later"))  # imported: runs at once
        self.assertEqual(ran[-1], ("later", 3))


if __name__ == "__main__":
    run_tests()
