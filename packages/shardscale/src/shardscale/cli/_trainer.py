"""The demo's training loop: FSDP2 (+TP), autocast, ShardedGradScaler and unscale_and_clip_.

Every rank runs :func:`train`; rank 0's ``on_step`` callback receives one
:class:`StepMetrics` per optimizer step. The loop is what a user would write:

.. code-block:: python

    with torch.autocast(device_type, dtype=torch.float16):
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    norm = unscale_and_clip_(scaler, optimizer, max_norm)
    scaler.step(optimizer)
    scaler.update()
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardscale.cli._corpus import CharCorpus, load_corpus
from shardscale.cli._distributed import DistContext, shard_model
from shardscale.cli._model import ModelConfig, TinyGPT
from shardscale.core import ShardedGradScaler
from shardscale.core.step import check_max_norm
from shardscale.telemetry import JsonlObserver, StepRow, Telemetry, enable

__all__ = [
    "OPTION_RULES",
    "PRECISIONS",
    "SIZE_FIELDS",
    "OptionRule",
    "check_config_values",
    "default_config",
    "size_defaults",
    "StepMetrics",
    "TrainConfig",
    "TrainResult",
    "train",
    "full_state",
    "params_digest",
    "scaler_options",
]

PRECISIONS: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _non_negative_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _positive_finite(v: Any) -> bool:
    return isinstance(v, int | float) and math.isfinite(v) and v > 0


def _contract_error(check: Callable[[Any], object], v: Any) -> str | None:
    # The step contract's own verdict and text (shardscale.core), so that the command line
    # accepts exactly what the scaler and shardscale.clip accept.
    try:
        check(v)
    except (TypeError, ValueError) as exc:
        return str(exc)
    return None


def _valid_max_norm(v: Any) -> bool:
    # +inf means "never clip" and is valid; 0, negatives and nan are refused by core.
    return _contract_error(check_max_norm, v) is None


@dataclass(frozen=True, slots=True)
class OptionRule:
    """One checked :class:`TrainConfig` field, and the command-line option that sets it."""

    field: str
    option: str  # "" for fields the command line does not expose
    ok: Callable[[Any], bool]
    need: str
    example: str
    #: The shardscale.core contract check of a step option (its text is the message).
    contract: Callable[[Any], object] | None = None

    def message(self, value: Any, *, cli: bool) -> str:
        """One line naming the option (``--lr``) or the field (``lr``), the value, and a fix."""
        if cli and self.option:
            name, fix = self.option, f"{self.option} {self.example}"
        else:
            name, fix = self.field, f"{self.field}={self.example}"
        if self.contract is not None:
            problem = _contract_error(self.contract, value)
            if problem is not None:
                return f"{name}: {problem}; try e.g. {fix}"
        return f"{name} must be {self.need}, got {value!r}; try e.g. {fix}"


#: Every numeric field of :class:`TrainConfig` a user can set, checked in this order.
OPTION_RULES: tuple[OptionRule, ...] = (
    OptionRule("steps", "--steps", _positive_int, ">= 1 (optimizer steps)", "100"),
    OptionRule("batch_size", "--batch-size", _positive_int, ">= 1 (sequences per rank)", "8"),
    OptionRule("context", "--context", _positive_int, ">= 1 (characters per sequence)", "64"),
    OptionRule("d_model", "--d-model", _positive_int, ">= 1 (model width)", "64"),
    OptionRule("n_layers", "--layers", _positive_int, ">= 1 (transformer blocks)", "2"),
    OptionRule("n_heads", "--heads", _positive_int, ">= 1 (attention heads)", "2"),
    OptionRule("lr", "--lr", _positive_finite, "a finite number > 0", "0.003"),
    OptionRule(
        "max_norm",
        "--max-norm",
        _valid_max_norm,
        "> 0 (inf: measure, never clip)",
        "1.0",
        contract=check_max_norm,
    ),
    OptionRule("init_scale", "--init-scale", _positive_finite, "a finite number > 0", "65536"),
    OptionRule("growth_interval", "--growth-interval", _positive_int, ">= 1 (clean steps)", "10"),
    OptionRule("sample_chars", "--sample-chars", _non_negative_int, ">= 0 (0: none)", "0"),
    OptionRule(
        "inject_spike", "--inject-spike", _non_negative_int, ">= 0 (a step number; 0: none)", "150"
    ),
    OptionRule(
        "max_consecutive_skips",
        "--max-consecutive-skips",
        _non_negative_int,
        ">= 0 (skipped steps in a row before every rank stops; 0: never)",
        "10",
    ),
    OptionRule("warmup", "", _non_negative_int, ">= 0", "10"),
    OptionRule("eval_batches", "", _positive_int, ">= 1", "4"),
)


def check_config_values(values: Mapping[str, Any], *, cli: bool) -> None:
    """Raise ``ValueError`` (one line) for the first value in ``values`` that breaks its rule.

    ``cli=True`` names command-line options (``--lr``), otherwise the dataclass
    fields (``lr``). Fields absent from ``values`` are not checked.
    """
    for rule in OPTION_RULES:
        if rule.field in values and not rule.ok(values[rule.field]):
            raise ValueError(rule.message(values[rule.field], cli=cli))
    precision = values.get("precision", "fp16")
    if precision not in PRECISIONS:
        name = "--precision" if cli else "precision"
        raise ValueError(f"{name} must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    d_model, n_heads = values.get("d_model"), values.get("n_heads")
    if d_model is not None and n_heads is not None and d_model % n_heads:
        if cli:
            raise ValueError(
                f"--d-model {d_model} is not divisible by --heads {n_heads}; try e.g. "
                f"--d-model {n_heads * max(1, d_model // n_heads)}"
            )
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainConfig:
    """Everything that decides what the demo trains and how.

    The defaults are sized for CPU (see [Note: the demo's size]);
    :func:`default_config` gives the bigger CUDA defaults.
    """

    steps: int = 200
    batch_size: int = 8
    context: int = 64
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 2
    lr: float = 6e-3
    warmup: int = 20
    max_norm: float = 1.0
    precision: str = "fp16"
    backend: str | None = None
    init_scale: float = 2.0**20
    growth_interval: int = 20
    seed: int = 0
    eval_batches: int = 8
    sample_chars: int = 160
    #: Skip steps whose gradient norm spikes (see [Note: the demo's skip policies]).
    spike: bool = False
    #: Multiply rank 0's loss by 1e3 at this step (1-based; 0: never), to show a spike skip.
    inject_spike: int = 0
    #: Stop every rank after this many skipped steps in a row (0: never).
    max_consecutive_skips: int = 0

    def __post_init__(self) -> None:
        check_config_values(asdict(self), cli=False)


# [Note: the demo's size]
# fp16 autocast on a CPU runs matmuls through a kernel about 13x slower than fp32
# (bf16 and fp32 use fast BLAS kernels). The demo must still train in fp16, so on CPU
# it is a small model (two blocks, width 64, 64-character windows, 200 steps) that
# finishes in well under two minutes on two cores even when other jobs share them
# (README: measured times). With CUDA, fp16 matmuls are the fast path and
# the model is 50x bigger. The high initial scale and short growth interval are on
# purpose on both: the first steps overflow in fp16 for real and back the scale off,
# and every few dozen steps the scale grows into overflow again, so the run shows
# the scaler's skip/backoff path, not only its happy path.
_SIZES: dict[str, dict[str, int]] = {
    "cpu": {},  # the dataclass defaults
    "cuda": {"steps": 300, "batch_size": 16, "context": 128, "d_model": 256, "n_layers": 4,
             "n_heads": 4},
}  # fmt: skip


# [Note: the demo's skip policies]
# fp16 scales the loss; bf16 does not need to, so it runs with loss_scaling=False: the scale
# stays 1 and a non-finite gradient still skips the step on every rank. --spike adds
# SpikeSkip with a window sized for a 200-step run (OLMo-core's 128 steps would never arm);
# --inject-spike N multiplies rank 0's loss by 1e3 at step N, a finite gradient far above the
# window, so the summary shows a spike skip on every rank. The first steps of a small model
# move fast, so the window waits for WARMUP accepted steps before it arms.
SPIKE_WINDOW, SPIKE_WARMUP, SPIKE_Z = 32, 24, 6.0
INJECTED_SPIKE = 1e3


def scaler_options(cfg: TrainConfig) -> dict[str, Any]:
    """The ``ShardedGradScaler`` options of the demo's precision and skip policies."""
    options: dict[str, Any]
    if cfg.precision == "fp16":
        options = {"init_scale": cfg.init_scale, "growth_interval": cfg.growth_interval}
    else:
        options = {"loss_scaling": False}
    if cfg.spike:
        from shardscale.core import SpikeSkip

        options["spike"] = SpikeSkip(z=SPIKE_Z, window=SPIKE_WINDOW, warmup=SPIKE_WARMUP)
    if cfg.max_consecutive_skips:
        options["max_consecutive_skips"] = cfg.max_consecutive_skips
    return options


def size_defaults(device: str) -> dict[str, int]:
    """The size fields (steps, batch, context, width, layers, heads) the demo uses on ``device``."""
    base = TrainConfig()
    sized = {name: int(getattr(base, name)) for name in SIZE_FIELDS}
    sized.update(_SIZES.get(device, {}))
    return sized


#: The fields whose default depends on the device (see :func:`size_defaults`).
SIZE_FIELDS = ("steps", "batch_size", "context", "d_model", "n_layers", "n_heads")


def default_config(device: str, **overrides: Any) -> TrainConfig:
    """The demo's configuration for ``device`` (``"cpu"`` or ``"cuda"``), with ``overrides``."""
    return TrainConfig(**{**size_defaults(device), **overrides})


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One optimizer step as rank 0 reports it (loss averaged over every data-parallel rank)."""

    step: int
    loss: float
    scale: float
    grad_norm: float
    skipped: bool
    skipped_total: int
    lr: float
    elapsed_s: float
    #: Why the step was skipped (a lower-case SkipReason name, from the telemetry row), else None.
    skip_reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A dict safe for strict JSON: non-finite numbers become ``None``."""
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float) and not math.isfinite(value):
                out[key] = None
        return out


@dataclass(slots=True)
class TrainResult:
    """What the run produced, identical on every rank (``rank`` aside)."""

    rank: int
    world_size: int
    mesh: str
    device: str
    backend: str
    precision: str
    parameters: int
    steps: int
    skipped_steps: int
    first_loss: float
    final_loss: float
    held_out_loss: float
    final_scale: float
    params_sha256: str
    sample: str
    wall_s: float
    history: list[StepMetrics] = field(default_factory=list)
    #: ``scaler.overflow_report(model)`` of the first skipped step, its reason included
    #: ("" if none was skipped).
    first_overflow: str = ""
    #: Skipped steps per reason (lower-case SkipReason names), e.g. ``{"overflow": 8}``.
    skip_reasons: dict[str, int] = field(default_factory=dict)


class _RowFeed:
    """A telemetry observer that keeps the rows, for the loop's progress and history.

    The demo's scale, skipped flag and gradient norm come from the same rows
    the JSONL observer writes: one code path for the scaler's metrics.
    """

    def __init__(self) -> None:
        self.rows: list[StepRow] = []

    def open(self, rank: int) -> None:
        """Nothing to create."""

    def write(self, rows: Sequence[StepRow]) -> None:
        """Keep the rows."""
        self.rows.extend(rows)

    def close(self) -> None:
        """Nothing to release."""


def _chain_name(backend: object) -> str:
    # "counting+c10d": each middleware exposes the backend it wraps as .inner.
    names = []
    while backend is not None:
        names.append(str(getattr(backend, "name", type(backend).__name__)))
        backend = getattr(backend, "inner", None)
    return "+".join(names)


def _lr_at(cfg: TrainConfig, step: int) -> float:
    # Linear warm-up, then cosine decay to a tenth: the usual small-GPT schedule.
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, progress))))


def _unscale_and_clip() -> Callable[..., torch.Tensor]:
    try:
        from shardscale.clip import unscale_and_clip_
    except ImportError as exc:  # shardscale depends on shardscale-clip; this is a broken install
        raise RuntimeError(
            "shardscale.clip.unscale_and_clip_ is missing: pip install shardscale-clip "
            f"(or reinstall shardscale) ({exc})"
        ) from exc
    return unscale_and_clip_  # type: ignore[no-any-return]


def full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, gathered whole on this rank (a collective: call on every rank)."""
    out = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().cpu().contiguous()
    return out


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    # One memcpy of the tensor's memory (bytes(storage) walks it element by element).
    flat = tensor.detach().cpu().contiguous()
    return ctypes.string_at(flat.data_ptr(), flat.numel() * flat.element_size())


def params_digest(state: dict[str, torch.Tensor]) -> str:
    """SHA-256 of a gathered state dict (see :func:`full_state`), in name order."""
    digest = hashlib.sha256()
    for name, value in sorted(state.items()):
        digest.update(name.encode())
        digest.update(_raw_bytes(value))
    return digest.hexdigest()


def _mean_over_ranks(value: torch.Tensor, ctx: DistContext) -> float:
    # Every rank's loss counts once (TP peers saw the same batch, so they agree anyway).
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return float(total.item()) / ctx.world_size


def _loss(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    with torch.autocast(x.device.type, dtype=dtype):
        logits = model(x)
    # The softmax runs in float32: fp16 log-probabilities lose the small differences that matter.
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


@torch.no_grad()
def _sample(model: TinyGPT, corpus: CharCorpus, cfg: TrainConfig) -> str:
    # Runs on an unsharded CPU copy on rank 0 only: sampling one character at a time
    # through FSDP would all-gather every layer once per character.
    if cfg.sample_chars <= 0:
        return ""
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    idx = corpus.held_out[: cfg.context // 2][None, :]
    out = []
    for _ in range(cfg.sample_chars):
        logits = model(idx[:, -cfg.context :])
        probs = torch.softmax(logits[0, -1].float() / 0.8, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        out.append(int(nxt))
        idx = torch.cat([idx, nxt[None, :]], dim=1)
    return corpus.decode(torch.tensor(out))


def train(
    cfg: TrainConfig,
    ctx: DistContext,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    steps_file: Path | None = None,
) -> TrainResult:
    """Train the demo model; every rank calls this. ``on_step`` is called on every rank.

    ``steps_file``: where rank 0's JSONL telemetry observer writes one line per step.
    """
    started = time.perf_counter()
    corpus = load_corpus()
    # Same seed everywhere: every rank builds the same full model before sharding it.
    torch.manual_seed(cfg.seed)
    model_cfg = ModelConfig(
        vocab_size=corpus.vocab_size,
        context=cfg.context,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
    )
    model = TinyGPT(model_cfg).to(ctx.device)
    n_params = model.num_parameters()
    pipe = None
    if ctx.shape.pp > 1:  # see [Note: fp16 with pipeline stages]
        from shardscale.cli._pipeline import Pipeline

        pipe = Pipeline(model, ctx, batch_size=cfg.batch_size)
        model = pipe.module  # type: ignore[assignment]  # this rank trains its stage only
    else:
        shard_model(model, ctx)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01
    )
    scaler = ShardedGradScaler(
        ctx.device.type,
        backend=cfg.backend,
        # Pipeline stages hold different parameters: the norm sums them, never dedups.
        distinct_dims=("pp",) if pipe is not None else (),
        **scaler_options(cfg),
    )
    unscale_and_clip_ = _unscale_and_clip()
    dtype = PRECISIONS[cfg.precision]
    # Data parallel ranks draw different batches; TP peers (same dp coordinate) the same one.
    data_gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17 + ctx.dp_rank)
    # Every rank reads each step's row (the overflow report below is a collective), so every
    # rank flushes each step: the one host read per step the progress display needs anyway.
    feed = _RowFeed()
    sessions: list[Telemetry] = [enable(feed, flush_every=1, ranks="all")]
    if steps_file is not None:
        # Its own session: one file, written by global rank 0 only.
        sessions.append(enable(JsonlObserver(steps_file), flush_every=1, ranks=0))
    scale = scaler.get_scale()  # the first step's; later ones come from the rows
    history: list[StepMetrics] = []
    skipped_total = 0
    first_overflow = ""
    reasons: dict[str, int] = {}
    try:
        for step in range(cfg.steps):
            lr = _lr_at(cfg, step)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = corpus.batch(data_gen, batch_size=cfg.batch_size, context=cfg.context)
            x, y = x.to(ctx.device), y.to(ctx.device)
            if pipe is None:
                loss = _loss(model, x, y, dtype)
                if step + 1 == cfg.inject_spike and ctx.rank == 0:
                    loss = loss * INJECTED_SPIKE  # see [Note: the demo's skip policies]
                scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
            else:
                loss = pipe.step(x, y, scaler, dtype)
            unscale_and_clip_(scaler, optimizer, max_norm=cfg.max_norm)
            scaler.step(optimizer)
            scaler.update()  # the telemetry session flushes this step's row here
            row = feed.rows[-1]
            skipped = row.skipped
            if skipped and not first_overflow:
                # Every rank knows the step was skipped (one decision), so every rank joins
                # the report's gather; it must run before zero_grad frees the gradients.
                first_overflow = str(scaler.overflow_report(model))  # says why, too
            if skipped:
                reason = row.skip_reason or "unknown"
                reasons[reason] = reasons.get(reason, 0) + 1
            optimizer.zero_grad(set_to_none=True)
            skipped_total += int(skipped)
            metrics = StepMetrics(
                step=step + 1,
                loss=_mean_over_ranks(loss, ctx),
                scale=scale,
                grad_norm=math.nan if row.grad_norm is None else row.grad_norm,
                skipped=skipped,
                skipped_total=skipped_total,
                lr=lr,
                elapsed_s=time.perf_counter() - started,
                skip_reason=row.skip_reason,
            )
            history.append(metrics)
            scale = row.scale  # after this update: the next step's scale
            if on_step is not None:
                on_step(metrics)
    finally:
        for session in sessions:
            session.close()
    backend_name = _chain_name(scaler.backend)
    if cfg.backend is None:
        backend_name += " (automatic)"
    # A pipeline stage cannot evaluate alone: gather the whole model on every rank first.
    state = pipe.full_state() if pipe is not None else None
    eval_model = model
    if state is not None:
        eval_model = TinyGPT(model_cfg).to(ctx.device)
        eval_model.load_state_dict(state)
    eval_model.eval()
    eval_gen = torch.Generator().manual_seed(cfg.seed * 1000 + 7 + ctx.dp_rank)
    losses = []
    with torch.no_grad():
        for _ in range(max(1, cfg.eval_batches)):
            ex, ey = corpus.batch(
                eval_gen, batch_size=cfg.batch_size, context=cfg.context, held_out=True
            )
            losses.append(_loss(eval_model, ex.to(ctx.device), ey.to(ctx.device), dtype))
    held_out = _mean_over_ranks(torch.stack(losses).mean(), ctx)
    if state is None:
        state = full_state(model)
    digest = params_digest(state)
    sample = ""
    if ctx.is_main:
        local = TinyGPT(model_cfg)
        local.load_state_dict(state)
        sample = _sample(local.eval(), corpus, cfg)
    return TrainResult(
        rank=ctx.rank,
        world_size=ctx.world_size,
        mesh=str(ctx.shape),
        device=str(ctx.device),
        backend=backend_name,
        precision=cfg.precision,
        parameters=n_params,
        steps=cfg.steps,
        skipped_steps=skipped_total,
        first_loss=history[0].loss,
        final_loss=history[-1].loss,
        held_out_loss=held_out,
        final_scale=scaler.get_scale(),
        params_sha256=digest,
        sample=sample,
        wall_s=time.perf_counter() - started,
        history=history,
        first_overflow=first_overflow,
        skip_reasons=reasons,
    )
