# Owner(s): ["module: moe"]
"""Restarts that lose nothing: ``benchmarks/demo.py --expert-parallel`` under ``torchrun``,
killed and restarted, ends with the parameters of an uninterrupted run, bit for bit.

One test, four launches of ``python -m torch.distributed.run --standalone --nproc-per-node 2``
(gloo, CPU, a model of one block with D=16 and E=4, 10 steps):

1. the reference: 10 steps without checkpoints, ``--save-final`` (the full model and AdamW
   state, gathered to rank 0);
2. ``--max-restarts 1 --checkpoint-dir D --checkpoint-every 3 --fail-at-step 7 --fail-rank 1``:
   rank 1 exits with status 1 after step 7, torchrun stops rank 0 and restarts both, the new
   group resumes from ``D/step_00000006`` (rank 0's log says so) and finishes; its final state
   is ``torch.equal`` to the reference in every tensor (parameters, the routers' expert bias,
   Adam's moments and steps) and equal in every other value (LR, scheduler);
3. then ``D`` gets what an interrupted save leaves (a complete-looking checkpoint of step 10
   under its temporary name, copied from step 9) and a ``step_00000011`` without DCP
   ``.metadata``; a third run resumes from ``step_00000009`` and ends equal to the reference
   again.

Only real processes under the real launcher show the restart (torchrun's agent stops and
starts the group; the demo finds its checkpoint by itself), hence the multi-process cost
(about 30 s on two cores). The unit tests of the commit protocol are in ``test_checkpoint.py``.

Workers of a restarted group run with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with the
agent's TCPStore shared across restarts (torch's default since 2.5), the new gloo group can read
the addresses the dead one published and fail to connect or hang in ``init_process_group``
(pytorch/pytorch#135712; seen here in about half of the restarts on torch 2.13).

Run: ``python -m pytest test/distributed/test_restart_torchrun.py -q`` from the repo root.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.common_utils import run_tests, TestCase

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "benchmarks" / "demo.py"
LAUNCH_TIMEOUT_S = 180
TINY = ["--expert-parallel", "--no-benchmark", "--steps", "10", "--layers", "1", "--dim", "16",
        "--heads", "2", "--ffn-dim", "32", "--experts", "4", "--batch", "4", "--seq-len", "17",
        "--vocab", "32", "--log-every", "5", "--warmup-steps", "10", "--lr", "1e-2"]


def _launch(*args: str, max_restarts: int = 0) -> str:
    """Runs the demo under torchrun on 2 ranks; returns its output (stdout and stderr)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + sys.path))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--max-restarts", str(max_restarts), "--monitor-interval", "0.2", str(DEMO),
           *TINY, *args]
    # a session of its own, so that a hung launch is stopped with all its workers
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {LAUNCH_TIMEOUT_S} s:\n{out}")
    if proc.returncode != 0:
        raise AssertionError(f"torchrun exited with {proc.returncode}:\n{out}")
    return out


def _summary(out: str) -> str:
    """The loss of the summary line: the first step's and the last ten steps' mean."""
    m = re.search(r"\[EP=2\] loss (\S+ -> \S+)", out)
    assert m is not None, out
    return m.group(1)


@unittest.skipIf(not (dist.is_available() and dist.is_gloo_available()),
                 "torch.distributed with the gloo backend is not available")
class TestRestartTorchrun(TestCase):
    def assertSameState(self, actual, expected, path="state"):
        self.assertEqual(type(actual), type(expected), path)
        if isinstance(expected, dict):
            self.assertEqual(sorted(actual, key=str), sorted(expected, key=str), path)
            for k in expected:
                self.assertSameState(actual[k], expected[k], f"{path}[{k!r}]")
        elif isinstance(expected, (list, tuple)):
            self.assertEqual(len(actual), len(expected), path)
            for i, (a, e) in enumerate(zip(actual, expected)):
                self.assertSameState(a, e, f"{path}[{i}]")
        elif isinstance(expected, torch.Tensor):
            self.assertTrue(torch.equal(actual, expected), f"{path} differs")
        else:
            self.assertTrue(actual == expected, f"{path}: {actual!r} != {expected!r}")

    def test_kill_restart_is_bit_identical(self):
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            ref_out = _launch("--save-final", os.path.join(tmp, "reference.pt"))
            reference = torch.load(os.path.join(tmp, "reference.pt"), weights_only=True)
            self.assertEqual(len([k for k in reference["model"] if k.endswith("expert_bias")]),
                             1)

            out = _launch("--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                          "--fail-at-step", "7", "--fail-rank", "1",
                          "--save-final", os.path.join(tmp, "restarted.pt"), max_restarts=1)
            self.assertIn("[fault injection] rank 1 exits with status 1 after step 7", out)
            self.assertIn(f"resuming from {ckpt}/step_00000006: 6 steps done (torchrun restart "
                          f"count 1)", out)
            self.assertEqual(sorted(os.listdir(ckpt)),
                             ["fault_injected_step_7_rank_1", "step_00000003", "step_00000006",
                              "step_00000009"])
            restarted = torch.load(os.path.join(tmp, "restarted.pt"), weights_only=True)
            self.assertSameState(restarted, reference)
            self.assertEqual(_summary(out), _summary(ref_out))

            # what an interrupted save of step 10 leaves, and a step 11 that is no checkpoint
            shutil.copytree(os.path.join(ckpt, "step_00000009"),
                            os.path.join(ckpt, "step_00000010.tmp-0123456789ab"))
            os.makedirs(os.path.join(ckpt, "step_00000011"))
            out = _launch("--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                          "--save-final", os.path.join(tmp, "resumed.pt"))
            self.assertIn(f"resuming from {ckpt}/step_00000009: 9 steps done", out)
            self.assertIn("step_00000011' holds no DCP .metadata", out)
            resumed = torch.load(os.path.join(tmp, "resumed.pt"), weights_only=True)
            self.assertSameState(resumed, reference)

    def test_kill_restart_with_replicas_is_bit_identical(self):
        # replicated experts rebalanced every 4 steps: the checkpoint of step 6 holds the
        # placement of step 4 and the loads of steps 5 and 6, which the rebalance of step 8
        # plans from; resumed, it must log the same rank loads and end in the same state
        replicas = ["--replicas", "1", "--rebalance-every", "4", "--router-skew", "1.2"]
        with tempfile.TemporaryDirectory() as tmp:
            ckpt = os.path.join(tmp, "ckpt")
            ref_out = _launch(*replicas, "--save-final", os.path.join(tmp, "reference.pt"))
            reference = torch.load(os.path.join(tmp, "reference.pt"), weights_only=True)
            out = _launch(*replicas, "--checkpoint-dir", ckpt, "--checkpoint-every", "3",
                          "--fail-at-step", "7", "--fail-rank", "1",
                          "--save-final", os.path.join(tmp, "restarted.pt"), max_restarts=1)
            self.assertIn(f"resuming from {ckpt}/step_00000006: 6 steps done", out)
            restarted = torch.load(os.path.join(tmp, "restarted.pt"), weights_only=True)
            # the physical expert weights, [R * S] = [6] slots of the 4 experts
            self.assertEqual(reference["model"]["blocks.0.moe.experts.w1"].size(0), 6)
            self.assertSameState(restarted, reference)
            rebalances = [re.findall(r"step +8  rebalance: .*", o) for o in (out, ref_out)]
            self.assertEqual(len(rebalances[1]), 1, ref_out)
            self.assertEqual(rebalances[0], rebalances[1])
            self.assertIn("the same losses (within 1e-5)", out)


if __name__ == "__main__":
    run_tests()
