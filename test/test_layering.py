# Owner(s): ["module: moe"]
"""The rooms of the package hold: no upward import, no import cycle, references apart.

The graph and the rules live in ``tools/import_graph.py`` (``python tools/import_graph.py`` prints
the whole graph by room); this test runs them on the package and on small packages made to
break each rule, so that a clean result on the package means something.
"""

import importlib.util
import pathlib
import tempfile
import textwrap

from torch.testing._internal.common_utils import run_tests, TestCase

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _load_tool():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


import_graph = _load_tool()


def _package(files: dict[str, str]) -> pathlib.Path:
    root = pathlib.Path(tempfile.mkdtemp())
    for rel, src in files.items():
        path = root / "torch_moe" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(src))
    return root


def _violations(root: pathlib.Path) -> list[str]:
    return import_graph.violations(import_graph.edges(root))


class TestRules(TestCase):
    def test_upward_import_is_found(self):
        root = _package({
            "__init__.py": "",
            "nn/__init__.py": "",
            "nn/functional.py": "def f():\n    from torch_moe.distributed.tensor import hook\n",
            "distributed/__init__.py": "",
            "distributed/tensor/__init__.py": "hook = None\n",
        })
        self.assertEqual(_violations(root), [
            "upward import: torch_moe.nn.functional (nn):2 imports torch_moe.distributed.tensor "
            "(distributed)"
        ])

    def test_relative_upward_import_is_found(self):
        root = _package({
            "__init__.py": "",
            "quantization/__init__.py": "",
            "quantization/ffn.py": "from ..nn import functional\n",
            "nn/__init__.py": "",
            "nn/functional.py": "",
        })
        self.assertEqual(_violations(root), [
            "upward import: torch_moe.quantization.ffn (quantization):1 imports "
            "torch_moe.nn.functional (nn)"
        ])

    def test_cycle_is_found(self):
        root = _package({
            "__init__.py": "",
            "nn/__init__.py": "",
            "nn/a.py": "from torch_moe.nn import b\n",
            "nn/b.py": "def f():\n    import torch_moe.nn.a\n",
        })
        self.assertEqual(_violations(root), ["cycle: torch_moe.nn.a -> torch_moe.nn.b -> torch_moe.nn.a"])

    def test_reference_sharing_code_is_found(self):
        root = _package({
            "__init__.py": "",
            "_refs/__init__.py": "from torch_moe._native.activation import swiglu\n",
            "_native/__init__.py": "",
            "_native/activation.py": "",
        })
        self.assertEqual(_violations(root), [
            "reference shares code: torch_moe._refs:1 imports torch_moe._native.activation"
        ])

    def test_library_using_a_reference_is_found(self):
        root = _package({
            "__init__.py": "",
            "_refs/__init__.py": "",
            "nn/__init__.py": "",
            "nn/functional.py": "from torch_moe._refs import moe_ffn_ref\n",
        })
        self.assertEqual(_violations(root), [
            "library uses a reference: torch_moe.nn.functional:1 imports torch_moe._refs"
        ])

    def test_downward_imports_are_fine(self):
        root = _package({
            "__init__.py": "from torch_moe import distributed, nn\n",
            "_checks.py": "",
            "nn/__init__.py": "from torch_moe import _checks\n",
            "distributed/__init__.py": "from torch_moe.nn import _checks\n",
        })
        self.assertEqual(_violations(root), [])


class TestPackageLayering(TestCase):
    def test_every_module_is_in_a_room(self):
        for module in import_graph.modules(ROOT):
            import_graph.room_of(module)  # raises for a module in no room

    def test_no_layering_violation(self):
        bad = _violations(ROOT)
        if bad:
            self.fail(f"{len(bad)} layering violations (python tools/import_graph.py prints the "
                      "graph):\n" + "\n".join(bad))


if __name__ == "__main__":
    run_tests()
