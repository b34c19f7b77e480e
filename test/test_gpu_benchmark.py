"""Tests of ``benchmarks/gpu.py`` that need no GPU: the run on a machine without CUDA (exit 0, a
JSON that says nothing was measured), and its pure helpers (FLOP counts, the peak table, the
device-test selection, pytest's summary, the targets, the budget) on made-up numbers."""

import importlib.util
import json
import math
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
from torch.testing._internal.common_utils import TestCase, run_tests

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gpu = _load_script()


def _gemm_row(impl, median_ms, tflops, gemm="w1", routing="balanced", model="DeepSeek-V3"):
    return {"model": model, "gemm": gemm, "routing": routing, "dtype": "bf16", "impl": impl,
            "median_ms": median_ms, "tflops": tflops}


def _layer_row(impl, median_ms, activation_MiB, model="DeepSeek-V3"):
    return {"model": model, "impl": impl, "median_ms": median_ms, "activation_MiB": activation_MiB}


class TestGpuBenchmark(TestCase):
    @unittest.skipIf(torch.cuda.is_available(), "with a GPU the script measures for minutes")
    def test_without_cuda_exits_zero_and_says_so(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gpu.json"
            proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)],
                                  capture_output=True, text=True, timeout=120)
            self.assertEqual(proc.returncode, 0, proc.stdout + proc.stderr)
            self.assertIn("no CUDA device: nothing measured", proc.stdout)
            record = json.loads(out.read_text())
        self.assertFalse(record["cuda_available"])
        self.assertIsNone(record["device"])
        self.assertEqual(record["message"], "no CUDA device: nothing measured")
        self.assertEqual(record["versions"]["torch"], torch.__version__)

    def test_flops(self):
        # DeepSeek-V3 up-projection over 16384 routed rows: 2 * 16384 * 7168 * 2048
        self.assertEqual(gpu.grouped_gemm_flops(16384, 7168, 2048), 481036337152.0)
        forward = 3 * 2.0 * 16384 * 7168 * 2048
        self.assertEqual(gpu.moe_ffn_flops(16384, 7168, 2048, backward=False), forward)
        self.assertEqual(gpu.moe_ffn_flops(16384, 7168, 2048, backward=True), 3 * forward)
        dsv3 = gpu.MODELS[0]
        self.assertEqual((dsv3.S, dsv3.scaled(4).T), (16384, 512))

    def test_dense_peak_table(self):
        self.assertEqual(gpu.dense_bf16_peak_tflops("NVIDIA H200"), 989.0)
        self.assertEqual(gpu.dense_bf16_peak_tflops("NVIDIA H100 80GB HBM3"), 989.0)
        self.assertEqual(gpu.dense_bf16_peak_tflops("NVIDIA H100 PCIe"), 756.0)
        self.assertEqual(gpu.dense_bf16_peak_tflops("NVIDIA GH200 480GB"), 989.0)
        self.assertIsNone(gpu.dense_bf16_peak_tflops("NVIDIA GeForce RTX 4090"))

    def test_select_device_tests(self):
        collected = [
            "test/cuda/test_a.py::TestKernelsCUDA::test_sort_cuda_bfloat16",
            "test/cuda/test_a.py::TestKernels::test_sort_interpreted",
            "test/cuda/test_b.py::TestCudaThings::test_x",  # "cuda" in the name, not a device class
            "test/cuda/test_b.py::test_function_cuda",
            "",
            "5 tests collected in 1.2s",
        ]
        self.assertEqual(gpu.select_device_tests(collected),
                         ["test/cuda/test_a.py::TestKernelsCUDA::test_sort_cuda_bfloat16"])

    def test_parse_pytest_counts(self):
        out = "F..s\nFAILED test/cuda/x.py::A::b\n2 failed, 10 passed, 1 skipped, 1 error in 3.10s\n"
        self.assertEqual(gpu.parse_pytest_counts(out),
                         {"failed": 2, "passed": 10, "skipped": 1, "errors": 1})
        self.assertEqual(gpu.parse_pytest_counts("no summary"), {})

    def test_targets(self):
        gemm_rows = [
            _gemm_row("torch._grouped_mm", 1.0, 600.0),
            _gemm_row("torch._grouped_mm (B column-major)", 0.8, 750.0),  # the faster layout
            _gemm_row("torch_moe.grouped_mm", 0.85, 720.0),
            _gemm_row("torch._grouped_mm", 1.0, 600.0, gemm="w2"),
            _gemm_row("torch_moe.grouped_mm", 1.25, 480.0, gemm="w2"),
            _gemm_row("torch_moe.grouped_mm", 0.1, 999.0, model="Mixtral-8x7B"),  # no target
        ]
        layer_rows = [
            _layer_row(gpu.LAYER_BF16, 10.0, 600.0),
            _layer_row(gpu.LAYER_FP8, 7.0, 500.0),
            _layer_row(gpu.LAYER_TITAN, 14.0, 1000.0),
            _layer_row(gpu.LAYER_LOOP, 40.0, 1200.0),
            {"model": "Qwen3-30B-A3B", "impl": gpu.LAYER_BF16, "error": "RuntimeError: boom"},
        ]
        targets = gpu.build_targets(gemm_rows, layer_rows, 989.0,
                                    models=("DeepSeek-V3", "Qwen3-30B-A3B"),
                                    routings=("balanced", "skewed"))
        by_name = {t["target"]: t for t in targets}
        self.assertEqual(len(targets), 2 * 2 * 2 + 2 * 3)

        t = by_name["bf16 grouped GEMM vs torch._grouped_mm, DeepSeek-V3 w1 balanced"]
        self.assertAlmostEqual(t["measured"], 0.8 / 0.85)
        self.assertTrue(t["pass"])
        t = by_name["bf16 grouped GEMM fraction of dense bf16 peak, DeepSeek-V3 w1 balanced"]
        self.assertAlmostEqual(t["measured"], 720.0 / 989.0)
        self.assertTrue(t["pass"])
        t = by_name["bf16 grouped GEMM vs torch._grouped_mm, DeepSeek-V3 w2 balanced"]
        self.assertAlmostEqual(t["measured"], 0.8)
        self.assertFalse(t["pass"])
        self.assertFalse(by_name["bf16 grouped GEMM fraction of dense bf16 peak, "
                                 "DeepSeek-V3 w2 balanced"]["pass"])
        t = by_name["bf16 grouped GEMM vs torch._grouped_mm, DeepSeek-V3 w1 skewed"]
        self.assertIsNone(t["measured"])
        self.assertIsNone(t["pass"])

        t = by_name["MoE layer fwd+bwd vs torchtitan-style, DeepSeek-V3"]
        self.assertAlmostEqual(t["measured"], 1.4)
        self.assertTrue(t["pass"])
        t = by_name["MoE layer activation memory saving vs torchtitan-style, DeepSeek-V3"]
        self.assertAlmostEqual(t["measured"], 0.4)
        self.assertTrue(t["pass"])
        t = by_name["FP8 rowwise layer fwd+bwd vs bf16, DeepSeek-V3"]
        self.assertAlmostEqual(t["measured"], 10.0 / 7.0)
        self.assertTrue(t["pass"])
        for name in ("MoE layer fwd+bwd vs torchtitan-style, Qwen3-30B-A3B",
                     "FP8 rowwise layer fwd+bwd vs bf16, Qwen3-30B-A3B"):
            self.assertIsNone(by_name[name]["pass"])

        printed = gpu.format_targets(targets)
        self.assertIn("PASS  MoE layer fwd+bwd vs torchtitan-style, DeepSeek-V3: 1.400", printed)
        self.assertIn("FAIL  bf16 grouped GEMM vs torch._grouped_mm, DeepSeek-V3 w2 balanced", printed)
        self.assertIn("not measured", printed)
        # no peak known: the fraction is not measured rather than wrong
        no_peak = gpu.build_targets(gemm_rows, [], None, models=("DeepSeek-V3",),
                                    routings=("balanced",))
        self.assertIsNone(no_peak[1]["pass"])

    def test_jsonable(self):
        record = {"a": float("nan"), "b": (1.0, float("inf")), "c": {"d": 2}}
        self.assertEqual(gpu.jsonable(record), {"a": None, "b": [1.0, None], "c": {"d": 2}})
        json.loads(json.dumps(gpu.jsonable(record), allow_nan=False))
        self.assertTrue(math.isnan(record["a"]))  # the input is left alone

    def test_budget_and_errors_are_recorded(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "gpu.json"
            run = gpu.Run(budget_s=100.0, out=out, quick=False)
            run.record = {"sections": {}}

            def fails(run):
                raise ValueError("broken section")

            gpu.run_section(run, "env", fails, needs_s=1.0)
            gpu.run_section(run, "tests", lambda run: {"value": 1}, needs_s=1.0)
            # the gemm share is 22 s of 100: a section that needs more is skipped
            gpu.run_section(run, "gemm", lambda run: {"value": 2}, needs_s=1e6)
            record = json.loads(out.read_text())
        sections = record["sections"]
        self.assertEqual(sections["env"]["status"], "error")
        self.assertIn("ValueError: broken section", sections["env"]["error"])
        self.assertEqual(sections["tests"], {"status": "ok", "value": 1})
        self.assertTrue(sections["gemm"]["status"].startswith("skipped: out of time"))
        self.assertIsNone(run.cuda_broken)

        run.note_error(RuntimeError("CUDA error: an illegal memory access was encountered"))
        self.assertTrue(run.skip_reason(0.0).startswith("skipped: CUDA context lost"))


if __name__ == "__main__":
    run_tests()
