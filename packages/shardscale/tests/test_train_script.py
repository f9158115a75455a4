"""The training script and its pieces: corpus, model, mesh parsing, metrics."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from importlib import resources
from pathlib import Path

import pytest
import torch

from shardscale.cli._corpus import load_corpus
from shardscale.cli._distributed import MeshShape, parse_mesh
from shardscale.cli._model import ModelConfig, TinyGPT
from shardscale.cli._trainer import StepMetrics, TrainConfig, _lr_at

# Read through the installed package: this also proves the wheel ships the text and its note.
DATA = resources.files("shardscale.cli").joinpath("data")


def test_shipped_corpus_matches_its_provenance_note() -> None:
    text = DATA.joinpath("sonnets.txt").read_bytes()
    note = DATA.joinpath("SOURCE.md").read_text(encoding="utf-8")
    digest = re.search(r"sha256: `([0-9a-f]{64})`", note)
    assert digest, "SOURCE.md must record the text's sha256"
    assert hashlib.sha256(text).hexdigest() == digest.group(1)
    assert len(text) < 300_000  # "a few hundred KB at most"
    assert "Gutenberg" not in text.decode("ascii")  # shipped without the PG trademark


def test_corpus_batches_predict_the_next_character() -> None:
    corpus = load_corpus()
    assert 40 <= corpus.vocab_size <= 100
    gen = torch.Generator().manual_seed(0)
    x, y = corpus.batch(gen, batch_size=4, context=32)
    assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert "From fairest creatures" in corpus.decode(corpus.train[:200])
    with pytest.raises(ValueError, match="--context"):
        corpus.batch(gen, batch_size=1, context=corpus.held_out.numel() + 5, held_out=True)


def test_model_has_a_few_million_parameters_and_is_causal() -> None:
    corpus = load_corpus()
    torch.manual_seed(0)
    model = TinyGPT(ModelConfig(vocab_size=corpus.vocab_size))
    assert 2_000_000 <= model.num_parameters() <= 8_000_000
    x = torch.randint(0, corpus.vocab_size, (2, 16))
    out = model(x)
    assert out.shape == (2, 16, corpus.vocab_size)
    # Changing a later token must not change earlier predictions.
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % corpus.vocab_size
    torch.testing.assert_close(model(x2)[:, :10], out[:, :10])
    # And the first loss is near ln(vocab): nothing has been learned yet.
    loss = torch.nn.functional.cross_entropy(out.flatten(0, 1), x.flatten())
    assert abs(float(loss.detach()) - math.log(corpus.vocab_size)) < 0.5


def test_parse_mesh() -> None:
    assert parse_mesh(None, 2) == MeshShape(2, 1)
    assert parse_mesh("2x2", 4) == MeshShape(2, 2) and str(parse_mesh("2x2", 4)) == "2x2"
    assert parse_mesh("4", 4) == MeshShape(4, 1)
    with pytest.raises(ValueError, match="needs 4 processes"):
        parse_mesh("2x2", 2)
    with pytest.raises(ValueError, match="'2y3' is not a dimension"):
        parse_mesh("2y3", 6)


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="precision"):
        TrainConfig(precision="fp8")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="max_norm"):
        TrainConfig(max_norm=0.0)


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(steps=100, warmup=10, lr=1e-3)
    lrs = [_lr_at(cfg, s) for s in range(100)]
    assert lrs[0] < lrs[9] == pytest.approx(1e-3)
    assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    assert lrs[-1] >= 1e-4 - 1e-12


def test_step_metrics_json_is_strict() -> None:
    m = StepMetrics(step=1, loss=2.0, scale=65536.0, grad_norm=float("inf"), skipped=True,
                    skipped_total=1, lr=1e-3, elapsed_s=0.1)  # fmt: skip
    doc = m.to_json()
    assert doc["grad_norm"] is None and doc["loss"] == 2.0
    json.dumps(doc, allow_nan=False)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_script_runs_standalone_as_one_process(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["--steps", "2", "--context", "32", "--batch-size", "2", "--sample-chars", "4",
                    "--out", str(tmp_path), "--progress", "plain", "--device", "cpu"],
                   module="shardscale.cli.train", timeout=150)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result-rank0.json").read_text())
    assert result["world_size"] == 1 and result["launcher"] == "standalone"
    assert "launched by standalone" in proc.stdout


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_diverged_run_reports_nan_instead_of_crashing(run_cli, tmp_path: Path) -> None:
    # An absurd learning rate drives the weights to where fp16 logits overflow: the loss
    # becomes nan. The run must still finish and write strict JSON, with null for nan.
    proc = run_cli(["--steps", "6", "--context", "16", "--batch-size", "2", "--d-model", "16",
                    "--lr", "1e6", "--init-scale", "1024", "--max-norm", "inf",
                    "--sample-chars", "0", "--out", str(tmp_path), "--progress", "plain",
                    "--device", "cpu"], module="shardscale.cli.train", timeout=150)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr

    def strict(name: str) -> object:
        raise AssertionError(f"{name} in JSON")

    metrics = json.loads((tmp_path / "metrics.json").read_text(), parse_constant=strict)
    assert metrics["summary"]["final_loss"] is None
    assert metrics["history"][-1]["loss"] is None
    assert math.isfinite(metrics["history"][0]["loss"])
    assert "-> nan" in proc.stdout


def test_script_refuses_a_half_set_launch_environment(run_cli, tmp_path: Path) -> None:
    proc = run_cli(["--steps", "1", "--out", str(tmp_path)], module="shardscale.cli.train",
                   env={"RANK": "0"}, timeout=60)  # fmt: skip
    assert proc.returncode == 2
    assert "torchrun" in proc.stderr and "WORLD_SIZE" in proc.stderr


def test_params_digest_reads_exact_bytes() -> None:
    from shardscale.cli._trainer import _raw_bytes, params_digest

    t = torch.randn(6, 4)
    assert _raw_bytes(t) == bytes(t.untyped_storage())
    view = t[:, :3]  # not contiguous: hashed as its values, not its storage
    assert _raw_bytes(view) == bytes(view.contiguous().untyped_storage())
    state = {"a.weight": t, "b.bias": torch.arange(3, dtype=torch.float16)}
    same = {k: v.clone() for k, v in state.items()}
    assert params_digest(state) == params_digest(same)
    same["b.bias"][1] = 7
    assert params_digest(state) != params_digest(same)
    # The name is part of the hash: the same values under another name differ.
    assert params_digest({"x": t}) != params_digest({"y": t})
