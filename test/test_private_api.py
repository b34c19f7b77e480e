# Owner(s): ["module: moe"]
"""Private PyTorch APIs are reached through one adapter module per area, and nowhere else.

The scan reads every module of the package with ``ast``: an import of, or an attribute chain
through, a private component of ``torch`` (``torch._x``, ``torch.distributed._x``,
``torch.distributed.tensor._x``, ``torch.ops.aten._x``, ...) outside the adapters is a failure,
listed with its file and line. Comments and docstrings are not code and are not read.
"""

import ast
import pathlib

from torch.testing._internal.common_utils import run_tests, TestCase

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "torch_moe"

# one adapter per area; every private torch API the package uses is reached through these
ADAPTERS = {
    "ops": "_compat.py",
    "Inductor": "_inductor/_compat.py",
    "distributed": "distributed/_compat.py",
    "DTensor": "distributed/tensor/_compat.py",
}

# The torch._check family is how PyTorch's own meta registrations (and the torch.export
# documentation) state conditions that tracing keeps; the fake kernels mirror that file.
DOCUMENTED = ("torch._check",)
# the package's own operator namespace: torch.ops.torch_moe._triton_* are torch_moe's ops
OWN = ("torch.ops.torch_moe",)


def _dotted(node: ast.AST):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return ".".join(reversed(parts))


def _private_prefix(name: str):
    """``torch.a._b.c`` -> ``torch.a._b`` (the first private component), or None."""
    parts = name.split(".")
    if parts[0] != "torch" or name.startswith(OWN):
        return None
    for i, p in enumerate(parts[1:], 1):
        if p.startswith("_") and not (p.startswith("__") and p.endswith("__")):
            prefix = ".".join(parts[: i + 1])
            return None if prefix.startswith(DOCUMENTED) else prefix
    return None


def private_references(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """``(line, private torch name)`` for every private torch API the code of ``source`` names:
    imports (module and function level), attribute chains rooted at ``torch``, and
    ``getattr(<torch...>, "_name")``."""
    tree = ast.parse(source, filename)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            names = [_dotted(node)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            base = _dotted(node.args[0])
            if base is not None:
                names = [f"{base}.{node.args[1].value}"]
        for name in names:
            prefix = name and _private_prefix(name)
            if prefix:
                found.add((node.lineno, prefix))
                break
    return sorted(found)


def _package_modules():
    return sorted(PACKAGE.rglob("*.py"))


class TestScanner(TestCase):
    """The scan itself finds what it must (so that an empty result means something)."""

    def test_finds_private_references(self):
        src = "\n".join([
            "import torch",
            "import torch.distributed._functional_collectives as funcol",
            "from torch._subclasses.fake_tensor import FakeTensor",
            "from torch.distributed.tensor._op_schema import OpSchema",
            "from torch.distributed.tensor import _ops",
            "def f(a, b, offs):",
            "    from torch._inductor.lowering import register_lowering",
            "    torch.ops.aten._grouped_mm.default(a, b, offs)",
            "    return torch._grouped_mm(a, b, offs=offs)",
            "g = getattr(torch.ops.mkldnn, '_is_mkldnn_bf16_supported')",
        ])
        self.assertEqual(private_references(src), [
            (2, "torch.distributed._functional_collectives"),
            (3, "torch._subclasses"),
            (4, "torch.distributed.tensor._op_schema"),
            (5, "torch.distributed.tensor._ops"),
            (7, "torch._inductor"),
            (8, "torch.ops.aten._grouped_mm"),
            (9, "torch._grouped_mm"),
            (10, "torch.ops.mkldnn._is_mkldnn_bf16_supported"),
        ])

    def test_ignores_public_and_own_names(self):
        src = "\n".join([
            "import torch",
            "import torch.nn.functional as F",
            "torch._check(True, lambda: 'x')",
            "torch._check_index(True)",
            "torch.ops.torch_moe._triton_grouped_mm.default",
            "torch.Tensor.__torch_function__",
            "x = F.grouped_mm",
            "# torch._grouped_mm in a comment",
            "'''torch._grouped_mm in a docstring'''",
        ])
        self.assertEqual(private_references(src), [])


class TestPrivateApiOnlyInAdapters(TestCase):
    def test_adapters_exist(self):
        for area, rel in ADAPTERS.items():
            self.assertTrue((PACKAGE / rel).is_file(), f"the {area} adapter {rel} is missing")

    def test_no_private_torch_api_outside_adapters(self):
        adapters = {PACKAGE / rel for rel in ADAPTERS.values()}
        outside = []
        for path in _package_modules():
            if path in adapters:
                continue
            for line, name in private_references(path.read_text(), str(path)):
                outside.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name}")
        if outside:
            self.fail(f"{len(outside)} references to private torch APIs outside the adapters "
                      f"({', '.join(ADAPTERS.values())}):\n" + "\n".join(outside))

    def test_every_adapter_is_used(self):
        # an adapter that nothing imports is dead code pretending to be the one place
        sources = {p: p.read_text() for p in _package_modules()}
        for area, rel in ADAPTERS.items():
            module = "torch_moe." + rel.removesuffix(".py").replace("/", ".")
            users = [p for p, s in sources.items() if p != PACKAGE / rel and (
                f"import {module}" in s or f"from {module} import" in s)]
            self.assertTrue(users, f"nothing imports the {area} adapter {module}")


if __name__ == "__main__":
    run_tests()
