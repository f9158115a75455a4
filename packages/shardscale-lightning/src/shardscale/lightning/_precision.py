"""``ShardscalePrecision``: Lightning's FSDP precision plugin with shardscale's scaler and clipping.

[Note: the order of one optimizer step]
Lightning's own ``16-mixed`` plugins run: closure (forward + backward) →
``scaler.unscale_`` → ``on_before_optimizer_step`` → ``configure_gradient_clipping``
→ ``scaler.step`` → ``scaler.update``. Under FSDP its clipping raises, and with a
fused optimizer it neither unscales nor clips. Here, when the Trainer's own
``gradient_clip_val`` / ``gradient_clip_algorithm="norm"`` applies (the module
does not override ``configure_gradient_clipping``), the unscale and the clip are
ONE call, ``unscale_and_clip_``, made where Lightning unscales: one read of each
gradient, one collective, the true global norm, fused optimizers included. The
hook then sees unscaled (and already clipped) gradients, as Lightning promises;
a fused optimizer's gradients stay scaled, as with Lightning's own plugin. When
the module overrides ``configure_gradient_clipping``, its call lands in
:meth:`ShardscalePrecision.clip_grad_by_norm`, which clips with the global norm
too (one more collective when the gradients were already unscaled).

In manual optimization (``automatic_optimization = False``) the module calls
``self.manual_backward``, ``self.clip_gradients(opt, ...)`` and ``opt.step()``
itself, with the ``LightningOptimizer`` wrappers ``self.optimizers()`` returns;
the plugin keys everything by the optimizer a wrapper holds (the one
``opt.step()`` hands it), so the clip is the unscale (``unscale_and_clip_``) and
the step does not unscale again. With several optimizers the scaler's update
waits for the iteration to end ([Note: one update per iteration], in
shardscale.core): Lightning calls ``optimizer_step`` once per ``opt.step()``,
and the iteration ends after a step when no optimizer of the Trainer is still
due, else when ``training_step`` returns, when a new backward begins, or when
an optimizer that already stepped is clipped or stepped again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.model_helpers import is_overridden

from shardscale.clip import clip_grad_norm_, unscale_and_clip_
from shardscale.core import ShardedGradScaler
from shardscale.core.scaler import Iteration
from shardscale.core.step import optimizer_params
from shardscale.lightning._schedulers import hold_on_skipped_steps
from shardscale.schedules import DeviceLRSchedule, SkipAwareScheduler

__all__ = ["ShardscalePrecision", "PrecisionName"]

PrecisionName = Literal["16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true"]
_PRECISIONS: tuple[str, ...] = ("16-mixed", "bf16-mixed", "32-true", "16-true", "bf16-true")
_INPUT_DTYPE = {
    "16-mixed": torch.float32,
    "bf16-mixed": torch.float32,
    "32-true": torch.float32,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
}


def _real(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer a ``LightningOptimizer`` (what ``self.optimizers()`` returns) wraps."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer  # type: ignore[no-any-return]


def _combined_norm(norms: list[torch.Tensor]) -> torch.Tensor | None:
    """The 2-norm over every optimizer clipped in one iteration (each clip's own norm)."""
    if not norms:
        return None
    if len(norms) == 1:
        return norms[0]
    wide = torch.stack([n.to(torch.float64) for n in norms])
    combined: torch.Tensor = torch.linalg.vector_norm(wide).to(norms[0].dtype)
    return combined


def _handles_unscaling(optimizer: object) -> bool:
    # torch's contract for fused optimizers: they divide by grad_scale inside their kernel.
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def _check_guard_only(precision: str, scaler: object, options: dict[str, Any]) -> None:
    """A precision that does not scale the loss takes a scaler only as the skip guard.

    ``loss_scaling=False`` is the one option that turns the guard on (see
    docs/lightning.md, "Skipping steps in bf16 and fp32"); with it come the
    scaler's other policies (``spike=``, ``check_loss=``, ``max_consecutive_skips=``).
    """
    if scaler is not None:
        if not isinstance(scaler, ShardedGradScaler) or scaler.loss_scaling:
            raise ValueError(
                f"precision={precision!r} does not scale the loss, so its scaler must be built "
                "with loss_scaling=False (the skip guard without scaling), or pass the options "
                f"instead: ShardscalePrecision({precision!r}, loss_scaling=False, ...)"
            )
        return
    if options and options.get("loss_scaling", True) is not False:
        raise ValueError(
            f"precision={precision!r} does not scale the loss, so scaler options "
            f"({sorted(options)}) need loss_scaling=False, the skip guard without scaling: "
            f"ShardscalePrecision({precision!r}, loss_scaling=False, spike=SpikeSkip()); or use "
            "precision='16-mixed' for loss scaling"
        )


class ShardscalePrecision(FSDPPrecision):
    """Mixed precision for Lightning with shardscale's scaler and global-norm clipping.

    Replaces ``precision="16-mixed"`` (or any other precision string) in a
    ``Trainer`` with FSDP, ModelParallel (FSDP2/TP) or DDP strategies::

        trainer = Trainer(strategy="fsdp", plugins=[ShardscalePrecision("16-mixed")])

    What changes: for ``"16-mixed"`` the loss scaler is
    :class:`shardscale.core.ShardedGradScaler`, so every rank skips the same
    steps whatever the layout and whatever the optimizer (fused ones included);
    ``gradient_clip_val`` with ``gradient_clip_algorithm="norm"`` works under
    FSDP and clips by the true global norm, fused with the unscale (one read,
    one collective); LR schedulers stepped every ``"step"`` do not advance on
    skipped steps; the scale, the skip flag and the gradient norm are logged
    through ``self.log`` as device tensors (no host sync per step).

    Args:
        precision: ``"16-mixed"`` (scaled), ``"bf16-mixed"``, ``"32-true"``,
            ``"16-true"`` or ``"bf16-true"``.
        device: device type for autocast and the scale (default: ``"cuda"`` when
            available, else ``"cpu"``).
        scaler: a ready :class:`ShardedGradScaler` (with another precision than
            ``"16-mixed"``, one built with ``loss_scaling=False``); default: one
            built from ``scaler_options``.
        log_metrics: log ``<prefix>scale``, ``<prefix>skipped``,
            ``<prefix>skip_reason`` (the ``SkipReason`` value) and
            ``<prefix>grad_norm`` on every optimizer step (on_step, logger only).
        log_prefix: prefix of the logged names.
        hold_schedulers: keep ``interval="step"`` schedulers from advancing on
            skipped steps.
        scaler_options: keyword arguments of ``ShardedGradScaler`` (``init_scale``,
            ``growth_interval``, ``backend``, ...), including the skip policies
            ``spike=SpikeSkip(...)``, ``check_loss=True`` and
            ``max_consecutive_skips=N``. With ``"bf16-mixed"`` and the
            ``"-true"`` precisions, ``loss_scaling=False`` turns the scaler on
            as the skip guard alone (scale 1): a step with a non-finite
            gradient (or a policy's reason) is skipped on every rank.
    """

    def __init__(
        self,
        precision: PrecisionName = "16-mixed",
        *,
        device: str | None = None,
        scaler: ShardedGradScaler | None = None,
        log_metrics: bool = True,
        log_prefix: str = "shardscale/",
        hold_schedulers: bool = True,
        **scaler_options: Any,
    ) -> None:
        # FSDPPrecision.__init__ would build torch's ShardedGradScaler: set its attributes here
        # instead (test_lightning_contract checks they are the ones Lightning's own sets).
        if precision not in _PRECISIONS:
            raise ValueError(
                f"ShardscalePrecision(precision={precision!r}) is not supported; use one of "
                f"{', '.join(map(repr, _PRECISIONS))}."
            )
        if scaler is not None and not isinstance(scaler, ShardedGradScaler):
            raise TypeError(
                f"ShardscalePrecision(scaler=...) takes a shardscale.core.ShardedGradScaler, got "
                f"{type(scaler).__name__}; build one with the same arguments, or pass them as "
                "keyword options (ShardscalePrecision('16-mixed', init_scale=...))."
            )
        if scaler is not None and scaler_options:
            raise ValueError(
                f"pass either a scaler or scaler options, not both (got {sorted(scaler_options)})"
            )
        if precision != "16-mixed":
            _check_guard_only(precision, scaler, scaler_options)
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.precision = precision
        self._desired_input_dtype = _INPUT_DTYPE[precision]
        self.scaler: ShardedGradScaler | None = None  # type: ignore[assignment]
        if precision == "16-mixed" or scaler is not None or scaler_options:
            # Without loss scaling (checked above) the scaler is the skip verdict alone.
            self.scaler = scaler or ShardedGradScaler(self.device, **scaler_options)
        self.log_metrics = log_metrics
        self.log_prefix = log_prefix
        self.hold_schedulers = hold_schedulers
        # What happened since the last update (several optimizers: [Note: one update per
        # iteration]; None without loss scaling), the optimizers clipped and their norms in this
        # iteration; the last iteration's norm; each optimizer's last skip flag.
        self._it = Iteration(self.scaler) if self.scaler is not None else None
        self._clipped: set[int] = set()
        self._norms: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | None = None
        self._skipped: dict[int, torch.Tensor] = {}
        self._model: pl.LightningModule | torch.nn.Module | None = None

    # -- what the strategies call ------------------------------------------------------------

    def connect(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer],
        lr_schedulers: list[Any],
    ) -> tuple[torch.nn.Module, list[torch.optim.Optimizer], list[Any]]:
        """Hold every ``interval="step"`` scheduler on steps the scaler skips.

        Schedules that already obey the verdict (``DeviceLRSchedule``,
        ``SkipAwareScheduler``, built with ``scaler=plugin.scaler``) are left as
        they are: holding them again would count a skip twice.
        """
        if self.hold_schedulers and self.scaler is not None:
            for config in lr_schedulers:
                if isinstance(config.scheduler, (DeviceLRSchedule, SkipAwareScheduler)):
                    continue
                if getattr(config, "interval", None) == "step":
                    hold_on_skipped_steps(config.scheduler, self.step_was_skipped)
        return model, optimizers, lr_schedulers

    @contextlib.contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast on this plugin's device (Lightning's FSDP plugin always autocasts "cuda")."""
        if "mixed" in self.precision:
            dtype = torch.bfloat16 if self.precision == "bf16-mixed" else torch.float16
            with torch.autocast(self.device, dtype=dtype):
                yield
        else:
            with super().forward_context():
                yield

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule | torch.nn.Module,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        """One step: closure, unscale (fused with the clip when the Trainer clips), hooks, step.

        The scaler's update follows once the iteration is over: see
        [Note: one update per iteration].
        """
        optimizer = _real(optimizer)
        scaler = self.scaler
        self._model = model
        automatic = not isinstance(model, pl.LightningModule) or model.automatic_optimization
        if automatic:
            # The closure runs forward and backward: a new iteration for this optimizer.
            if self._it is not None:
                self._it.unscaled.discard(id(optimizer))
            self._clipped.discard(id(optimizer))
        it = self._it
        if scaler is None or it is None or not scaler.is_enabled():
            out = super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)  # type: ignore[arg-type]
            self._end_iteration()
            return out
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError(
                "LBFGS re-evaluates its closure, which loss scaling cannot follow; use another "
                "optimizer with precision='16-mixed', or precision='bf16-mixed'."
            )
        if it.has_stepped(optimizer):
            self._end_iteration()  # stepped again: the previous iteration is over
        closure_result = closure()
        if closure_result is None and automatic:
            # training_step returned None: no backward ran, so there is nothing to unscale or step.
            self._clipped.add(id(optimizer))  # the hooks' clip request has nothing to do
            self._after_closure(model, optimizer)  # type: ignore[arg-type]
            self._clipped.discard(id(optimizer))
            return closure_result
        clip_val = self._trainer_clip_value(model)
        if clip_val is not None:
            # Unscaled now (fuse_optimizer=False): on_before_optimizer_step reads the gradients.
            norm = unscale_and_clip_(scaler, optimizer, max_norm=clip_val, fuse_optimizer=False)
            self._norms.append(norm)
            it.mark_unscaled(optimizer)
            self._clipped.add(id(optimizer))
        elif not _handles_unscaling(optimizer):
            it.unscale_(optimizer)  # the hooks see unscaled gradients, as in Lightning
        self._after_closure(model, optimizer)  # type: ignore[arg-type]
        out, _ = it.step(optimizer, **kwargs)
        if not it.due(self._trainer_optimizers(model)):
            self._end_iteration()
        return out

    @contextlib.contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """Lightning's context around ``training_step``; an iteration ends with the step at the latest."""
        with super().train_step_context():
            yield
        if self._it is not None and self._it.stepped:
            self._end_iteration()

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """A backward after a step starts the next iteration: update first, then scale the loss."""
        if self._it is not None and self._it.stepped:
            self._end_iteration()
        return super().pre_backward(tensor, module)  # type: ignore[no-any-return]

    def _end_iteration(self) -> None:
        """The scaler's one update for the optimizers stepped since the last, then the metrics."""
        scaler = self.scaler
        stepped = self._it.end() if self._it is not None else {}
        self._grad_norm = _combined_norm(self._norms)
        self._norms.clear()
        self._clipped.clear()
        if scaler is not None and scaler.is_enabled() and stepped:
            skipped = scaler.last_step_skipped
            for key, flag in stepped.items():
                found = flag if flag is not None else skipped
                if found is not None:
                    self._skipped[key] = found
        if self._model is not None:
            self._log(self._model)

    @staticmethod
    def _trainer_optimizers(
        model: pl.LightningModule | torch.nn.Module,
    ) -> list[torch.optim.Optimizer]:
        if not isinstance(model, pl.LightningModule):
            return []
        return list(model.trainer.optimizers)

    def _trainer_clip_value(self, model: pl.LightningModule | torch.nn.Module) -> float | None:
        """The Trainer's norm-clip value when the default ``configure_gradient_clipping`` applies."""
        if not isinstance(model, pl.LightningModule) or not model.automatic_optimization:
            return None
        trainer = model.trainer
        value = trainer.gradient_clip_val
        if not value or value <= 0:
            return None
        # Unset means "norm", as in LightningModule.clip_gradients.
        if (
            trainer.gradient_clip_algorithm or GradClipAlgorithmType.NORM
        ) != GradClipAlgorithmType.NORM:
            return None
        if is_overridden("configure_gradient_clipping", model, pl.LightningModule):
            return None  # the module decides per step: clip_grad_by_norm serves its request
        return float(value)

    # -- clipping ----------------------------------------------------------------------------

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip by norm (global, fused with the unscale when possible) or by value; fused optimizers too.

        ``optimizer`` may be the ``LightningOptimizer`` that ``self.optimizers()``
        hands out (manual optimization): the optimizer it wraps is the one tracked.
        """
        optimizer = _real(optimizer)
        if clip_val <= 0 or id(optimizer) in self._clipped:
            return  # already clipped with the Trainer's value in this step
        if gradient_clip_algorithm == GradClipAlgorithmType.VALUE:
            self._ensure_unscaled(optimizer)
            torch.nn.utils.clip_grad_value_(
                [p for p in optimizer_params(optimizer) if p.grad is not None], clip_val
            )
        elif gradient_clip_algorithm == GradClipAlgorithmType.NORM:
            self.clip_grad_by_norm(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: int | float) -> None:  # type: ignore[override]
        """Clip ``optimizer``'s gradients by their true global norm (FSDP, FSDP2/TP, DDP)."""
        optimizer = _real(optimizer)
        scaler, it = self.scaler, self._it
        if it is not None and it.has_stepped(optimizer):
            self._end_iteration()  # clipping a stepped optimizer: its next iteration began
        if (
            scaler is not None
            and it is not None
            and scaler.is_enabled()
            and id(optimizer) not in it.unscaled
        ):
            # The module's code runs between this clip and the step: keep the gradients unscaled.
            norm = unscale_and_clip_(
                scaler, optimizer, max_norm=float(clip_val), fuse_optimizer=False
            )
            it.mark_unscaled(optimizer)
        elif scaler is not None:
            # Already unscaled (or scaling off): clip with the scaler's whole configuration.
            # Every parameter, not only those with a gradient here: the ranks' declarations
            # are compared, and a rank may lack a gradient its peers have.
            norm = scaler.clip_grad_norm_(list(optimizer_params(optimizer)), float(clip_val))
        else:
            norm = clip_grad_norm_(list(optimizer_params(optimizer)), float(clip_val))
        self._norms.append(norm)
        self._clipped.add(id(optimizer))

    def _ensure_unscaled(self, optimizer: torch.optim.Optimizer) -> None:
        it = self._it
        if it is None:
            return  # no loss scaling: nothing to unscale
        if it.has_stepped(optimizer):
            self._end_iteration()
        it.unscale_(optimizer)

    # -- skip signal and logging -------------------------------------------------------------

    def step_was_skipped(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """The last step's skip flag for ``optimizer`` (a 0-dim bool tensor), or None.

        Known from the optimizer's own step on: with several optimizers, before
        the scaler's update that ends the iteration.
        """
        optimizer = _real(optimizer)
        flag = self._it.stepped.get(id(optimizer)) if self._it is not None else None
        return flag if flag is not None else self._skipped.get(id(optimizer))

    @property
    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the last clipped step (device tensor), else None."""
        return self._grad_norm

    def _log(self, model: pl.LightningModule | torch.nn.Module) -> None:
        if not self.log_metrics or not isinstance(model, pl.LightningModule):
            return
        if getattr(model, "_current_fx_name", None) is None:
            return  # not inside a Lightning hook (a step called by hand): nowhere to log
        values: dict[str, torch.Tensor] = {}
        scaler = self.scaler
        if scaler is not None and scaler.scale_tensor is not None:
            values["scale"] = scaler.scale_tensor
            skipped = scaler.last_step_skipped  # the iteration's: any optimizer overflowed
            if skipped is not None:
                values["skipped"] = skipped.to(torch.float32)
            reason = scaler.last_skip_reason  # SkipReason's value, 0 on a step taken
            if reason is not None:
                values["skip_reason"] = reason.to(torch.float32)
        if self._grad_norm is not None:
            values["grad_norm"] = self._grad_norm
        # Without a logger the values still reach callback_metrics (checkpoint monitors).
        to_logger = bool(getattr(model.trainer, "loggers", None))
        for name, value in values.items():
            # Device tensors, logger only: Lightning reads them on the host only when it writes
            # the logs (every log_every_n_steps), not per step; the progress bar would read them.
            try:
                model.log(
                    self.log_prefix + name,
                    value,
                    on_step=True,
                    on_epoch=False,
                    prog_bar=False,
                    logger=to_logger,
                    batch_size=1,
                    sync_dist=False,  # already identical on every rank
                )
            except MisconfigurationException:
                return  # a hook where Lightning forbids logging: the metrics are optional

    # -- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (torch's keys), saved by Lightning in the checkpoint."""
        return self.scaler.state_dict() if self.scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state from a checkpoint (validated before anything changes)."""
        if self.scaler is not None:
            self.scaler.load_state_dict(state_dict)
