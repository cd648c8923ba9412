"""`make gpu-campaign` cannot rot (issue 33, point 4): its dry mode runs every stage end to end on the CPU
(tiny sizes, the Triton interpreter, --device cpu) and writes the files and the summary the GPU run will;
a second run skips the finished stages; without a GPU and without --dry it says so in one line (exit 2).
About 50 s on 2 CPU cores. The GPU queue's calls (issue 47, point 4) in --dry: a stand-in for reproduce with
the real cap, tabulation, packing, unpacking and resume; seconds."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("triton", reason="the check stage runs the Triton kernels in the interpreter")

from ttt_bench import campaign  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def run_campaign(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ttt_bench.campaign", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=600, env={**os.environ, **(env or {})})


def test_dry_campaign_writes_every_stage_and_resumes(tmp_path):
    out, work = tmp_path / "gpu", tmp_path / "work"
    first = run_campaign("--stage", "all", "--dry", "--out", str(out), "--work", str(work))
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    folder = {stage: campaign.stage_dir(out, stage) for stage in campaign.STAGES}
    assert {p.name for p in out.iterdir()} == {"check", "speed", "train", "figure3", "sections", "SUMMARY.md",
                                               "machine.json"}  # each stage in the folder of what it measures
    for stage, files in campaign.OUTPUTS.items():
        assert (folder[stage] / f"{stage}.done").exists(), stage
        for name in files:
            assert (folder[stage] / name).stat().st_size > 0, name
        section = (out / "sections" / f"{stage}.md").read_text()
        assert section.startswith(f"## {stage}") and "| command | wall (s) |" in section
    summary = (out / "SUMMARY.md").read_text()
    for stage in campaign.STAGES:
        assert f"## {stage} (dry run, CPU)" in summary
    assert "- GPU: no GPU" in summary and "torch " in summary and "Triton " in summary

    check = pd.read_csv(folder["check"] / "check.csv")
    assert set(check["head_size"]) == set(campaign.HEAD_SIZES)
    assert {"dual/ieee", "dual/tf32", "decode"} <= set(check["kernel"])
    assert (check["status"].isin(["pass", "unsupported"])).all(), check.to_string()
    assert "passed" in (folder["check"] / "pytest.txt").read_text()
    for stage in ("bench", "figure3"):
        for part in campaign.BENCH[stage]:
            assert not pd.read_csv(folder[stage] / campaign.BENCH_OUT[part]).empty, part
    models = pd.read_csv(folder["bench"] / "bench_models_125m.csv")
    assert set(models["model"]) == set(campaign.MODELS) and set(models["phase"]) == {"prefill", "decode"}
    train = pd.read_csv(folder["train"] / "train.csv")
    assert list(train["model"]) == list(campaign.MODELS)
    assert train["ok"].all() and train["all_finite"].all(), train.to_string()
    assert (train["peak_mem_mb"] > 0).all() and (train["steady_tokens_per_s"] > 0).all()
    assert sorted(p.name for p in (folder["train"] / "logs").iterdir()) == sorted(
        f"train_{m}.log" for m in campaign.MODELS)
    assert not any(out.rglob("*.ckpt"))  # run folders and checkpoints stay in --work

    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*.csv")}
    assert len(stamps) == 1 + len(campaign.BENCH_OUT) + 1  # check, the bench CSVs, train
    second = run_campaign("--stage", "all", "--dry", "--out", str(out), "--work", str(work))
    assert second.returncode == 0, second.stderr[-3000:]
    for stage in campaign.STAGES:
        assert f"[campaign] {stage}: finished before" in second.stdout
    assert stamps == {p: p.stat().st_mtime_ns for p in out.glob("*/*.csv")}
    assert (out / "SUMMARY.md").read_text() == summary


def test_without_a_gpu_it_says_so_in_one_line(tmp_path):
    done = run_campaign("--stage", "check", "--out", str(tmp_path / "gpu"), env={"CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs one" in lines[0] and "--dry" in lines[0], done.stderr
    assert not (tmp_path / "gpu").exists()


# -- the GPU queue (issue 47, point 4; docs/gpu_campaign.md): seconds on the CPU ----------------------------


def test_a_queue_call_caps_tabulates_packs_and_the_next_call_resumes(tmp_path, monkeypatch):
    """One queue call in --dry: a stand-in for reproduce, with the real cap, tabulation and packing. At the
    cap the call's process group gets SIGTERM and the unfinished run checkpoints; the step folder is tabulated
    from what finished; the pack holds the step folder and reports, the run folders without checkpoints, and
    the unfinished run's last checkpoint; --unpack puts them in place (results, runs/gpu-queue, .gpuruns),
    and the next call restores the checkpoint with --resume."""
    import tarfile

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # what --dry sets, restored after the test
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    out, pack, repo = tmp_path / "results" / "gpu", tmp_path / "pack", tmp_path / "repo"
    args = ["--stage", "queue", "--item", "table1", "--dry", "--out", str(out), "--train-s", "1",
            "--grace-s", "5"]
    assert campaign.main([*args, "--runs", str(tmp_path / "runs"), "--pack", str(pack)]) == 0
    row = pd.read_csv(out / "queue" / "queue.csv").iloc[-1]
    assert row["item"] == "table1" and bool(row["capped"]) and not bool(row["done"])
    assert row["state"] == "1 of 2 runs finished" and row["tabulate_exit"] == 0
    assert (out / "table1" / "registry.csv").is_file()
    names = lambda f: tarfile.open(pack / f).getnames()
    assert {"results/gpu/table1/registry.csv", "results/gpu/queue/queue.csv"} <= set(
        names("table1-results.tgz"))
    assert not [n for n in names("table1-runs.tgz") if n.endswith(".ckpt")]
    ckpts = [n for n in names("table1-ckpt-0.tgz") if n.endswith(".ckpt")]
    assert ckpts == ["table1/b-s0/checkpoints/last.ckpt"]
    log = (pack / "table1.log").read_text()
    assert "python -m ttt_bench.reproduce --profile gpu --steps table1 --data-dir .gpudata" in log
    assert "--jobs 4" in log and "SIGTERM, b-s0 checkpointed" in log

    campaign.unpack(pack, repo)
    assert (repo / "results" / "gpu" / "table1" / "registry.csv").is_file()
    assert (repo / "runs" / "gpu-queue" / "table1" / "a-s0" / "metrics.json").is_file()
    assert [p.name for p in (repo / ".gpuruns").iterdir()] == ["table1-ckpt-0.tgz"]
    again = ["--runs", str(tmp_path / "runs2"), "--resume", str(repo / ".gpuruns")]
    assert campaign.main([*args, *again]) == 0
    log = (out / "queue" / "table1.log").read_text()
    assert "restored from" in log and "b-s0 resumed from its checkpoint" in log
    assert len(pd.read_csv(out / "queue" / "queue.csv")) == 2


def test_the_cap_reaches_every_process_of_the_call(tmp_path):
    """reproduce trains in joblib workers, processes of their own: the cap's SIGTERM goes to the whole
    process group, so a worker checkpoints (here: writes a marker) even though its parent dies at once."""
    marker = tmp_path / "worker-got-sigterm"
    worker = (f"import signal, sys, time, pathlib\n"
              f"def stop(*_):\n    time.sleep(1.5)\n"  # the optimizer step in progress, then the checkpoint
              f"    pathlib.Path({str(marker)!r}).write_text('checkpointed')\n    sys.exit(0)\n"
              f"signal.signal(signal.SIGTERM, stop)\ntime.sleep(60)\n")
    parent = (f"import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', {worker!r}])\n"
              "time.sleep(60)\n")
    with open(tmp_path / "log", "w") as log:
        code, capped, wall = campaign.run_capped([sys.executable, "-c", parent], log, cap=4, grace=8)
    assert capped and code != 0 and 5 < wall < 11  # the cap, then the worker's 1.5 s, not the 8-s grace
    assert marker.read_text() == "checkpointed"


def test_queue_next_skips_finished_and_waiting_items(tmp_path, capsys):
    """`--item next` is the first item in queue order that waits on nothing and whose step folder is not
    complete: every run of the registry finished and, for a profile in parts, the last part."""
    out = tmp_path / "gpu"

    def folder(step, finished, total, part=None):
        (out / step).mkdir(parents=True, exist_ok=True)
        pd.DataFrame({"run": [f"r{i}" for i in range(total)],
                      "status": ["finished"] * finished + ["pending"] * (total - finished)}
                     ).to_csv(out / step / "registry.csv", index=False)
        (out / step / "step.json").write_text(json.dumps({"part": part} if part else {}))

    assert campaign.queue_item("next", out).name == "scaling"
    folder("scaling", 12, 15)
    assert campaign.queue_item("next", out).name == "scaling"
    folder("scaling", 15, 15)
    folder("table1", 13, 13, part="1 of 3")  # the first part's runs: finished, but not the step
    assert campaign.queue_item("next", out).name == "table1"
    folder("table1", 39, 39, part="3 of 3")
    assert campaign.queue_item("next", out).name == "mttt_patches"
    for item in campaign.QUEUE:
        folder(item.step, 5, 5)
    with pytest.raises(SystemExit, match="every queue item that can run has finished"):
        campaign.queue_item("next", out)
    with pytest.raises(SystemExit, match="no queue item 'tabel1'"):
        campaign.queue_item("tabel1", out)
    assert campaign.main(["--stage", "queue", "--item", "list", "--out", str(out)]) == 0
    listed = capsys.readouterr().out
    assert "waits: TTT-MLP's training speed on the GPU" in listed
    assert listed.count("done") == len(campaign.QUEUE) - 1


def test_the_queue_items_and_their_gpu_profiles():
    """Each item trains a step whose sweep has a gpu profile; Table 1's is the paper's 2k context in bytes
    with >= 20M bytes a run and 3 seeds, recall's >= 256 tokens and 5 seeds, long range's 3 seeds; what a
    call brings back fits the device tool's files (8, of 16 MiB each)."""
    import yaml

    assert [i.letter for i in campaign.QUEUE][:2] == ["c1", "a"]
    assert [i.name for i in campaign.QUEUE if i.waits] == ["scaling_ttt_mlp"]
    sweep = lambda step: yaml.safe_load((REPO / "conf" / "sweep" / f"{step}.yaml").read_text())
    profile = lambda step: sweep(step)["profiles"]["gpu"]
    value = lambda p, key: next(o.split("=", 1)[1] for o in p["overrides"] if o.startswith(key + "="))
    for item in campaign.QUEUE:
        assert "trainer=gpu" in profile(item.step)["overrides"], item.step
        assert item.calls * campaign.TRAIN_S <= 4 * 600 and item.ckpt_mib <= 2 * campaign.FILE_MIB
    t1 = profile("table1")
    assert t1["seeds"] == 3 and int(value(t1, "data.seq_len")) == 2048
    assert int(value(t1, "recipe.total_tokens")) >= 20_000_000
    assert int(value(t1, "recipe.tokens_per_batch")) == int(value(t1, "data.micro_batch_size")) * 2048
    recall = profile("recall")
    assert recall["seq_len"] >= 256 and recall["seeds"] == 5 and "transformer" in recall["methods"]
    assert profile("longrange")["seeds"] == 3 and "transformer" in sweep("longrange")["methods"]
    # the call's limit: the cap, the grace, the tabulation, install (~30 s) and packing inside 600 s
    assert campaign.TRAIN_S + campaign.GRACE_S + campaign.TABULATE_S + 60 <= 600


def test_prepare_copies_only_the_corpora_an_item_reads(tmp_path, capsys):
    data = tmp_path / "data"
    for corpus in ("pile-mini", "books-mini"):
        (data / corpus).mkdir(parents=True)
        (data / corpus / "train.jsonl.zst").write_bytes(b"x" * 1000)
    (tmp_path / ".gpudata" / "fashion-mnist").mkdir(parents=True)  # an earlier item's
    campaign.prepare(campaign.queue_item("table1", tmp_path), data, tmp_path)
    assert sorted(p.name for p in (tmp_path / ".gpudata").iterdir()) == ["pile-mini"]
    assert "bash scripts/gpu_queue.sh table1" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="fashion-mnist is not a folder"):
        campaign.prepare(campaign.queue_item("mttt_patches", tmp_path), data, tmp_path)


def test_the_speed_lease_script_runs_its_parts_and_packs_each(tmp_path):
    """scripts/gpu_speed_lease.sh (the next lease's speed work, docs/gpu_campaign.md) with DRY=1 on the CPU: a
    part runs in its tiny form and comes back packed with its log, an unknown part is named, and the card is
    written."""
    import tarfile

    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "DRY": "1", "OUT": str(out), "PARTS": "speed nope", "PY": sys.executable,
           "LEASE_WORK": str(tmp_path / "work")}
    done = subprocess.run(["bash", "scripts/gpu_speed_lease.sh"], cwd=campaign.REPO, env=env, text=True,
                          capture_output=True, timeout=600)
    assert "speed rc=0" in done.stdout and "unknown part nope" in done.stdout, done.stdout + done.stderr
    with tarfile.open(out / "speed.tgz") as tar:
        names = tar.getnames()
    assert {"speed.log", "speed/prefill_speed.csv", "speed/train_speed.csv"} <= set(names)
    assert "torch" in (out / "gpu.txt").read_text()
