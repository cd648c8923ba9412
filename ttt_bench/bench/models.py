"""`ttt-bench bench models`: prefill and decode latency vs context, training throughput and MFU, peak memory,
for language models built from their configs (Figures 3, 15 and 20 of the paper), all in one run.

  prefill  forward of a batch of `context`-token prompts with fresh caches; latency = time / context (the
           sequences of a batch run in parallel, as Figure 3's batch of 16)
  decode   one token per step after prefilling `context` tokens; latency = time of one step
  train    forward + backward + AdamW step on tokens_per_step tokens of train_context; latency = time / tokens
           (1 / throughput); MFU = model FLOPs/s (ttt_bench/flops.py, analytic) over the matmul ceiling
           measured at the start of the run (kernels/speed.matmul_tflops)

tokens_per_s counts every sequence of the batch. A model whose config does not exist is skipped with a note;
a context that runs out of memory ends that model's sweep with a note. Every comparison is measured
round-robin: each repeat times every model once in turn (common.time_interleaved).
"""

import argparse
import time

import pandas as pd
import torch
import torch.nn.functional as F

from ttt_bench import flops
from ttt_bench.errors import UserError
from ttt_bench.kernels.speed import matmul_tflops
from ttt_bench.models.graphs import DecodeGraphs, cuda_graph

from . import common

MODELS = ("transformer", "mamba", "ttt_linear", "ttt_mlp")
SIZE_KEYS = ("d_model", "n_layers", "n_heads", "mlp_hidden")
# The CPU reference size of docs/speed.md: width 256, 4 blocks, 4 heads, TTT mini-batch 16 (configs' default).
PRESETS = {
    "cpu-ref": dict(size="l", d_model=256, n_layers=4, n_heads=4, mlp_hidden=688, contexts="1024-16384",
                    train_context=2048, tokens_per_step=16384, threads=2, device="cpu", dtype="float32"),
    "quick": dict(size="xs", contexts="256-512", train_context=256, tokens_per_step=512, decode_tokens=4,
                  warmup=1, repeats=2),
}
COLUMNS = ["model", "context", "phase", "batch", "latency_ms_per_token", "tokens_per_s", "ms_per_call", "mfu",
           "model_tflops_per_s", "matmul_tflops", "spread", "busy_cores_during", "loaded_during",
           "peak_mem_mb", "graphed", "params", "d_model", "n_layers", "device", "dtype", "threads", "repeats",
           "note"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=PRESETS, help="cpu-ref: the reference size of docs/speed.md; "
                        "quick: tiny and fast (also --quick). Explicit options win over the preset.")
    parser.add_argument("--quick", action="store_true", help="same as --preset quick")
    parser.add_argument("--models", default=",".join(MODELS), help="model configs (conf/model/*.yaml)")
    parser.add_argument("--phases", default="prefill,decode,train")
    parser.add_argument("--size", default="s", help="size config (conf/size/*.yaml)")
    for key in SIZE_KEYS:
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override size.{key}")
    parser.add_argument("--vocab-size", type=int, default=8192, help="the BPE tokenizer's default vocabulary")
    parser.add_argument("--contexts", default="1024-32768",
                        help="LO-HI in 2x steps, or a comma-separated list (prefill and decode)")
    parser.add_argument("--batch", type=int, default=1, help="sequences per prefill call (the paper: 16)")
    parser.add_argument("--decode-batch", type=int, default=1, help="sequences per decode step (paper: 512)")
    parser.add_argument("--decode-tokens", type=int, default=16, help="timed decode steps, after --warmup")
    parser.add_argument("--decode-graphs", choices=("auto", "on", "off", "both"), default="auto",
                        help="replay decoding steps from CUDA graphs (auto: on a GPU, for the models whose "
                        "caches allow it; models/graphs.py); both: also time the eager steps (phase "
                        "decode_eager)")
    parser.add_argument("--train-context", type=int, default=2048)
    parser.add_argument("--tokens-per-step", type=int, default=16384, help="tokens per optimizer step")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every model, e.g. --set model.block.mini_batch_size=16")
    common.add_device_arguments(parser)


def apply_preset(args, parser: argparse.ArgumentParser) -> None:
    """Preset values for the options left at their defaults."""
    preset = PRESETS.get("quick" if args.quick else args.preset, {})
    for key, value in preset.items():
        if getattr(args, key) == parser.get_default(key):
            setattr(args, key, value)


def parse_contexts(text: str) -> list[int]:
    try:
        if "-" in text:
            lo, hi = (int(v) for v in text.split("-"))
            contexts = [c for c in (lo << i for i in range(32)) if c <= hi]
        else:
            contexts = [int(v) for v in text.split(",")]
    except ValueError:
        contexts = []
    if not contexts or min(contexts) < 1:
        raise ValueError(f"--contexts {text} must be LO-HI (1024-32768) or a list (1024,4096) of positive "
                         "lengths, LO <= HI")
    return contexts


def _is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


class Bench:
    """The measurements of every model at one setting, round-robin (common.time_interleaved), so that the
    ratios between models are fair on a noisy machine; peak memory comes from one more, untimed call."""

    def __init__(self, args, names: list[str], device: torch.device):
        self.args, self.names, self.device = args, names, device
        self.dtype = common.DTYPES[args.dtype]
        self.size = {k: getattr(args, k) for k in SIZE_KEYS}
        self.rows: list[dict] = []
        self.capture = cuda_graph  # how a decoding step is captured (the tests emulate it on the CPU)

    def cfg(self, name: str, seq_len: int):
        return common.model_cfg(name, self.args.size, self.size, seq_len, self.args.set)

    def model(self, name: str, seq_len: int):
        return common.build_model(self.cfg(name, seq_len), self.args.vocab_size, self.device, self.dtype)

    def ids(self, batch: int, length: int) -> torch.Tensor:
        return torch.randint(0, self.args.vocab_size, (batch, length), device=self.device)

    def measure(self, fns: dict, phase: str, context: int, repeats: int) -> dict:
        """{name: (common.Timing, peak MB)}; a model that runs out of memory gets a note and leaves `fns`."""
        for name in list(fns):
            try:  # the memory pass doubles as a first warm-up
                with common.peak_memory(self.device) as mem:
                    fns[name]()
                fns[name] = (fns[name], mem["mb"])
            except (RuntimeError, MemoryError) as e:
                if not _is_oom(e):
                    raise
                self.rows.append(dict(model=name, context=context, phase=phase, note="out of memory"))
                del fns[name]
        times = common.timings({k: f for k, (f, _) in fns.items()}, self.device, self.args.warmup, repeats)
        return {k: (times[k], fns[k][1]) for k in fns}

    def row(self, model, name, context, phase, batch, t: common.Timing, tokens, positions, mem_mb,
            **extra) -> None:
        """One timing: `tokens` processed per call, over `positions` sequence positions (the latency per
        token is per position: a batch's sequences run in parallel); with the repeats' relative range and
        the cores other work kept busy during the timing."""
        self.rows.append(dict(model=name, context=context, phase=phase, batch=batch,
                              latency_ms_per_token=1e3 * t.median / positions, tokens_per_s=tokens / t.median,
                              ms_per_call=1e3 * t.median, spread=t.spread, busy_cores_during=t.others,
                              loaded_during=common.loaded(t.others, self.args.threads),
                              peak_mem_mb=mem_mb, params=model.num_params(), d_model=model.d_model,
                              n_layers=len(model.blocks), **extra))

    @torch.inference_mode()
    def latency(self, contexts: list[int], phases: set[str]) -> None:
        a = self.args
        models = {name: self.model(name, max(contexts)).eval() for name in self.names}
        for T in contexts:
            if "prefill" in phases:
                prompt = self.ids(a.batch, T)
                fns = {n: (lambda m=m, p=prompt: m(p, m.init_caches(a.batch))) for n, m in models.items()}
                for n, (t, mb) in self.measure(fns, "prefill", T, a.repeats).items():
                    self.row(models[n], n, T, "prefill", a.batch, t, a.batch * T, T, mb)
            if "decode" in phases:
                self.decode(models, T)
            models = {n: m for n, m in models.items() if not self._out_of_memory(n)}

    def decode(self, models: dict, T: int) -> None:
        """Prefill T tokens of decode_batch sequences, then time single-token steps: replayed from CUDA
        graphs (models/graphs.py) where --decode-graphs allows and the model's caches can, else eager. A
        model whose graphs fail (a cache that cannot, a capture that fails) decodes eagerly, the reason in
        its row's note. With `both`, the eager steps are timed too, as phase decode_eager."""
        a = self.args
        if a.decode_graphs in ("on", "both") and self.capture is cuda_graph and self.device.type != "cuda":
            raise ValueError(f"--decode-graphs {a.decode_graphs} needs --device cuda: CUDA graphs replay GPU "
                             "kernels")
        on_gpu = self.device.type == "cuda"
        wanted = a.decode_graphs in ("on", "both") or (a.decode_graphs == "auto" and on_gpu)
        self._decode_phase(models, T, "decode", wanted)
        if a.decode_graphs == "both":
            self._decode_phase(models, T, "decode_eager", False)

    def _decode_phase(self, models: dict, T: int, phase: str, wanted: bool) -> None:
        a, fns, graphed, notes = self.args, {}, {}, {}
        for n, m in models.items():
            graphed[n] = wanted and not DecodeGraphs.why_not(m.init_caches(a.decode_batch))
            try:
                fns[n] = self._decoder(m, T, graphed[n])
            except (RuntimeError, MemoryError, UserError) as e:
                if _is_oom(e):
                    self.rows.append(dict(model=n, context=T, phase=phase, note="out of memory"))
                    continue
                if not graphed[n]:
                    raise
                reason = (str(e).splitlines() or [type(e).__name__])[0]
                graphed[n], notes[n] = False, f"eager: {reason}"
                fns[n] = self._decoder(m, T, False)
        for n, (t, mb) in self.measure(fns, phase, T, a.decode_tokens).items():
            self.row(models[n], n, T, phase, a.decode_batch, t, a.decode_batch, 1, mb, graphed=graphed[n],
                     note=notes.get(n))

    def _decoder(self, model, T: int, graphed: bool):
        """A decoding step of `model` after a prefill of T tokens, with caches for every step it will take
        (measure()'s and the graphs' warm-up: no step reallocates)."""
        a = self.args
        steps = 2 * a.warmup + a.decode_tokens + 1
        steps += DecodeGraphs.warm_up_steps(model.init_caches(a.decode_batch)) if graphed else 0
        caches = model.init_caches(a.decode_batch, max_len=T + steps)
        model(self.ids(a.decode_batch, T), caches)
        tokens = iter(self.ids(a.decode_batch, steps).split(1, 1))
        if not graphed:
            return lambda: model(next(tokens), caches)
        step = DecodeGraphs(model, caches, capture=self.capture)
        step.warm_up(tokens)
        return lambda: step(next(tokens))

    def _out_of_memory(self, name: str) -> bool:
        return any(r["model"] == name and r.get("note") == "out of memory" for r in self.rows)

    def train(self, ceiling_tflops: float) -> None:
        a = self.args
        T, batch = a.train_context, max(1, a.tokens_per_step // a.train_context)
        models, fns = {}, {}
        for name in self.names:
            model = models[name] = self.model(name, T).train()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            ids = self.ids(batch, T + 1)

            def step(model=model, opt=opt, ids=ids):
                opt.zero_grad(set_to_none=True)
                logits = model(ids[:, :-1])
                F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()).backward()
                opt.step()

            fns[name] = step
        for n, (t, mb) in self.measure(fns, "train", T, a.repeats).items():
            tflops = flops.train_flops(self.cfg(n, T), a.vocab_size, batch * T) / t.median / 1e12
            self.row(models[n], n, T, "train", batch, t, batch * T, batch * T, mb,
                     model_tflops_per_s=tflops, mfu=tflops / ceiling_tflops)


def run(args) -> pd.DataFrame:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    apply_preset(args, parser)
    device = common.setup(args)
    phases = set(args.phases.split(","))
    if unknown := phases - {"prefill", "decode", "train"}:
        raise ValueError(f"unknown phases {sorted(unknown)}; use prefill, decode, train")
    contexts = parse_contexts(args.contexts)
    ceiling = matmul_tflops(device, common.DTYPES[args.dtype])
    names = args.models.split(",")
    rows = [dict(model=n, note=f"skipped: conf/model/{n}.yaml does not exist")
            for n in names if not common.model_config_exists(n)]
    bench = Bench(args, [n for n in names if common.model_config_exists(n)], device)
    start = time.perf_counter()
    if phases & {"prefill", "decode"}:
        bench.latency(contexts, phases)
        print(f"[bench] prefill/decode: {time.perf_counter() - start:.0f} s", flush=True)
    if "train" in phases:
        start = time.perf_counter()
        bench.train(ceiling)
        print(f"[bench] train: {time.perf_counter() - start:.0f} s", flush=True)
    df = pd.DataFrame(rows + bench.rows).reindex(columns=COLUMNS)
    df["matmul_tflops"], df["device"], df["dtype"] = ceiling, str(device), args.dtype
    df["threads"], df["repeats"] = args.threads, args.repeats
    return df


def summary(df: pd.DataFrame) -> list[str]:
    """The ratios of the speed targets (docs/speed.md) that this run's rows allow."""
    lat = df.dropna(subset=["latency_ms_per_token"]).pivot_table(
        index=["phase", "context"], columns="model", values="latency_ms_per_token")
    lines = []
    if "train" in lat.index.get_level_values(0) and "transformer" in lat:
        train = lat.loc["train"].iloc[0]
        for m in ("ttt_linear", "ttt_mlp", "mamba"):
            if m in train:
                lines.append(f"train throughput {m} / transformer: {train['transformer'] / train[m]:.2f}x")
    if {"decode", "decode_eager"} <= set(lat.index.get_level_values(0)):
        gain = (lat.loc["decode_eager"] / lat.loc["decode"]).dropna(how="all")
        for m in gain.columns:
            g = gain[m].dropna()
            if len(g):
                lines.append(f"decode from CUDA graphs, {m}: {g.min():.2f}-{g.max():.2f}x faster than eager "
                             f"({int(g.index.min())}-{int(g.index.max())})")
    for phase in ("prefill", "decode"):
        if phase not in lat.index.get_level_values(0):
            continue
        p = lat.loc[phase]
        lo, hi = p.index.min(), p.index.max()
        for m in p.columns:
            lines.append(f"{phase} latency {m}: {p.loc[hi, m] / p.loc[lo, m]:.2f}x from {lo} to {hi}")
        if {"ttt_linear", "transformer"} <= set(p.columns):
            faster = [int(T) for T in p.index if p.loc[T, "ttt_linear"] < p.loc[T, "transformer"]]
            lines.append(f"{phase}: ttt_linear faster than transformer at contexts {faster}")
        if {"ttt_linear", "mamba"} <= set(p.columns):
            ratio = p.loc[hi, "ttt_linear"] / p.loc[hi, "mamba"]
            lines.append(f"{phase} latency ttt_linear / mamba at {hi}: {ratio:.2f}x")
    return lines
