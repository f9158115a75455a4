"""A real 🤗 ``Trainer`` (and TRL's ``SFTTrainer``) on 2 gloo ranks with ``use_shardscale``.

The model is a tiny Llama built from a ``LlamaConfig`` (nothing downloaded;
``HF_HUB_OFFLINE=1``); the Trainer runs DDP over gloo on CPU (Accelerate's
``MULTI_CPU`` path). Accelerate turns fp16 off on CPU (no autocast, no scaler),
so each run sets ``trainer.accelerator.native_amp = True`` before ``train()``:
``prepare`` then wraps the forward in ``torch.autocast("cpu", float16)`` and
``unscale_gradients`` unscales, exactly as Accelerate does on a GPU. The
"torch" runs also set ``trainer.accelerator.scaler = torch.amp.GradScaler("cpu")``,
which is what Accelerate builds there (``get_grad_scaler``): that is the
Trainer WITHOUT shardscale, as fp16 users run it.

Each run trains STEPS optimizer steps with a fused AdamW (``adamw_torch_fused``)
and a linear schedule, with two overflows injected on ONE rank:
- step LOSS_STEP: rank 0's loss is inf, so DDP's all-reduce carries it to
  every rank's gradient;
- step GRAD_STEP: after backward (DDP has reduced), one element of rank 1's
  gradient is set to inf: an overflow only that rank sees, as in a sharded
  layout.
What must hold, from torch's GradScaler semantics rather than from our code:
every rank skips exactly those steps (the parameters stay bit-identical
across ranks); the scale halves once per skip; the scheduler advances only on
the steps taken; the logged ``grad_norm`` is the true global norm (torch's
``get_total_norm`` of the gradients after backward, divided by the scale);
``trainer.state`` lists the skipped steps; a checkpoint stores the scale and
a resumed run starts from it. The torch runs show which of these fail
without shardscale.
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
from tolerances import norm_rtol

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
pytest.importorskip("transformers")
pytest.importorskip("shardscale.transformers")

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 8
LOSS_STEP, LOSS_RANK = 2, 0  # 0-based optimizer step -> the rank whose loss is inf
GRAD_STEP, GRAD_RANK = 5, 1  # 0-based optimizer step -> the rank whose gradient gets an inf
SKIPPED = [LOSS_STEP + 1, GRAD_STEP + 1]  # as trainer.state.global_step counts them
INIT_SCALE = 1024.0
CLIP = 0.5  # below the clean steps' norms (checked), so clipping really acts
LR = 1e-2
BATCH, SEQ, VOCAB = 4, 16, 64


def _launch_env() -> None:
    from accelerate.state import AcceleratorState, GradientState

    # Accelerate keeps process-wide singletons; each Trainer starts from none. The pool already
    # holds the process group, which Accelerate's MULTI_CPU path adopts.
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        {"LOCAL_RANK": str(rank), "RANK": str(rank), "WORLD_SIZE": str(world),
         "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29557"}
    )  # fmt: skip


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)  # identical initial weights on every rank
    return LlamaForCausalLM(config)


class _Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Random token sequences, the same on every rank (the Trainer's sampler splits them)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _fsdp2_model(out: str) -> Any:
    """The same model, FSDP2-sharded over both ranks by transformers' own distributed loading
    (``from_pretrained(..., distributed_config=...)``, from a local save: nothing downloaded)."""
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    saved = str(Path(out) / "initial")
    if dist.get_rank() == 0:
        _model().save_pretrained(saved)
    dist.barrier()
    return LlamaForCausalLM.from_pretrained(
        saved, distributed_config=DistributedConfig(fsdp_size=2)
    )


def _global_norm(model: torch.nn.Module) -> float:
    """torch's norm of every gradient (DTensor shards gathered), in float64."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad.to(torch.float64) for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def _injecting(base: type, loss_step: int = LOSS_STEP, grad_step: int = GRAD_STEP) -> type:
    """``base`` (Trainer or a TRL trainer) with the overflows injected and the reference norm read."""

    class Injecting(base):  # type: ignore[misc, valid-type]
        rows: list[dict[str, Any]]

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            out = super().compute_loss(model, inputs, *args, **kwargs)
            if self.state.global_step == loss_step and dist.get_rank() == LOSS_RANK:
                if isinstance(out, tuple):
                    return (out[0] * math.inf, *out[1:])
                return out * math.inf
            return out

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(model, inputs, *args, **kwargs)
            step = self.state.global_step  # 0-based index of the optimizer step under way
            if step == grad_step and dist.get_rank() == GRAD_RANK:
                from torch.distributed.tensor import DTensor

                with torch.no_grad():
                    grad = next(p.grad for p in model.parameters() if p.grad is not None)
                    local = grad.to_local() if isinstance(grad, DTensor) else grad
                    local.view(-1)[0] = math.inf
            scale = self.accelerator.scaler.get_scale()
            self.rows.append(
                {"step": step, "ref_norm": _global_norm(model) / scale, "scale_before": scale}
            )
            return loss

    return Injecting


def _args(out: str, *, steps: int, save: bool) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, use_cpu=True, fp16=True, max_steps=steps, per_device_train_batch_size=BATCH,
        learning_rate=LR, lr_scheduler_type="linear", warmup_steps=0, max_grad_norm=CLIP,
        optim="adamw_torch_fused", logging_steps=1, report_to="none", disable_tqdm=True,
        save_strategy="steps" if save else "no", save_steps=STEPS, seed=0,
        dataloader_num_workers=0, ddp_backend="gloo", ddp_find_unused_parameters=False,
    )  # fmt: skip


def _trainer(
    kind: str, out: str, *, steps: int, save: bool, init_scale: float, layout: str = "ddp"
) -> Any:
    from transformers import Trainer

    _launch_env()
    trainer = _injecting(Trainer)(
        model=_fsdp2_model(out) if layout == "fsdp2" else _model(),
        args=_args(out, steps=steps, save=save),
        train_dataset=_Tokens(64),
    )
    trainer.rows = []
    _hold(trainer, kind, init_scale)
    return trainer


def _hold(trainer: Any, kind: str, init_scale: float) -> None:
    """Put ``trainer`` on shardscale (the one line) or on what Accelerate builds on a GPU."""
    from shardscale.transformers import use_shardscale

    acc = trainer.accelerator
    assert acc.distributed_type.name == "MULTI_CPU" and acc.scaler is None
    if kind == "shardscale":
        use_shardscale(trainer, init_scale=init_scale)
    else:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    acc.native_amp = True  # fp16 autocast and unscaling as on a GPU (see the module docstring)


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return [
        (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        for p in model.parameters()
    ]


def _summary(trainer: Any) -> dict[str, Any]:
    logs = [e for e in trainer.state.log_history if "grad_norm" in e]
    record = trainer.state.stateful_callbacks.get("ShardscaleCallback")
    return {
        "rows": trainer.rows, "logs": logs, "record": record,
        "sched": trainer.lr_scheduler.last_epoch, "lr": trainer.lr_scheduler.get_last_lr()[0],
        "params": _params(trainer.model), "scale": trainer.accelerator.scaler.get_scale(),
    }  # fmt: skip


def _case(kind: str, out: str, resume: bool, layout: str = "ddp") -> dict[str, Any]:
    trainer = _trainer(kind, out, steps=STEPS, save=resume, init_scale=INIT_SCALE, layout=layout)
    trainer.train()
    result = _summary(trainer)
    if not resume:
        return result
    ckpt = Path(out) / f"checkpoint-{STEPS}"
    result["saved_scaler"] = torch.load(ckpt / "scaler.pt", weights_only=True)
    # A fresh Trainer whose scaler starts elsewhere: the checkpoint's scale must win.
    again = _trainer(kind, out + "-resumed", steps=STEPS + 2, save=False, init_scale=2.0**16)
    again.train(resume_from_checkpoint=str(ckpt))
    result["resumed"] = _summary(again)
    return result


def _check_shardscale(results: list[dict[str, Any]]) -> None:
    numel = sum(p.numel() for p in results[0]["params"])
    rtol = 4 * norm_rtol(numel, torch.float32, 2.0)  # ours and the reference, each within the bound
    for rank, res in enumerate(results):
        logs, rows = res["logs"], res["rows"]
        assert [e["step"] for e in logs] == list(range(1, STEPS + 1))
        # trainer.state tells the skipped steps apart: the callback's record and the logs.
        assert res["record"]["attributes"]["skipped_steps"] == SKIPPED, (rank, res["record"])
        assert [e["skipped_steps"] for e in logs] == [
            sum(1 for s in SKIPPED if s <= e["step"]) for e in logs
        ]
        # The scale halves once per skipped step, on every rank.
        assert [e["loss_scale"] for e in logs] == [
            INIT_SCALE * 0.5 ** sum(1 for s in SKIPPED if s <= e["step"]) for e in logs
        ]
        # The scheduler advanced only on the steps taken (linear decay over STEPS).
        taken = STEPS - len(SKIPPED)
        assert res["sched"] == taken
        assert res["lr"] == pytest.approx(LR * (1 - taken / STEPS), rel=1e-12)
        # The logged grad_norm is the true global norm on every step taken.
        assert len(rows) == STEPS
        clean = [(r, e) for r, e in zip(rows, logs, strict=True) if e["step"] not in SKIPPED]
        assert any(r["ref_norm"] > CLIP for r, _ in clean)  # clipping really acts
        for r, e in clean:
            assert e["grad_norm"] == pytest.approx(r["ref_norm"], rel=rtol), (rank, r, e)
    # Both ranks logged the same norms, skipped steps included (nan where the loss was inf).
    norms = [[e["grad_norm"] for e in res["logs"]] for res in results]
    for a, b in zip(*norms, strict=True):
        assert a == b or (math.isnan(a) and math.isnan(b))
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
    assert all(torch.isfinite(p).all() for p in results[0]["params"])


def _check_resume(results: list[dict[str, Any]]) -> None:
    final = INIT_SCALE * 0.5 ** len(SKIPPED)
    for res in results:
        assert res["saved_scaler"]["scale"] == res["scale"] == final
        resumed = res["resumed"]
        # Two more steps, both from the checkpoint's scale (not the new Trainer's 2**16).
        assert [r["scale_before"] for r in resumed["rows"]] == [final, final]
        assert resumed["record"]["attributes"]["skipped_steps"] == SKIPPED
        new = [
            e for e in resumed["logs"] if e["step"] > STEPS
        ]  # the history before is the checkpoint's
        assert [e["skipped_steps"] for e in new] == [len(SKIPPED)] * 2
        assert [e["loss_scale"] for e in new] == [final, final]
    for a, b in zip(results[0]["resumed"]["params"], results[1]["resumed"]["params"], strict=True):
        assert torch.equal(a, b)


def test_trainer_ddp_fused_adamw_skip_clip_log_and_resume(pool2: Pool, tmp_path: Path) -> None:
    results = pool2.run(_case, "shardscale", str(tmp_path / "ours"), True)
    _check_shardscale(results)
    _check_resume(results)


def test_trainer_fsdp2_from_transformers_distributed_loading(pool2: Pool, tmp_path: Path) -> None:
    """FSDP2 as transformers 5 shards a model itself (``distributed_config=DistributedConfig(
    fsdp_size=2)``; Accelerate's own FSDP path needs a GPU): the same checks, no resume."""
    _check_shardscale(pool2.run(_case, "shardscale", str(tmp_path / "fsdp2"), False, "fsdp2"))
    # Without shardscale: torch's GradScaler reduces the overflow flag over the mesh of the
    # first gradient, which here is every parameter's, so the ranks agree on the skips; the
    # scheduler still advances on them (fused AdamW) and nothing records them.
    r0, r1 = pool2.run(_case, "torch", str(tmp_path / "fsdp2-torch"), False, "fsdp2")
    assert all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    assert r0["scale"] == r1["scale"] == INIT_SCALE / 4
    assert r0["sched"] == r1["sched"] == STEPS
    assert r0["record"] is None and "skipped_steps" not in r0["logs"][-1]


def test_trainer_without_shardscale_fails_the_same_checks(pool2: Pool, tmp_path: Path) -> None:
    """The same loop on what Accelerate builds on a GPU: each check above fails here."""
    r0, r1 = pool2.run(_case, "torch", str(tmp_path / "torch"), True)
    # The rank-local overflow: rank 1 skipped, rank 0 stepped; the replicas have diverged.
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    # The scheduler advanced on every step, skipped ones included (fused AdamW, accelerate#4242).
    assert r0["sched"] == r1["sched"] == STEPS
    # Nothing in trainer.state or the logs tells the skipped steps apart.
    assert r0["record"] is None and r1["record"] is None
    assert not any("skipped_steps" in e or "loss_scale" in e for e in r0["logs"] + r1["logs"])
    # The ranks' scales diverged (rank 1 backed off once more), so DDP averages gradients scaled
    # differently and each rank unscales by its own scale: after the rank-local step the logged
    # grad_norm differs between ranks (a global norm cannot), by the ratio of the scales.
    assert (r0["scale"], r1["scale"]) == (INIT_SCALE / 2, INIT_SCALE / 4)
    g0 = [e["grad_norm"] for e in r0["logs"]]
    g1 = [e["grad_norm"] for e in r1["logs"]]
    assert math.isfinite(g0[GRAD_STEP]) and not math.isfinite(g1[GRAD_STEP])
    for a, b in zip(g0[GRAD_STEP + 1 :], g1[GRAD_STEP + 1 :], strict=True):
        assert math.isfinite(a) and math.isfinite(b) and b > 1.5 * a
    # The checkpoint holds rank 0's scale only: rank 1 resumes from a scale it never had.
    assert r1["saved_scaler"]["scale"] == r0["scale"] != r1["scale"]
    assert r1["resumed"]["rows"][0]["scale_before"] != r1["scale"]


# -- TRL's SFTTrainer: the same line, the same checks ------------------------------------------


def _tokenizer() -> Any:
    """A word-level tokenizer made here with ``tokenizers`` (nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i + 3 for i in range(VOCAB - 3)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _sft_case(kind: str, out: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    _launch_env()
    g = torch.Generator().manual_seed(11)
    texts = [
        " ".join(f"w{int(i)}" for i in torch.randint(0, VOCAB - 3, (SEQ - 1,), generator=g))
        for _ in range(64)
    ]
    config = SFTConfig(
        **{k: v for k, v in _args(out, steps=STEPS, save=False).to_dict().items()
           if k in {"output_dir", "use_cpu", "fp16", "max_steps", "per_device_train_batch_size",
                    "learning_rate", "lr_scheduler_type", "warmup_steps", "max_grad_norm", "optim",
                    "logging_steps", "report_to", "disable_tqdm", "save_strategy", "seed",
                    "dataloader_num_workers", "ddp_backend", "ddp_find_unused_parameters"}},
        max_length=SEQ, packing=False, dataset_num_proc=None,
    )  # fmt: skip
    trainer = _injecting(SFTTrainer)(
        model=_model(), args=config, train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=_tokenizer(),
    )  # fmt: skip
    trainer.rows = []
    _hold(trainer, kind, INIT_SCALE)
    trainer.train()
    return _summary(trainer)


def test_trl_sft_trainer_with_and_without_shardscale(pool2: Pool, tmp_path: Path) -> None:
    pytest.importorskip("trl")
    _check_shardscale(pool2.run(_sft_case, "shardscale", str(tmp_path / "ours")))
    r0, r1 = pool2.run(_sft_case, "torch", str(tmp_path / "torch"))
    # Without shardscale: the replicas diverge, the scheduler advances on skipped steps, and
    # nothing records them.
    assert not all(torch.equal(a, b) for a, b in zip(r0["params"], r1["params"], strict=True))
    assert r0["sched"] == r1["sched"] == STEPS
    assert r0["record"] is None and "skipped_steps" not in r0["logs"][-1]


def _grpo_case(out: str) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    _launch_env()
    prompts = [f"w{i} w{i + 1} w{i + 2}" for i in range(32)]
    config = GRPOConfig(
        output_dir=out, use_cpu=True, fp16=True, max_steps=GRPO_STEPS, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, learning_rate=LR, lr_scheduler_type="linear",
        max_grad_norm=CLIP, optim="adamw_torch_fused", logging_steps=1, report_to="none",
        disable_tqdm=True, save_strategy="no", seed=0, ddp_backend="gloo",
        ddp_find_unused_parameters=False,
    )  # fmt: skip

    def reward(completions: list[str], **kwargs: Any) -> list[float]:
        return [float(len(c)) for c in completions]

    trainer = _injecting(GRPOTrainer, loss_step=1, grad_step=2)(
        model=_model(), reward_funcs=reward, args=config,
        train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=_tokenizer(),
    )  # fmt: skip
    trainer.rows = []
    _hold(trainer, "shardscale", INIT_SCALE)
    trainer.train()
    return _summary(trainer)


GRPO_STEPS = 4


def test_trl_grpo_trainer_generates_on_cpu_and_skips_together(pool2: Pool, tmp_path: Path) -> None:
    """GRPO generates with the policy itself (no vLLM server): overflows at steps 1 (rank 0's
    loss) and 2 (rank 1's gradient) are skipped on both ranks, the scheduler holds."""
    pytest.importorskip("trl")
    results = pool2.run(_grpo_case, str(tmp_path / "grpo"))
    numel = sum(p.numel() for p in results[0]["params"])
    rtol = 4 * norm_rtol(numel, torch.float32, 2.0)
    for res in results:
        assert res["record"]["attributes"]["skipped_steps"] == [2, 3]
        assert res["sched"] == GRPO_STEPS - 2
        assert [e["loss_scale"] for e in res["logs"]] == [INIT_SCALE, INIT_SCALE / 2] + [
            INIT_SCALE / 4
        ] * (GRPO_STEPS - 2)
        for r, e in zip(res["rows"], res["logs"], strict=True):
            if e["step"] not in (2, 3):
                assert e["grad_norm"] == pytest.approx(r["ref_norm"], rel=rtol)
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        assert torch.equal(a, b)
