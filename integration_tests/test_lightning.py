"""A real Lightning ``Trainer`` on 2 gloo ranks with ``ShardscalePrecision``, overflow on one rank.

Strategies exercised on CPU: ``DDPStrategy`` and ``ModelParallelStrategy``,
both as FSDP2 (``fully_shard`` in ``configure_model``) and as tensor parallel
(``parallelize_module``, column- then row-wise). Lightning's ``"fsdp"`` strategy
(FSDP1) refuses a CPU accelerator and torch's FSDP1 needs an accelerator
device, so it is not exercised here (docs/lightning.md says so).

Each run trains STEPS optimizer steps with an infinite loss injected on ONE
rank at the steps in INJECT (rank 0 at one step, rank 1 at another). What must
hold, derived from torch's GradScaler semantics rather than from our code:
every rank skips exactly the injected steps; the scale halves once per skip
(growth_interval is far away); an ``interval="step"`` scheduler advances only
on the steps taken; parameters are bit-identical across ranks; the logged
gradient norm is the true global norm (computed here with torch's own
``get_total_norm`` from the gradients after backward) and the gradients the
optimizer sees are clipped to it; the checkpoint stores the scaler's state and
a resumed run starts from it. Lightning's own plugins are run on the same
loop to show what this fixes: the scheduler advances on skipped steps, and
norm clipping raises with a fused optimizer or under FSDP2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mp_harness import Pool
from scaler_support import torch_steps
from tolerances import clipped_grad_rtol, norm_rtol

pl = pytest.importorskip("lightning.pytorch")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

STEPS = 8
INJECT = {2: 0, 5: 1}  # optimizer step -> the one rank whose loss is inf there
INIT_SCALE = 1024.0
CLIP = 0.05  # below the clean steps' norms (checked), so clipping really acts
BATCH = 8
DIM = 8


def _launch_env() -> None:
    # The pool already holds the process group: Lightning sees an external launcher
    # (LOCAL_RANK set) and an initialized group, so it starts nothing itself.
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        {"LOCAL_RANK": str(rank), "NODE_RANK": "0", "RANK": str(rank),
         "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555"}
    )  # fmt: skip


class _Net(pl.LightningModule):
    def __init__(self, *, fused: bool, layout: str, override_clip: bool) -> None:
        super().__init__()
        torch.manual_seed(0)  # identical initial weights on every rank
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        self.fused = fused
        self.layout = layout
        self.override_clip = override_clip

    def configure_model(self) -> None:
        if self.layout == "tensor_parallel":
            from torch.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )

            tp = self.device_mesh["tensor_parallel"]
            parallelize_module(self.net, tp, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            return
        if self.layout != "model_parallel":
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = (self.net(x).float() - 1.0).pow(2).mean()
        if INJECT.get(self.global_step) == dist.get_rank():
            loss = loss * math.inf
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=self.fused)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1.0 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class _OverrideClip(_Net):
    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        # A module that decides clipping itself: the request reaches the plugin's clip_grad_by_norm.
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")


def _grads(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in module.parameters() if p.grad is not None]


def _global_norm(grads: list[torch.Tensor]) -> float:
    """torch's own norm of the (DTensor or replicated) gradients, in float64."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.get_total_norm([g.to(torch.float64) for g in grads], 2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


class _Recorder(pl.Callback):
    """Reads what the test checks, on the host (the plugin itself never does)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.steps: list[dict[str, Any]] = []
        self.start: dict[str, Any] = {}
        self._row: dict[str, Any] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        sched = trainer.lr_scheduler_configs[0].scheduler
        self.start = {"scale": self.plugin.scaler.get_scale(), "sched": sched.last_epoch}

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        scale = self.plugin.scaler.get_scale()
        self._row = {"ref_norm": _global_norm(_grads(pl_module)) / scale, "scale_before": scale}

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._row["hook_norm"] = _global_norm(_grads(pl_module))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        opt = trainer.optimizers[0]
        flag = self.plugin.step_was_skipped(opt)
        norm = self.plugin.grad_norm
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if "shardscale" in k}
        self._row.update(
            skipped=bool(flag), scale=self.plugin.scaler.get_scale(),
            norm=float(norm) if norm is not None else None, logged=logged,
            lr=opt.param_groups[0]["lr"],
        )  # fmt: skip
        self.steps.append(self._row)


def _full_params(module: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in module.parameters()
    ]


def _trainer(plugin: Any, strategy: str, steps: int, recorder: _Recorder, **kw: Any) -> Any:
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    strat: Any = DDPStrategy()
    if strategy == "model_parallel":  # FSDP2 over both ranks
        strat = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    elif strategy == "tensor_parallel":  # both ranks hold shards of every weight
        strat = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strat, plugins=[plugin], max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False, callbacks=[recorder], **kw,
    )  # fmt: skip


def _loader(rank: int, steps: int, *, same: bool = False) -> torch.utils.data.DataLoader[Any]:
    # Each rank its own data, except under tensor parallelism, where ranks share the batch.
    g = torch.Generator().manual_seed(100 + (0 if same else rank))
    data = torch.utils.data.TensorDataset(torch.randn(steps * BATCH, DIM, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=BATCH)


def _shardscale_case(strategy: str, fused: bool, override_clip: bool, ckpt: str | None) -> Any:
    from shardscale.lightning import ShardscalePrecision

    _launch_env()
    rank = dist.get_rank()
    sharded_ckpt = strategy != "ddp"  # ModelParallel saves a distributed checkpoint (a directory)
    same = strategy == "tensor_parallel"
    cls = _OverrideClip if override_clip else _Net
    model = cls(fused=fused, layout=strategy, override_clip=override_clip)
    plugin = ShardscalePrecision("16-mixed", device="cpu", init_scale=INIT_SCALE)
    rec = _Recorder(plugin)
    clip_kw = {} if override_clip else {"gradient_clip_val": CLIP}
    trainer = _trainer(plugin, strategy, STEPS, rec, **clip_kw)
    trainer.fit(model, _loader(rank, STEPS + 2, same=same))
    out: dict[str, Any] = {
        "steps": rec.steps,
        "params": _full_params(model),
        "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "global_step": trainer.global_step,
    }
    if ckpt is None:
        return out
    trainer.save_checkpoint(ckpt)
    dist.barrier()
    if not sharded_ckpt:
        out["saved"] = torch.load(ckpt, weights_only=False)[type(plugin).__qualname__]
    # Resume into a fresh plugin built with another scale: the checkpoint's must win.
    plugin2 = ShardscalePrecision("16-mixed", device="cpu", init_scale=2.0**16)
    rec2 = _Recorder(plugin2)
    model2 = cls(fused=fused, layout=strategy, override_clip=override_clip)
    trainer2 = _trainer(plugin2, strategy, STEPS + 2, rec2, **clip_kw)
    trainer2.fit(model2, _loader(rank, STEPS + 2, same=same), ckpt_path=ckpt)
    out["resumed"] = {"start": rec2.start, "steps": rec2.steps, "params": _full_params(model2)}
    return out


def _lightning_own_case() -> dict[str, Any]:
    """The same loop on Lightning's own plugins: what ShardscalePrecision fixes."""
    from lightning.pytorch.plugins.precision import FSDPPrecision, MixedPrecision

    _launch_env()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", INIT_SCALE))
    trainer = _trainer(plugin, "ddp", STEPS, _NoRecorder())
    trainer.fit(_Net(fused=False, layout="ddp", override_clip=False), _loader(rank, STEPS))
    out["scale"] = plugin.scaler.get_scale()
    out["sched"] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
    errors = []
    for strategy, prec in (
        ("ddp", MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))),
        ("model_parallel", FSDPPrecision("bf16-mixed")),
    ):
        trainer = _trainer(prec, strategy, 2, _NoRecorder(), gradient_clip_val=CLIP)
        net = _Net(fused=strategy == "ddp", layout=strategy, override_clip=False)
        try:
            trainer.fit(net, _loader(rank, 2))
            errors.append(None)
        except Exception as exc:  # what Lightning raises is the point
            errors.append(f"{type(exc).__name__}: {exc}")
    out["errors"] = errors
    return out


class _NoRecorder(pl.Callback):
    pass


# -- parent side ------------------------------------------------------------------------------


def _check_run(results: list[dict[str, Any]], *, fused: bool) -> None:
    r0, r1 = results
    numel = sum(p.numel() for p in r0["params"])
    for rank, res in enumerate(results):
        steps = res["steps"]
        assert len(steps) == STEPS and res["global_step"] == STEPS
        # Every rank skips exactly the injected steps, whichever rank overflowed.
        assert [i for i, s in enumerate(steps) if s["skipped"]] == sorted(INJECT), (rank, steps)
        # The scale halves once per skip (growth_interval 2000 is never reached).
        assert [s["scale"] for s in steps] == [
            INIT_SCALE * 0.5 ** sum(1 for k in INJECT if k <= i) for i in range(STEPS)
        ]
        # The scheduler advanced on the steps taken only, and the lr shows it.
        taken = STEPS - len(INJECT)
        assert res["sched"] == taken
        assert steps[-1]["lr"] == pytest.approx(1e-2 / (1.0 + taken), rel=1e-12)
        clean = [s for s in steps if not s["skipped"]]
        assert any(s["ref_norm"] > CLIP for s in clean)  # clipping really acts
        rtol = 4 * norm_rtol(numel, torch.float32, 2.0)  # ours and torch's, each within the bound
        for s in clean:
            assert s["norm"] == pytest.approx(s["ref_norm"], rel=rtol), s
            # logged through self.log as a device tensor; callback_metrics hold the last step's
        assert steps[-1]["logged"]["shardscale/grad_norm"] == pytest.approx(steps[-1]["norm"])
        assert steps[-1]["logged"]["shardscale/scale"] == steps[-1]["scale"]
        assert steps[-1]["logged"]["shardscale/skipped"] == 0.0
        if not fused:
            # The optimizer sees unscaled gradients of norm min(norm, CLIP): torch's clip rule.
            for s in clean:
                expected = s["ref_norm"] * min(1.0, CLIP / (s["ref_norm"] + 1e-6))
                tol = clipped_grad_rtol(numel, torch.float32, 2.0) + rtol
                assert s["hook_norm"] == pytest.approx(expected, rel=tol), s
        for s in steps:
            if s["skipped"]:
                assert s["norm"] is None or not math.isfinite(s["norm"])
    # Identical parameters on every rank, bit for bit, and training moved them.
    for a, b in zip(r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b)


def _check_resume(results: list[dict[str, Any]]) -> None:
    final_scale = INIT_SCALE * 0.5 ** len(INJECT)
    for res in results:
        if "saved" in res:
            assert res["saved"]["scale"] == final_scale
            assert res["saved"]["growth_factor"] == 2.0
        resumed = res["resumed"]
        assert resumed["start"] == {"scale": final_scale, "sched": STEPS - len(INJECT)}
        assert len(resumed["steps"]) == 2 and not any(s["skipped"] for s in resumed["steps"])
        assert [s["scale_before"] for s in resumed["steps"]] == [final_scale] * 2
    for a, b in zip(results[0]["resumed"]["params"], results[1]["resumed"]["params"], strict=True):
        assert torch.equal(a, b)


def test_ddp_unfused_adamw_clip_skip_and_resume(pool2: Pool, tmp_path: Path) -> None:
    results = pool2.run(_shardscale_case, "ddp", False, False, str(tmp_path / "ddp.ckpt"))
    _check_run(results, fused=False)
    _check_resume(results)


def test_fsdp2_model_parallel_fused_adamw_clip_skip_and_resume(pool2: Pool, tmp_path: Path) -> None:
    results = pool2.run(
        _shardscale_case, "model_parallel", True, False, str(tmp_path / "fsdp2.ckpt")
    )
    _check_run(results, fused=True)
    _check_resume(results)


def test_tensor_parallel_unfused_adamw_clip_and_skip(pool2: Pool) -> None:
    # Column- then row-wise sharded weights: the inf stays in one rank's shards.
    results = pool2.run(_shardscale_case, "tensor_parallel", False, False, None)
    _check_run(results, fused=False)


def test_ddp_fused_adamw_module_overrides_clipping(pool2: Pool) -> None:
    results = pool2.run(_shardscale_case, "ddp", True, True, None)
    _check_run(results, fused=True)


def test_lightning_own_plugins_show_what_is_fixed(pool2: Pool) -> None:
    for res in pool2.run(_lightning_own_case):
        # torch's scaler under DDP skips the same steps (gradients are all-reduced first) ...
        assert res["scale"] == INIT_SCALE * 0.5 ** len(INJECT)
        # ... but Lightning steps the scheduler on the skipped steps too.
        assert res["sched"] == STEPS
        fused_clip, fsdp2_clip = res["errors"]
        assert fused_clip is not None and "does not allow for gradient clipping" in fused_clip
        assert fsdp2_clip is not None and "not supported" in fsdp2_clip


# -- manual optimization, one and two optimizers, against a hand-written torch loop -----------
#
# The user's loop: manual_backward, self.clip_gradients(opt, CLIP, "norm") on each optimizer,
# then opt.step() on each. The reference is torch's own recipe for several optimizers, in the
# same process on the same data: scaler.unscale_ + clip_grad_norm_ (DDP averaged the gradients,
# so the local norm is the true one) per optimizer, scaler.step each, ONE scaler.update().

MANUAL_LR = 0.1


def _manual_optimizers(net: torch.nn.Module, count: int) -> list[torch.optim.Optimizer]:
    if count == 1:
        return [torch.optim.SGD(net.parameters(), lr=MANUAL_LR)]
    # Two optimizers, the second fused: it unscales inside its step from the scaler's grad_scale.
    return [
        torch.optim.SGD(net[0].parameters(), lr=MANUAL_LR),
        torch.optim.SGD(net[2].parameters(), lr=MANUAL_LR, fused=True),
    ]


def _manual_loss(net: torch.nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    loss = (net(x).float() - 1.0).pow(2).mean()
    return loss * math.inf if INJECT.get(step) == dist.get_rank() else loss


class _Manual(pl.LightningModule):
    def __init__(self, count: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the torch loop builds the same weights
        self.net = torch.nn.Sequential(
            torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
        )
        self.count = count
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opts = self.optimizers()
        opts = opts if isinstance(opts, list) else [opts]
        self.manual_backward(_manual_loss(self.net, batch[0], batch_idx))
        for opt in opts:
            self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
        for opt in opts:
            opt.step()
        for opt in opts:
            opt.zero_grad()

    def configure_optimizers(self) -> Any:
        return _manual_optimizers(self.net, self.count)


class _ManualRecorder(pl.Callback):
    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.rows: list[dict[str, Any]] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        logged = {k: float(v) for k, v in trainer.callback_metrics.items() if "shardscale" in k}
        flags = [self.plugin.step_was_skipped(opt) for opt in trainer.optimizers]
        self.rows.append(
            {"scale": self.plugin.scaler.get_scale(), "logged": logged,
             "flags": [bool(f) for f in flags if f is not None]}
        )  # fmt: skip


def _torch_manual_loop(count: int, loader: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    model = DistributedDataParallel(net)
    opts = _manual_optimizers(net, count)
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    rows = []
    for step, (x,) in enumerate(loader):
        with torch.autocast("cpu", dtype=torch.float16):  # what the plugin's training_step runs in
            loss = _manual_loss(model, x, step)
            scaler.scale(loss).backward()
        norms = []
        for opt in opts:
            scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"]]
            norms.append(torch.nn.utils.clip_grad_norm_(params, CLIP))
        skipped = torch_steps(scaler, opts)
        norm = float(torch.linalg.vector_norm(torch.stack(norms).double()))
        rows.append({"scale": scaler.get_scale(), "skipped": skipped, "norm": norm})
    return {"rows": rows, "params": [p.detach().clone() for p in net.parameters()]}


def _manual_case(count: int) -> dict[str, Any]:
    from shardscale.lightning import ShardscalePrecision

    _launch_env()
    rank = dist.get_rank()
    plugin = ShardscalePrecision("16-mixed", device="cpu", init_scale=INIT_SCALE)
    rec = _ManualRecorder(plugin)
    model = _Manual(count)
    # In manual optimization global_step counts optimizer steps: `count` per batch.
    trainer = _trainer(plugin, "ddp", STEPS * count, rec)
    trainer.fit(model, _loader(rank, STEPS))
    ours = {"rows": rec.rows, "params": [p.detach().clone() for p in model.net.parameters()]}
    return {"ours": ours, "torch": _torch_manual_loop(count, _loader(rank, STEPS))}


def _check_manual(results: list[dict[str, Any]]) -> None:
    numel = sum(p.numel() for p in results[0]["torch"]["params"])
    # The two loops differ only in how the norm is rounded (each within norm_rtol, float32
    # accumulation) and, through weights one float32 ulp apart, in an fp16 rounding of the
    # forward (one fp16 eps): clipped_grad_rtol of fp16 covers both. Each step moves a weight by
    # at most lr * CLIP, the next gradient's sensitivity to the gap at most doubles it, so after
    # STEPS steps the weights agree within 2 * STEPS * lr * CLIP * rtol. (A double unscale or a
    # missing clip moves them by about lr * CLIP per step: 40x more than this.)
    atol = 2 * STEPS * MANUAL_LR * CLIP * clipped_grad_rtol(numel, torch.float16, 2.0)
    rtol = 4 * norm_rtol(numel, torch.float32, 2.0)
    for rank, res in enumerate(results):
        ours, ref = res["ours"]["rows"], res["torch"]["rows"]
        assert len(ours) == len(ref) == STEPS
        # The same scale history as torch's: one backoff per overflowing step, nothing else.
        assert [r["scale"] for r in ours] == [r["scale"] for r in ref], (rank, ours, ref)
        skipped = [i for i, r in enumerate(ref) if r["skipped"]]
        assert skipped == sorted(INJECT)
        for i, (o, t) in enumerate(zip(ours, ref, strict=True)):
            # Every optimizer's own flag and the logged flag say the same as torch.
            assert o["flags"] and all(f == t["skipped"] for f in o["flags"]), (rank, i, o)
            assert o["logged"]["shardscale/skipped"] == float(t["skipped"])
            assert o["logged"]["shardscale/scale"] == t["scale"]
            if not t["skipped"]:
                assert t["norm"] > CLIP  # clipping acts on every clean step
                # The logged norm is the 2-norm over the optimizers clipped, each the true norm.
                assert o["logged"]["shardscale/grad_norm"] == pytest.approx(t["norm"], rel=rtol)
        for a, b in zip(res["ours"]["params"], res["torch"]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0.0, atol=atol)
    for a, b in zip(results[0]["ours"]["params"], results[1]["ours"]["params"], strict=True):
        assert torch.equal(a, b)


def test_manual_optimization_one_optimizer_matches_torch(pool2: Pool) -> None:
    _check_manual(pool2.run(_manual_case, 1))


def test_manual_optimization_two_optimizers_match_torch(pool2: Pool) -> None:
    _check_manual(pool2.run(_manual_case, 2))


# -- plain-tensor expert parallelism: the clip of already-unscaled gradients --------------------
#
# ModelParallelStrategy without fully_shard: plain parameters, nothing all-reduced. `shared`
# sees the same batch on both ranks (identical gradients: a replica, counted once); `expert` is
# each rank's own (declared in distinct_params: counted on every rank). A module that overrides
# configure_gradient_clipping gets its gradients unscaled before the hook, so its clip is the
# plugin's "clip with the scaler's configuration" path.


class _Experts(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = torch.nn.Linear(DIM, 4)
        torch.manual_seed(10 + dist.get_rank())  # each rank its own expert
        self.expert = torch.nn.Linear(DIM, 4)
        self.seen: list[float] = []

    def configure_model(self) -> None:
        pass  # plain tensors: ModelParallelStrategy only asks that the hook exists

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(batch_idx)
        same = torch.randn(BATCH, DIM, generator=g)  # identical on every rank
        return (self.shared(same).float() - 1.0).pow(2).mean() + (
            self.expert(batch[0]).float() - 1.0
        ).pow(2).mean()

    def on_after_backward(self) -> None:
        # The true norm, by hand: the shared part once, every rank's expert.
        scale = self.trainer.precision_plugin.scaler.get_scale()

        def sq(module: torch.nn.Module) -> torch.Tensor:
            return sum(p.grad.double().pow(2).sum() for p in module.parameters())  # type: ignore[union-attr,return-value]

        experts = sq(self.expert)
        dist.all_reduce(experts)
        self.seen.append(float((sq(self.shared) + experts).sqrt()) / scale)

    def configure_gradient_clipping(
        self, optimizer: Any, gradient_clip_val: Any = None, gradient_clip_algorithm: Any = None
    ) -> None:
        self.clip_gradients(optimizer, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=MANUAL_LR)


def _expert_case() -> dict[str, Any]:
    from lightning.pytorch.strategies import ModelParallelStrategy

    from shardscale.lightning import ShardscalePrecision

    _launch_env()
    model = _Experts()
    plugin = ShardscalePrecision(
        "16-mixed", device="cpu", init_scale=INIT_SCALE, distinct_params=model.expert.parameters()
    )
    norms = _Norms(plugin)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, plugins=[plugin], max_steps=3, logger=False,
        strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, callbacks=[norms],
    )  # fmt: skip
    trainer.fit(model, _loader(dist.get_rank(), 3))
    return {"true": model.seen, "ours": norms.norms}


class _Norms(pl.Callback):
    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.norms: list[float] = []

    def on_train_batch_end(self, *args: Any) -> None:
        self.norms.append(float(self.plugin.grad_norm))


def test_expert_parallel_plain_tensors_clip_by_the_true_norm(pool2: Pool) -> None:
    numel = 2 * (DIM * 4 + 4)
    for res in pool2.run(_expert_case):
        assert len(res["true"]) == len(res["ours"]) == 3
        for true, ours in zip(res["true"], res["ours"], strict=True):
            # ours (float32 accumulation) against the float64 reference: one norm_rtol
            assert ours == pytest.approx(true, rel=norm_rtol(numel, torch.float32, 2.0)), res


# -- skip policies without loss scaling: bf16-mixed + loss_scaling=False + spike=SpikeSkip ----
#
# The one option: ShardscalePrecision("bf16-mixed", loss_scaling=False, spike=...). A spike
# (the loss times 1e4 on rank 1: finite gradients far above the threshold) and a nan loss on
# rank 0 (non-finite gradients) are injected at known steps. Whether each step is a spike is
# decided here from torch's own norm of the gradients (float64), not read from the scaler.

SPIKE_STEP, NAN_STEP = 3, 5
SPIKE_ABS = 100.0  # far above this model's clean pre-clip norms (checked), far below 1e4 times


class _PolicyNet(_Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = (self.net(x).float() - 1.0).pow(2).mean()
        if self.global_step == SPIKE_STEP and dist.get_rank() == 1:
            loss = loss * 1e4
        if self.global_step == NAN_STEP and dist.get_rank() == 0:
            loss = loss * math.nan
        return loss


class _PolicyRecorder(_Recorder):
    """Also keeps an EMA of the weights with update_averaged_model (DDP: plain modules), and
    torch's AveragedModel.update_parameters called only on the steps expected to be taken."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

        super().on_train_start(trainer, pl_module)
        self.ema = self.ref_ema = None
        if pl_module.layout == "ddp":
            self.ema = AveragedModel(pl_module.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
            self.ref_ema = AveragedModel(pl_module.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        from shardscale.schedules import update_averaged_model

        super().on_train_batch_end(trainer, pl_module, *args)
        self.steps[-1]["reason"] = int(self.plugin.scaler.last_skip_reason)
        if self.ema is not None and self.ref_ema is not None:
            update_averaged_model(self.ema, pl_module.net, scaler=self.plugin.scaler)
            if len(self.steps) - 1 not in (SPIKE_STEP, NAN_STEP):
                self.ref_ema.update_parameters(pl_module.net)


def _policy_case(strategy: str, fused: bool) -> dict[str, Any]:
    from shardscale.core import SpikeSkip
    from shardscale.lightning import ShardscalePrecision

    _launch_env()
    plugin = ShardscalePrecision(
        "bf16-mixed",
        device="cpu",
        loss_scaling=False,
        spike=SpikeSkip(max_norm_abs=SPIKE_ABS, z=None),
    )
    rec = _PolicyRecorder(plugin)
    model = _PolicyNet(fused=fused, layout=strategy, override_clip=False)
    trainer = _trainer(plugin, strategy, STEPS, rec, gradient_clip_val=CLIP)
    trainer.fit(model, _loader(dist.get_rank(), STEPS))
    ema_equal = None
    if rec.ema is not None and rec.ref_ema is not None:
        pairs = zip(rec.ema.state_dict().values(), rec.ref_ema.state_dict().values(), strict=True)
        ema_equal = all(torch.equal(a, b) for a, b in pairs)
    return {
        "steps": rec.steps,
        "params": _full_params(model),
        "sched": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        "ema_equal": ema_equal,
    }


def _check_policy(results: list[dict[str, Any]]) -> None:
    from shardscale.core import SkipReason

    expected = {SPIKE_STEP: SkipReason.SPIKE, NAN_STEP: SkipReason.NONFINITE}
    for rank, res in enumerate(results):
        steps = res["steps"]
        assert len(steps) == STEPS
        # The reference decision: a spike where torch's norm exceeds the threshold.
        norms = [s["ref_norm"] for s in steps]
        assert norms[SPIKE_STEP] > SPIKE_ABS and math.isfinite(norms[SPIKE_STEP])
        assert not math.isfinite(norms[NAN_STEP])
        assert all(n < SPIKE_ABS for i, n in enumerate(norms) if i not in expected)
        # Every rank skips exactly those steps, for that reason; the scale stays 1.
        assert [s["skipped"] for s in steps] == [i in expected for i in range(STEPS)], (rank, steps)
        assert [s["reason"] for s in steps] == [
            int(expected.get(i, SkipReason.NONE)) for i in range(STEPS)
        ]
        assert {s["scale"] for s in steps} == {1.0}
        # The scheduler did not advance on either skipped step.
        taken = STEPS - len(expected)
        assert res["sched"] == taken
        assert steps[-1]["lr"] == pytest.approx(1e-2 / (1.0 + taken), rel=1e-12)
        assert steps[-1]["logged"]["shardscale/skip_reason"] == 0.0
        # Averaged weights (DDP): bit for bit torch's, updated on the taken steps only.
        assert res["ema_equal"] in (True, None)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)


def test_bf16_spike_and_nonfinite_skips_hold_the_scheduler_and_ema_ddp(pool2: Pool) -> None:
    results = pool2.run(_policy_case, "ddp", False)
    _check_policy(results)
    assert all(res["ema_equal"] is True for res in results)


def test_bf16_spike_and_nonfinite_skips_hold_the_scheduler_fsdp2_fused(pool2: Pool) -> None:
    _check_policy(pool2.run(_policy_case, "model_parallel", True))


# -- every skip reason holds the scheduler, and nothing is read on the host per step -----------
#
# Each run injects, at known optimizer steps and on one rank, what makes each reason: an inf
# loss under fp16 (OVERFLOW), a nan loss times the gradients under bf16 (NONFINITE), a finite
# loss times 1e4 (SPIKE: a norm far above SPIKE_ABS, see the policy tests above for the clean
# norms), a nan constant added to the loss (LOSS: the loss is nan, its gradients are finite).
# The learning rate every optimizer step used is compared with a torch scheduler of the same
# kind, stepped only for the steps the test expects to be taken; the optimizer step (closure
# included) and each scheduler step run inside HostReadRecorder.

_REASON_INJECT = {
    "16-mixed": {2: (0, "OVERFLOW"), 5: (1, "LOSS")},
    "bf16-mixed": {1: (1, "SPIKE"), 3: (0, "LOSS"), 5: (1, "NONFINITE")},
}


def _lr_lambda(step: int) -> float:
    return 1.0 / (1.0 + step)


class _ReasonNet(_Net):
    """Injects each reason; records host reads in its optimizer and scheduler steps."""

    def __init__(self, inject: dict[int, tuple[int, str]]) -> None:
        super().__init__(fused=True, layout="ddp", override_clip=False)
        self.inject = inject
        self.step_reads: list[list[str]] = []
        self.sched_reads: list[list[str]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (x,) = batch
        loss = (self.net(x).float() - 1.0).pow(2).mean()
        rank, what = self.inject.get(self.global_step, (-1, ""))
        if rank == dist.get_rank():
            if what == "OVERFLOW":
                loss = loss * math.inf
            elif what == "NONFINITE":
                loss = loss * math.nan
            elif what == "SPIKE":
                loss = loss * 1e4
            elif what == "LOSS":
                loss = loss + torch.tensor(math.nan)  # a constant: no gradient of its own
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        from shardscale.core.testing import HostReadRecorder

        with HostReadRecorder() as reads:
            super().optimizer_step(*args, **kwargs)
        self.step_reads.append(reads.seen)

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        from shardscale.core.testing import HostReadRecorder

        with HostReadRecorder() as reads:
            scheduler.step()
        self.sched_reads.append(reads.seen)


class _LrSeen(pl.Callback):
    """The lr of each optimizer step, read in a step pre-hook (fused AdamW: every step runs)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin
        self.lrs: list[float] = []
        self.reasons: list[int] = []

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # Registered after the plugin's hold: a decision still pending would be taken first.
        trainer.optimizers[0].register_step_pre_hook(
            lambda opt, *_: self.lrs.append(float(opt.param_groups[0]["lr"]))
        )

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.reasons.append(int(self.plugin.scaler.last_skip_reason))  # a host read, the test's


def _reasons_case(precision: str) -> dict[str, Any]:
    from shardscale.core import SpikeSkip
    from shardscale.lightning import ShardscalePrecision

    _launch_env()
    options: dict[str, Any] = {"check_loss": True}
    if precision == "16-mixed":
        options["init_scale"] = INIT_SCALE
    else:
        options.update(loss_scaling=False, spike=SpikeSkip(max_norm_abs=SPIKE_ABS, z=None))
    plugin = ShardscalePrecision(precision, device="cpu", **options)  # type: ignore[arg-type]
    seen = _LrSeen(plugin)
    model = _ReasonNet(_REASON_INJECT[precision])
    trainer = _trainer(plugin, "ddp", STEPS, seen, gradient_clip_val=CLIP)  # type: ignore[arg-type]
    trainer.fit(model, _loader(dist.get_rank(), STEPS))
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {
        "lrs": seen.lrs,
        "reasons": seen.reasons,
        "last_epoch": sched.last_epoch,
        "last_lr": sched.get_last_lr(),
        "step_reads": model.step_reads,
        "sched_reads": model.sched_reads,
    }


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_every_skip_reason_holds_the_scheduler_without_a_host_read(
    pool2: Pool, precision: str
) -> None:
    from shardscale.core import SkipReason

    inject = _REASON_INJECT[precision]
    expected = [SkipReason[inject[i][1]] if i in inject else SkipReason.NONE for i in range(STEPS)]
    # The reference: the same torch scheduler, advanced once per step the test expects taken.
    ref_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-2)
    ref = torch.optim.lr_scheduler.LambdaLR(ref_opt, _lr_lambda)
    ref_lrs = [ref.get_last_lr()[0]]
    for _ in range(STEPS):
        ref_opt.step()
        ref.step()
        ref_lrs.append(ref.get_last_lr()[0])
    taken_before = [sum(r is SkipReason.NONE for r in expected[:i]) for i in range(STEPS + 1)]
    for rank, res in enumerate(pool2.run(_reasons_case, precision)):
        # Every rank skipped exactly the injected steps, each for the injected reason.
        assert res["reasons"] == [int(r) for r in expected], (rank, res["reasons"])
        # Each step used the reference's lr after as many advances as steps taken before it:
        # the same float64 host arithmetic in torch, so equal exactly.
        assert res["lrs"] == [ref_lrs[k] for k in taken_before[:STEPS]], (rank, res["lrs"])
        assert res["last_epoch"] == taken_before[STEPS]
        assert res["last_lr"] == [ref_lrs[taken_before[STEPS]]]
        # No host read in any scheduler step, nor in any optimizer step after the first (the
        # backend chain is checked once, by design).
        assert res["sched_reads"] == [[]] * STEPS, (rank, res["sched_reads"])
        assert res["step_reads"][1:] == [[]] * (STEPS - 1), (rank, res["step_reads"])
