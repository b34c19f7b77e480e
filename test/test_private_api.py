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


def _aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch modules or objects by imports: ``import torch.distributed as
    dist`` -> ``{"dist": "torch.distributed"}``, ``from torch.nn import functional as F`` ->
    ``{"F": "torch.nn.functional"}``."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname and a.name.split(".")[0] == "torch":
                    names[a.asname] = a.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module.split(".")[0] == "torch":
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _string(node: ast.AST):
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _names_in_call(node: ast.Call, resolve) -> list[str]:
    """``getattr(obj, "_name")`` / ``hasattr``: ``obj._name``; ``importlib.import_module("m")``
    and ``__import__("m")``: ``m``."""
    func = _dotted(node.func) or ""
    if func in ("getattr", "hasattr") and len(node.args) >= 2 and _string(node.args[1]):
        base = resolve(_dotted(node.args[0]))
        return [f"{base}.{_string(node.args[1])}"] if base else []
    if (func.endswith("import_module") or func == "__import__") and node.args \
            and _string(node.args[0]):
        return [_string(node.args[0])]
    return []


def private_references(source: str, filename: str = "<string>") -> list[tuple[int, str]]:
    """``(line, private torch name)`` for every private torch API the code of ``source`` names:
    imports (module and function level), attribute chains rooted at ``torch`` or at a name an
    import bound to a torch module, ``getattr(<torch...>, "_name")`` and
    ``importlib.import_module("torch._x")``."""
    tree = ast.parse(source, filename)
    aliases = _aliases(tree)

    def resolve(dotted):
        if dotted is None:
            return None
        head, _, rest = dotted.partition(".")
        if head in aliases:
            return aliases[head] + ("." + rest if rest else "")
        return dotted

    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            names = [resolve(_dotted(node))]
        elif isinstance(node, ast.Call):
            names = _names_in_call(node, resolve)
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
            "import torch.distributed as dist",
            "dist._functional_collectives.all_to_all_single",
            "import importlib",
            "importlib.import_module('torch._inductor.lowering')",
            "from torch.nn import functional as F",
            "F._canonical_mask",
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
            (12, "torch.distributed._functional_collectives"),
            (14, "torch._inductor"),
            (16, "torch.nn.functional._canonical_mask"),
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
