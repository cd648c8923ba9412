"""Decoding from CUDA graphs (ttt_bench/models/graphs.py). Without a GPU the graphs are emulated the way CUDA
replays them: a capture records every aten op with the tensors it read and wrote, a replay runs the same
ops on the same tensors, the Python that chose them not run again, a position or a branch baked in as it was
at the capture; a sync (`.item()`, `nonzero`) or a tensor made from Python data inside a capture fails as
it does on a GPU. So a cache whose
step depends on Python state its graph key does not name, or that moves its state to new memory the graph
does not copy back, decodes wrong here too."""

import os
import subprocess
import sys

import pandas as pd
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.conftest import REPO
from tests.helpers import tiny_model
from ttt_bench.errors import UserError
from ttt_bench.models.graphs import DecodeGraphs, cuda_graph

# what a capture cannot hold: a sync, or a tensor made from Python data (a copy from the host, baked)
SYNCS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.nonzero.default,
         torch.ops.aten.is_nonzero.default, torch.ops.aten.lift_fresh.default,
         torch.ops.aten.lift_fresh_copy.default}


class Recording(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            raise RuntimeError(f"{func} synchronizes or copies from the host: not allowed in a CUDA graph "
                               "capture")
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, args, kwargs or {}, out))
        return out


def emulated_graph(step):
    """(replay, True): the capture ran the step, as an eager call would."""
    recording = Recording()
    with recording:
        step()

    def replay():
        for func, args, kwargs, out in recording.ops:
            for old, new in zip(tree_leaves(out), tree_leaves(func(*args, **kwargs)), strict=True):
                same = old is new or (old.data_ptr() == new.data_ptr() and old.stride() == new.stride())
                if isinstance(old, torch.Tensor) and not same:
                    old.copy_(new)

    return replay, True


# the models of `bench models`, TTT on both backbones, Mamba on its PyTorch step and on its default backend
# (mamba-ssm's selective_state_update on a GPU where it imports)
GRAPHED = {"transformer": [], "ttt_linear": [], "ttt_mlp": [],
           "ttt_linear-transformer_backbone": ["model.block.backbone=transformer"],
           "mamba-torch": ["model.block.backend=torch"], "mamba-auto": [],
           "linear_attention-rope": ["model.block.rope=true"],
           "linear_attention-katharopoulos-rope": ["model.block.variant=katharopoulos",
                                                   "model.block.rope=true"]}


def _model(name: str):
    return tiny_model(name.split("-")[0], "size.n_layers=2", *GRAPHED[name])


@pytest.mark.parametrize("name", GRAPHED)
@pytest.mark.parametrize("prompt", [16, 19], ids=["prompt16", "prompt19"])
def test_graphs_decode_as_the_model(name, prompt):
    """Prefill, then 40 tokens from the graphs (one eager step per key, one capture, then replays: past two
    TTT mini-batches of 16): the logits of one forward pass at every step, 16 graphs for TTT (one per
    position in a mini-batch), one for the others; every state tensor stays at its address after the
    warm-up, as a replayed graph needs."""
    model = _model(name)
    x = torch.randint(0, 97, (3, prompt + 40))
    with torch.no_grad():
        full = model(x)
        caches = model.init_caches(3, max_len=x.shape[1])
        model(x[:, :prompt], caches)
        graphs = DecodeGraphs(model, caches, capture=emulated_graph)
        steps, addresses = [], []
        for t in range(prompt, x.shape[1]):
            steps.append(graphs(x[:, t : t + 1]).clone())
            if graphs.replays:
                addresses.append(sorted(b.data_ptr() for b in graphs.buffers.values()))
    torch.testing.assert_close(torch.cat(steps, 1), full[:, prompt:], rtol=0, atol=1e-10)
    assert len(graphs.graphs) == (16 if name.startswith("ttt") else 1) and graphs.replays
    assert all(a == addresses[0] for a in addresses)


def test_warm_up_captures_every_key_then_replays():
    model = _model("ttt_linear")
    x = torch.randint(0, 97, (2, 80))
    with torch.no_grad():
        caches = model.init_caches(2)
        model(x[:, :5], caches)
        graphs = DecodeGraphs(model, caches, capture=emulated_graph)
        steps = graphs.warm_up(iter(x[:, 5:].split(1, 1)))
    assert steps == 33 == DecodeGraphs.warm_up_steps(caches)  # 16 eager, 16 captured, one replayed
    assert graphs.replays == 1


def test_what_cannot_decode_from_graphs_says_so():
    with torch.no_grad():
        linear = _model("transformer")
        assert DecodeGraphs.why_not(linear.init_caches(1)) is None
        with pytest.raises(UserError, match="not a StaticCache"):
            DecodeGraphs(linear, [object()], capture=emulated_graph)
        kernel = tiny_model("ttt_kernel", "size.n_layers=1")
        caches = kernel.init_caches(1)
        kernel(torch.zeros(1, 3, dtype=torch.long), caches)
        with pytest.raises(UserError, match="decodes eagerly only"):
            DecodeGraphs(kernel, caches, capture=emulated_graph)(torch.zeros(1, 1, dtype=torch.long))
        caches = linear.init_caches(1, max_len=4)
        linear(torch.zeros(1, 4, dtype=torch.long), caches)
        with pytest.raises(UserError, match="KV cache is full"):
            DecodeGraphs(linear, caches, capture=emulated_graph)(torch.zeros(1, 1, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", GRAPHED)
def test_cuda_graphs_decode_as_eager_steps(name):
    """On a GPU: the real CUDA graphs give the eager steps' logits (float32, the Triton decode kernels where
    the layer runs them)."""
    model = _model(name).float().cuda()
    x = torch.randint(0, 97, (4, 19 + 40), device="cuda")
    with torch.no_grad():
        eager, graphed = model.init_caches(4, max_len=x.shape[1]), model.init_caches(4, max_len=x.shape[1])
        model(x[:, :19], eager), model(x[:, :19], graphed)
        graphs = DecodeGraphs(model, graphed, capture=cuda_graph)
        for t in range(19, x.shape[1]):
            step = x[:, t : t + 1]
            torch.testing.assert_close(graphs(step), model(step, eager), rtol=1e-4, atol=1e-4)
    assert graphs.replays


def test_bench_models_times_decoding_from_the_graphs(monkeypatch):
    """`bench models` decodes from the graphs where they are on (here emulated): the rows say so, a model
    whose cache cannot (the kernel learner's training set grows) decodes eagerly beside them, its note says
    why; on the CPU, `on` with the real
    CUDA graphs is a one-line error."""
    import argparse

    from tests.conftest import BENCH_TINY
    from ttt_bench.bench import models as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args([*BENCH_TINY, "--models", "transformer,ttt_linear,ttt_kernel",
                              "--decode-graphs", "on", "--contexts", "32"])
    names = args.models.split(",")
    run = bench.Bench(args, names, torch.device("cpu"))
    with pytest.raises(ValueError, match="needs --device cuda"):
        run.latency([32], {"decode"})
    run.capture = emulated_graph
    run.latency([32], {"decode"})
    rows = {r["model"]: r for r in run.rows}
    assert [rows[n]["graphed"] for n in names] == [True, True, False]
    assert rows["ttt_kernel"]["note"].startswith("eager: the kernel learner's training set grows")
    assert all(rows[n]["latency_ms_per_token"] > 0 for n in names)

    run.rows, run.args.decode_graphs = [], "both"  # and the eager steps beside them, as decode_eager
    run.latency([32], {"decode"})
    assert [(r["model"], r["phase"], r["graphed"]) for r in run.rows if r["model"] == "ttt_linear"] == [
        ("ttt_linear", "decode", True), ("ttt_linear", "decode_eager", False)]
    assert any(line.startswith("decode from CUDA graphs, ttt_linear: ")
               for line in bench.summary(pd.DataFrame(run.rows)))
    run.args.decode_graphs = "on"

    def failing(step):
        raise RuntimeError("operation not permitted when stream is capturing")

    run.rows, run.capture = [], failing  # a capture that fails: that model decodes eagerly, and says why
    run.latency([32], {"decode"})
    rows = {r["model"]: r for r in run.rows}
    assert not any(rows[n]["graphed"] for n in names)
    assert all(rows[n]["latency_ms_per_token"] > 0 for n in names)
    assert rows["ttt_linear"]["note"] == "eager: operation not permitted when stream is capturing"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_sample_from_graphs_as_eagerly():
    """`generate`'s sampling on a GPU decodes from the graphs by default: greedy, the same tokens."""
    from ttt_bench.generate import sample

    model = _model("ttt_linear").float().cuda()
    prompt = list(range(1, 20))
    eager = sample(model, prompt, 40, temperature=0, graphs=False)
    assert sample(model, prompt, 40, temperature=0) == eager


def test_decode_ops_script_counts_the_launches_of_a_step():
    """scripts/decode_ops.py (results/speed/decode_ops) at size xs: a table row per model, the TTT layer's
    Triton decode kernel counted as one launch in place of the primal step's operators."""
    def table(*extra):
        done = subprocess.run([sys.executable, "scripts/decode_ops.py", "--size", "xs", *extra], cwd=REPO,
                              capture_output=True, text=True, env={**os.environ, "TRITON_INTERPRET": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        rows = [line.split("|")[1:-1] for line in done.stdout.splitlines() if line.startswith("| ")][1:]
        return {r[0].strip(): (int(r[2]), int(r[3])) for r in rows}

    pytorch, triton = table("--models", "transformer,ttt_linear"), table("--models", "ttt_linear", "--triton")
    assert set(pytorch) == {"transformer", "ttt_linear"} and pytorch["transformer"][0] > 0
    assert 0 < triton["ttt_linear (Triton decode kernels)"][0] < pytorch["ttt_linear"][0]


@pytest.mark.parametrize("capture", ["emulated", "failing"])
def test_sample_decodes_from_graphs_and_falls_back_to_eager(capture, monkeypatch, caplog):
    """`generate`'s sampling from the graphs (here emulated) gives the eager tokens; a capture that fails
    mid-way leaves the caches half-stepped, so sampling prefills them again and goes on eagerly, saying so."""
    import functools

    from ttt_bench import generate

    def failing(step):
        step()  # the step's Python ran (counters advanced) before the capture failed
        raise RuntimeError("operation not permitted when stream is capturing")

    chosen = emulated_graph if capture == "emulated" else failing
    model, prompt = _model("ttt_linear"), list(range(1, 20))
    eager = generate.sample(model, prompt, 40, temperature=0, graphs=False)
    monkeypatch.setattr(generate, "DecodeGraphs", functools.partial(DecodeGraphs, capture=chosen))
    assert generate.sample(model, prompt, 40, temperature=0, graphs=True) == eager
    assert ("CUDA graphs failed" in caplog.text) == (capture == "failing")
