"""Table 1's ladder (conf/sweep/table1.yaml) as the sweep plans it: Theorem 1 between rows 2 and 3, and
consecutive rows that differ in exactly their documented change."""

import lightning as L
import pytest
import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from tests.conftest import rel_err
from ttt_bench.config import compose
from ttt_bench.experiments.table1 import EXPERIMENT as TABLE1

VOCAB = 256


def resolved(overrides: list[str]) -> dict:
    return OmegaConf.to_container(compose("train", overrides), resolve=True)


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
    return out


@pytest.fixture(scope="module")
def ladder() -> list[dict]:
    """The rows of the cpu profile (one seed), in order."""
    runs = TABLE1.plan("cpu")
    return [r for r in runs.values() if r.seed == 0 and r.info["row"] is not None]


def build(run):
    cfg = compose("train", run.overrides)
    L.seed_everything(cfg.seed)
    return instantiate(cfg.model, vocab_size=VOCAB).float()


def test_ttt_equivalence_row_is_improved_linear_attention(ladder):
    """Theorem 1, from the sweep's own configs and seed: outputs and every gradient agree (fp32)."""
    la_spec, ttt_spec = ladder[1], ladder[2]
    assert (la_spec.label, ttt_spec.label) == ("Linear attn. improved", "TTT equivalence")
    la, ttt = build(la_spec), build(ttt_spec)
    pairs = list(zip(la.parameters(), ttt.parameters(), strict=True))  # attn.* <-> ttt.*, in order
    assert all(torch.equal(p, q) for p, q in pairs)  # the same seed gives the same weights
    ids = torch.randint(0, VOCAB, (2, 128), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (la, ttt):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
        outs.append(logits)
    assert rel_err(outs[1], outs[0]) <= 1e-5
    for (name, p), q in zip(la.named_parameters(), ttt.parameters(), strict=True):
        assert rel_err(q.grad, p.grad) <= 1e-5, name


def test_consecutive_rows_differ_in_exactly_their_change(ladder):
    """Each row with a `change` resolves to the row above with exactly the changed keys different."""
    for above, row in zip(ladder, ladder[1:]):
        if not row.info["change"]:  # a new model (Theorem 1): checked by the test above
            continue
        a, b = flat(resolved(above.overrides)), flat(resolved(row.overrides))
        differ = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
        changed = {c.split("=", 1)[0] for c in row.info["change"].split()}
        assert differ == changed, (row.label, differ ^ changed)


def test_last_row_is_ttt_linear_and_references_share_the_budget(ladder):
    runs = TABLE1.plan("cpu")
    base = [o for o in ladder[-1].overrides if not o.startswith("model")]
    last = resolved(ladder[-1].overrides)["model"]
    assert last == resolved([*base, "model=ttt_linear"])["model"]
    for ref in ("transformer-s0", "mamba-s0"):
        assert [o for o in runs[ref].overrides if not o.startswith("model")] == base
    profile = TABLE1.sweep["profiles"]["cpu"]
    assert len(runs) == (len(ladder) + 2) * TABLE1.seeds("cpu") + len(profile["etas"]) * profile["eta_seeds"]


def test_the_eta_sweep_changes_only_the_step_size_of_its_row(ladder):
    """eta-<eta> is the mini-batch row with eta_base = eta * head_dim, nothing else."""
    runs = TABLE1.plan("cpu")
    row = next(r for r in ladder if r.config.endswith("-minibatch"))
    a = flat(resolved(row.overrides))
    for eta in TABLE1.sweep["profiles"]["cpu"]["etas"]:
        b = flat(resolved(runs[f"eta-{eta:g}-s0"].overrides))
        assert {k for k in a if a[k] != b.get(k)} == {"model.block.eta_base"}
        assert b["model.block.eta_base"] / (b["size.d_model"] // b["size.n_heads"]) == eta


def test_learnable_eta_starts_where_the_fixed_row_was(ladder):
    """The step-size rows change one thing each: '+ learnable eta' makes eta learnable at about the value of
    the row above at initialisation (eta_base sigmoid(~0) ~ the authors' fixed 0.5), and the authors' scale
    row moves Theorem 1's eta = 1 to 1 / (2 head_dim)."""
    names = [r.config.split("-", 1)[1] for r in ladder]
    fixed, learnable = (build(ladder[names.index(n)]) for n in ("minibatch", "learnable_eta"))
    x = torch.randn(2, 16, 64)  # size xs: d_model 64
    lrs = [m.blocks[0].ttt.inner_lr(x) for m in (fixed, learnable)]
    ratio = lrs[1] / lrs[0]  # theta_lr starts near 0 (normal, std 0.02, as the authors'): sigmoid ~ 1/2
    assert abs(ratio.mean().item() - 1) < 0.05 and torch.allclose(lrs[1], lrs[0], rtol=0.3)
    theorem, authors = (build(ladder[names.index(n)]).blocks[0].ttt
                        for n in ("ttt_equivalence", "authors_eta"))
    assert theorem.inner_lr(x).unique().tolist() == [1.0]
    assert authors.inner_lr(x).unique().tolist() == [0.5 / authors.head_dim]


def test_the_equivalent_rows_train_the_same_way(ladder):
    """Theorem 1's two rows stay the same model under training, not only at initialisation: five AdamW steps
    with the recipe's parameter groups (weight decay on matrices only) and gradient clipping, in float64,
    leave every parameter equal. (In float32 the runs part after the first step: AdamW scales each gradient
    entry by its own magnitude, so rounding noise in near-zero entries becomes a step of the full learning
    rate; training then amplifies the difference as it would a change of seed.)"""
    la, ttt = (build(r).double() for r in ladder[1:3])
    g = torch.Generator().manual_seed(1)
    opts = [torch.optim.AdamW([{"params": [p for p in m.parameters() if p.dim() >= 2], "weight_decay": 0.1},
                               {"params": [p for p in m.parameters() if p.dim() < 2], "weight_decay": 0.0}],
                              lr=3e-3, betas=(0.9, 0.95)) for m in (la, ttt)]
    for _ in range(5):
        ids = torch.randint(0, VOCAB, (2, 65), generator=g)
        for model, opt in zip((la, ttt), opts, strict=True):
            opt.zero_grad()
            logits = model(ids[:, :-1])
            torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    for (name, p), q in zip(la.named_parameters(), ttt.parameters(), strict=True):
        assert rel_err(q, p) <= 1e-9, name
