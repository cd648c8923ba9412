"""Verdict rules a statistician accepts (issue 47, point 2) and one table of verdicts for the whole
reproduction (point 5), on made-up Differences, registries and profile folders: equivalence by two one-sided
tests, the a-priori margin, the MDE at 80% power and the seeds an underpowered claim would need, Table 1's
largest gain judged on its ladder's runs only, checks counted apart from claims, the range a claim was judged
on, and results/REPORT.md."""

import json

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ttt_bench.experiments import EXPERIMENTS
from ttt_bench.experiments.engine import combined, report
from ttt_bench.experiments.engine.experiment import Experiment
from ttt_bench.experiments.engine.stats import POWER, Difference, difference
from ttt_bench.experiments.engine.verdicts import (
    CHECK,
    CLAIM,
    FAILS,
    HOLDS,
    INCONCLUSIVE,
    UNDERPOWERED,
    UNDERTRAINED,
    Claim,
    Verdict,
    compare,
    judge_all,
    status_of,
)

CLAIMS = {c.id: c for e in EXPERIMENTS.values() for c in e.claims}


def interval(lo: float, hi: float) -> Difference:
    """A made-up difference with just an interval (what status_of reads)."""
    return Difference((lo + hi) / 2, lo, hi, 5, 5, paired=True, sd_d=1.0)


# ---- a. equivalence: two one-sided tests on the 95% interval ----


def test_equivalence_holds_inside_the_margin_even_where_the_interval_excludes_0():
    # reference 10, margin 1% = +-0.1
    assert status_of(interval(0.02, 0.08), "=", 10.0, 0.01) == HOLDS  # excludes 0, inside the margin
    assert status_of(interval(-0.05, 0.05), "=", 10.0, 0.01) == HOLDS
    assert status_of(interval(0.05, 0.15), "=", 10.0, 0.01) == INCONCLUSIVE  # straddles +margin
    assert status_of(interval(-0.3, 0.3), "=", 10.0, 0.01) == INCONCLUSIVE  # wider than the margin
    assert status_of(interval(0.12, 0.3), "=", 10.0, 0.01) == FAILS  # entirely beyond +margin
    assert status_of(interval(-0.3, -0.11), "=", 10.0, 0.01) == FAILS  # entirely beyond -margin
    assert status_of(Difference(0.0, None, None, 1, 1), "=", 10.0, 0.01) == INCONCLUSIVE  # one seed


def test_equivalence_straddling_the_margin_is_underpowered_with_the_seeds_that_would_fit_it():
    """Paired seeds whose differences all lie near +0.05 (reference 10, margin +-0.1): the interval
    excludes 0 and lies inside the margin, so equal; the same mean with a wider spread straddles the margin:
    underpowered, naming the seeds whose interval would fit inside it; a mean outside the margin is not
    underpowered (more seeds would not show equality)."""
    b = pd.DataFrame({"seed": range(4), "v": [10.0, 10.5, 9.5, 10.0]})
    tight = b.assign(v=b["v"] + [0.05, 0.06, 0.04, 0.05])
    v = compare(tight, b, ("a", "b"), "=", None, value="v", margin=0.01, margin_source="set a priori here")
    assert v.numbers["ci"][0] > 0 and v.status == HOLDS
    assert "inside the equivalence margin +-0.1 (1.00% of b, set a priori here)" in v.sentence

    wide = b.assign(v=b["v"] + [0.05, 0.2, -0.1, 0.05])
    v = compare(wide, b, ("a", "b"), "=", None, value="v", margin=0.01, margin_source="set a priori here")
    assert v.status == UNDERPOWERED and "set a priori here" in v.sentence
    d = difference(wide["v"], b["v"], paired=True)
    n = v.numbers["seeds_needed"]
    assert f"{n} pairs of seeds would fit it inside the margin" in v.sentence
    half = lambda k: stats.t.ppf(0.975, k - 1) * d.sd_d / np.sqrt(k)
    assert abs(d.mean) + half(n) <= 0.1 < abs(d.mean) + half(n - 1)  # the fewest such seeds

    off = b.assign(v=b["v"] + [0.15, 0.3, 0.0, 0.15])  # mean +0.15, outside the margin; interval straddles
    v = compare(off, b, ("a", "b"), "=", None, value="v", margin=0.01)
    assert v.status == INCONCLUSIVE and "more seeds would not show equivalence" in v.sentence

    apart = b.assign(v=b["v"] + [0.5, 0.52, 0.48, 0.5])
    v = compare(apart, b, ("a", "b"), "=", None, value="v", margin=0.01)
    assert v.status == FAILS and "outside the equivalence margin" in v.sentence


# ---- b. the a-priori margin, from the sweep ----


class Swept(Experiment):
    name = "swept"
    definition = {"name": "swept", "equivalence_margin": 0.02, "profiles": {"cpu": {}}}


def test_equivalence_margin_comes_from_the_sweep_and_is_named_with_its_source():
    margin, source = Swept().equivalence_margin
    assert margin == 0.02 and source == "set a priori in conf/sweep/swept.yaml: equivalence_margin 0.02"
    bare = Swept()
    bare.definition = {"name": "swept", "profiles": {"cpu": {}}}
    assert bare.equivalence_margin == (None, None)  # the default EQUIVALENCE_MARGIN then
    table1 = EXPERIMENTS["table1"]
    assert table1.equivalence_margin[0] == 0.01 and table1.margin() == 0.01
    b = pd.DataFrame({"seed": range(3), "v": [10.0, 10.1, 9.9]})
    v = compare(b.assign(v=b["v"] + 0.3), b, ("a", "b"), "=", None, value="v")
    assert "the default margin, EQUIVALENCE_MARGIN" in v.sentence and v.numbers["margin"] == 0.05


# ---- c. the MDE at 80% power, and the seeds an underpowered claim needs ----


def test_mde_is_at_80_percent_power_and_seeds_to_detect_inverts_it():
    d = Difference(0.1, -0.5, 0.7, 5, 5, paired=True, sd_d=0.5)
    se = 0.5 / np.sqrt(5)
    assert POWER == 0.8
    assert d.mde == pytest.approx((stats.t.ppf(0.975, 4) + stats.t.ppf(0.8, 4)) * se)
    mde = lambda n: (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * 0.5 / np.sqrt(n)
    n = d.seeds_to_detect(0.2)
    assert mde(n) <= 0.2 < mde(n - 1)
    assert d.seeds_to_detect(100.0) == 2 and d.seeds_to_detect(0.0) is None
    assert Difference(0.1, None, None, 1, 1).mde is None  # one seed
    # Welch: the interval's half-width is t_.975 on Welch-Satterthwaite's df, as scipy's
    w = difference([1.0, 2.0, 3.5, 4.0], [1.5, 2.2, 3.1])
    se, df = w.se_at(4, 3)
    assert stats.t.ppf(0.975, df) * se == pytest.approx((w.hi - w.lo) / 2)
    assert w.mde == pytest.approx((stats.t.ppf(0.975, df) + stats.t.ppf(0.8, df)) * se)
    assert "MDE" in w.text() and "at 80% power" in w.text()


def test_an_underpowered_claim_names_the_seeds_it_needs_and_prints_the_mde_beside_the_paper_effect():
    a = pd.DataFrame({"seed": [0, 1, 2], "v": [10.0, 10.6, 9.5]})
    b = a.assign(v=[10.1, 10.0, 10.2])
    v = compare(a, b, ("a", "b"), "<", None, value="v", paper_effect=0.02)
    d = difference(a["v"], b["v"], paired=True)
    n = d.seeds_to_detect(0.02 * b["v"].mean())
    assert v.status == UNDERPOWERED and v.numbers["seeds_needed"] == n
    assert f"{n} pairs of seeds would detect the paper's effect at this seed spread" in v.sentence
    assert f"the MDE at 80% power is {d.mde:.3f}" in v.sentence
    seen = compare(a, b, ("a", "b"), "<", None, value="v", paper_effect=0.5)  # big enough to see
    assert seen.status == INCONCLUSIVE and f"against our MDE {d.mde:.3f} at 80% power" in seen.sentence


# ---- d. Table 1's largest gain: under-trained on its ladder's runs only ----

LADDER = ["linear_attention", "linear_attention_improved", "ttt_equivalence", "authors_eta", "learnable_w0",
          "inner_bias", "ln_residual", "token_scaling", "minibatch", "learnable_eta", "mamba_backbone"]
MEANS = [12.0, 11.5, 11.5, 11.5, 11.6, 11.6, 10.5, 10.4, 9.0, 8.7, 8.0]


def ladder_registry(eta_ppl: float) -> pd.DataFrame:
    rng = np.random.default_rng(0)
    run = lambda config, seed, ppl, **kw: {"run": f"{config}-s{seed}", "config": config, "seed": seed,
                                           "label": config, "status": "finished", "role": "pile",
                                           "seq_len": 128, "val_ppl": ppl, **kw}
    rows = [run(f"{i + 1}-{name}", s, m + 0.05 * rng.standard_normal(), row=i + 1)
            for i, (name, m) in enumerate(zip(LADDER, MEANS, strict=True)) for s in range(3)]
    rows += [run("eta-1", s, eta_ppl, row=None, eta=1.0) for s in range(2)]  # the step-size sweep
    rows += [run("transformer", s, 9.0, row=None) for s in range(3)]  # a reference
    return pd.DataFrame(rows)


def test_largest_gain_is_judged_when_only_an_eta_sweep_run_is_under_its_floor():
    floors = pd.DataFrame({"role": ["pile"], "seq_len": [128], "floor": ["3-gram (Witten-Bell)"],
                           "val_ppl": [14.0]})
    frames = lambda eta: {("table1", "registry.csv"): ladder_registry(eta), ("table1", "floors.csv"): floors}
    v = CLAIMS["table1.largest_gain"].judge(report.Results(frames=frames(20.0)))  # eta-1 above the floor
    assert v.status == HOLDS and "under-trained" not in v.sentence
    broken = ladder_registry(9.0)
    broken.loc[broken["run"] == "9-minibatch-s0", "val_ppl"] = 15.0  # a ladder run above its floor
    r = report.Results(frames={("table1", "registry.csv"): broken, ("table1", "floors.csv"): floors})
    v = CLAIMS["table1.largest_gain"].judge(r)
    assert v.status == UNDERTRAINED and "1 runs do not beat" in v.sentence


# ---- e. checks apart from claims ----


def test_calibration_and_budget_rows_are_checks_counted_apart():
    checks = {i for i, c in CLAIMS.items() if c.kind == CHECK}
    assert checks == {"budgets", "recall.calibration"}
    assert all(c.kind == CLAIM for i, c in CLAIMS.items() if i not in checks)
    fixed = lambda status, p=None: (lambda r: Verdict(status, "s", {} if p is None else {"p": p}))
    claims = [Claim("t.a", "T", "a", fixed(HOLDS, 0.04)), Claim("t.b", "T", "b", fixed(FAILS)),
              Claim("t.c", "T", "c", fixed(HOLDS, 0.03), kind=CHECK),
              Claim("t.d", "T", "d", fixed(INCONCLUSIVE), kind=CHECK)]
    table = judge_all(claims, None)
    assert table["kind"].tolist() == [CLAIM, CLAIM, CHECK, CHECK]
    assert table.set_index("id").loc["t.a", "verdict"] == HOLDS  # the check's p is not in its Holm family
    counts = "2 claims: 1 holds, 1 does not hold; 2 checks: 1 holds, 1 inconclusive."
    assert report.status_counts(table) == counts
    no_kinds = "4 claims: 2 holds, 1 does not hold, 1 inconclusive."  # an older claims.csv: all claims
    assert report.status_counts(table.drop(columns="kind")) == no_kinds


# ---- f. a claim names the range it was judged on ----


def test_figure8_trend_names_the_range_of_b_it_is_judged_on():
    text = CLAIMS["fig8.trend"].claim
    smallest = min(int(b) for b in EXPERIMENTS["minibatch"].sweep["profiles"]["cpu"]["mini_batch_sizes"]
                   if b != "T")
    assert smallest == 4 and "judged on b >= 4 to T" in text and "b = 1 to T" in text


# ---- one table of verdicts: results/REPORT.md ----


def toy_claim(cid: str, a: str, b: str, kind: str = CLAIM) -> Claim:
    def judge(r):
        reg = r.csv("toy")
        if reg is None:
            return Verdict("not measured", "no runs")
        return compare(reg[reg["config"] == a], reg[reg["config"] == b], (a, b), "<", None)

    return Claim(cid, "Toy", f"{a} is below {b}.", judge, kind)


class Toy(Experiment):
    name = "toy"
    definition = {"name": "toy", "profiles": {"cpu": {}, "gpu": {}}}

    @property
    def claims(self):
        return [toy_claim("toy.both", "a", "b"), toy_claim("toy.cpu_only", "a", "c"),
                toy_claim("toy.check", "a", "b", kind=CHECK)]


def profile_folder(root, profile: str, means: dict, size: str, seq_len: int, tokens: int,
                   noisy: str = "") -> None:
    folder = root / profile / "toy"
    folder.mkdir(parents=True)
    rows = [{"run": f"{c}-s{s}", "config": c, "seed": s, "status": "finished", "size": size,
             "seq_len": seq_len, "tokens_seen": tokens, "role": "pile", "corpus": "pile-mini",
             "val_ppl": m + [0.0, 0.05, -0.05][s] * (1 + (c == noisy) * 40)}
            for c, m in means.items() for s in range(3)]
    pd.DataFrame(rows).to_csv(folder / "registry.csv", index=False)
    (folder / "step.json").write_text(json.dumps({"hardware": f"{profile} machine", "wall_time_s": 1}))


def bench(models_ms: dict, batch: int, device: str, **conditions) -> pd.DataFrame:
    """A latency benchmark as `ttt-bench bench models` writes it: warmed up, 3 repeats 2% apart, on an
    otherwise idle machine (`conditions` override any of these)."""
    taken = {"repeats": 3, "spread": 0.02, "busy_cores_during": 0.1, "loaded_during": False, **conditions}
    return pd.DataFrame([{"model": m, "context": c, "phase": "prefill", "batch": batch,
                          "latency_ms_per_token": ms, "device": device, "dtype": "bfloat16", "note": "",
                          **taken} for (m, c), ms in models_ms.items()])


# ---- timing verdicts: warmed up, >= 3 repeats, outside their spread, not under load (issue 50.3) ----

FAST = {("ttt_linear", 8192): 0.05, ("transformer", 8192): 0.1, ("ttt_linear", 16384): 0.05,
        ("transformer", 16384): 0.2}


def latency_verdict(df: pd.DataFrame) -> Verdict:
    return CLAIMS["latency.prefill"].judge(report.Results(frames={("latency", "latency.csv"): df}))


def test_a_timing_verdict_needs_three_repeats_an_idle_machine_and_a_ratio_outside_the_spread():
    assert latency_verdict(bench(FAST, 1, "cpu")).status == HOLDS
    v = latency_verdict(bench(FAST, 1, "cpu", repeats=2))
    assert v.status == INCONCLUSIVE and "fewer than 3 repeats (2 recorded)" in v.sentence
    v = latency_verdict(bench(FAST, 1, "cpu", loaded_during=True, busy_cores_during=1.4))
    assert v.status == INCONCLUSIVE and "under load: other work kept up to 1.4 cores busy" in v.sentence
    v = latency_verdict(bench(FAST, 1, "cpu").drop(columns=["loaded_during"]))  # an older benchmark
    assert v.status == INCONCLUSIVE and "load during the timing was not recorded" in v.sentence
    v = latency_verdict(bench(FAST, 1, "cpu", spread=0.6))  # 0.5x and 0.25x, but the repeats 60% apart
    assert v.status == INCONCLUSIVE and "largest spread 60%" in v.sentence
    slow = {k: ms * (4 if k[0] == "ttt_linear" else 1) for k, ms in FAST.items()}
    assert latency_verdict(bench(slow, 1, "cpu")).status == FAILS
    # on a GPU the host's other work is not required to be recorded, the repeats are
    assert latency_verdict(bench(FAST, 16, "cuda").drop(columns=["loaded_during"])).status == HOLDS
    assert latency_verdict(bench(FAST, 16, "cuda", repeats=1)).status == INCONCLUSIVE


def test_figure8_forward_time_is_judged_on_trusted_timings_only():
    def timing(spread=0.02, loaded=False, repeats=5):
        ms = {1: 40.0, 4: 12.0, 16: 6.0, 64: 9.0, 1024: 30.0}
        return pd.DataFrame([{"mini_batch": b, "total_ms": t, "w_ms": t / 2, "spread": spread,
                              "busy_cores_during": 0.1, "loaded_during": loaded, "repeats": repeats}
                             for b, t in ms.items()])

    judge = lambda df: CLAIMS["fig8.time"].judge(report.Results(frames={("minibatch", "timing.csv"): df}))
    assert judge(timing()).status == HOLDS
    assert judge(timing(loaded=True)).status == INCONCLUSIVE
    assert judge(timing(repeats=1)).status == INCONCLUSIVE
    assert judge(timing(spread=3.0)).status == INCONCLUSIVE  # 40 vs 6 ms, but repeats 300% apart


def test_combined_report_shows_each_claim_at_the_largest_profile_that_decided_it(tmp_path):
    """cpu (size xs) and gpu (size s): a claim both decide the same way shows the gpu's; one only the cpu
    decides shows the cpu's; Figure 3 holds in the cpu's latency step and does not in the gpu campaign's
    benchmark at the paper's batch (16): both are shown; the check is counted apart."""
    profile_folder(tmp_path, "cpu", {"a": 5.0, "b": 6.0, "c": 5.5}, "xs", 1024, 1_000_000)
    profile_folder(tmp_path, "gpu", {"a": 4.0, "b": 5.0, "c": 4.0}, "s", 34816, 16_000_000, noisy="c")
    (tmp_path / "cpu" / "latency").mkdir()
    bench({("ttt_linear", 8192): 0.05, ("transformer", 8192): 0.1, ("ttt_linear", 16384): 0.05,
           ("transformer", 16384): 0.2}, 1, "cpu").to_csv(tmp_path / "cpu" / "latency" / "latency.csv",
                                                           index=False)
    (tmp_path / "cpu" / "latency" / "step.json").write_text(json.dumps({"hardware": "cpu machine"}))
    gpu_bench = bench({("ttt_linear", 8192): 0.22, ("transformer", 8192): 0.13, ("ttt_linear", 16384): 0.22,
                       ("transformer", 16384): 0.16}, 16, "cuda")
    gpu_bench.to_csv(tmp_path / "gpu" / "bench_prefill_1.3b_b16.csv", index=False)
    bench({("ttt_linear", 65536): 0.05, ("transformer", 65536): 0.08}, 4, "cuda").to_csv(
        tmp_path / "gpu" / "bench_prefill_1.3b_b4_64k.csv", index=False)  # another batch: not judged
    (tmp_path / "gpu" / "machine.json").write_text(json.dumps({"gpu": "NVIDIA H200"}))
    experiments = [Toy(), EXPERIMENTS["latency"]]

    table = combined.combined_verdicts(tmp_path, experiments).set_index("id")
    both = table.loc["toy.both", ["cpu", "gpu", "verdict", "profile"]].tolist()
    assert both == [HOLDS, HOLDS, HOLDS, "gpu"]
    assert table.loc["toy.cpu_only", ["cpu", "gpu", "profile"]].tolist() == [HOLDS, INCONCLUSIVE, "cpu"]
    fig3 = table.loc["latency.prefill"]
    assert (fig3["cpu"], fig3["gpu"], fig3["verdict"], fig3["disagree"]) == (HOLDS, FAILS, FAILS, True)
    assert "batch 16 (the paper's)" in fig3["gpu_scale"] and "NVIDIA H200" in fig3["gpu_scale"]
    assert "bench_prefill_1.3b_b4_64k.csv" not in fig3["gpu_scale"]

    text = combined.write_combined_report(tmp_path, experiments).read_text()
    assert (tmp_path / "REPORT.md").is_file()
    assert "**3 claims: 2 holds, 1 does not hold; 1 checks: 1 holds.**" in text
    assert "Decided (holds or does not hold): 3 of 3 claims, 1 by the cpu profile alone, 0 by the gpu " \
           "profile alone, 2 by more than one; 1 decided differently by two profiles." in text
    row = next(line for line in text.splitlines() if "a is below c" in line)
    assert "**holds** | cpu: size xs, context 1,024 bytes, 1.0M training tokens a run, 3 seeds" in row
    assert "(cpu machine) | gpu: inconclusive |" in row
    row = next(line for line in text.splitlines() if line.startswith("| Toy: a is below b. |"))
    assert "| **holds** | gpu: size s, context 34,816 bytes, 16.0M training tokens a run" in row
    row = next(line for line in text.splitlines() if "Figures 3/15" in line)
    assert "**does not hold** (gpu); **holds** (cpu)" in row and "<br>cpu: batch 1" in row
    assert "*(check)*" in next(line for line in text.splitlines() if "| Toy: a is below b. *(check)*" in line)
    disagree = text.split("## Where profiles disagree")[1]  # each profile's evidence, largest first
    assert disagree.index("- gpu, **does not hold**: TTT-Linear / Transformer prefill latency per token: 8k "
                          "1.69x") < disagree.index("- cpu, **holds**: TTT-Linear / Transformer")
