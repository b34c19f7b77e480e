# Owner(s): ["module: moe"]
"""Faults in expert-parallel dispatch end with an error within the process group's timeout.

Two real gloo processes per case (plain subprocesses, so a hang fails the test through the
parent's deadline instead of hanging the suite). Rank 0 always calls
``expert_parallel_moe_ffn``; rank 1 misbehaves:

* ``exit``: it leaves before the call (a rank gone): rank 0's first exchange fails as soon as
  gloo sees the closed connection, at the latest after the timeout;
* ``stall``: it stays alive but never calls (a rank stuck elsewhere): rank 0's exchange fails
  when the process group's 3 s timeout expires.

Collectives whose shapes or layer disagree across ranks are in ``test_dispatch.py`` (threaded):
they raise a ``ValueError`` on every rank before any token moves.

Run: ``python -m pytest test/distributed/test_dispatch_faults_gloo.py -q`` from the repo root.
"""

import os
import socket
import subprocess
import sys
import textwrap
import time
import unittest

import torch.distributed as dist
from torch.testing._internal.common_utils import TestCase, run_tests

TIMEOUT_S = 3

_CHILD = textwrap.dedent(
    """
    import os, sys, time, datetime
    import torch, torch.distributed as dist
    import torch_moe
    from torch_moe.distributed.dispatch import expert_parallel_moe_ffn

    rank, mode = int(os.environ["RANK"]), os.environ["FAULT"]
    dist.init_process_group("gloo", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds={timeout}))
    if rank == 1:
        if mode == "stall":
            time.sleep(4 * {timeout} + 10)  # killed by the parent before this ends
        os._exit(0)
    x, ids, w = torch.randn(4, 8), torch.tensor([[0, 3]] * 4), torch.rand(4, 2)
    w1, w2 = torch.randn(2, 8, 4), torch.randn(2, 4, 8)
    start = time.monotonic()
    try:
        expert_parallel_moe_ffn(x, ids, w, w1, w2, torch.randn(2, 8, 4), num_experts=4)
    except Exception as e:  # the fault must surface as an exception
        print(f"RAISED {{type(e).__name__}} after {{time.monotonic() - start:.1f}} s: "
              f"{{str(e).splitlines()[0][:200]}}", flush=True)
        os._exit(0)
    print("NO ERROR", flush=True)
    os._exit(1)
    """
).format(timeout=TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipIf(not (dist.is_available() and dist.is_gloo_available()), "needs gloo")
class TestDispatchFaults(TestCase):
    def _run(self, mode: str) -> str:
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
                   WORLD_SIZE="2", FAULT=mode)
        procs = [subprocess.Popen([sys.executable, "-c", _CHILD], env=dict(env, RANK=str(r)),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(2)]
        try:
            # imports and rendezvous take a few seconds on 2 loaded cores; the error itself
            # must come within the timeout (asserted from rank 0's own clock below)
            out, _ = procs[0].communicate(timeout=120)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        self.assertEqual(procs[0].returncode, 0, msg=out)
        line = next((ln for ln in out.splitlines() if ln.startswith("RAISED")), None)
        self.assertIsNotNone(line, msg=out)
        elapsed = float(line.split(" after ")[1].split(" s")[0])
        self.assertLessEqual(elapsed, TIMEOUT_S + 5, msg=line)
        return line

    def test_rank_gone_or_stalled_raises_within_timeout(self):
        for mode in ("exit", "stall"):
            with self.subTest(mode=mode):
                start = time.monotonic()
                line = self._run(mode)
                print(f"{mode}: {line} (case took {time.monotonic() - start:.1f} s)")


if __name__ == "__main__":
    run_tests()
