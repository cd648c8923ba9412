"""TTT blocks in the language model: configs (Table 1), diagnostics, conversion (decoding and the paper sizes'
parameter counts: tests/test_models.py)."""

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hydra.utils import instantiate
from ttt_bench.kernels.ttt import learner

from tests.conftest import rel_err
from ttt_bench.config import compose
from ttt_bench.experiments.table1 import EXPERIMENT as TABLE1
from ttt_bench.models.lm import LanguageModel
from ttt_bench.models.ttt import TTTBlock
from ttt_bench.models.ttt.convert import from_authors, to_authors
from ttt_bench.models.ttt.diagnostics import record_inner_losses

pytestmark = pytest.mark.usefixtures("float64_one_thread")


def tiny_model(n_layers: int = 2, **block) -> LanguageModel:
    torch.manual_seed(0)
    block = {"d_model": 16, "n_heads": 2, "mlp_hidden": 32, "mini_batch_size": 4, **block}
    model = LanguageModel(64, block["d_model"], n_layers, partial(TTTBlock, **block)).eval()
    with torch.no_grad():  # move LN weights, biases and offsets off their init
        for name, p in model.named_parameters():
            if p.dim() < 2 or "norm" in name or "b1" in name or "lr_bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def test_eta_warmup_hook():
    model = tiny_model(learner="mlp", eta_warmup=True)
    block = model.blocks[0]
    block.on_train_step(4, 10)
    assert block.ttt.eta_scale == pytest.approx(0.5)
    block.on_train_step(50, 10)
    assert block.ttt.eta_scale == 1.0


TABLE_1 = {  # conf/sweep/table1.yaml as the sweep plans it: each row's model overrides
    run.config: [o for o in run.overrides if o.startswith("model")] for run in TABLE1.plan("smoke").values()
}


@pytest.mark.parametrize("row", list(TABLE_1))
def test_table_1_rows_are_configs(row):
    """Every row of Table 1 is a set of overrides of the model configs that builds a working model."""
    cfg = compose("train", TABLE_1[row] + ["size=xs", "data.seq_len=24"])
    model = instantiate(cfg.model, vocab_size=32)
    assert model(torch.randint(0, 32, (1, 24))).shape == (1, 24, 32)


def test_diagnostics_record_inner_losses(tmp_path):
    model = tiny_model(learner="linear")
    ids = torch.randint(0, 64, (3, 10))
    with torch.no_grad(), record_inner_losses(model) as rec:
        logits = model(ids)
        model(ids[:, :7])
    assert torch.equal(logits, model(ids))  # recording does not change the function
    losses = rec.losses()
    assert sorted(losses) == [0, 1]
    for layer in losses.values():
        assert all(v.shape == (10,) and np.isfinite(v).all() for v in layer.values())
        assert layer["prev"][0] == pytest.approx(layer["w0"][0])  # W_{t-1} = W_0 for the first token
    rec.save(tmp_path / "inner.npz")
    assert set(np.load(tmp_path / "inner.npz").files) == {
        f"layer{i}_{k}" for i in (0, 1) for k in ("w0", "prev", "now")
    }
    assert model.blocks[0].ttt.diagnostics is None


@pytest.mark.parametrize("backbone", ["mamba", "transformer"])
def test_convert_round_trip(backbone):
    model = tiny_model(learner="mlp", backbone=backbone)
    sd = model.state_dict()
    theirs = to_authors(sd)
    assert "model.layers.1.seq_modeling_block.learnable_ttt_lr_weight" in theirs
    assert "model.layers.0.mlp.gate_proj.weight" in theirs and "model.embed_tokens.weight" in theirs
    assert ("model.layers.0.conv.conv.weight" in theirs) == (backbone == "mamba")
    back = from_authors(theirs)
    assert back.keys() == sd.keys() and all(back[k] is sd[k] for k in sd)


@pytest.mark.parametrize("decode", [False, True])
def test_triton_kernels_in_the_layer_match_torch(monkeypatch, decode):
    """kernel="triton" (Triton's interpreter on CPU) against kernel="torch": the dual kernel over complete
    mini-batches, and the decode kernel token by token. Layers and inputs on the kernel's device: CUDA where
    there is one (compiled kernels take CUDA tensors only; exact float32 matmuls there, as the tolerances
    below), else the CPU and the interpreter."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("TTT_BENCH_KERNEL_PRECISION", "ieee")  # the layer's CUDA default is tf32 (~1e-3)
    from ttt_bench.models.ttt import TTTLayer
    from ttt_bench.models.ttt.layer import TTTCache

    torch.manual_seed(0)
    layers = [TTTLayer(32, 2, mini_batch_size=16, share_qk=True, use_gate=True, kernel=k).float().to(device)
              for k in ("torch", "triton")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 20 if decode else 40, 32, dtype=torch.float32).to(device)
    if decode:
        outs = []
        for layer in layers:
            cache = TTTCache()
            outs.append(torch.cat([layer(x[:, t : t + 1], cache) for t in range(x.shape[1])], 1))
        assert torch.allclose(outs[1], outs[0], rtol=0, atol=1e-5)
        return
    zs = [layer(x) for layer in layers]
    assert torch.allclose(zs[1], zs[0], rtol=0, atol=1e-5)
    grads = [torch.autograd.grad(z.square().sum(), list(layer.parameters())) for z, layer in zip(zs, layers)]
    for u, v in zip(*grads, strict=True):  # float32, relative to the largest entry
        assert (v - u).abs().max() <= 1e-4 * u.abs().max()


def test_learner_gelu_is_the_tanh_approximation_and_its_derivatives():
    x = torch.linspace(-8, 8, 2001, dtype=torch.float64, requires_grad=True)
    assert rel_err(learner.gelu(x), F.gelu(x, approximate="tanh")) <= 1e-14
    (d1,) = torch.autograd.grad(learner.gelu(x).sum(), x, create_graph=True)
    (d2,) = torch.autograd.grad(d1.sum(), x)
    assert rel_err(learner.gelu_grad(x), d1) <= 1e-13 and rel_err(learner.gelu_grad2(x.detach()), d2) <= 1e-12
    y, dy = learner.gelu_and_grad(x.detach())  # the dual scans' in-place version
    assert rel_err(y, F.gelu(x, approximate="tanh")) <= 1e-14 and rel_err(dy, d1) <= 1e-13


@pytest.mark.parametrize("learner_name", ["linear", "mlp"])
def test_mixed_precision_runs_the_inner_loop_in_float32(learner_name):
    """Under autocast (bf16-mixed training) the inner loop runs in float32, outside autocast: forward and
    backward work (the dual scans write float32 weights into buffers of their inputs' dtype), and the output
    stays close to the float32 layer's."""
    torch.manual_seed(0)
    layer = TTTBlock(0, 64, 4, 128, learner=learner_name, mini_batch_size=8).ttt.float()
    x = torch.randn(2, 40, 64, dtype=torch.float32, requires_grad=True)
    ref = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().square().sum().backward()
    assert y.dtype == torch.bfloat16 and torch.isfinite(x.grad).all()
    assert rel_err(y.float(), ref) <= 0.05


@pytest.mark.parametrize("learner_name", ["linear", "mlp"])
def test_a_model_cast_to_bfloat16_prefills_and_decodes_with_a_float32_inner_loop(learner_name):
    """`bench models --dtype bfloat16` casts the whole model: the inner loop's state (W0, b0, the TTT norm,
    the lr gate, the token scale) is used in float32 all the same, and the output is close to float32's."""
    model = tiny_model(learner=learner_name).float()
    ids = torch.randint(0, 64, (2, 10))
    ref = model(ids)
    half = model.to(torch.bfloat16)
    full = half(ids)
    caches = half.init_caches(2, dtype=torch.bfloat16)
    steps = [half(ids[:, :6], caches), *(half(ids[:, t : t + 1], caches) for t in range(6, 10))]
    assert full.dtype == torch.bfloat16 and torch.isfinite(full.float()).all()
    assert rel_err(full.float(), ref) <= 0.05
    assert rel_err(torch.cat(steps, 1).float(), full.float()) <= 0.05


@pytest.mark.parametrize("backbone", ["mamba", "transformer"])
def test_the_fused_projection_is_the_separate_projections(backbone):
    """One GEMM over the concatenated weights (TTTLayer.project, fused as on CUDA) gives each view as its own
    projection: theta_Q x, theta_K x (not with share_qk, the Mamba backbone's), theta_V x, the gate's
    theta_G x (the Mamba backbone's) and the inner learning rate's logits theta_lr . x; and the layer on its
    strided views (the convs, RoPE, the inner loop) the same outputs and gradients as on separate ones."""
    layer = tiny_model(1, backbone=backbone).blocks[0].ttt
    x = torch.randn(2, 7, 16)
    views = layer.project(x, fused=True)
    want = {"q": layer.q_proj(x), "k": None if layer.share_qk else layer.k_proj(x), "v": layer.v_proj(x),
            "g": None if layer.g_proj is None else layer.g_proj(x),
            "lr": F.linear(x, layer.lr_weight.flatten(1))}
    assert (views["k"] is None) == (backbone == "mamba") and (views["g"] is None) == (backbone != "mamba")
    for name, w in want.items():
        assert (views[name] is None) == (w is None) and (w is None or rel_err(views[name], w) < 1e-14), name
    x = torch.randn(2, 40, 16, requires_grad=True)
    runs = []
    for fused in (True, False):
        layer.project = partial(type(layer).project, layer, fused=fused)
        out = layer(x)
        runs.append([out, *torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])])
    for a, b in zip(*runs, strict=True):
        assert rel_err(a, b) < 1e-12
