"""`ttt-bench bench profile`: where one block's time goes. One block of each model (its first, built as the
language model builds it, at a paper size), a training step's forward and backward on [batch, seq_len,
d_model] under torch.profiler after `--warmup` untimed calls: the top operators by their own time on the
device (CUDA kernels' time on a GPU, CPU time here), each with its calls and share of the step, so the glue
around a kernel (casts, copies, the projections, the convs) shows beside the kernel itself (issue 48).

  ttt-bench bench profile --models ttt_linear --size 1.3b --seq-len 2048 --batch 4 --dtype bfloat16
"""

import argparse

import pandas as pd
import torch

from . import common

COLUMNS = ["model", "size", "seq_len", "batch", "dtype", "device", "rank", "op", "calls", "self_ms", "share",
           "step_ms"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default="ttt_linear", help="model configs (conf/model/*.yaml)")
    parser.add_argument("--size", default="125m", help="size config (conf/size/*.yaml)")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=1, help="sequences")
    parser.add_argument("--top", type=int, default=15, help="operators listed per model")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every model, e.g. --set model.block.kernel=torch")
    common.add_device_arguments(parser)


def one_block(name: str, args, device: torch.device, dtype: torch.dtype) -> tuple[torch.nn.Module, int]:
    """The first block of `name` at args.size, as the language model builds it, and its width."""
    cfg = common.model_cfg(name, args.size, {}, args.seq_len, [*args.set, "size.n_layers=1"])
    model = common.build_model(cfg, vocab_size=256, device=device, dtype=dtype)
    return model.blocks[0], cfg.size.d_model


def profile_block(block: torch.nn.Module, x: torch.Tensor, warmup: int) -> tuple[pd.DataFrame, float]:
    """torch.profiler over one forward and backward of `block` on x: ({op, calls, self_ms}, the step's
    wall milliseconds), operators by their own device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = x.device.type == "cuda"
    step = lambda: block(x).float().square().mean().backward()
    for _ in range(warmup):
        step()
    common.sync(x.device)
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities) as prof:
        step()
        common.sync(x.device)
    rows = []
    for event in prof.key_averages():
        own = event.self_device_time_total if cuda else event.self_cpu_time_total
        if own > 0:
            rows.append({"op": event.key, "calls": event.count, "self_ms": own / 1e3})
    table = pd.DataFrame(rows, columns=["op", "calls", "self_ms"]).sort_values("self_ms", ascending=False)
    return table, common.time_calls(step, x.device, 0, 1) * 1e3


def run(args) -> pd.DataFrame:
    device = common.setup(args)
    dtype = common.DTYPES[args.dtype]
    frames = []
    for name in args.models.split(","):
        block, d_model = one_block(name, args, device, dtype)
        x = torch.randn(args.batch, args.seq_len, d_model, device=device, dtype=dtype, requires_grad=True)
        table, step_ms = profile_block(block, x, args.warmup)
        table = table.assign(share=table["self_ms"] / table["self_ms"].sum(), step_ms=step_ms).head(args.top)
        frames.append(table.assign(model=name, size=args.size, seq_len=args.seq_len, batch=args.batch,
                                   dtype=args.dtype, device=str(device), rank=range(1, len(table) + 1)))
    return pd.concat(frames, ignore_index=True)[COLUMNS]


def summary(df: pd.DataFrame) -> list[str]:
    """Each model's top operator and the share of the step its top three take."""
    lines = []
    for name, t in df.groupby("model", sort=False):
        top = t.iloc[0]
        lines.append(f"{name}: {top['op']} {top['share']:.0%} of the block's time on {top['device']}; "
                     f"the top three {t['share'].head(3).sum():.0%} (step {top['step_ms']:.1f} ms)")
    return lines
