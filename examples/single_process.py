"""Train a small model in bf16 autocast with shardscale's ShardedGradScaler, beside torch's.

Run: python examples/single_process.py
"""

from __future__ import annotations

import torch

from shardscale.core import ShardedGradScaler


def main() -> None:
    """Train twice on the same data, with torch's scaler and with ours, and compare."""
    results = {}
    for name, scaler in (
        ("torch.amp.GradScaler", torch.amp.GradScaler("cpu", init_scale=2.0**14)),
        ("shardscale", ShardedGradScaler("cpu", init_scale=2.0**14)),
    ):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 1)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        gen = torch.Generator().manual_seed(1)
        target_w = torch.randn(32, 1, generator=gen)
        losses = []
        for step in range(200):
            x = torch.randn(64, 32, generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = torch.nn.functional.mse_loss(model(x).float(), x @ target_w)
            if step == 50:
                loss = loss * float("inf")  # an overflow: the step is skipped, the scale backs off
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[name] = (
            losses,
            scaler.get_scale(),
            [p.detach().clone() for p in model.parameters()],
        )
        print(
            f"{name:>22}: loss {losses[0]:.4f} -> {losses[-1]:.4f}, final scale {scaler.get_scale():g}"
        )
    (_, s_a, p_a), (_, s_b, p_b) = results.values()
    same = s_a == s_b and all(torch.equal(a, b) for a, b in zip(p_a, p_b, strict=True))
    print("identical parameters and scale:", same)
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
