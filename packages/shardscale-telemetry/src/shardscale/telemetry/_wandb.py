"""The Weights & Biases observer: each step's values logged to a W&B run."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from shardscale.telemetry._errors import TelemetryConfigError
from shardscale.telemetry._rows import reason_code

if TYPE_CHECKING:
    from shardscale.telemetry._rows import StepRow

__all__ = ["WandbObserver", "wandb_unavailable_reason"]

_EXTRA = "pip install 'shardscale-telemetry[wandb]'"


def wandb_unavailable_reason() -> str | None:
    """Why the W&B observer cannot run here (``None``: it can)."""
    try:
        import wandb  # noqa: F401
    except ImportError as exc:
        return f"the wandb package is missing ({exc}): {_EXTRA}"
    return None


class WandbObserver:
    """Logs each step to W&B under ``<prefix>scale``, ``skipped``, ``grad_norm``, ... .

    The values are plotted against ``<prefix>step`` (the scaler's iteration),
    declared with ``define_metric``, so they never fight the step counter of
    your own ``wandb.log`` calls. The run is ``run`` if given, else the active
    ``wandb.run``, else a new run (``wandb.init(project=project, ...)``; the
    project defaults to ``$WANDB_PROJECT``, then ``"shardscale"``), which
    :meth:`close` finishes; a run it did not start is left open. W&B's own
    variables apply (``WANDB_MODE=offline``, ``WANDB_DIR``, ...).
    """

    name = "wandb"

    def __init__(
        self,
        project: str | None = None,
        *,
        run: Any = None,
        prefix: str = "shardscale/",
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        reason = wandb_unavailable_reason()
        if reason is not None:
            raise TelemetryConfigError(f"the W&B observer cannot run: {reason}")
        if project is not None and (not isinstance(project, str) or not project.strip()):
            raise TelemetryConfigError(f"project must be a non-empty string, got {project!r}")
        if not isinstance(prefix, str):
            raise TelemetryConfigError(f"prefix must be a string, got {prefix!r}")
        self._project = project
        self._given_run = run
        self._prefix = prefix
        self._init_kwargs = dict(init_kwargs or {})
        self._run: Any = None
        self._owned = False
        self._skipped_total = 0

    def __repr__(self) -> str:
        return f"WandbObserver(project={self._project!r})"

    @property
    def run(self) -> Any:
        """The W&B run written to (``None`` before the first write)."""
        return self._run

    def open(self, rank: int) -> None:
        """Attach to (or start) the run and declare the step metric."""
        import wandb

        run = self._given_run if self._given_run is not None else wandb.run
        if run is None:
            kwargs: dict[str, Any] = {
                "project": self._project or os.environ.get("WANDB_PROJECT") or "shardscale",
            }
            if rank != 0:
                kwargs["name"] = f"rank{rank}"
            kwargs.update(self._init_kwargs)
            run = wandb.init(**kwargs)
            self._owned = True
        p = self._prefix
        run.define_metric(f"{p}step")
        run.define_metric(f"{p}*", step_metric=f"{p}step")
        self._run = run

    def write(self, rows: Sequence[StepRow]) -> None:
        """One ``run.log`` per step."""
        if self._run is None:
            raise RuntimeError("WandbObserver.write() before open(): a Telemetry session opens it")
        p = self._prefix
        for row in rows:
            self._skipped_total += int(row.skipped)
            data: dict[str, Any] = {
                f"{p}step": row.step,
                f"{p}scale": row.scale,
                f"{p}skipped": int(row.skipped),
                f"{p}skipped_total": self._skipped_total,
                f"{p}growth_tracker": row.growth_tracker,
                f"{p}overflow_ranks": len(row.overflow_ranks),
                f"{p}skip_reason": reason_code(row.skip_reason),
            }
            if row.grad_norm is not None:
                data[f"{p}grad_norm"] = row.grad_norm
            if row.hysteresis_tracker is not None:
                data[f"{p}hysteresis_tracker"] = row.hysteresis_tracker
            self._run.log(data)

    def close(self) -> None:
        """Finish the run if this observer started it."""
        if self._run is not None and self._owned:
            self._run.finish()
        self._run = None
