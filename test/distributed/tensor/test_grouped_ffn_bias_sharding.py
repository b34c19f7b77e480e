# Owner(s): ["oncall: distributed"]
"""The DTensor sharding strategies of ``grouped_ffn`` / ``grouped_ffn_backward`` with expert
biases (``torch_moe/distributed/tensor/_ops/_moe_ops.py``), against the single-device op.

One process simulates the ranks (the ``"fake"`` process group and ``LocalTensorMode``), on 1-D
meshes of 2 and 4. For every rule that takes biases the op runs on DTensors placed as the rule
says; the test checks that DTensor ran that rule (the output placements it claims, so that a
fallback to all-Replicate, which is always right, cannot pass) and that the result, gathered,
is the single-device op's:

* F sharded (expert tensor parallel): w1 / w3 ``Shard(2)`` (a fused w13 ``_StridedShard(2, 2)``),
  w2 ``Shard(1)``; b1 / b3 ``Shard(1)`` (the ``[E, 2F]`` b1 of a fused w13 ``_StridedShard(1,
  2)``); b2 ``Partial``, given so (b2 on rank 0, zeros elsewhere, the exact split) or given
  ``Replicate`` (DTensor divides it over the ranks: b2 must still count once, not once per
  shard). Output ``Partial``, hidden sharded like the F columns.
* the routing weights ``Partial``, biases ``Replicate``; w2 and b2 ``Partial`` together.
* the backward: F sharded (the bias gradients of b1 / b3 sharded like their biases, that of b2
  ``Replicate``; the routing weights' gradient ``Partial``, which takes its ``<grad, b2>`` term
  from a ``Partial`` b2), the output gradient ``Partial``, the routing weights ``Partial``.
* autograd end to end on the F-sharded layout, from Replicate biases: every gradient, gathered,
  equals the single-device autograd's (the division of b2 and its way back included).
* the token-parallel handlers (``_token_parallel.py``) on a 2 x 2 mesh, tokens sharded on dim 0
  and expert tensor parallel on dim 1 (F-sharded weights and b1 / b3, b2 replicated and added
  once): the MoE layer with ``ffn_bias`` (separate w1 / w3, and ``fused_gate_up`` with
  ``_StridedShard`` w13 and b1) and ``moe_ffn`` with biases, forward and backward against the
  unsharded layer; the layouts they refuse (a bias not laid out like its weights, a fused w13
  sharded with a plain ``Shard(2)``).

Layouts: swiglu with separate w1 / w3 and each bias alone or all three, the fused w13 with its
``[E, 2F]`` b1 (swiglu_oai), and an ungated kind (relu). Shapes divide by 4.
"""

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)
import torch_moe.distributed.tensor  # noqa: F401  (registers the sharding strategies)
from torch_moe.nn import MoE, MoEConfig
from torch_moe.nn.functional import moe_ffn

ops = torch.ops.torch_moe
R, P = Replicate(), Partial()
SS1, SS2 = _StridedShard(1, split_factor=2), _StridedShard(2, split_factor=2)

T, K_TOP, E, D, F = 8, 2, 4, 8, 8
ALPHA, LIMIT = 1.702, 1.0
# (activation, layout, biases)
CASES = (
    ("swiglu", "separate", ("b1",)),
    ("swiglu", "separate", ("b2",)),
    ("swiglu", "separate", ("b3",)),
    ("swiglu", "separate", ("b1", "b2", "b3")),
    ("swiglu_oai", "fused", ("b1", "b2")),
    ("relu", "plain", ("b1", "b2")),
)
# the placement of each forward tensor argument on the F-sharded mesh dim, by layout
F_SHARDED = {
    "separate": {"w1": Shard(2), "w2": Shard(1), "w3": Shard(2), "b1": Shard(1), "b3": Shard(1)},
    "fused": {"w1": SS2, "w2": Shard(1), "b1": SS1},
    "plain": {"w1": Shard(2), "w2": Shard(1), "b1": Shard(1)},
}
HIDDEN_F = {"separate": SS1, "fused": SS1, "plain": Shard(1)}
# the tensor arguments of the forward and of the backward, in order
FWD = ("x", "sorted_ids", "offs", "topk_weights", "w1", "w2", "w3")
BWD = ("grad", "x", "sorted_ids", "offs", "topk_weights", "w1", "w2", "w3", "hidden")
GRADS = ("x", "topk_weights", "w1", "w2", "w3", "b1", "b2", "b3")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _problem(activation: str, layout: str, names, seed: int = 0) -> dict:
    """The tensors of one problem (float64: the simulated ranks only reorder sums), biases of
    the magnitude of the pre-activations (the clamps of swiglu_oai engage)."""
    g = _gen(seed)
    scores = torch.rand(T, E, generator=g)
    scores[:, 0] += 0.5  # uneven groups
    topk_ids = scores.topk(K_TOP, dim=1).indices
    sorted_ids, offs, _ = ops.token_sort(topk_ids, E, 2)  # with padding

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    width = 2 * F if layout == "fused" else F
    p = {
        "x": randn(T, D), "sorted_ids": sorted_ids, "offs": offs,
        "topk_weights": torch.rand(T, K_TOP, generator=g, dtype=torch.float64) + 0.5,
        "w1": randn(E, D, width) / D**0.5, "w2": randn(E, F, D) / F**0.5,
        "w3": randn(E, D, F) / D**0.5 if layout == "separate" else None,
        "b1": randn(E, width) if "b1" in names else None,
        "b2": randn(E, D) if "b2" in names else None,
        "b3": randn(E, F) if "b3" in names else None,
        "grad": randn(T, D),
    }
    return p


def _fwd_args(p: dict, activation: str, tensors=None) -> list:
    t = p if tensors is None else tensors
    return [t[n] for n in FWD] + [activation, ALPHA, LIMIT, t["b1"], t["b2"], t["b3"]]


def _bwd_args(p: dict, activation: str, mask, tensors=None) -> list:
    t = p if tensors is None else tensors
    return ([t[n] for n in BWD] + [activation, ALPHA, LIMIT, mask, t["b1"], t["b2"], t["b3"]])


def _value(t: torch.Tensor) -> torch.Tensor:
    """The value of a replicated LocalTensor (the same on every simulated rank)."""
    if isinstance(t, LocalTensor):
        vals = list(t._local_tensors.values())
        for v in vals[1:]:
            torch.testing.assert_close(v, vals[0], atol=0, rtol=0)
        return vals[0]
    return t


class _Ranks:
    """DTensors of plain tensors on a 1-D mesh of ``ws`` simulated ranks (under
    LocalTensorMode)."""

    def __init__(self, ws: int, mode: LocalTensorMode, shape=None):
        self.ws, self.mode = ws, mode
        self.mesh = init_device_mesh("cpu", shape or (ws,))

    def place(self, t, p):
        """``t`` placed by ``p``: one placement (a 1-D mesh), or a tuple of them; Partial on a
        1-D mesh only."""
        if t is None:
            return None
        if isinstance(p, Partial):
            return self.partial(t)
        # from a replicated LocalTensor: distribute_tensor of a plain tensor with a
        # _StridedShard gives every rank rank 0's shard under LocalTensorMode
        src = LocalTensor({r: t.clone() for r in range(self.ws)})
        return distribute_tensor(src, self.mesh, p if isinstance(p, tuple) else (p,))

    def replicated(self, t) -> LocalTensor:
        """``t`` on every rank, as a plain tensor of the simulated ranks."""
        return LocalTensor({r: t.clone() for r in range(self.ws)})

    def partial(self, t, exact: bool = False):
        """``t`` as a Partial(sum) DTensor: uneven parts with sign-alternating offsets (the last
        rank's part the rest of t), or t on rank 0 and zeros elsewhere (``exact``)."""
        with self.mode.disable():
            if exact:
                parts = {r: t.clone() if r == 0 else torch.zeros_like(t) for r in range(self.ws)}
            else:
                off = torch.linspace(-1, 1, t.numel(), dtype=t.dtype).view(t.shape)
                parts = {r: t * (0.6 if r == 0 else 0.4 / (self.ws - 1)) + off * (-1) ** r
                         for r in range(self.ws - 1)}
                parts[self.ws - 1] = t - sum(parts.values())
        return DTensor.from_local(LocalTensor(parts), self.mesh, (P,), run_check=False)

    def problem(self, *args) -> dict:
        """:func:`_problem`, built outside the mode (whose random functions differ per rank)."""
        with self.mode.disable():
            return _problem(*args)

    def full(self, d) -> torch.Tensor:
        return _value(d.full_tensor())

    def compare(self, test: TestCase, actual: DTensor, expected: torch.Tensor, msg: str,
                **tol):
        """``actual`` gathered against ``expected``, compared outside the mode (whose per-rank
        dispatch cannot build a mismatch message)."""
        full = self.full(actual)
        with self.mode.disable():
            test.assertEqual(full, expected, msg=msg, **tol)


@contextlib.contextmanager
def _fake_world(ws: int, shape=None):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=ws)
    try:
        mode = LocalTensorMode(frozenset(range(ws)))
        with mode:
            yield _Ranks(ws, mode, shape)
    finally:
        dist.destroy_process_group()


class TestGroupedFFNBiasSharding(TestCase):
    def assertPlaced(self, d, placement, what):
        self.assertIsInstance(d, DTensor, msg=what)
        # compared as text: Shard and _StridedShard compare equal on some torch versions
        self.assertEqual(str(d.placements), str((placement,)), msg=what)

    def check_forward(self, ranks, p, activation, placements, out_p, hidden_p, what):
        """Runs the forward on DTensors placed by ``placements`` (name -> placement, default
        Replicate; a DTensor value is taken as it is) and checks the claimed placements and the
        gathered values against the single-device op."""
        with ranks.mode.disable():
            ref_out, ref_hidden = ops.grouped_ffn(*_fwd_args(p, activation))
        d = {n: placements[n] if isinstance(placements.get(n), DTensor)
             else ranks.place(p[n], placements.get(n, R))
             for n in FWD + ("b1", "b2", "b3")}
        out, hidden = ops.grouped_ffn(*_fwd_args(p, activation, d))
        self.assertPlaced(out, out_p, f"{what}: out")
        self.assertPlaced(hidden, hidden_p, f"{what}: hidden")
        ranks.compare(self, out, ref_out, f"{what}: out")
        ranks.compare(self, hidden, ref_hidden, f"{what}: hidden")

    def test_forward_f_sharded(self):
        for ws in (2, 4):
            with _fake_world(ws) as ranks:
                for activation, layout, names in CASES:
                    p = ranks.problem(activation, layout, names)
                    pl = dict(F_SHARDED[layout])
                    for b2 in ("Replicate", "Partial", "exact Partial"):
                        if b2 != "Replicate" and p["b2"] is None:
                            continue
                        if b2 == "Partial":
                            pl["b2"] = ranks.partial(p["b2"])
                        elif b2 == "exact Partial":
                            pl["b2"] = ranks.partial(p["b2"], exact=True)
                        what = f"ws={ws} {activation} {layout} {names} b2 {b2}"
                        self.check_forward(ranks, p, activation, pl, P, HIDDEN_F[layout], what)

    def test_forward_linear_rules(self):
        with _fake_world(2) as ranks:
            for activation, layout, names in CASES:
                p = ranks.problem(activation, layout, names)
                what = f"{activation} {layout} {names}"
                self.check_forward(ranks, p, activation, {"topk_weights": P}, P, R,
                                   f"{what} routing weights Partial")
                if p["b2"] is not None:
                    self.check_forward(ranks, p, activation, {"w2": P, "b2": P}, P, R,
                                       f"{what} w2 and b2 Partial")

    def check_backward(self, ranks, p, activation, placements, grad_placements, what):
        mask = [True] * 5 + [p[n] is not None for n in ("b1", "b2", "b3")]
        with ranks.mode.disable():
            hidden = ops.grouped_ffn(*_fwd_args(p, activation))[1]
            tensors = dict(p, hidden=hidden)
            ref = ops.grouped_ffn_backward(*_bwd_args(tensors, activation, mask))
        d = {n: ranks.place(tensors[n], placements.get(n, R))
             for n in BWD + ("b1", "b2", "b3")}
        got = ops.grouped_ffn_backward(*_bwd_args(p, activation, mask, d))
        for name, g, r in zip(GRADS, got, ref):
            if r.numel() == 0:
                continue
            self.assertPlaced(g, grad_placements[name], f"{what}: grad_{name}")
            ranks.compare(self, g, r, f"{what}: grad_{name}")

    def test_backward_rules(self):
        for ws in (2, 4):
            with _fake_world(ws) as ranks:
                for activation, layout, names in CASES:
                    p = ranks.problem(activation, layout, names)
                    what = f"ws={ws} {activation} {layout} {names}"
                    f = F_SHARDED[layout]
                    self.check_backward(
                        ranks, p, activation, dict(f, b2=P, hidden=HIDDEN_F[layout]),
                        {"x": P, "topk_weights": P, "b2": R, **f}, f"{what} F sharded")
                    if ws > 2:
                        continue
                    every = {n: P for n in GRADS}
                    self.check_backward(ranks, p, activation, {"grad": P}, every,
                                        f"{what} grad Partial")
                    self.check_backward(ranks, p, activation, {"topk_weights": P},
                                        dict(every, topk_weights=R),
                                        f"{what} routing weights Partial")

    def test_autograd_f_sharded(self):
        """Forward and backward through DTensor's autograd, F-sharded weights and biases from
        Replicate: the strategies' redistributions (b2 to Partial) and their way back."""
        with _fake_world(2) as ranks:
            for activation, layout, names in CASES:
                p = ranks.problem(activation, layout, names)
                what = f"{activation} {layout} {names}"
                leaves = ("x", "topk_weights", "w1", "w2", "w3", "b1", "b2", "b3")
                with ranks.mode.disable():
                    ref_in = {n: p[n].clone().requires_grad_()
                              if n in leaves and p[n] is not None else p[n] for n in p}
                    ref_out = ops.grouped_ffn(*_fwd_args(p, activation, ref_in))[0]
                    ref_out.backward(p["grad"])
                pl = F_SHARDED[layout]
                d = {n: ranks.place(p[n], pl.get(n, R)) for n in FWD + ("b1", "b2", "b3")}
                for n in leaves:
                    if d[n] is not None:
                        d[n].requires_grad_()
                out = ops.grouped_ffn(*_fwd_args(p, activation, d))[0]
                self.assertPlaced(out, P, f"{what}: out")
                y = out.redistribute(ranks.mesh, (R,))
                y.backward(ranks.place(p["grad"], R))
                ranks.compare(self, y, ref_out.detach(), f"{what}: out")
                for n in leaves:
                    if d[n] is None:
                        continue
                    ranks.compare(self, d[n].grad, ref_in[n].grad, f"{what}: {n}.grad")


    # -- the token-parallel handlers, tokens on mesh dim 0 and expert TP on mesh dim 1 -------

    @staticmethod
    def _etp(fused: bool) -> dict:
        """Parameter name -> placement on the expert-tensor-parallel mesh dim."""
        if fused:
            return {"w1": SS2, "w2": Shard(1), "b1": SS1}
        return {"w1": Shard(2), "w2": Shard(1), "w3": Shard(2), "b1": Shard(1),
                "b3": Shard(1)}

    def test_layer_tokens_and_expert_tensor_parallel(self):
        for fused in (False, True):
            cfg = MoEConfig(dim=D, hidden_dim=F, num_experts=E, top_k=K_TOP, ffn_bias=True,
                            activation="swiglu_oai", swiglu_limit=LIMIT, fused_gate_up=fused)
            torch.manual_seed(0)
            moe = MoE(cfg).double()
            with torch.no_grad():
                for n in ("b1", "b2", "b3"):
                    b = getattr(moe.experts, n)
                    if b is not None:
                        b.copy_(torch.randn(b.shape, generator=_gen(5), dtype=b.dtype))
            x = torch.randn(2 * T, D, dtype=torch.float64, generator=_gen(3))
            grad = torch.randn(2 * T, D, dtype=torch.float64, generator=_gen(4))
            ref_x = x.clone().requires_grad_()
            ref_y = moe(ref_x)
            ref_y.backward(grad)
            etp = self._etp(fused)
            with _fake_world(4, (2, 2)) as ranks:
                m = copy.deepcopy(moe)
                m.zero_grad()
                for name, prm in list(m.named_parameters()):
                    owner, attr = name.rsplit(".", 1)
                    pl = (R, etp.get(attr, R) if owner == "experts" else R)
                    setattr(m.get_submodule(owner), attr,
                            torch.nn.Parameter(ranks.place(prm.detach(), pl)))
                xd = ranks.place(x, (Shard(0), R)).requires_grad_()
                y = m(xd)
                y.full_tensor().backward(ranks.replicated(grad))
                what = f"fused={fused}"
                ranks.compare(self, y, ref_y.detach(), f"{what}: y")
                ranks.compare(self, xd.grad, ref_x.grad, f"{what}: x.grad")
                ref_params = dict(moe.named_parameters())
                for name, prm in m.named_parameters():
                    # the router scores in fp32 whatever its parameters' dtype: its gradient
                    # matches to fp32 rounding (the token shards sum it in another order)
                    tol = {} if name.startswith("experts.") else {"atol": 1e-6, "rtol": 1e-5}
                    ranks.compare(self, prm.grad, ref_params[name].grad, f"{what}: {name}.grad",
                                  **tol)

    def test_moe_ffn_tokens_and_expert_tensor_parallel(self):
        from torch_moe.nn.functional import route

        for fused in (False, True):
            layout = "fused" if fused else "separate"
            names = ("b1", "b2") if fused else ("b1", "b2", "b3")
            p = _problem("swiglu", layout, names)
            topk_weights, topk_ids = torch.rand(T, K_TOP, generator=_gen(6)), None
            topk_ids = torch.stack([torch.randperm(E, generator=_gen(7 + t))[:K_TOP]
                                    for t in range(T)])
            topk_weights = topk_weights.double()
            leaves = {n: p[n].clone().requires_grad_() for n in ("x", "w1", "w2", "w3") + names
                      if p[n] is not None}
            ref = moe_ffn(leaves["x"], topk_ids, topk_weights, leaves["w1"], leaves["w2"],
                          leaves.get("w3"), b1=leaves.get("b1"), b2=leaves.get("b2"),
                          b3=leaves.get("b3"))
            ref.backward(p["grad"])
            etp = self._etp(fused)
            with _fake_world(4, (2, 2)) as ranks:
                tok = (Shard(0), R)
                d = {n: ranks.place(p[n], (R, etp.get(n, R))).requires_grad_() for n in leaves}
                d["x"] = ranks.place(p["x"], tok).requires_grad_()
                out = moe_ffn(d["x"], ranks.place(topk_ids, tok), ranks.place(topk_weights, tok),
                              d["w1"], d["w2"], d.get("w3"), b1=d.get("b1"), b2=d.get("b2"),
                              b3=d.get("b3"))
                out.full_tensor().backward(ranks.replicated(p["grad"]))
                ranks.compare(self, out, ref.detach(), f"{layout}: out")
                for n, t in d.items():
                    ranks.compare(self, t.grad, leaves[n].grad, f"{layout}: {n}.grad")

    def test_refused_layouts(self):
        p = _problem("swiglu", "fused", ("b1", "b2"))
        ids = torch.zeros(T, K_TOP, dtype=torch.long)
        with _fake_world(4, (2, 2)) as ranks:
            tok = (Shard(0), R)
            args = [ranks.place(p["x"], tok), ranks.place(ids, tok),
                    ranks.place(p["topk_weights"], tok)]
            cases = [
                # the fused w13 cut into contiguous halves: rank 0 would hold gate columns only
                ({"w1": Shard(2), "w2": Shard(1)}, {},
                 "expected expert weights all Replicate, or the fused w1 "
                 r"_StridedShard\(2, split_factor=2\) with w2 Shard\(1\)"),
                ({"w1": SS2, "w2": Shard(1)}, {"b1": Shard(1)},
                 r"expected the expert bias b1 to be _S\(1, 2\) \(as its weights are laid "
                 r"out\), but got S\(1\)"),
                ({"w1": SS2, "w2": Shard(1), "b1": SS1}, {"b2": Shard(1)},
                 r"expected the expert bias b2 to be R \(as its weights are laid out\), but "
                 r"got S\(1\)"),
            ]
            for weights, biases, msg in cases:
                pl = {**weights, **biases}
                d = {n: ranks.place(p[n], (R, pl.get(n, R))) for n in ("w1", "w2", "b1", "b2")}
                with ranks.mode.disable(), self.assertRaisesRegex(ValueError, msg):
                    with ranks.mode:
                        moe_ffn(*args, d["w1"], d["w2"], None, b1=d["b1"], b2=d["b2"])


if __name__ == "__main__":
    run_tests()
