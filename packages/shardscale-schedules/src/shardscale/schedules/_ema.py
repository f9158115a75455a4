"""Update a torch ``AveragedModel`` (SWA or EMA) only on taken steps, without a host sync.

[Note: averaging gated on the device]
``AveragedModel.update_parameters`` asks the host twice whether
``n_averaged == 0`` (a sync per call), and a caller that skips it on skipped
steps would need a third read, of the skip flag. ``update_averaged_model``
does the same arithmetic with both questions answered on the device: it runs
the model's averaging function (``multi_avg_fn``, ``avg_fn`` or torch's SWA
default, chosen exactly as ``update_parameters`` chooses) unconditionally and
then keeps, per tensor, what ``update_parameters`` would hold: the tensor as
it was on a skipped step, the model's on the first taken one (``n == 0``),
the average otherwise (two ``torch.where``: one before the averaging, one
after); ``n_averaged`` grows by ``1 - skipped``. ``where`` selects, so
the result is bit for bit what ``update_parameters`` gives after the same
taken steps, and a discarded branch cannot leak a nan.

The price: what to keep is copied before each update (one extra read of the
averaged and model tensors, one write) and selected after it (two reads, one
write in place), in chunks of at most ``_CHUNK_ELEMENTS`` elements so the
temporary memory stays small whatever the model's size.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from torch.optim.swa_utils import AveragedModel, get_swa_avg_fn, get_swa_multi_avg_fn
from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

from shardscale.schedules._skip_signal import SkipFlagReader, SkipSource

__all__ = ["update_averaged_model"]

# 16 Mi elements (64 MiB in float32): the largest temporary copy one update makes.
_CHUNK_ELEMENTS = 1 << 24


def _chunks(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Consecutive runs of (averaged, model) pairs on one device and dtype, bounded in size."""
    chunk: list[tuple[torch.Tensor, torch.Tensor]] = []
    size = 0
    for pair in pairs:
        avg = pair[0]
        if chunk and (
            size + avg.numel() > _CHUNK_ELEMENTS
            or (avg.device, avg.dtype) != (chunk[0][0].device, chunk[0][0].dtype)
        ):
            yield chunk
            chunk, size = [], 0
        chunk.append(pair)
        size += avg.numel()
    if chunk:
        yield chunk


def _average(
    averaged: AveragedModel, avgs: list[torch.Tensor], models: list[torch.Tensor], n: torch.Tensor
) -> None:
    """``update_parameters``'s averaging step for one device/dtype chunk, in place on ``avgs``."""
    if averaged.multi_avg_fn is not None:
        averaged.multi_avg_fn(avgs, models, n)
    elif averaged.avg_fn is None:
        if avgs[0].device.type in _get_foreach_kernels_supported_devices():
            get_swa_multi_avg_fn()(avgs, models, n)  # type: ignore[no-untyped-call]
        else:
            swa = get_swa_avg_fn()  # type: ignore[no-untyped-call]
            for a, m in zip(avgs, models, strict=True):
                a.copy_(swa(a, m, n))
    else:
        for a, m in zip(avgs, models, strict=True):
            a.copy_(averaged.avg_fn(a, m, n))


@torch.no_grad()
def update_averaged_model(
    averaged: AveragedModel,
    model: torch.nn.Module,
    *,
    skipped: torch.Tensor | None = None,
    scaler: SkipSource | None = None,
) -> None:
    """``averaged.update_parameters(model)`` on taken steps only, decided on the device.

    After N calls of which K followed skipped steps, ``averaged`` (weights,
    buffers and ``n_averaged``) equals an ``AveragedModel`` whose
    ``update_parameters`` ran only on the N - K taken steps, bit for bit, and
    no call reads a device value on the host (see [Note: averaging gated on
    the device] in the source). Works with torch's SWA default,
    ``get_ema_multi_avg_fn``/``get_ema_avg_fn`` and custom averaging
    functions.

    Call it after ``scaler.update()``. The flag comes from ``skipped`` if
    given, else from ``scaler.last_step_skipped``; a disabled scaler never
    skips.
    """
    if not isinstance(averaged, AveragedModel):
        raise TypeError(
            "update_averaged_model updates a torch.optim.swa_utils.AveragedModel, got "
            f"{type(averaged).__name__}; wrap the model with AveragedModel(model, ...)"
        )
    flag = SkipFlagReader(scaler, who="update_averaged_model").read(skipped)
    n = averaged.n_averaged
    take = torch.ones((), dtype=torch.bool, device=n.device) if flag is None else ~flag.to(n.device)
    if averaged.use_buffers:
        avg_ts = list(itertools.chain(averaged.module.parameters(), averaged.module.buffers()))
        model_ts = list(itertools.chain(model.parameters(), model.buffers()))
    else:
        avg_ts, model_ts = list(averaged.module.parameters()), list(model.parameters())
    if len(avg_ts) != len(model_ts):
        raise ValueError(
            f"update_averaged_model: the averaged model holds {len(avg_ts)} tensors to average, "
            f"the model {len(model_ts)}; pass the model the AveragedModel was made from"
        )
    first = n == 0
    copy_model = first & take  # the first taken update copies the model, as torch's does
    hold = first | ~take  # ... and it, like a skipped one, ignores the averaging's result
    pairs = [(a.detach(), m.detach().to(a.device)) for a, m in zip(avg_ts, model_ts, strict=True)]
    for chunk in _chunks(pairs):
        avgs = [a for a, _ in chunk]
        models = [m for _, m in chunk]
        device = avgs[0].device
        cond_copy, cond_hold = copy_model.to(device), hold.to(device)
        kept = [torch.where(cond_copy, m, a) for a, m in zip(avgs, models, strict=True)]
        _average(averaged, avgs, models, n.to(device))
        for a, k in zip(avgs, kept, strict=True):
            torch.where(cond_hold, k, a, out=a)
    if not averaged.use_buffers:
        # torch keeps these buffers equal to the model's on every update: on taken ones here.
        for b_avg, b_model in zip(averaged.module.buffers(), model.buffers(), strict=True):
            b_avg.copy_(torch.where(take.to(b_avg.device), b_model.to(b_avg.device), b_avg))
    averaged.n_averaged += take.to(n.dtype)
