# Owner(s): ["module: moe"]
"""Single-process tests of ``torch_moe.distributed.checkpoint``.

* the mapping between local slots and logical experts (``expert_runs``), and that the chunks
  the ranks of a placement save tile the logical ``[E, ...]`` tensor exactly once;
* round trips through ``torch.distributed.checkpoint`` on disk without a process group (DCP
  then runs as a single process): a placement on one rank with replicas, loading every rank of
  multi-rank placements (loading is local to a rank), plain ``[E, ...]`` tensors, and the
  model + Adam helpers on a plain model;
* the ``ValueError`` of every public function on bad input;
* restarts: the atomic commit of ``atomic_checkpoint`` (a save interrupted while written, or a
  directory without DCP ``.metadata``, is never what ``latest_checkpoint`` picks; the next save
  removes stale temporary directories), the checks of both, and ``extra_state`` of the
  model + optimizer helpers.

The multi-process chain (4 -> 2 -> 1 -> 4 ranks) is in ``test_checkpoint_gloo.py``; a kill and
restart under torchrun in ``test_restart_torchrun.py``.

Run: ``python -m pytest test/distributed/test_checkpoint.py -q`` from the repo root, or
``python test/distributed/test_checkpoint.py``.
"""

import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.testing._internal.common_distributed import MultiThreadedTestCase
from torch.testing._internal.common_utils import (
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
    TestCase,
)

from torch_moe.distributed.checkpoint import (
    atomic_checkpoint,
    expert_runs,
    latest_checkpoint,
    load_expert_parallel_checkpoint,
    load_logical_expert_state_dict,
    logical_expert_state_dict,
    save_expert_parallel_checkpoint,
)
from torch_moe.distributed.placement import Placement, plan_placement

E, D, F = 6, 4, 3
KEYS = ["w1", "w2", "w1.exp_avg"]


def _placement(p2l, num_ranks):
    return Placement.from_phys_to_logical(torch.tensor(p2l), num_ranks, E)


# 3 ranks x 3 slots, replicas of 1 (twice on rank 1) and 4
PLACEMENT_A = _placement([0, 1, 2, 1, 1, 3, 4, 5, 4], 3)
# 2 ranks x 4 slots, replicas of 5 (both ranks) and 0
PLACEMENT_B = _placement([5, 0, 0, 1, 2, 3, 4, 5], 2)
# 1 rank x 8 slots, experts out of order
PLACEMENT_C = _placement([3, 3, 2, 1, 0, 5, 4, 0], 1)


def _logical():
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(E, D, F, generator=g),
        "w2": torch.randn(E, F, D, generator=g),
        "w1.exp_avg": torch.randn(E, D, F, generator=g).to(torch.bfloat16),
        "router": torch.randn(E, D, generator=g),
        "step": torch.tensor(7.0),
    }


def _slots(placement, rank):
    S = placement.slots_per_rank
    return placement.phys_to_logical[rank * S:(rank + 1) * S]


def _local(logical, placement, rank, fill=None):
    slots = _slots(placement, rank)
    out = {}
    for k, v in logical.items():
        t = v[slots] if k in KEYS else v
        out[k] = t.clone() if fill is None else torch.full_like(t, fill)
    return out


class TestExpertRuns(TestCase):
    def test_primary_runs(self):
        # rank 1 of A holds [1, 1, 3]: 1's primary is slot 1 (rank 0), so only 3 is written
        self.assertEqual(expert_runs(PLACEMENT_A, 0, primary_only=True), [(0, 0, 3)])
        self.assertEqual(expert_runs(PLACEMENT_A, 1, primary_only=True), [(2, 3, 1)])
        self.assertEqual(expert_runs(PLACEMENT_A, 2, primary_only=True), [(0, 4, 2)])
        # rank 0 of B holds [5, 0, 0, 1]: slots 1 and 3 hold consecutive experts, not
        # consecutive slots
        self.assertEqual(expert_runs(PLACEMENT_B, 0, primary_only=True),
                         [(0, 5, 1), (1, 0, 1), (3, 1, 1)])
        # rank 1 holds [2, 3, 4, 5]; 5's primary is on rank 0
        self.assertEqual(expert_runs(PLACEMENT_B, 1, primary_only=True), [(0, 2, 3)])

    def test_read_runs(self):
        # every expert held by the rank once, at its first slot there
        self.assertEqual(expert_runs(PLACEMENT_A, 1, primary_only=False), [(0, 1, 1), (2, 3, 1)])
        self.assertEqual(expert_runs(PLACEMENT_A, 2, primary_only=False), [(0, 4, 2)])
        self.assertEqual(expert_runs(PLACEMENT_B, 0, primary_only=False),
                         [(0, 5, 1), (1, 0, 1), (3, 1, 1)])
        self.assertEqual(expert_runs(PLACEMENT_B, 1, primary_only=False), [(0, 2, 4)])
        self.assertEqual(expert_runs(PLACEMENT_C, 0, primary_only=False),
                         [(0, 3, 1), (2, 2, 1), (3, 1, 1), (4, 0, 1), (5, 5, 1), (6, 4, 1)])

    @parametrize("num_ranks,slots", [(1, 6), (2, 5), (3, 3), (4, 2), (4, 4), (2, 6)])
    def test_saved_chunks_tile_logical_experts(self, num_ranks, slots):
        # over all ranks, the saved chunks cover every expert exactly once, with its data;
        # with (2, 6) rank 1 holds only replicas and writes nothing
        load = torch.tensor([9, 1, 30, 2, 7, 5])
        placement = plan_placement(load, num_ranks, slots)
        logical = _logical()
        seen = torch.zeros(E, dtype=torch.int64)
        for rank in range(num_ranks):
            sd = logical_expert_state_dict(_local(logical, placement, rank), placement, rank,
                                           KEYS)
            w1 = sd["w1"]
            self.assertEqual(w1.shape, (E, D, F))
            for chunk in w1.__create_chunk_list__():
                e, n = chunk.offsets[0], chunk.sizes[0]
                self.assertEqual(tuple(chunk.offsets[1:]), (0, 0))
                seen[e:e + n] += 1
                item = next(i for i in w1.__create_write_items__("w1", w1)
                            if i.index.offset == chunk.offsets)
                self.assertEqual(item.tensor_data.size, (E, D, F))
                data = w1.__get_tensor_shard__(item.index)
                self.assertTrue(torch.equal(data, logical["w1"][e:e + n]))
        self.assertEqual(seen.tolist(), [1] * E)

    def test_state_dict_is_views_and_passes_other_entries(self):
        local = _local(_logical(), PLACEMENT_A, 2)
        sd = logical_expert_state_dict(local, PLACEMENT_A, 2, KEYS)
        self.assertIs(sd["router"], local["router"])
        self.assertIs(sd["step"], local["step"])
        self.assertEqual(sd["w1.exp_avg"].dtype, torch.bfloat16)
        (chunk,) = sd["w1"]._chunks
        self.assertEqual(chunk[1].data_ptr(), local["w1"].data_ptr())  # no copy
        self.assertIn("_LogicalExpertChunks(size=(6, 4, 3)", repr(sd["w1"]))
        with self.assertRaisesRegex(RuntimeError, "logical expert stand-in"):
            sd["w1"] + 1

    def test_expert_keys_predicate(self):
        local = _local(_logical(), PLACEMENT_B, 0)
        sd = logical_expert_state_dict(local, PLACEMENT_B, 0, lambda k: k.startswith("w"))
        self.assertEqual({k for k, v in sd.items() if v is not local[k]}, set(KEYS))


class TestRoundTrip(TestCase):
    def setUp(self):
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        # DCP warns that it runs as a single process without a process group
        ctx = warnings.catch_warnings()
        ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("ignore")

    def path(self, name):
        return os.path.join(self._tmp.name, name)

    def _load_everywhere(self, path, logical, placement):
        for rank in range(placement.num_ranks):
            local = _local(logical, placement, rank, fill=float("nan"))
            load_logical_expert_state_dict(local, placement, rank, KEYS, checkpoint_id=path)
            expected = _local(logical, placement, rank)
            for k, v in expected.items():
                self.assertTrue(torch.equal(local[k], v), f"rank {rank}: {k}")

    def test_placement_to_placements_and_plain(self):
        logical = _logical()
        dcp.save(logical_expert_state_dict(_local(logical, PLACEMENT_C, 0), PLACEMENT_C, 0,
                                           KEYS), checkpoint_id=self.path("c"))
        # the checkpoint holds logical tensors: a plain load gives them back
        plain = {k: torch.zeros_like(v) for k, v in logical.items()}
        dcp.load(plain, checkpoint_id=self.path("c"))
        for k, v in logical.items():
            self.assertTrue(torch.equal(plain[k], v), k)
        for placement in (PLACEMENT_A, PLACEMENT_B, PLACEMENT_C):
            self._load_everywhere(self.path("c"), logical, placement)

    def test_plain_checkpoint_to_placements(self):
        logical = _logical()
        dcp.save(logical, checkpoint_id=self.path("plain"))
        for placement in (PLACEMENT_A, PLACEMENT_B):
            self._load_everywhere(self.path("plain"), logical, placement)

    def test_storage_reader(self):
        logical = _logical()
        dcp.save(logical, checkpoint_id=self.path("plain"))
        local = _local(logical, PLACEMENT_A, 1, fill=0.0)
        load_logical_expert_state_dict(local, PLACEMENT_A, 1, KEYS,
                                       storage_reader=dcp.FileSystemReader(self.path("plain")))
        self.assertTrue(torch.equal(local["w2"], logical["w2"][_slots(PLACEMENT_A, 1)]))

    def test_non_tensor_entries_are_loaded(self):
        logical = _logical()
        logical_sd = dict(logical, epoch=3)
        dcp.save(logical_sd, checkpoint_id=self.path("plain"))
        local = dict(_local(logical, PLACEMENT_B, 0, fill=0.0), epoch=0)
        load_logical_expert_state_dict(local, PLACEMENT_B, 0, KEYS,
                                       checkpoint_id=self.path("plain"))
        self.assertEqual(local["epoch"], 3)

    def test_expert_parallel_helpers_plain_model_with_adam(self):
        def make(seed):
            torch.manual_seed(seed)
            net = nn.ModuleDict({"router": nn.Linear(D, E, bias=False)})
            net.w1 = nn.Parameter(torch.randn(E, D, F))
            return net, torch.optim.Adam(net.parameters(), lr=0.1)

        net, opt = make(0)
        for p in net.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        save_expert_parallel_checkpoint(net, opt, checkpoint_id=self.path("ep"))
        net2, opt2 = make(1)
        load_expert_parallel_checkpoint(net2, opt2, checkpoint_id=self.path("ep"))
        for (n, p), p2 in zip(net.named_parameters(), net2.parameters()):
            self.assertTrue(torch.equal(p, p2), n)
            for k in ("exp_avg", "exp_avg_sq", "step"):
                self.assertTrue(torch.equal(opt.state[p][k], opt2.state[p2][k]), f"{n}.{k}")
        # model only
        net3, _ = make(2)
        load_expert_parallel_checkpoint(net3, checkpoint_id=self.path("ep"))
        self.assertTrue(torch.equal(net3.w1, net.w1))


class TestBadInput(TestCase):
    def setUp(self):
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(_logical(), checkpoint_id=self._tmp.name)
        self.ckpt = self._tmp.name

    def _load(self, local, placement=PLACEMENT_B, rank=0, keys=KEYS, **kw):
        kw.setdefault("checkpoint_id", self.ckpt)
        load_logical_expert_state_dict(local, placement, rank, keys, **kw)

    def test_placement_and_rank(self):
        local = _local(_logical(), PLACEMENT_B, 0)
        for fn in (logical_expert_state_dict, self._load):
            with self.assertRaisesRegex(ValueError, "expected placement to be a Placement, but "
                                                    "got dict"):
                fn(local, {}, 0, KEYS)
            with self.assertRaisesRegex(ValueError, r"expected rank in \[0, 2\) .* but got 2"):
                fn(local, PLACEMENT_B, 2, KEYS)
            with self.assertRaisesRegex(ValueError, "expected rank to be an int, but got True"):
                fn(local, PLACEMENT_B, True, KEYS)
        with self.assertRaisesRegex(ValueError, r"expected rank in \[0, 3\) .* but got -1"):
            expert_runs(PLACEMENT_A, -1, primary_only=True)

    def test_local_dim0_is_not_slots_per_rank(self):
        local = _local(_logical(), PLACEMENT_A, 0)  # 3 slots, B has 4
        msg = r"expected dim 0 of 'w1' to be slots_per_rank = 4, but got shape \(3, 4, 3\)"
        with self.assertRaisesRegex(ValueError, msg):
            logical_expert_state_dict(local, PLACEMENT_B, 0, KEYS)
        with self.assertRaisesRegex(ValueError, msg):
            self._load(local)
        local = dict(_local(_logical(), PLACEMENT_B, 0), w2=torch.tensor(1.0))
        with self.assertRaisesRegex(ValueError, r"dim 0 of 'w2' .* but got shape \(\)"):
            logical_expert_state_dict(local, PLACEMENT_B, 0, KEYS)

    def test_expert_keys(self):
        local = _local(_logical(), PLACEMENT_B, 0)
        with self.assertRaisesRegex(ValueError, r"but \['w3'\] are missing"):
            logical_expert_state_dict(local, PLACEMENT_B, 0, ["w1", "w3"])
        with self.assertRaisesRegex(ValueError, "expected expert_keys to be a collection of keys "
                                                "or a callable, but got 'w1'"):
            logical_expert_state_dict(local, PLACEMENT_B, 0, "w1")
        with self.assertRaisesRegex(ValueError, "expected state_dict to be a dict, but got list"):
            logical_expert_state_dict([], PLACEMENT_B, 0, KEYS)
        local["w2"] = torch.zeros(4, F, D).to_sparse()
        with self.assertRaisesRegex(ValueError, "expected 'w2' to be a plain strided local "
                                                "tensor .*, but got Tensor torch.sparse_coo"):
            logical_expert_state_dict(local, PLACEMENT_B, 0, KEYS)
        local["w2"] = [1.0]
        with self.assertRaisesRegex(ValueError, "but got list"):
            logical_expert_state_dict(local, PLACEMENT_B, 0, KEYS)

    def test_checkpoint_experts_differ_from_placement(self):
        # 7 logical experts in the placement, 6 in the checkpoint
        placement = Placement.from_phys_to_logical(torch.arange(7), 1, 7)
        local = {k: torch.zeros((7,) + v.shape[1:], dtype=v.dtype)
                 for k, v in _logical().items() if k in KEYS}
        with self.assertRaisesRegex(ValueError, "expected 'w1' in the checkpoint to have the "
                                                "placement's 7 logical experts, but it has 6"):
            self._load(local, placement)

    def test_checkpoint_shape_and_dtype_differ(self):
        local = _local(_logical(), PLACEMENT_B, 0)
        local["w2"] = torch.zeros(4, F + 1, D)
        with self.assertRaisesRegex(ValueError, r"expected 'w2' in the checkpoint to have "
                                                r"per-expert shape \(4, 4\) of the local tensor, "
                                                r"but got \(3, 4\)"):
            self._load(local)
        local = _local(_logical(), PLACEMENT_B, 0)
        local["w1.exp_avg"] = local["w1.exp_avg"].float()
        with self.assertRaisesRegex(ValueError, "to have the local dtype torch.float32, but got "
                                                "torch.bfloat16"):
            self._load(local)
        local = _local(_logical(), PLACEMENT_B, 0)
        local["router"] = torch.zeros(E + 1, D)
        with self.assertRaisesRegex(ValueError, r"expected 'router' in the checkpoint to have "
                                                r"the model's shape \(7, 4\), but got \(6, 4\)"):
            self._load(local)

    def test_checkpoint_entry_missing(self):
        local = dict(_local(_logical(), PLACEMENT_B, 0), w3=torch.zeros(4, D, F))
        with self.assertRaisesRegex(ValueError, r"expected the checkpoint to hold a tensor "
                                                r"\[6, ...\] for 'w3', but got nothing"):
            self._load(local, keys=KEYS + ["w3"])
        local = dict(_local(_logical(), PLACEMENT_B, 0), bias=torch.zeros(3))
        with self.assertRaisesRegex(ValueError, "expected the checkpoint to hold 'bias'"):
            self._load(local)

    def test_checkpoint_location(self):
        local = _local(_logical(), PLACEMENT_B, 0)
        with self.assertRaisesRegex(ValueError, "expected checkpoint_id or storage_reader, but "
                                                "got neither"):
            self._load(local, checkpoint_id=None)
        missing = os.path.join(self.ckpt, "nope")
        with self.assertRaisesRegex(ValueError, "is not a directory"):
            self._load(local, checkpoint_id=missing)

    def test_expert_parallel_helpers(self):
        torch.manual_seed(0)
        net = nn.ModuleDict({"router": nn.Linear(D, E, bias=False)})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save_expert_parallel_checkpoint(net, checkpoint_id=os.path.join(self.ckpt, "ep"))
        bigger = nn.ModuleDict({"router": nn.Linear(D, E + 2, bias=False)})
        with self.assertRaisesRegex(ValueError, r"expected 'model.router.weight' in the "
                                                r"checkpoint to have the model's shape \(8, 4\), "
                                                r"but got \(6, 4\)"):
            load_expert_parallel_checkpoint(bigger, checkpoint_id=os.path.join(self.ckpt, "ep"))
        with self.assertRaisesRegex(ValueError, "expected model to be an nn.Module, but got dict"):
            save_expert_parallel_checkpoint({}, checkpoint_id=self.ckpt)
        with self.assertRaisesRegex(ValueError, "expected optimizers to be "
                                                "torch.optim.Optimizer, but got str"):
            save_expert_parallel_checkpoint(net, ["adam"], checkpoint_id=self.ckpt)


def _dcp_save(state, checkpoint_id):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP runs as a single process without a process group
        dcp.save(state, checkpoint_id=checkpoint_id)


class TestAtomicCheckpoint(TestCase):
    def setUp(self):
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.dir = os.path.join(self._tmp.name, "ckpt")

    def save(self, step, value):
        with atomic_checkpoint(self.dir, step) as checkpoint_id:
            self.assertEqual(os.path.dirname(checkpoint_id), self.dir)
            self.assertRegex(os.path.basename(checkpoint_id), rf"^step_{step:08d}\.tmp-[0-9a-f]+$")
            _dcp_save({"x": torch.full((3,), float(value))}, checkpoint_id)
        return os.path.join(self.dir, f"step_{step:08d}")

    def load(self, path):
        x = {"x": torch.zeros(3)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(x, checkpoint_id=path)
        return x["x"][0].item()

    def test_commit_and_latest(self):
        self.assertIsNone(latest_checkpoint(self.dir))  # a first run: no directory yet
        self.save(3, 3.0)
        path6 = self.save(6, 6.0)
        self.assertEqual(sorted(os.listdir(self.dir)), ["step_00000003", "step_00000006"])
        self.assertEqual(latest_checkpoint(self.dir), (6, path6))
        self.assertEqual(self.load(latest_checkpoint(self.dir)[1]), 6.0)
        # steps past 8 digits sort by value, not by name
        path_big = self.save(123456789, 9.0)
        self.assertEqual(latest_checkpoint(self.dir), (123456789, path_big))

    def test_interrupted_save_is_never_loaded(self):
        self.save(3, 3.0)
        # the job dies while step 6 is written: DCP finished, the commit did not happen
        with self.assertRaisesRegex(RuntimeError, "killed"):
            with atomic_checkpoint(self.dir, 6) as checkpoint_id:
                _dcp_save({"x": torch.full((3,), 6.0)}, checkpoint_id)
                raise RuntimeError("killed")
        staging = os.path.basename(checkpoint_id)
        self.assertTrue(os.path.isfile(os.path.join(checkpoint_id, ".metadata")))
        # a committed name without DCP .metadata (its files half written, or not DCP at all)
        os.makedirs(os.path.join(self.dir, "step_00000009"))
        with open(os.path.join(self.dir, "step_00000009", "__0_0.distcp"), "wb") as f:
            f.write(b"partial")
        with self.assertWarnsRegex(UserWarning, r"step_00000009' holds no DCP \.metadata"):
            self.assertEqual(latest_checkpoint(self.dir),
                             (3, os.path.join(self.dir, "step_00000003")))
        # the next save removes the temporary directory of the interrupted one
        self.save(4, 4.0)
        self.assertNotIn(staging, os.listdir(self.dir))
        with self.assertWarnsRegex(UserWarning, "holds no DCP"):
            step, path = latest_checkpoint(self.dir)
        self.assertEqual((step, self.load(path)), (4, 4.0))

    def test_body_writes_nothing(self):
        with self.assertRaisesRegex(ValueError, r"expected the body to write a DCP checkpoint "
                                                r"at .*step_00000002\.tmp-[0-9a-f]+', but it holds "
                                                r"no \.metadata; nothing is committed"):
            with atomic_checkpoint(self.dir, 2):
                pass
        self.assertIsNone(latest_checkpoint(self.dir))

    def test_other_entries_are_ignored(self):
        os.makedirs(self.dir)
        open(os.path.join(self.dir, "notes.txt"), "w").close()
        open(os.path.join(self.dir, "step_00000005.tmp-abc"), "w").close()
        for name in ("step_abc", "step_5", "step_000000005"):
            os.makedirs(os.path.join(self.dir, name))
            open(os.path.join(self.dir, name, ".metadata"), "w").close()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.assertIsNone(latest_checkpoint(self.dir))
        self.assertEqual(sorted(str(w.message).split("'")[1].rsplit("/", 1)[1] for w in caught),
                         ["step_000000005", "step_5", "step_abc"])
        self.assertTrue(all("is not named step_<step, 8 digits>: ignored" in str(w.message)
                            for w in caught))
        self.save(5, 5.0)  # the stale temporary file is removed
        self.assertNotIn("step_00000005.tmp-abc", os.listdir(self.dir))

    def test_bad_input(self):
        self.save(3, 3.0)
        with self.assertRaisesRegex(ValueError, r"expected no checkpoint of step 3 in .*, but "
                                                r".*step_00000003' exists"):
            self.save(3, 3.0)
        for step in (-1, True, 2.0, "3", None):
            with self.assertRaisesRegex(ValueError, "atomic_checkpoint: expected step to be a "
                                                    f"non-negative int, but got {step!r}"):
                with atomic_checkpoint(self.dir, step):
                    pass
        a_file = os.path.join(self._tmp.name, "file")
        open(a_file, "w").close()
        for fn, call in (("latest_checkpoint", lambda d: latest_checkpoint(d)),
                         ("atomic_checkpoint", lambda d: atomic_checkpoint(d, 1).__enter__())):
            for bad in (3, "", b"dir", None):
                with self.assertRaisesRegex(ValueError, f"{fn}: expected checkpoint_dir to be a "
                                                        "non-empty path"):
                    call(bad)
            with self.assertRaisesRegex(ValueError, f"{fn}: expected checkpoint_dir to be a "
                                                    r"directory, but .*file' is not one"):
                call(a_file)


class TestExtraState(TestCase):
    def setUp(self):
        super().setUp()
        self._tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self._tmp.cleanup)
        self.path = os.path.join(self._tmp.name, "ep")
        torch.manual_seed(0)
        self.net = nn.ModuleDict({"router": nn.Linear(D, E, bias=False)})
        self.opt = torch.optim.AdamW(self.net.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 0.5 ** s)
        for _ in range(3):
            self.net.router.weight.grad = torch.randn_like(self.net.router.weight)
            self.opt.step()
            self.sched.step()
        ctx = warnings.catch_warnings()
        ctx.__enter__()
        self.addCleanup(ctx.__exit__, None, None, None)
        warnings.simplefilter("ignore")

    def extra(self, step, rng):
        return {"train": {"step": step, "losses": [1.5, 0.25] if step else []},
                "scheduler": self.sched.state_dict(), "rng": rng}

    def test_round_trip(self):
        rng = torch.get_rng_state()
        save_expert_parallel_checkpoint(self.net, self.opt, checkpoint_id=self.path,
                                        extra_state=self.extra(3, rng))
        torch.manual_seed(1)
        net = nn.ModuleDict({"router": nn.Linear(D, E, bias=False)})
        opt = torch.optim.AdamW(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 ** s)
        state = {"train": {"step": 0, "losses": []}, "scheduler": sched.state_dict(),
                 "rng": torch.zeros_like(torch.get_rng_state())}
        load_expert_parallel_checkpoint(net, opt, checkpoint_id=self.path, extra_state=state)
        self.assertEqual(state["train"], {"step": 3, "losses": [1.5, 0.25]})
        self.assertEqual(state["scheduler"], self.sched.state_dict())
        self.assertTrue(torch.equal(state["rng"], rng))
        sched.load_state_dict(state["scheduler"])
        self.assertEqual(sched.last_epoch, 3)
        self.assertEqual(opt.param_groups[0]["lr"], self.opt.param_groups[0]["lr"])
        self.assertTrue(torch.equal(net.router.weight, self.net.router.weight))
        self.assertTrue(torch.equal(opt.state[net.router.weight]["step"],
                                    self.opt.state[self.net.router.weight]["step"]))

    def test_bad_extra_state(self):
        for fn, call in (("save", save_expert_parallel_checkpoint),
                         ("load", load_expert_parallel_checkpoint)):
            with self.assertRaisesRegex(ValueError, f"{fn}_expert_parallel_checkpoint: expected "
                                                    "extra_state to be a dict, but got list"):
                call(self.net, self.opt, checkpoint_id=self.path, extra_state=[1])
            with self.assertRaisesRegex(ValueError, "expected the keys of extra_state to be "
                                                    r"strings other than 'model' and 'optim' "
                                                    r"\(the model and optimizer state\), but got "
                                                    r"\['optim', 3\]"):
                call(self.net, self.opt, checkpoint_id=self.path,
                     extra_state={"optim": 1, 3: 2, "ok": 4})
        save_expert_parallel_checkpoint(self.net, self.opt, checkpoint_id=self.path,
                                        extra_state=self.extra(3, torch.zeros(5)))
        with self.assertRaisesRegex(ValueError, r"expected 'rng' in the checkpoint to have the "
                                                r"model's shape \(6,\), but got \(5,\)"):
            load_expert_parallel_checkpoint(self.net, self.opt, checkpoint_id=self.path,
                                            extra_state=self.extra(0, torch.zeros(6)))
        with self.assertRaisesRegex(ValueError, r"expected the checkpoint to hold 'placement."
                                                r"phys_to_logical', a tensor of shape \(4,\), but "
                                                r"it has no such entry"):
            load_expert_parallel_checkpoint(
                self.net, self.opt, checkpoint_id=self.path,
                extra_state={"placement": {"phys_to_logical": torch.zeros(4)}})


class TestAtomicCheckpointThreaded(MultiThreadedTestCase):
    """The collective protocol on two threaded ranks sharing a directory: rank 0's decisions
    reach every rank, and a body that fails on one rank commits nothing and fails every rank.
    The bodies write the ``.metadata`` by hand (the commit looks for nothing else); DCP itself
    goes through it in ``test_restart_torchrun.py``."""

    @property
    def world_size(self):
        return 2

    @property
    def dir(self):
        # each rank's thread runs its own instance of the test: the path is derived, not stored
        return os.path.join(tempfile.gettempdir(),
                            f"torch_moe_atomic_{os.getpid()}_{self._testMethodName}")

    def setUp(self):
        super().setUp()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.addCleanup(shutil.rmtree, self.dir, True)
        self._spawn_threads()

    def _write(self, checkpoint_id):
        dist.barrier()
        if dist.get_rank() == 0:
            os.makedirs(checkpoint_id)
            open(os.path.join(checkpoint_id, ".metadata"), "w").close()
        dist.barrier()

    def test_ranks_agree(self):
        self.assertIsNone(latest_checkpoint(self.dir))
        with atomic_checkpoint(self.dir, 4) as checkpoint_id:
            ids = [None] * 2
            dist.all_gather_object(ids, checkpoint_id)
            self.assertEqual(ids[0], ids[1])  # rank 0 drew the suffix
            self._write(checkpoint_id)
        self.assertEqual(latest_checkpoint(self.dir), (4, os.path.join(self.dir, "step_00000004")))

    def test_body_fails_on_one_rank(self):
        if dist.get_rank() == 1:
            with self.assertRaisesRegex(RuntimeError, "rank 1 fails"):
                with atomic_checkpoint(self.dir, 4) as checkpoint_id:
                    self._write(checkpoint_id)
                    raise RuntimeError("rank 1 fails")
        else:
            with self.assertRaisesRegex(RuntimeError, "the checkpoint of step 4 was not "
                                                      "committed: the body raised on another "
                                                      "rank"):
                with atomic_checkpoint(self.dir, 4) as checkpoint_id:
                    self._write(checkpoint_id)
        self.assertIsNone(latest_checkpoint(self.dir))

    def test_errors_found_by_rank0_raise_everywhere(self):
        with self.assertRaisesRegex(ValueError, "holds no .metadata; nothing is committed"):
            with atomic_checkpoint(self.dir, 4):
                pass
        with atomic_checkpoint(self.dir, 5) as checkpoint_id:
            self._write(checkpoint_id)
        with self.assertRaisesRegex(ValueError, "expected no checkpoint of step 5"):
            with atomic_checkpoint(self.dir, 5):
                pass


instantiate_parametrized_tests(TestExpertRuns)

if __name__ == "__main__":
    run_tests()
