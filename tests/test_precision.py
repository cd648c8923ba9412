"""bf16 mixed precision on CPU, for every language model: `ttt-bench train trainer.precision=bf16-mixed`
trains (the loss falls, every gradient is finite), and its checkpoint, float32 weights, serves
`ttt-bench eval` and `ttt-bench generate` in float32."""

import json

import pytest
import torch

from tests.conftest import TINY
from tests.helpers import run_cli
from ttt_bench.training.checkpoint import load_checkpoint

# Every language model of conf/model/ (the vit_* and mttt_* models are image classifiers, tests/test_mttt.py),
# TTT layers on both backbones.
LANGUAGE_MODELS = {
    "transformer": ["model=transformer"],
    "ttt_linear": ["model=ttt_linear"],
    "ttt_linear-transformer_backbone": ["model=ttt_linear", "model.block.backbone=transformer"],
    "ttt_mlp": ["model=ttt_mlp"],
    "ttt_mlp-transformer_backbone": ["model=ttt_mlp", "model.block.backbone=transformer"],
    "ttt_kernel": ["model=ttt_kernel"],
    "mamba": ["model=mamba"],
    "linear_attention": ["model=linear_attention"],
}
# 30 steps of 4 sequences of 32 byte tokens at size=xs, 2 layers: about a second of training per model.
STEPS = 30
BF16_RUN = [*TINY, "size=xs", "size.n_layers=2", "data.corpus.train_docs=8", "data.corpus.validation_docs=2",
            "data.seq_len=32", "recipe.tokens_per_batch=128", "data.val_tokens=256",
            f"trainer.max_steps={STEPS}", "eval_every_n_steps=1000", "checkpoint_every_n_steps=1000",
            "trainer.precision=bf16-mixed"]


@pytest.mark.parametrize("name", list(LANGUAGE_MODELS))
def test_bf16_mixed_trains_on_cpu_and_its_checkpoint_serves_eval_and_generate_in_float32(
        name, tmp_path, capsys, one_thread):
    run_cli("train", *LANGUAGE_MODELS[name], *BF16_RUN, f"paths.runs={tmp_path}")
    (run,) = [p.parent for p in tmp_path.rglob("metrics.json")]
    metrics = json.loads((run / "metrics.json").read_text())
    # nonfinite=stop (the default) ends the run with an error at the first NaN/inf loss or gradient norm
    assert metrics["status"] == "finished" and metrics["skipped_steps"] == 0 and metrics["steps"] == STEPS
    losses = [float(r.split(",")[1]) for r in (run / "losses.csv").read_text().splitlines()[1:]]
    assert len(losses) == STEPS and all(torch.isfinite(torch.tensor(losses)))
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, (first, last)  # from ~ln(256) = 5.5 to below the byte unigram entropy

    ckpt = run / "checkpoints" / "last.ckpt"
    module, _ = load_checkpoint(ckpt)
    assert {p.dtype for p in module.parameters()} == {torch.float32}  # bf16-mixed keeps float32 weights

    run_cli("eval", f"ckpt_path={ckpt}", "max_tokens=256", f"paths.runs={tmp_path / 'eval'}")
    evaluated = json.loads(next((run / "eval").rglob("metrics.json")).read_text())  # beside the run
    assert evaluated["val_loss"] == pytest.approx(metrics["val_loss"], rel=1e-5)  # both float32, same tokens

    capsys.readouterr()
    run_cli("generate", str(ckpt), "--prompt", "Ra koki", "--max-new-tokens", "8", "--temperature", "0")
    assert capsys.readouterr().out.startswith("Ra koki")

