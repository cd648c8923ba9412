"""MTTT (docs/mttt.md): the equivalences of Sections 4.1/4.2 exactly (float64), the inner loop against a naive
reference, the inner loss falling over the steps, the image data and its errors, and a tiny end-to-end run."""

import gzip
import json
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from ttt_bench.cli.main import main

from tests.conftest import DATA_DIR
from ttt_bench.data.images import ImageDataModule, read_idx, synthetic_images, tokenise
from ttt_bench.errors import UserError
from ttt_bench.vision import LinearAttention, MTTTLayer, NadarayaWatson, SelfAttention, ViTClassifier
from ttt_bench.vision.reference import linear_inner_gradient, per_token_inner_gradient

FASHION = DATA_DIR / "fashion-mnist"


@pytest.fixture
def f64(one_thread):
    """float64 for exact comparisons, this test only (the end-to-end runs below train in float32)."""
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(dtype)


def random_sizes(seed: int) -> tuple[int, int, int, int]:
    g = np.random.default_rng(seed)
    H = int(g.integers(1, 4))
    return int(g.integers(1, 4)), int(g.integers(2, 12)), H * int(g.integers(2, 6)), H  # B, N, d, H


def randomise(module: torch.nn.Module) -> None:
    """Non-zero everything (biases included), so that no term of the equivalence hides behind a zero."""
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0, 0.5)


def linear_attention_of(m: MTTTLayer) -> LinearAttention:
    """The identity-map linear attention that MTTT-Linear (T = 1, W_0 = 0) computes (Eq. 11, Appendix B):
    query = psi, key = phi, value_h = (x - g_b) G_h^T, output projection = h. Row-vector convention."""
    d, H = m.d, m.H
    la = LinearAttention(d, H, feature_map="identity", normalizer="constant")
    with torch.no_grad():
        la.q.weight.copy_(m.psi.weight.permute(0, 2, 1).reshape(d, d))
        la.q.bias.copy_(m.psi.bias.reshape(d))
        la.k.weight.copy_(m.phi.weight.permute(0, 2, 1).reshape(d, d))
        la.k.bias.copy_(m.phi.bias.reshape(d))
        la.v.weight.copy_(m.g.weight.reshape(d, d))
        la.v.bias.copy_(-(m.g.weight @ m.g_bias).reshape(d))
        la.proj.weight.copy_(m.h.weight.reshape(d, d).T)
        la.proj.bias.copy_(m.h_bias)
    return la


@pytest.mark.parametrize("seed", range(4))
def test_mttt_linear_one_step_is_identity_map_linear_attention(f64, seed):
    """Section 4.1: outputs and the gradients of every parameter and of the input agree to float64
    rounding."""
    torch.manual_seed(seed)
    B, N, d, H = random_sizes(seed)
    m = MTTTLayer(d, H, encoder="linear", steps=1, decoder_ln=False, learned_w0=False)
    randomise(m)
    la = linear_attention_of(m)
    x1 = torch.randn(B, N, d, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = m(x1), la(x2)
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
    r = torch.randn_like(y1)
    (y1 * r).sum().backward()
    (y2 * r).sum().backward()
    close = dict(rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(x1.grad, x2.grad, **close)
    torch.testing.assert_close(
        m.psi.weight.grad, la.q.weight.grad.T.reshape(d, H, -1).permute(1, 0, 2), **close
    )
    torch.testing.assert_close(m.psi.bias.grad.flatten(), la.q.bias.grad, **close)
    torch.testing.assert_close(
        m.phi.weight.grad, la.k.weight.grad.T.reshape(d, H, -1).permute(1, 0, 2), **close
    )
    torch.testing.assert_close(m.phi.bias.grad.flatten(), la.k.bias.grad, **close)
    torch.testing.assert_close(m.h.weight.grad.reshape(d, d), la.proj.weight.grad.T, **close)
    torch.testing.assert_close(m.h_bias.grad, la.proj.bias.grad, **close)
    # g enters through the value weights (G_h^T) and bias (-g_b G_h^T): the chain rule of that map
    bv = la.v.bias.grad.reshape(H, -1)  # [H, d_h]
    wv = la.v.weight.grad.reshape(H, -1, d)  # [H, d_h, d]
    torch.testing.assert_close(m.g.weight.grad, wv - bv[:, :, None] * m.g_bias, **close)
    torch.testing.assert_close(m.g_bias.grad, -torch.einsum("he,hed->d", bv, m.g.weight), **close)


def test_one_seed_starts_identity_linear_attention_and_mttt_linear_from_one_function(one_thread):
    """The two rows of MTTT Table 1 that compute one function are paired by seed: with the same seed the
    ViTs hold the same numbers (the mixers under Eq. 11's map, everything else as is), so their difference
    measures the parametrisation (g_b), not two initialisations."""
    def vit(mixer):
        torch.manual_seed(3)
        return ViTClassifier(mixer, d_model=16, n_layers=2, n_heads=2, mlp_hidden=24, token_dim=9,
                             num_tokens=4, num_classes=10)

    la = vit(partial(LinearAttention, feature_map="identity", normalizer="constant"))
    mt = vit(partial(MTTTLayer, encoder="linear", steps=1, decoder_ln=False, learned_w0=False))
    for a, b in zip(la.blocks, mt.blocks, strict=True):
        mapped = linear_attention_of(b.mixer).state_dict()
        for name, p in a.mixer.state_dict().items():
            torch.testing.assert_close(p, mapped[name], rtol=0, atol=0, msg=name)
    rest = lambda m: {k: v for k, v in m.state_dict().items() if ".mixer." not in k}
    torch.testing.assert_close(rest(la), rest(mt), rtol=0, atol=0)
    x = torch.randn(5, 4, 9)
    torch.testing.assert_close(la.pre_logits(la.norm(la.blocks[1](la.blocks[0](la.embed(x) + la.pos)))),
                               mt.pre_logits(mt.norm(mt.blocks[1](mt.blocks[0](mt.embed(x) + mt.pos)))))


@pytest.mark.parametrize("seed", range(3))
def test_nadaraya_watson_is_self_attention(f64, seed):
    """Section 4.2: the Nadaraya-Watson estimator with the exponential kernel is non-causal softmax
    attention."""
    torch.manual_seed(seed)
    B, N, d, H = random_sizes(seed + 10)
    sa, nw = SelfAttention(d, H), NadarayaWatson(d, H)
    randomise(sa)
    nw.load_state_dict(sa.state_dict())
    x1 = torch.randn(B, N, d, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y1, y2 = sa(x1), nw(x2)
    torch.testing.assert_close(y1, y2, rtol=1e-12, atol=1e-12)
    y1.pow(2).sum().backward()
    y2.pow(2).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-10, atol=1e-12)
    for (name, p1), p2 in zip(sa.named_parameters(), nw.parameters()):
        torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize(
    "encoder,decoder_ln", [("linear", False), ("linear", True), ("mlp", True), ("mlp", False)]
)
def test_inner_gradient_matches_the_per_token_reference(f64, encoder, decoder_ln):
    """The batched autograd gradient of Eq. 1 (all examples and heads at once) is the mean of per-token
    gradients computed one token at a time, and for MTTT-Linear without Decoder LN the closed form."""
    torch.manual_seed(1)
    B, N, d, H = 2, 7, 6, 2
    m = MTTTLayer(d, H, encoder=encoder, decoder_ln=decoder_ln, learned_w0=True)
    randomise(m)
    x = torch.randn(B, N, d)
    W = m.initial_weights(B)
    z, target = m.phi(x), x.unsqueeze(1).expand(B, H, N, d)
    grads = torch.autograd.grad(m.inner_loss(z, target, W).sum(), list(W.values()))
    for b in range(B):
        for h in range(H):
            Wbh = {k: w[b, h] for k, w in W.items()}
            ref = per_token_inner_gradient(m, x[b], Wbh, h)
            for (k, _), g in zip(W.items(), grads):
                torch.testing.assert_close(g[b, h], ref[k], rtol=1e-10, atol=1e-12, msg=f"{k} b={b} h={h}")
            if encoder == "linear" and not decoder_ln:
                closed = linear_inner_gradient(m, x[b], Wbh["w1"], h)
                torch.testing.assert_close(grads[0][b, h], closed, rtol=1e-10, atol=1e-12)


def test_outer_gradient_is_second_order(f64):
    """The outer loss reaches g and phi only through the inner gradient step (Section 3): their gradients
    agree with finite differences of the whole forward."""
    torch.manual_seed(2)
    m = MTTTLayer(4, 2, encoder="mlp", steps=2, learned_w0=True)
    x = torch.randn(1, 5, 4)
    params = [p for p in m.parameters()]
    assert torch.autograd.gradcheck(
        lambda *ps: torch.func.functional_call(m, dict(zip([n for n, _ in m.named_parameters()], ps)), (x,)),
        params,
    )


def test_inner_loss_is_recorded_per_layer_and_falls_over_the_steps(one_thread):
    torch.manual_seed(0)
    mixer = lambda **k: MTTTLayer(**k, encoder="mlp", steps=4)  # noqa: E731
    model = ViTClassifier(
        mixer, d_model=32, n_layers=3, n_heads=2, mlp_hidden=64, token_dim=16, num_tokens=49, num_classes=10
    )
    images, _ = synthetic_images(8, 0, "train")
    with torch.no_grad():
        model(tokenise(torch.from_numpy(images), None, 4))
    inner = model.inner_losses()
    assert inner.shape == (3, 5)  # layers x (T + 1)
    assert (inner[:, 1:] < inner[:, :-1]).all(), inner  # full-batch GD with eta = 1 descends at every step


def test_sgd_draws_random_minibatches_in_training_and_repeatable_ones_in_evaluation(one_thread):
    torch.manual_seed(0)
    m = MTTTLayer(8, 2, encoder="mlp", steps=4, sgd=True)
    x = torch.randn(2, 12, 8)
    m(x)
    assert m.inner_losses.shape == (5,)
    m.eval()  # evaluation draws its mini-batches from a fixed seed: repeatable whatever ran before
    with torch.no_grad():
        first = m(x)
        torch.rand(100)
        assert torch.equal(m(x), first)
    m.train()
    assert not torch.equal(m(x), m(x))  # training draws new mini-batches from the global generator
    with pytest.raises(UserError, match="divide the number of tokens"):
        m(torch.randn(2, 10, 8))


def test_frozen_w0_is_a_buffer_and_bad_steps_are_errors():
    m = MTTTLayer(8, 2, encoder="linear", learned_w0=False)
    assert "w1" not in dict(m.named_parameters()) and torch.equal(m.w1, torch.zeros(2, 4, 4))
    assert "w2" in dict(MTTTLayer(8, 2, encoder="mlp").named_parameters())
    for steps in (0, -1, 1.5, True):
        with pytest.raises(UserError, match="steps"):
            MTTTLayer(8, 2, steps=steps)


# -- data -----------------------------------------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray, magic: int, truncate: int = 0) -> Path:
    raw = magic.to_bytes(4, "big") + b"".join(s.to_bytes(4, "big") for s in array.shape) + array.tobytes()
    path.write_bytes(gzip.compress(raw[: len(raw) - truncate]))
    return path


def test_idx_errors(tmp_path):
    images = np.arange(2 * 28 * 28, dtype=np.uint8).reshape(2, 28, 28)
    np.testing.assert_array_equal(read_idx(write_idx(tmp_path / "ok.gz", images, 0x803), "images"), images)
    with pytest.raises(UserError, match="magic number 0x00000801"):
        read_idx(write_idx(tmp_path / "labels.gz", images, 0x801), "images")
    with pytest.raises(UserError, match="truncated"):
        read_idx(write_idx(tmp_path / "cut.gz", images, 0x803, truncate=10), "images")
    (tmp_path / "broken.gz").write_bytes(b"not gzip at all")
    with pytest.raises(UserError, match="unreadable"):
        read_idx(tmp_path / "broken.gz", "images")
    with pytest.raises(UserError, match="not found"):
        ImageDataModule(source="fashion_mnist", folder=str(tmp_path)).prepare_data()
    with pytest.raises(UserError, match="does not exist"):
        ImageDataModule(source="fashion_mnist", folder=str(tmp_path / "absent")).prepare_data()


def test_patch_size_must_tile_the_image():
    with pytest.raises(
        UserError, match=r"data.patch_size=5 does not divide the 28x28 image; use one of \[1, 2, 4, 7"
    ):
        ImageDataModule(patch_size=5)
    with pytest.raises(UserError, match="14x14"):
        ImageDataModule(patch_size=4, image_size=14)
    assert ImageDataModule(patch_size=7, image_size=14).num_tokens == 4


def test_tokenise_patches_pixels_and_downsampling():
    images = torch.arange(2 * 4 * 4, dtype=torch.uint8).reshape(2, 4, 4)
    patches = tokenise(images, None, 2)
    assert patches.shape == (2, 4, 4)
    expected = images[0, :2, 2:].flatten().float() / 127.5 - 1  # the second patch: top right, row-major
    torch.testing.assert_close(patches[0, 1], expected)
    assert tokenise(images, None, 1).shape == (2, 16, 1)
    small = tokenise(images, 2, 1)  # 2x2 area average
    torch.testing.assert_close(small[0, 0, 0], images[0, :2, :2].float().mean() / 127.5 - 1)


def test_fashion_mnist_splits():
    if not (FASHION / "train-images-idx3-ubyte.gz").is_file():
        pytest.skip(
            f"Fashion-MNIST not found at {FASHION} (set TTT_BENCH_DATA_DIR to the folder holding "
            "fashion-mnist/)"
        )
    dm = ImageDataModule(source="fashion_mnist", folder=str(FASHION), patch_size=7, val_examples=5000)
    dm.prepare_data()
    assert {k: v["n_images"] for k, v in dm.meta.items()} == {
        "train": 55000,
        "validation": 5000,
        "test": 10000,
    }
    item = dm.val_dataset()[0]
    assert item["tokens"].shape == (16, 49) and 0 <= int(item["label"]) < 10
    again = ImageDataModule(source="fashion_mnist", folder=str(FASHION), patch_size=7, seed=5)
    again.prepare_data()  # the validation split depends on split_seed only
    assert torch.equal(again.val_dataset().images, dm.val_dataset().images)


# -- end to end -----------------------------------------------------------------------------------------

# Not conftest's TINY_IMAGE (one step to make a checkpoint): task=image's own model and size (MTTT-MLP,
# vit_xs) made smaller, trained for 20 steps to an accuracy above chance.
TINY_IMAGE = [
    "task=image",
    "size.n_layers=2",
    "size.d_model=32",
    "size.mlp_hidden=64",
    "recipe.batch_size=32",
    "recipe.total_images=640",
    "data.micro_batch_size=16",
    "data.synthetic_train=600",
    "data.synthetic_test=100",
    "data.val_examples=100",
    "data.patch_size=7",
    "eval_every_n_steps=10",
    "trainer.enable_progress_bar=false",
]


def test_train_image_end_to_end(tmp_path, one_thread):
    main(["train", *TINY_IMAGE, "model.mixer.steps=2", f"paths.runs={tmp_path}"])
    (metrics_path,) = tmp_path.rglob("metrics.json")
    metrics = json.loads(metrics_path.read_text())
    assert metrics["task"] == "image" and metrics["steps"] == 20 and metrics["images_seen"] == 640
    assert metrics["val_accuracy"] > 0.2 and 0 <= metrics["test_accuracy"] <= 1  # chance is 0.1
    rows = (metrics_path.parent / "inner_losses.csv").read_text().splitlines()
    assert rows[0] == "split,layer,step,inner_loss" and len(rows) == 1 + 2 * 2 * 3  # splits x layers x T+1
    losses = np.array([float(r.split(",")[3]) for r in rows[1:]]).reshape(2, 2, 3)
    assert (np.diff(losses, axis=-1) < 0).all(), losses  # on the trained model, every inner step lowers it
    ckpt = metrics_path.parent / "checkpoints" / "last.ckpt"
    assert ckpt.is_file()

    # eval reads an image checkpoint: the same accuracies and inner losses as the end of training
    main(["eval", f"ckpt_path={ckpt}", f"hydra.run.dir={tmp_path / 'eval'}"])
    evaluated = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    for key in ("val_accuracy", "test_accuracy", "val_loss", "test_loss"):
        assert evaluated[key] == pytest.approx(metrics[key], rel=1e-6), key
    assert (tmp_path / "eval" / "inner_losses.csv").read_text().splitlines()[0] == rows[0]
    # plot inner-loss draws an MTTT run's inner losses against the inner step
    inner_csv = metrics_path.parent / "inner_losses.csv"
    main(["plot", "inner-loss", str(inner_csv), "--out", str(tmp_path / "fig")])
    assert (tmp_path / "fig" / "inner_loss.png").stat().st_size > 0
    # generate needs a language model: one line and exit 2, no traceback
    with pytest.raises(SystemExit) as e:
        main(["generate", str(ckpt), "--prompt", "The"])
    assert e.value.code == 2


def test_image_task_errors(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY_IMAGE, "model=transformer", f"paths.runs={tmp_path}"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["train", *TINY_IMAGE, "model.mixer.steps=0", f"paths.runs={tmp_path}"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["train", "model=mttt_mlp", f"paths.runs={tmp_path}"])  # an image model without task=image
    assert e.value.code == 2


# -- sweeps, tables, claims -----------------------------------------------------------------------------


def test_mttt_sweeps_plan_and_compose(tmp_path):
    from ttt_bench.config import compose
    from ttt_bench.experiments import EXPERIMENTS

    for sweep, rows, seeds in (("mttt_patches", 6, 10), ("mttt_pixels", 6, 3), ("mttt_ablation", 4, 10)):
        runs = EXPERIMENTS[sweep].plan("cpu", str(tmp_path))
        assert len(runs) == seeds * rows and all("data=fashion_mnist" in r.overrides for r in runs.values())
        assert EXPERIMENTS[sweep].parts("cpu") == (2 if seeds == 10 else 1)  # two committed parts of 5 seeds
        smoke = EXPERIMENTS[sweep].plan("smoke")
        for run in list(smoke.values())[:2]:
            cfg = compose("train", run.overrides)
            assert cfg.task.name == "image" and cfg.data.name == "synthetic_images"


def fake_registry(accuracies: dict, seeds: int = 3):
    import pandas as pd

    rows = []
    for i, (config, acc) in enumerate(accuracies.items()):
        for s in range(seeds):
            rows.append(
                {
                    "run": f"{config}-s{s}",
                    "config": config,
                    "seed": s,
                    "status": "finished",
                    "label": config,
                    "reference": "linear_attention",
                    "test_accuracy": acc + 0.002 * s,
                    "params": 1e5 * (i + 1),
                    "forward_flops_per_image": 1e6 * (i + 1),
                    "paper_acc": None,
                    "paper_params_m": None,
                    "paper_flops": None,
                }
            )
    return pd.DataFrame(rows)


@pytest.mark.slow  # trains the table's runs: 8 s
def test_mttt_table_and_claims():
    import pandas as pd

    from ttt_bench.experiments import EXPERIMENTS
    from ttt_bench.experiments.engine.report import Results
    from ttt_bench.experiments.engine.verdicts import judge_all
    from ttt_bench.experiments.mttt import mttt_table

    claims = [c for e in EXPERIMENTS.values() for c in e.claims]

    patches = fake_registry(
        {
            "linear_attention": 0.70,
            "linear_attention_identity": 0.71,
            "mttt_linear": 0.71,
            "mttt_mlp": 0.74,
            "mttt_mlp_t4": 0.75,
            "self_attention": 0.76,
        }
    )
    table, md = mttt_table(patches)
    assert table["flops_rel"].tolist() == [1, 2, 3, 4, 5, 6] and "| mttt_mlp | 74.20" in md
    pixels = fake_registry({"linear_attention": 0.50, "mttt_mlp": 0.60, "mttt_mlp_sgd4": 0.63})
    registries = {("mttt_patches", "registry.csv"): patches, ("mttt_pixels", "registry.csv"): pixels}
    verdicts = judge_all(claims, Results(frames=registries)).set_index("id")
    assert verdicts.loc["mttt.linear_equivalence", "verdict"] == "holds"
    assert verdicts.loc["mttt.mlp_beats_linear_attention", "verdict"] == "holds"
    assert verdicts.loc["mttt.pixels_gap", "verdict"] == "holds"
    assert verdicts.loc["mttt.ablation_ln", "verdict"] == "not measured"
    linear = pd.DataFrame({"floor": ["linear classifier on the pixels"], "test_acc": [72.0]})
    frames = {("mttt_patches", "registry.csv"): patches, ("mttt_patches", "image_floors.csv"): linear}
    v = judge_all(claims, Results(frames=frames)).set_index("id")
    assert v.loc["mttt.mlp_beats_linear_attention", "verdict"] == "under-trained"  # linear attention <= 72%
    assert "do not beat the linear classifier on the pixels (72.0%): under-trained" in \
        v.loc["mttt.mlp_beats_linear_attention", "evidence"]
    assert v.loc["mttt.more_steps", "verdict"] == "holds"  # both rows above the floor
    frames = {**registries, ("mttt_pixels", "image_floors.csv"): linear.assign(test_acc=55.0)}
    v = judge_all(claims, Results(frames=frames)).set_index("id")  # pixels' linear attention <= 55%
    assert v.loc["mttt.pixels_gap", "verdict"] == "under-trained"  # the gap reads the pixel runs too
    assert "do not beat the linear classifier on the pixels (55.0%)" in v.loc["mttt.pixels_gap", "evidence"]


def test_image_floors_on_the_runs_own_split():
    from ttt_bench.experiments.mttt import floors_text, image_floors, mttt_table

    floors = image_floors(["task=image", "data=synthetic_images", "model=mttt_mlp"])
    assert floors["majority class"] < 20 < floors["linear classifier on the pixels"] <= 100
    table, _ = mttt_table(fake_registry({"linear_attention": 0.10, "mttt_mlp": 1.0}))
    assert "Under-trained** (not above the linear floor): linear_attention." in floors_text(floors, table)



def test_every_image_split_is_checked_against_the_geometry_the_model_reads(tmp_path):
    """A test split of another size would be scored by a model of another token count: a one-line error
    naming the split."""
    rng = np.random.default_rng(0)
    labels = lambda n: rng.integers(0, 10, n, dtype=np.uint8)
    for name, shape in (("train-images-idx3-ubyte", (40, 28, 28)), ("t10k-images-idx3-ubyte", (8, 32, 32))):
        write_idx(tmp_path / f"{name}.gz", rng.integers(0, 255, shape, dtype=np.uint8), 0x803)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels(40), 0x801)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", labels(8), 0x801)
    with pytest.raises(UserError, match=r"^test images in .* are 32x32, data.native_size says 28; give"):
        ImageDataModule(source="fashion_mnist", folder=str(tmp_path), val_examples=8).prepare_data()
