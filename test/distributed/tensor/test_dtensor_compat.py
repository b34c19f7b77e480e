# Owner(s): ["module: moe"]
"""The DTensor adapter (:mod:`torch_moe.distributed.tensor._compat`) hands the strategy filter
of the mesh-dependent rules to ``expand_to_full_mesh_op_strategy`` under the keyword that the
installed torch takes, whichever of its spellings that is, and refuses to drop it.

The rules that the filter keeps or drops are checked against the ops themselves in
``test_moe_sharding.py``; here only the hand-over is, so that both spellings are exercised on any
one torch.
"""

import inspect
from unittest import mock

from torch.testing._internal.common_utils import run_tests, TestCase

from torch_moe.distributed.tensor import _compat


def _keep_all(input_specs, output_specs) -> bool:
    return True


class TestStrategyFilterKeyword(TestCase):
    def setUp(self):
        super().setUp()
        # the keyword is looked up once per process; every test here swaps the function
        _compat._strategy_filter_keyword.cache_clear()
        self.addCleanup(_compat._strategy_filter_keyword.cache_clear)

    def _expand_with(self, fake):
        with mock.patch.object(_compat._op_utils, "expand_to_full_mesh_op_strategy", fake):
            return _compat.expand_to_full_mesh_op_strategy(
                "mesh", "op_schema", [["rule"]], input_index=2, strategy_filter=_keep_all
            )

    def test_installed_torch_takes_one_of_the_keywords(self):
        params = inspect.signature(_compat._op_utils.expand_to_full_mesh_op_strategy).parameters
        self.assertIn(_compat._strategy_filter_keyword(), params)

    def test_older_keyword(self):
        def fake(mesh, op_schema, rules, *, input_index=1, is_valid_strategy_cb=None):
            return (mesh, op_schema, rules, input_index, is_valid_strategy_cb)

        self.assertEqual(self._expand_with(fake), ("mesh", "op_schema", [["rule"]], 2, _keep_all))

    def test_newer_keyword(self):
        def fake(mesh, op_schema, rules, *, input_index=1, full_mesh_strategy_filter=None):
            return (mesh, op_schema, rules, input_index, full_mesh_strategy_filter)

        self.assertEqual(self._expand_with(fake), ("mesh", "op_schema", [["rule"]], 2, _keep_all))

    def test_no_keyword_raises(self):
        # expanding without the filter would claim shards that split MX blocks: a wrong
        # sharding, so no silent fallback
        def fake(mesh, op_schema, rules, *, input_index=1):
            raise AssertionError("called without the filter")

        with self.assertRaisesRegex(RuntimeError, "full_mesh_strategy_filter"):
            self._expand_with(fake)

    def test_no_filter_passes_no_keyword(self):
        def fake(mesh, op_schema, rules, *, input_index=1):
            return input_index

        with mock.patch.object(_compat._op_utils, "expand_to_full_mesh_op_strategy", fake):
            self.assertEqual(
                _compat.expand_to_full_mesh_op_strategy("mesh", "op_schema", [], input_index=3), 3
            )


if __name__ == "__main__":
    run_tests()
