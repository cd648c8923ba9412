"""`ttt-bench bench step`: one optimizer step of each language model at a paper size (default 125m) on this
machine, and what it costs: the model built from its config as training builds it, one micro-batch of
`--seq-len` random tokens (forward, cross-entropy, backward), clipping by the global norm and the AdamW update
of the training recipe (LitLM's parameter groups). Each model runs in a fresh process, so that its peak
memory, the resident set's high-water mark (Linux's VmHWM: the interpreter, torch, the parameters, their
gradients, AdamW's two moments and the activations), is its own; `base_rss_mb` is that process's before the
model is built.

  ttt-bench bench step --size 125m --seq-len 64 --micro-batch 1
"""

import argparse
import json
import math
import resource
import subprocess
import sys
import time

import pandas as pd

LANGUAGE_MODELS = ("transformer", "ttt_linear", "ttt_mlp", "ttt_kernel", "mamba", "linear_attention")
LLAMA_VOCAB = 32000  # the paper's tokenizer, as ttt_bench.reproduce.LLAMA_VOCAB
COLUMNS = ["model", "size", "seq_len", "micro_batch", "params", "loss", "build_s", "step_s", "base_rss_mb",
           "peak_rss_mb", "threads", "note"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(LANGUAGE_MODELS),
                        help="model configs (conf/model/*.yaml)")
    parser.add_argument("--size", default="125m", help="size config (conf/size/*.yaml)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences in the step")
    parser.add_argument("--vocab-size", type=int, default=LLAMA_VOCAB,
                        help="the Llama tokenizer's, as the paper")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a Hydra override for every model, e.g. --set model.block.mini_batch_size=16")


def _max_rss_mb() -> float:
    """This process's resident high-water mark. Linux's VmHWM belongs to the process's own address space;
    getrusage's ru_maxrss survives exec: a child of a large parent (pytest) would report the parent's."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024  # kB
    except (OSError, StopIteration):
        per_kb = 1024 if sys.platform == "darwin" else 1  # bytes on macOS, kilobytes on Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / per_kb / 1024


def one_step(model: str, size: str = "125m", seq_len: int = 64, micro_batch: int = 1,
             vocab_size: int = LLAMA_VOCAB, threads: int = 1, overrides: list[str] = ()) -> dict:
    """One optimizer step of `model` at `size` on CPU in this process: its loss, times and peak memory."""
    import torch
    import torch.nn.functional as F
    from omegaconf import OmegaConf

    from ttt_bench.config import compose
    from ttt_bench.training.module import LitLM

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = compose("train", [f"model={model}", f"size={size}", f"data.seq_len={seq_len}", *overrides])
    base = _max_rss_mb()
    start = time.perf_counter()
    module = LitLM(OmegaConf.to_container(cfg.model, resolve=True),
                   OmegaConf.to_container(cfg.recipe, resolve=True), vocab_size=vocab_size,
                   tokenizer={"kind": "byte"}, max_steps=1000)
    optimizer = module.configure_optimizers()["optimizer"]
    built = time.perf_counter()
    ids = torch.randint(0, vocab_size, (micro_batch, seq_len + 1))
    before = [p.detach().clone() for p in module.parameters()][:1]
    logits = module.model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(module.parameters(), float(cfg.recipe.grad_clip))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    done = time.perf_counter()
    changed = not torch.equal(before[0], next(module.parameters()).detach())
    finite = math.isfinite(loss.item()) and math.isfinite(norm.item())
    return {"model": model, "size": size, "seq_len": seq_len, "micro_batch": micro_batch,
            "params": module.model.num_params(False), "loss": loss.item(), "build_s": built - start,
            "step_s": done - built, "base_rss_mb": base, "peak_rss_mb": _max_rss_mb(), "threads": threads,
            "note": None if finite and changed else "non-finite loss or gradient, or no update"}


def in_fresh_process(model: str, args) -> dict:
    """one_step in a new interpreter (its own peak memory); a crash or an out-of-memory kill is a note."""
    spec = {"model": model, "size": args.size, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
            "vocab_size": args.vocab_size, "threads": args.threads, "overrides": list(args.set)}
    done = subprocess.run([sys.executable, "-m", "ttt_bench.bench.step", json.dumps(spec)],
                          capture_output=True, text=True)
    if done.returncode:
        reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"model": model, "size": args.size, "note": f"failed: {reason}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> pd.DataFrame:
    rows = [in_fresh_process(m, args) for m in args.models.split(",") if m]
    return pd.DataFrame(rows).reindex(columns=COLUMNS)


def summary(df: pd.DataFrame) -> list[str]:
    ok = df[df["note"].isna()]
    if ok.empty:
        return []
    worst = ok.loc[ok["peak_rss_mb"].idxmax()]
    return [f"largest peak: {worst['model']} {worst['peak_rss_mb']:.0f} MB resident "
            f"({worst['params'] / 1e6:.0f}M parameters)"]


if __name__ == "__main__":
    print(json.dumps(one_step(**json.loads(sys.argv[1]))))
