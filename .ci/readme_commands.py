"""Runs every command README.md shows, in short form, where a new user would run it.

A fresh virtual environment is set up by README.md's own demo set-up command (its ``pip``
steps, as written); in it run, in this order:

* the demo command's program, in short form;
* every other command README.md shows: the inline ``python ...`` / ``torchrun ...`` commands,
  each in the short form that ``SHORT_FORMS`` gives, and every ``python`` code block, as written.

A command that README.md shows and this file does not know fails the run, so a new command in the
README cannot go untested. The test command is not run here: ``.ci/run`` runs it as written in a
fresh environment of its own, and this script checks that ``.ci/run`` holds it verbatim.

    python .ci/readme_commands.py            # from the repository root
    python .ci/readme_commands.py --list     # the commands and their short forms, without running
"""

import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The command as README.md writes it (whitespace collapsed) -> the short form run here. The
# short forms keep every code path of the full command and shrink only its length.
SHORT_FORMS = {
    "python benchmarks/demo.py": "python benchmarks/demo.py --steps 20 --log-every 10",
    "torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 20":
        "torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 4 --log-every 2",
    "python benchmarks/quantization.py": "python benchmarks/quantization.py --sections sqnr --quick",
    'python -c "from torch_moe.distributed._tools import planner; planner.main()"':
        'python -c "from torch_moe.distributed._tools import planner; planner.main()"',
    "python benchmarks/sparsity_sweep.py": "python benchmarks/sparsity_sweep.py --quick",
    "python benchmarks/ops.py": "python benchmarks/ops.py --quick",
    "python benchmarks/hf_models.py": "python benchmarks/hf_models.py --quick --csv \"$(mktemp -d)/hf_models.csv\"",
    "python benchmarks/moe_layer.py": "python benchmarks/moe_layer.py --quick",
    "python benchmarks/moe_layer.py --sweep":
        "python benchmarks/moe_layer.py --quick --no-check --sweep --sweep-ts 64,128",
    "python benchmarks/offload.py": "python benchmarks/offload.py --quick",
    "python tools/import_graph.py": "python tools/import_graph.py",
    "python benchmarks/gpu.py": "python benchmarks/gpu.py --quick",
    "torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 40 --replicas 1 "
    "--rebalance-every 10 --router-skew 1.2":
        "torchrun --nproc-per-node 2 benchmarks/demo.py --expert-parallel --steps 8 --log-every 4 "
        "--replicas 1 --rebalance-every 4 --router-skew 1.2",
    # a checkpoint directory of its own for every run: the command resumes from what it finds
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 "
    "benchmarks/demo.py --expert-parallel --steps 40 --checkpoint-dir /tmp/moe_ckpt "
    "--checkpoint-every 10 --fail-at-step 25":
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --nproc-per-node 2 --max-restarts 1 "
        "benchmarks/demo.py --expert-parallel --steps 8 --log-every 4 --checkpoint-dir "
        "\"$(mktemp -d)/ckpt\" --checkpoint-every 3 --fail-at-step 5",
}

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
# a command, after any environment assignments (NAME=value)
_INLINE = re.compile(r"`((?:[A-Z_][A-Z0-9_]*=\S+\s+)*(?:python|torchrun)\s[^`]+)`")


def readme_commands(text: str):
    """(bash blocks, python blocks, inline commands) of a README, in order of appearance."""
    bash, python = [], []
    for lang, body in _FENCE.findall(text):
        (bash if lang in ("bash", "sh") else python if lang == "python" else []).append(body)
    prose = _FENCE.sub("", text)
    inline = [" ".join(m.group(1).split()) for m in _INLINE.finditer(prose)]
    return bash, python, inline


def split_setup(block: str):
    """A set-up block ``pip ... && pip ... && <program>`` as (pip steps, program)."""
    steps = [s.strip() for s in " ".join(block.split()).split("&&")]
    setup = [s for s in steps if s.startswith("pip ")]
    program = [s for s in steps if not s.startswith("pip ")]
    if len(program) != 1 or steps[-1] != program[0]:
        raise SystemExit(f"README set-up block not of the form 'pip ... && <program>': {block!r}")
    return setup, program[0]


def short_form(command: str) -> str:
    if command not in SHORT_FORMS:
        raise SystemExit(
            f"README.md shows {command!r}, which {Path(__file__).name} has no short form for: "
            "add one to SHORT_FORMS"
        )
    return SHORT_FORMS[command]


def run(command: str, env, cwd=ROOT):
    start = time.perf_counter()
    print(f"\n$ {command}", flush=True)
    result = subprocess.run(command, shell=True, cwd=cwd, env=env)
    print(f"[{result.returncode}] {time.perf_counter() - start:.0f} s: {command}", flush=True)
    if result.returncode:
        raise SystemExit(f"README command failed with exit code {result.returncode}: {command}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--list", action="store_true", help="print the plan and exit")
    args = ap.parse_args()

    bash, python_blocks, inline = readme_commands((ROOT / "README.md").read_text())
    if len(bash) < 2:
        raise SystemExit("README.md must start with two bash blocks: the demo and the test command")
    demo_setup, demo_program = split_setup(bash[0])
    test_command = " ".join(bash[1].split())
    ci_run = (ROOT / ".ci" / "run").read_text()
    if test_command not in " ".join(ci_run.split()):
        raise SystemExit(f".ci/run does not run README.md's test command {test_command!r}")

    plan = [short_form(demo_program)] + [short_form(c) for c in inline]
    plan += [f"python -c {shlex.quote(block)}" for block in python_blocks]
    if args.list:
        print("set-up:", " && ".join(demo_setup))
        print("\n".join(plan))
        return 0

    with tempfile.TemporaryDirectory(prefix="torch_moe_readme_") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = dict(os.environ, VIRTUAL_ENV=str(venv),
                   PATH=f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
        env.pop("PYTHONPATH", None)
        start = time.perf_counter()
        for step in demo_setup:
            run(step, env)
        for command in plan:
            run(command, env)
    print(f"\nall {len(plan)} README commands passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
