"""What every suite shares: device setup, timing (warm-up, repeats, median, device sync), peak memory, the
matmul ceiling for MFU, and models built from their configs."""

import argparse
import os
import statistics
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ttt_bench.allocator import release_free_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def _busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (Linux's /proc/stat)."""
    with open("/proc/stat") as f:
        ticks = [int(v) for v in f.readline().split()[1:8]]  # user nice system idle iowait irq softirq
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class OtherWork:
    """`with OtherWork() as w: ...` then `w.cores`: the cores that other processes kept busy while the
    block ran, i.e. the machine's busy CPU time less this process's own, over the block's wall time (NaN
    where the OS has no /proc/stat). Measured during a timing, unlike `busy_cores`, which samples before."""

    def __enter__(self):
        self.cores = float("nan")
        try:
            self._start = (_busy_seconds(), time.process_time(), time.perf_counter())
        except (OSError, ValueError, IndexError):
            self._start = None
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            busy, own, wall = (now - then for now, then in
                               zip((_busy_seconds(), time.process_time(), time.perf_counter()), self._start))
            self.cores = max(0.0, busy - own) / max(wall, 1e-9)


def busy_cores(seconds: float = 1.0) -> float:
    """Cores other work keeps busy: the machine's CPU time used during `seconds` while this process sleeps
    (Linux's /proc/stat); elsewhere the 1-minute load average. The load average lags: for about a minute
    after a timing it still counts that timing's own threads, so in `make bench` every suite after the
    first read as taken under load."""
    try:
        before = _busy_seconds()
        time.sleep(seconds)
        return (_busy_seconds() - before) / seconds
    except (OSError, ValueError, IndexError):
        return load_average()


def under_load(busy_before: float, threads: int) -> bool:
    """Whether other work competed with a timing: the cores busy just before it exceeded the cores the
    timing leaves free (cores - threads) by more than half a core."""
    return busy_before > max(0, (os.cpu_count() or 1) - threads) + 0.5


def loaded(busy_during: float, threads: int) -> bool | None:
    """`under_load` for the cores other work kept busy during a timing (OtherWork); None where unknown."""
    return None if busy_during != busy_during else under_load(busy_during, threads)


def conditions(busy_before: float, load_before: float, threads: int) -> dict:
    """The conditions of a timing, as columns of its CSV: the cores other work kept busy just before it,
    the load average before and after, the threads used, and whether it was taken under load."""
    return {"busy_cores_before": round(busy_before, 2), "load_before": round(load_before, 2),
            "load_after": round(load_average(), 2), "threads_used": threads,
            "under_load": under_load(busy_before, threads)}


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cpu or cuda[:i] (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls before timing")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls; the median is reported")
    parser.add_argument("--seed", type=int, default=0)


def setup(args) -> torch.device:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda but torch sees no GPU; use --device cpu")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    return device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class Timing:
    """Seconds of one timed function: the median of its repeats and their range, and the cores other work
    kept busy while the round-robin that timed it ran (OtherWork)."""
    median: float
    low: float
    high: float
    others: float

    @property
    def spread(self) -> float:
        """The repeats' range relative to their median."""
        return (self.high - self.low) / self.median if self.median else float("nan")


def time_calls(fn: Callable[[], object], device: torch.device, warmup: int, repeats: int) -> float:
    """Median wall time of fn() in seconds over `repeats` calls after `warmup` calls, device synced."""
    return time_interleaved({"fn": fn}, device, warmup, repeats)["fn"]


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int, repeats: int):
    """{name: median wall time of fns[name]() in seconds} (`timings`)."""
    return {name: t.median for name, t in timings(fns, device, warmup, repeats).items()}


def timings(fns: dict[str, Callable[[], object]], device: torch.device, warmup: int,
            repeats: int) -> dict[str, Timing]:
    """{name: Timing of fns[name]()}: `warmup` untimed rounds, then `repeats` rounds that call every
    function once in turn, so that a slow spell of a noisy machine hits all of them alike and their ratios
    stay fair. On a CPU the wall time of each call; on a GPU each call's time between two CUDA events
    recorded on its stream around it (the device synced before the call, so that it starts idle)."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    with OtherWork() as others:
        for _ in range(repeats):
            for name, fn in fns.items():
                times[name].append(_timed_call(fn, device))
    return {name: Timing(statistics.median(t), min(t), max(t), others.cores) for name, t in times.items()}


def _timed_call(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one call of fn: CUDA events on a GPU, the wall clock elsewhere."""
    sync(device)
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def peak_memory(device: torch.device):
    """Yields a dict whose "mb" is set on exit: on CUDA the peak allocated memory of the block; on CPU the
    peak growth of the resident set over the block, sampled every 2 ms (Linux; None elsewhere)."""
    out = {"mb": None}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        yield out
        out["mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        return
    if not os.path.exists("/proc/self/statm"):
        yield out
        return
    release_free_memory()
    base, peak, done = _rss_bytes(), [0], threading.Event()

    def sample():
        while not done.wait(0.002):
            peak[0] = max(peak[0], _rss_bytes())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield out
    finally:
        done.set()
        sampler.join()
        out["mb"] = max(0, max(peak[0], _rss_bytes()) - base) / 2**20


def model_config_exists(name: str) -> bool:
    from ttt_bench.config import REPO_ROOT

    return (REPO_ROOT / "conf" / "model" / f"{name}.yaml").is_file()


def model_cfg(name: str, size: str, size_overrides: dict, seq_len: int, extra: list[str] = ()):
    """The composed config of conf/model/<name>.yaml at conf/size/<size>.yaml (+ size.* overrides)."""
    from ttt_bench.config import compose

    overrides = [f"model={name}", f"size={size}", f"data.seq_len={seq_len}", *extra]
    overrides += [f"size.{k}={v}" for k, v in size_overrides.items() if v is not None]
    return compose("train", overrides)


def build_model(cfg, vocab_size: int, device: torch.device, dtype=torch.float32):
    """The LanguageModel of a composed config, as training builds it."""
    import hydra

    with torch.device(device):
        model = hydra.utils.instantiate(cfg.model, vocab_size=vocab_size)
    return model.to(dtype=dtype)
