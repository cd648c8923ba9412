"""MQAR (ttt_bench/data/mqar.py): the generator's semantics, determinism and cache; the loss mask in LitLM;
a small Transformer learning the task end to end."""

import csv
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from ttt_bench.config import compose
from ttt_bench.data.mqar import (
    MQARDataModule,
    MQARSequences,
    generate,
    query_slots,
    slot_probabilities,
    weighted_draws,
)
from ttt_bench.data.tokenizers import from_spec
from ttt_bench.errors import UserError
from ttt_bench.training.module import LitLM, masked_loss

V, N, T = 64, 4, 32
OPTS = dict(vocab_size=V, num_kv_pairs=N, seq_len=T)


def small(n: int = 512, **kw):
    return generate(n, **{**OPTS, **kw})


def test_answers_are_the_paired_values_and_the_mask_covers_exactly_them():
    tokens, queries = small(n=1000)
    assert tokens.shape == (1000, T + 1) and queries.shape == (1000, N)
    tokens = tokens.astype(np.int64)
    keys, values = tokens[:, 0 : 2 * N : 2], tokens[:, 1 : 2 * N : 2]
    assert ((1 <= keys) & (keys < V // 2)).all() and ((V // 2 <= values) & (values < V)).all()
    for row_keys, row_values in zip(keys, values):
        assert len(set(row_keys)) == N and len(set(row_values)) == N  # distinct within a sequence
    rows = np.arange(1000)[:, None]
    # query i at an even offset of the query region, holding key i; its target (next token) is value i
    assert (queries >= 2 * N).all() and (queries <= T - 1).all() and ((queries - 2 * N) % 2 == 0).all()
    assert (tokens[rows, queries] == keys).all() and (tokens[rows, queries + 1] == values).all()
    assert all(len(set(q)) == N for q in queries)
    # the datamodule's loss mask marks those positions, and nothing else
    dm = MQARDataModule(**OPTS, train_examples=1000, val_examples=10, micro_batch_size=8)
    ds = dm.train_dataset()
    for i in (0, 1, 999):
        item, mask = ds[i], ds.loss_mask(i)
        assert item.dtype == torch.int64 and item.shape == (T + 1,) and mask.shape == (T,)
        assert mask.nonzero().flatten().tolist() == sorted(queries[i].tolist())
        targets = item[1:][mask]
        assert sorted(targets.tolist()) == sorted(values[i].tolist())
        assert torch.equal(item, torch.from_numpy(tokens[i]))


def test_non_query_positions_carry_noise_or_the_filler():
    tokens, queries = small(n=200, random_non_queries=False)
    region = tokens[:, 2 * N :].astype(np.int64).copy()
    np.put_along_axis(region, queries - 2 * N, 0, axis=1)
    np.put_along_axis(region, queries - 2 * N + 1, 0, axis=1)
    assert (region == 0).all()  # filler everywhere but the queries and answers
    noisy, _ = small(n=200)
    assert len(np.unique(noisy[:, 2 * N :])) > V // 2  # random tokens of the whole vocabulary


def test_deterministic_per_seed_and_split_and_a_prefix_of_a_larger_split():
    a, qa = small(n=300)
    b, qb = small(n=300)
    assert np.array_equal(a, b) and np.array_equal(qa, qb)
    c, _ = small(n=300, seed=1)
    v, _ = small(n=300, split="validation")
    assert not np.array_equal(a, c) and not np.array_equal(a, v)
    big, qbig = generate(5000, **OPTS, seed=0)  # more than one chunk: the first 300 are the same
    assert np.array_equal(big[:300], a) and np.array_equal(qbig[:300], qa)


def test_query_distance_distribution():
    space = query_slots(256, 16)
    assert space == 112
    rng = np.random.default_rng(0)
    for power_a in (0.01, 1.0):  # successive draws without replacement: the first follows p itself
        p = slot_probabilities(space, power_a)
        first = weighted_draws(rng, 40_000, 16, p)[:, 0]
        freq = np.bincount(first, minlength=space) / len(first)
        assert np.abs(freq - p).max() < 0.01
    near = generate(2000, 8192, 16, 256, power_a=0.01)[1]
    uniform = generate(2000, 8192, 16, 256, power_a=1.0)[1]
    slot = lambda q: (q - 32) // 2
    assert np.median(slot(near)) < 25 and abs(np.median(slot(uniform)) - 55.5) < 4
    # uniform: every slot equally likely to hold a query (16 of 112)
    counts = np.bincount(slot(uniform).flatten(), minlength=space) / 2000
    assert np.abs(counts - 16 / space).max() < 0.05
    d = generate(2000, 8192, 16, 256, power_a=0.01)
    key_pos = np.arange(16) * 2
    assert (d[1] - key_pos).mean() < (uniform - key_pos).mean()  # query distances shorter


def test_bad_options_are_user_errors():
    with pytest.raises(UserError, match="too short"):
        generate(1, vocab_size=64, num_kv_pairs=8, seq_len=16)
    with pytest.raises(UserError, match="vocab_size"):
        generate(1, vocab_size=8, num_kv_pairs=4, seq_len=64)
    with pytest.raises(UserError, match="power_a"):
        generate(1, vocab_size=64, num_kv_pairs=4, seq_len=64, power_a=0)


def test_datamodule_cache_batches_and_surface(tmp_path):
    kw = dict(**OPTS, train_examples=100, val_examples=20, micro_batch_size=8, cache_dir=str(tmp_path))
    dm = MQARDataModule(**kw)
    dm.prepare_data()
    files = sorted(p.name for p in (tmp_path / "mqar").iterdir())
    assert len(files) == 4 and all(f.endswith(".npy") for f in files)  # tokens + queries per split
    again = MQARDataModule(**kw)
    again.prepare_data()  # from the cache, memory-mapped
    assert isinstance(again.data["train"][0], np.memmap)
    assert np.array_equal(again.data["train"][0], dm.data["train"][0])
    assert len(list((tmp_path / "mqar").iterdir())) == 4
    other = MQARDataModule(**{**kw, "power_a": 1.0})
    other.prepare_data()
    assert len(list((tmp_path / "mqar").iterdir())) == 8  # keyed by every option
    assert dm.vocab_size == V and dm.build_tokenizer().spec == {"kind": "mqar", "vocab_size": V}
    assert dm.bytes_per_token() == 1.0 and dm.meta["validation"]["n_answers"] == 20 * N
    assert len(dm.val_dataset()) == 20 and len(dm.val_dataset(max_tokens=5 * T)) == 5
    batch = next(iter(dm.val_dataloader()))
    assert batch["tokens"].shape == (8, T + 1) and batch["loss_mask"].shape == (8, T)
    assert batch["loss_mask"].sum().item() == 8 * N
    dm.samples_per_step = 8
    train_batch = next(iter(dm.train_dataloader()))
    assert train_batch["loss_mask"].dtype == torch.bool and train_batch["tokens"].dtype == torch.int64


@pytest.fixture(scope="module")
def lit():
    cfg = compose("train", ["model=transformer", "size=xs", "size.n_layers=1", f"data.seq_len={T}"])
    torch.manual_seed(0)
    model_cfg, recipe = (OmegaConf.to_container(c, resolve=True) for c in (cfg.model, cfg.recipe))
    return LitLM(model_cfg, recipe, vocab_size=V, tokenizer={"kind": "mqar", "vocab_size": V}).eval()


def test_loss_mask_in_the_module(lit):
    dm = MQARDataModule(**OPTS, train_examples=16, val_examples=16, micro_batch_size=16)
    batch = next(iter(dm.val_dataloader()))
    tokens, mask = batch["tokens"], batch["loss_mask"]
    with torch.no_grad():
        logits = lit.model(tokens[:, :-1])
        # by hand: the mean cross-entropy of the answers, and argmax accuracy
        answers = mask.nonzero().tolist()
        by_hand = [F.cross_entropy(logits[b, t][None], tokens[b, t + 1][None]) for b, t in answers]
        hits = [float(logits[b, t].argmax() == tokens[b, t + 1]) for b, t in answers]
        loss, accuracy, positions = lit.loss_and_accuracy(batch)
        assert positions.item() == 16 * N and len(by_hand) == 16 * N
        assert loss.item() == pytest.approx(torch.stack(by_hand).mean().item(), rel=1e-5)
        assert accuracy.item() == pytest.approx(sum(hits) / len(hits))
        assert lit.loss(batch).item() == loss.item()
        # no mask: the old loss over every target, bitwise; dict without a mask is the same batch
        old = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        assert torch.equal(lit.loss(tokens), old) and torch.equal(lit.loss({"tokens": tokens}), old)
        assert lit.loss_and_accuracy(tokens)[1:] == (None, None)
        # reduction none: per position, zero off the mask; sum: the masked sum
        per = lit.loss(batch, reduction="none").view(16, T)
        assert (per[~mask] == 0).all() and per[mask].mean().item() == pytest.approx(loss.item(), rel=1e-5)
        assert lit.loss(batch, reduction="sum").item() == pytest.approx(per.sum().item(), rel=1e-5)
    # an unmasked target (the last token of a row without a query at T - 1: a target, never an input) does
    # not count; in the full loss it does
    row = int((~mask[:, -1]).nonzero()[0])
    changed = tokens.clone()
    changed[row, -1] = (changed[row, -1] + 1) % V
    with torch.no_grad():
        assert torch.equal(lit.loss({"tokens": changed, "loss_mask": mask}), loss)
        assert not torch.equal(lit.loss(changed), old)


def test_masked_loss_with_an_empty_mask_is_zero_with_gradient():
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets, mask = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.bool)
    loss, accuracy, count = masked_loss(logits, targets, mask)
    loss.backward()
    assert loss.item() == 0 and count.item() == 0 and (logits.grad == 0).all()


# The recipe of docs/recall.md: a 2-layer width-64 Transformer++ learns 4-pair MQAR (vocab 64, length 32) in
# 600 steps of 64 sequences. Its keys: one head of width 64, and init_std 0.05 (0.02 sits on the plateau of
# "one of the values in context", ~27% accuracy, for 1000+ steps); the small MLP only halves the step time.
RECIPE = [
    "data=mqar", "model=transformer", "size=xs", "size.n_layers=2", "size.n_heads=1", "size.mlp_hidden=32",
    "+model.init_std=0.05", "size.lr=3e-3", "trainer.max_steps=600",
    "data.vocab_size=64", "data.num_kv_pairs=4", "data.seq_len=32",
    "data.train_examples=20000", "data.val_examples=512", "data.micro_batch_size=64",
    "recipe.tokens_per_batch=2048", "trainer.enable_progress_bar=false",
]


@pytest.mark.slow
def test_a_small_transformer_learns_mqar(tmp_path, one_thread):
    from ttt_bench.training.train import train

    cfg = compose("train", [*RECIPE, "eval_every_n_steps=600", "checkpoint_every_n_steps=600",
                            f"paths.cache={tmp_path / 'cache'}"])
    start = time.perf_counter()
    metrics = train(cfg, tmp_path / "run")
    seconds = time.perf_counter() - start
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    accuracy = [float(r["val/accuracy"]) for r in rows if r.get("val/accuracy")]
    assert len(accuracy) == 1 and accuracy[0] > 0.95, (accuracy, seconds)
    assert metrics["steps"] == 600 and metrics["tokens_seen"] == 600 * 2048
    assert metrics["val_accuracy"] == pytest.approx(accuracy[0], abs=1e-6)  # evaluate() reads the same mask
    assert metrics["val_tokens"] == 512 * 4  # the answer positions only


def test_a_training_mixture_of_pair_counts():
    """data.train_num_kv_pairs: every chunk holds the numbers of pairs in equal parts, each sequence's mask
    covers exactly its own answers (query positions padded with -1), and validation keeps num_kv_pairs."""
    seqs = MQARSequences(*generate(4096, 64, 8, 32, mixture=[2, 8], seed=3))
    pairs = (seqs.queries >= 0).sum(1)
    assert seqs.queries.shape == (4096, 8) and set(pairs[:2048]) == {2} and set(pairs[2048:]) == {8}
    for i in (0, 4095):
        mask, t = seqs.loss_mask(i), seqs[i]
        n = int(mask.sum())
        assert n in (2, 8)
        keys, values = t[0 : 2 * n : 2].tolist(), t[1 : 2 * n : 2].tolist()
        for q in mask.nonzero().flatten().tolist():
            assert t[q + 1].item() == values[keys.index(t[q].item())]


def test_checkpoints_rebuild_the_mqar_vocabulary():
    vocab = MQARDataModule(vocab_size=64, num_kv_pairs=4, seq_len=32).build_tokenizer()
    again = from_spec(vocab.spec)
    assert again.vocab_size == 64 and again.decode(again.encode("3 40 7")) == "3 40 7"
