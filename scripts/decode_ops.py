"""Operators one decoding step launches, per model at a paper size: each is a kernel launch on a GPU (a few
microseconds of Python and driver each), which a CUDA graph replays without Python (models/graphs.py).
Counts the aten operators and Triton kernels of one eager step, batch 1, after a prefill of 33 tokens (TTT: at
a position inside a mini-batch, and at its last position, where W is updated). With --triton the TTT layers
take their Triton decode kernels, as on a GPU (here in Triton's interpreter).

    python scripts/decode_ops.py --size 125m --models transformer,ttt_linear,ttt_mlp,mamba
    TRITON_INTERPRET=1 python scripts/decode_ops.py --size 125m --models ttt_linear,ttt_mlp --triton
"""

import argparse

import torch
from hydra.utils import instantiate
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ttt_bench.config import compose


def _storages(tree) -> set:
    return {t.untyped_storage().data_ptr() for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


class Count(TorchDispatchMode):
    """aten operators that launch a kernel, and Triton kernels (counted by patching the launcher). An operator
    launches if it returns a tensor and writes memory: not a view, not a no-op cast (an output in an input's
    storage, unless the operator writes in place), not metadata (promote_types)."""

    def __init__(self):
        super().__init__()
        self.launches, self.in_triton = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = _storages(out)
        in_place = func._schema.name.endswith("_") or any(a.is_out for a in func._schema.arguments)
        fresh = outputs and (in_place or not outputs <= _storages((args, kwargs)))
        if fresh and not self.in_triton:  # not the interpreter's own
            self.launches += 1
        return out

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self.run = InterpretedFunction.run

        def counted(fn, *args, **kwargs):
            self.launches, self.in_triton = self.launches + 1, True
            try:
                return self.run(fn, *args, **kwargs)
            finally:
                self.in_triton = False

        InterpretedFunction.run = counted
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self.run
        return super().__exit__(*exc)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="125m")
    p.add_argument("--models", default="transformer,ttt_linear,ttt_mlp,mamba")
    p.add_argument("--triton", action="store_true", help="TTT's Triton decode kernels (TRITON_INTERPRET=1)")
    args = p.parse_args()
    extra = ["model.block.kernel=triton"] if args.triton else []
    print("| model | size | operators a step (inside a mini-batch) | at a mini-batch's end |")
    print("|---|---|---|---|")
    for name in args.models.split(","):
        cfg = compose("train", [f"model={name}", f"size={args.size}", "data.seq_len=64",
                                *(extra if name.startswith("ttt") else [])])
        model = instantiate(cfg.model, vocab_size=32000).eval()
        with torch.inference_mode():
            caches = model.init_caches(1, max_len=64)
            model(torch.zeros(1, 33, dtype=torch.long), caches)  # 33: position 33 is inside a mini-batch
            counts = []
            for _ in range(15):  # to position 48, the last of the third mini-batch of 16
                with Count() as c:
                    model(torch.zeros(1, 1, dtype=torch.long), caches)
                counts.append(c.launches)
        kernels = " (Triton decode kernels)" if args.triton and name.startswith("ttt") else ""
        print(f"| {name}{kernels} | {args.size} | {counts[0]} | {counts[-1]} |", flush=True)


if __name__ == "__main__":
    main()
