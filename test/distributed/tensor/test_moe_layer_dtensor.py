# Owner(s): ["oncall: distributed"]
"""The MoE layer and ``moe_ffn`` on DTensors (2-D meshes, simulated ranks with
``LocalTensorMode``): forward and backward equal the plain layer.

Layouts per mesh dim: tokens sharded (batch or sequence dim) with replicated weights, or tokens
replicated with the expert FFN dim sharded (expert tensor parallel: w1/w3 ``Shard(2)``, w2
``Shard(1)``). Every rank routes its own tokens; no token crosses a rank.

Auxiliary losses are computed per token shard (each rank's micro-batch statistics, as a
data-parallel rank does); the equality tests run without them, and
``test_aux_loss_is_per_shard`` pins that semantics.
"""

import copy
import pathlib
import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401
import torch_moe.distributed.tensor  # noqa: F401
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.functional import moe_ffn

import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

WORLD = 4
ETP = {"experts.w1": Shard(2), "experts.w3": Shard(2), "experts.w2": Shard(1)}


def value(t: torch.Tensor) -> torch.Tensor:
    """A replicated LocalTensor's value (identical on every simulated rank)."""
    if isinstance(t, LocalTensor):
        vals = list(t._local_tensors.values())
        for v in vals[1:]:
            torch.testing.assert_close(v, vals[0], atol=0, rtol=0)
        return vals[0]
    return t


def distribute_moe(moe: MoE, mesh, expert_placements_per_dim) -> MoE:
    """A copy of ``moe`` whose parameters are DTensors: expert weights with
    ``expert_placements_per_dim[i][name]`` (default Replicate) on mesh dim i, the rest
    replicated."""
    m = copy.deepcopy(moe)
    m.reset_load_stats()
    for name, p in list(m.named_parameters()):
        placements = [plc.get(name, Replicate()) for plc in expert_placements_per_dim]
        owner, attr = name.rsplit(".", 1)
        setattr(m.get_submodule(owner), attr,
                torch.nn.Parameter(distribute_tensor(p.detach(), mesh, placements)))
    return m


class _FakeWorld(TestCase):
    """One process simulating WORLD ranks (fake process group + LocalTensorMode in the tests)."""

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=WORLD)

    @classmethod
    def tearDownClass(cls):
        if dist.is_initialized():
            dist.destroy_process_group()
        super().tearDownClass()


class TestMoELayerDTensor(_FakeWorld):
    def check_layer(self, cfg, x_placements, expert_placements, *, atol=1e-5):
        torch.manual_seed(0)
        moe = MoE(cfg)
        x = torch.randn(4, 8, cfg.dim, requires_grad=True)
        ref = moe(x)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        with LocalTensorMode(frozenset(range(WORLD))):
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
            m = distribute_moe(moe, mesh, expert_placements)
            xd = distribute_tensor(x.detach(), mesh, x_placements).requires_grad_()
            y = m(xd)
            y.backward(distribute_tensor(grad, mesh, y.placements if all(
                not isinstance(p, Partial) for p in y.placements) else x_placements))
            out_diff = value((y.full_tensor() - ref).abs().max())
            dx_diff = value((xd.grad.full_tensor() - x.grad).abs().max())
            grad_diffs = {
                n: value((q.grad.full_tensor() - p.grad).abs().max()).item()
                for (n, p), (_, q) in zip(moe.named_parameters(), m.named_parameters())
            }
            self.assertEqual(m.tokens_per_expert, moe.tokens_per_expert)
            self.assertEqual(m.num_dropped, moe.num_dropped)
        self.assertLessEqual(out_diff.item(), atol)
        self.assertLessEqual(dx_diff.item(), atol)
        for n, d in grad_diffs.items():
            self.assertLessEqual(d, atol, msg=n)
        return y.placements, out_diff.item(), max(grad_diffs.values())

    def test_tokens_by_batch_and_expert_tensor_parallel(self):
        cfg = MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2, num_shared_experts=1)
        placements, _, _ = self.check_layer(cfg, [Shard(0), Replicate()], [{}, ETP])
        self.assertEqual(placements, (Shard(0), Partial()))

    def test_tokens_by_batch_and_sequence(self):
        # 2-D token parallelism: batch on one mesh dim, sequence on the other
        cfg = MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2,
                        load_balance_bias=True, capacity_factor=1.5)
        placements, _, _ = self.check_layer(cfg, [Shard(0), Shard(1)], [{}, {}])
        self.assertEqual(placements, (Shard(0), Shard(1)))

    def test_expert_tensor_parallel_on_both_dims_of_one_mesh_dim(self):
        # replicated tokens, F sharded on one mesh dim, everything replicated on the other
        cfg = MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2, activation="gelu")
        placements, _, _ = self.check_layer(cfg, [Replicate(), Replicate()], [{}, ETP])
        self.assertEqual(placements, (Replicate(), Partial()))

    def test_mxfp8_layer_with_expert_tensor_parallel(self):
        # MXFP8 blocks run along K = D (forward), N = F (grad-input) and tokens (grad-weight);
        # with F = 64 split in two, every block of 32 stays on one rank, so the sharded layer
        # quantizes exactly like the plain one.
        cfg = MoEConfig(dim=32, hidden_dim=64, num_experts=4, top_k=2, precision="mxfp8")
        self.check_layer(cfg, [Shard(0), Replicate()], [{}, ETP], atol=1e-5)

    def test_moe_ffn_functional(self):
        torch.manual_seed(0)
        T, D, F, E, k = 16, 8, 12, 4, 2
        x = torch.randn(T, D, requires_grad=True)
        ids = torch.rand(T, E).topk(k, 1).indices
        tw = torch.rand(T, k, requires_grad=True)
        w1, w3 = ((torch.randn(E, D, F) / D**0.5).requires_grad_() for _ in range(2))
        w2 = (torch.randn(E, F, D) / F**0.5).requires_grad_()
        ref = moe_ffn(x, ids, tw, w1, w2, w3)
        grad = torch.randn_like(ref)
        ref.backward(grad)
        with LocalTensorMode(frozenset(range(WORLD))):
            mesh = init_device_mesh("cpu", (2, 2))
            tok = [Shard(0), Replicate()]
            d = lambda t, p: distribute_tensor(t.detach(), mesh, p).requires_grad_(t.requires_grad)
            xd, twd = d(x, tok), d(tw, tok)
            w1d, w3d = d(w1, [Replicate(), Shard(2)]), d(w3, [Replicate(), Shard(2)])
            w2d = d(w2, [Replicate(), Shard(1)])
            out = moe_ffn(xd, distribute_tensor(ids, mesh, tok), twd, w1d, w2d, w3d)
            self.assertEqual(out.placements, (Shard(0), Partial()))
            out.backward(distribute_tensor(grad, mesh, tok))
            diffs = [value((a.full_tensor() - b).abs().max()).item() for a, b in
                     ((out, ref), (xd.grad, x.grad), (twd.grad, tw.grad), (w1d.grad, w1.grad),
                      (w2d.grad, w2.grad), (w3d.grad, w3.grad))]
        self.assertLessEqual(max(diffs), 1e-5)

    def test_aux_loss_is_per_shard(self):
        # With a load-balancing loss the token-parallel layer equals the plain layer run on
        # each token shard separately (each rank's micro-batch statistics).
        torch.manual_seed(0)
        cfg = MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2, load_balance_coeff=0.1)
        moe = MoE(cfg)
        x = torch.randn(4, 8, 16)
        shards = []
        for xs in x.chunk(2):
            m = copy.deepcopy(moe)
            xs = xs.clone().requires_grad_()
            m(xs).sum().backward()
            shards.append(m.router.weight.grad)
        expected = shards[0] + shards[1]
        with LocalTensorMode(frozenset(range(WORLD))):
            mesh = init_device_mesh("cpu", (2, 2))
            m = distribute_moe(moe, mesh, [{}, {}])
            xd = distribute_tensor(x, mesh, [Shard(0), Replicate()]).requires_grad_()
            m(xd).sum().backward()
            got = value(m.router.weight.grad.full_tensor())
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


class TestMoEDTensorBadInput(_FakeWorld):
    def message(self, fn, *args):
        with self.assertRaises(ValueError) as ctx:
            fn(*args)
        return str(ctx.exception)

    def test_bad_layouts(self):
        torch.manual_seed(0)
        cfg = MoEConfig(dim=16, hidden_dim=24, num_experts=4, top_k=2)
        moe = MoE(cfg)
        x = torch.randn(4, 8, 16)
        with LocalTensorMode(frozenset(range(WORLD))):
            mesh = init_device_mesh("cpu", (2, 2))
            m = distribute_moe(moe, mesh, [{}, {}])
            self.assertExpectedInline(
                self.message(m, distribute_tensor(x, mesh, [Shard(2), Replicate()])),
                """MoE: on mesh dim 0, expected x to be Shard(d) on a token dim (d < 2) or Replicate, but got S(2): the hidden dim of the tokens cannot be sharded across the expert FFN""",
            )
            m = distribute_moe(moe, mesh, [ETP, {}])
            self.assertExpectedInline(
                self.message(m, distribute_tensor(x, mesh, [Shard(0), Replicate()])),
                """MoE: on mesh dim 0, expected expert weights Replicate (tokens are sharded on this mesh dim), but got w1 S(2), w2 S(1), w3 S(2)""",
            )
            m = distribute_moe(moe, mesh, [{"experts.w1": Shard(0)}, {}])
            self.assertExpectedInline(
                self.message(m, distribute_tensor(x, mesh, [Replicate(), Replicate()])),
                """MoE: on mesh dim 0, expected expert weights all Replicate, or w1/w3 Shard(2) with w2 Shard(1) (expert tensor parallel), but got w1 S(0)""",
            )
            other = init_device_mesh("cpu", (4,))
            m = distribute_moe(moe, other, [{}])
            msg = self.message(m, distribute_tensor(x, mesh, [Shard(0), Replicate()]))
            self.assertIn("expected w1 on the mesh of x", msg)
            xd = distribute_tensor(x.view(32, 16), mesh, [Shard(0), Replicate()])
            ids = torch.zeros(32, 2, dtype=torch.long)
            w = torch.randn(4, 16, 24)
            self.assertExpectedInline(
                self.message(moe_ffn, xd, distribute_tensor(ids, mesh, [Replicate(), Replicate()]),
                             distribute_tensor(torch.ones(32, 2), mesh, [Shard(0), Replicate()]),
                             distribute_tensor(w, mesh, [Replicate(), Replicate()]),
                             distribute_tensor(torch.randn(4, 24, 16), mesh, [Replicate(), Replicate()]),
                             distribute_tensor(w, mesh, [Replicate(), Replicate()])),
                """moe_ffn: expected topk_ids to be a DTensor placed like the tokens of x (Shard(dim=0), Replicate()), but got (Replicate(), Replicate())""",
            )
            self.assertExpectedInline(
                self.message(moe_ffn, xd, distribute_tensor(ids, mesh, [Shard(0), Replicate()]),
                             distribute_tensor(torch.ones(32, 2), mesh, [Shard(0), Replicate()]),
                             w, torch.randn(4, 24, 16), w),
                """moe_ffn: x is a DTensor, so w1 must be a DTensor on the same mesh too, but got a LocalTensor""",
            )


class TestDTensorHandlersRegistration(TestCase):
    def test_registered_when_torch_distributed_tensor_is_imported_later(self):
        # torch_moe imported first, DTensor later: the DTensor handlers of moe_ffn / MoE and the
        # sharding strategies are registered by the time a DTensor can exist
        script = textwrap.dedent("""
            import sys
            import torch_moe
            from torch_moe.nn import _subclass_hooks
            assert "torch.distributed.tensor" not in sys.modules, "imported too early"
            assert not _subclass_hooks._HANDLERS
            from torch.distributed.tensor import DTensor
            handlers = _subclass_hooks._HANDLERS[DTensor]
            assert "torch_moe.distributed.tensor._ops._moe_ops" in sys.modules
            token_parallel = sys.modules["torch_moe.distributed.tensor._token_parallel"]
            assert handlers.moe_ffn is token_parallel.token_parallel_moe_ffn
            assert handlers.moe_layer is token_parallel.moe_layer_forward
            print("ok")
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             cwd=pathlib.Path(__file__).resolve().parents[3], timeout=300)
        self.assertEqual(out.returncode, 0, msg=out.stderr)
        self.assertEqual(out.stdout.strip(), "ok")


if __name__ == "__main__":
    run_tests()
