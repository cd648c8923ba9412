"""Decoding steps replayed from CUDA graphs, so that a step costs its kernels and not Python's launches (the
authors capture decoding in CUDA graphs; the paper's Figure 15, right).

A CUDA graph replays the kernels of one captured call on the same memory with the same arguments: Python
does not run, so whatever a step's Python decides (which branch, which slice, a position baked into a
launch) must be the same at every replay, and every state the step reads or writes must live at the same
address. A decoding cache that allows it is a `StaticCache`:

  graph_key()  the Python state its step's control flow depends on; `DecodeGraphs` captures one graph per
               key (TTT: the position within the mini-batch, so 16 graphs; the KV cache and Mamba: one);
  advance(n)   what a step does to its Python counters (a replay runs no Python);
  make_static()  state that Python would otherwise read moves to the device (the KV cache's position);
  period()     the steps after which its key repeats.

`DecodeGraphs` keeps every tensor of the caches in a buffer of its own: a step that writes a new tensor
(TTT's W_b at a mini-batch's end, the convolution windows, every state on the PyTorch paths; the GPU kernels
write TTT's gradient sums and Mamba's state in place) is followed, inside the graph, by a copy into that
buffer. Each key is run eagerly once (Triton compiles and tunes, cuBLAS makes
its handles, every state tensor appears), captured the second time, and replayed from then on.
"""

import dataclasses
from collections.abc import Callable, Hashable, Iterator

import torch

from ..errors import UserError

Path = tuple  # the fields, keys and indices from a cache to one of its tensors


class StaticCache:
    """The protocol above; the defaults fit a cache whose step does not depend on Python state."""

    def graph_key(self) -> Hashable:
        return ()

    def advance(self, n: int) -> None:
        pass

    def make_static(self) -> None:
        pass

    def period(self) -> int:
        """Steps after which graph_key repeats."""
        return 1


def cuda_graph(step: Callable[[], None]) -> tuple[Callable[[], None], bool]:
    """Capture `step` in a CUDA graph of its own memory pool: (replay, False), the step not run (capture
    records kernels without running them)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay, False


def _leaves(obj, path: Path = ()) -> Iterator[tuple[Path, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _leaves(getattr(obj, f.name), (*path, f.name))
    elif isinstance(obj, dict):
        for k in sorted(obj):
            yield from _leaves(obj[k], (*path, k))
    elif isinstance(obj, (tuple, list)):
        for i, v in enumerate(obj):
            yield from _leaves(v, (*path, i))


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


def _rebind(obj, path: Path, value):
    """obj with the tensor at `path` replaced by `value` (dataclasses and dicts in place, tuples rebuilt)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if dataclasses.is_dataclass(obj):
        setattr(obj, head, _rebind(getattr(obj, head), rest, value))
        return obj
    if isinstance(obj, dict):
        obj[head] = _rebind(obj[head], rest, value)
        return obj
    items = list(obj)
    items[head] = _rebind(items[head], rest, value)
    return type(obj)(items)


class DecodeGraphs:
    """`model(tokens, caches)` for one token [B, 1] per sequence, replayed from CUDA graphs once each key of
    the caches has run eagerly once and been captured once. Returns the logits [B, 1, V] in a buffer that the
    next step overwrites. `capture`: how to capture a step (cuda_graph; the tests pass an emulation)."""

    def __init__(self, model, caches: list, capture: Callable = cuda_graph):
        if why := self.why_not(caches):
            raise UserError(why)
        self.model, self.caches, self.capture = model, caches, capture
        for cache in caches:
            cache.make_static()
        self.buffers: dict[Path, torch.Tensor] = {}
        self.graphs: dict[Hashable, Callable[[], None]] = {}
        self.eager_keys: set[Hashable] = set()
        self.tokens = self.logits = None
        self.replays = 0

    @staticmethod
    def why_not(caches: list) -> str | None:
        """Why these caches cannot decode from CUDA graphs, or None."""
        for cache in caches:
            if not isinstance(cache, StaticCache):
                return (f"{type(cache).__name__} is not a StaticCache (models/graphs.py): this model decodes "
                        "eagerly only")
        return None

    def _key(self) -> Hashable:
        return tuple(cache.graph_key() for cache in self.caches)

    def _bind(self, capturing: bool = False) -> None:
        """Every tensor of the caches into its buffer: a new one is copied in (inside a capture, the copy is
        part of the graph); one seen for the first time becomes its buffer (outside a capture only)."""
        for i, cache in enumerate(self.caches):
            for path, t in list(_leaves(cache, (i,))):
                buffer = self.buffers.get(path)
                if buffer is None:
                    if capturing:
                        raise RuntimeError(f"decoding state {path} first appeared in a CUDA graph capture")
                    own = t._base is None and t.is_contiguous()
                    self.buffers[path] = buffer = t if own else t.clone()
                elif buffer is t:
                    continue
                elif _where(t) == _where(buffer):
                    pass  # written in place, returned as another tensor object: no copy
                elif buffer.shape != t.shape or buffer.dtype != t.dtype:
                    raise UserError(f"decoding state {path} changed from {tuple(buffer.shape)} "
                                    f"{buffer.dtype} to {tuple(t.shape)} {t.dtype}: it cannot decode from "
                                    "a CUDA graph")
                else:
                    buffer.copy_(t)
                _rebind(cache, path[1:], buffer)

    def _step(self) -> None:
        self.logits.copy_(self.model(self.tokens, self.caches))
        self._bind(capturing=True)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        key = self._key()
        if self.tokens is None or self.tokens.shape != tokens.shape:
            if self.graphs:
                raise UserError(f"decoding graphs captured for tokens {tuple(self.tokens.shape)}, called "
                                f"with {tuple(tokens.shape)}")
            self.tokens = tokens.clone()
        self.tokens.copy_(tokens)
        if key in self.graphs:
            self.graphs[key]()
            self.replays += 1
            for cache in self.caches:
                cache.advance(tokens.shape[1])
        elif key not in self.eager_keys:  # warm-up: compile, tune, allocate, outside any capture
            self.eager_keys.add(key)
            logits = self.model(self.tokens, self.caches)
            if self.logits is None:
                self.logits = torch.empty_like(logits)
            self.logits.copy_(logits)
            self._bind()
        else:
            replay, ran = self.capture(self._step)
            if not ran:
                replay()
            self.graphs[key] = self._with_references(replay)
        return self.logits

    def _with_references(self, replay: Callable[[], None]) -> Callable[[], None]:
        """`replay`, then the caches' references as the captured step left them (a state it created, as the
        TTT gradient sums at a mini-batch's start, or dropped): a replay runs no Python to set them."""
        after = [{f.name: getattr(c, f.name) for f in dataclasses.fields(c)
                  if not isinstance(getattr(c, f.name), (int, float, bool, str))} for c in self.caches]

        def replay_and_rebind() -> None:
            replay()
            for cache, references in zip(self.caches, after, strict=True):
                for name, value in references.items():
                    setattr(cache, name, dict(value) if isinstance(value, dict) else value)

        return replay_and_rebind

    @staticmethod
    def warm_up_steps(caches: list) -> int:
        """The steps `warm_up` takes from a cycle's start: each key eager once, captured once, one replay."""
        return 2 * max((cache.period() for cache in caches), default=1) + 1

    def warm_up(self, tokens: Iterator[torch.Tensor], max_steps: int = 1024) -> int:
        """Step (with the next of `tokens`) until a step has replayed a graph: every key of a cycle captured.
        Returns the steps taken."""
        steps = 0
        while not self.replays:
            if steps == max_steps:
                raise UserError(f"no decoding graph replayed in {max_steps} steps: the caches' keys "
                                f"({self._key()}) do not repeat")
            self(next(tokens))
            steps += 1
        return steps
