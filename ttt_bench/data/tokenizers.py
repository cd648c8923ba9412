"""Tokenizers: byte-level (default, no downloads), a BPE trained on the training split, any Hugging Face
hub tokenizer by name, or MQAR's identity vocabulary (its token ids are the data). Each is described by a
small dict (`spec`) saved in checkpoints, so `eval` and `generate` rebuild exactly the tokenizer a model was
trained with."""

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from ..errors import UserError


class ByteTokenizer:
    """UTF-8 bytes 0..255, EOS = 256."""

    byte_level = True

    def __init__(self):
        self.vocab_size, self.eos_id = 257, 256

    @property
    def spec(self) -> dict:
        return {"kind": "byte"}

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A `tokenizers.Tokenizer`: trained BPE (serialised JSON in the spec) or a hub tokenizer by name."""

    byte_level = False

    def __init__(self, tokenizer, spec: dict, eos_token: str | None = None):
        self.tok, self._spec = tokenizer, spec
        eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        if eos_id is None:
            for candidate in ("</s>", "<|endoftext|>", "<eos>", "[SEP]"):
                eos_id = tokenizer.token_to_id(candidate)
                if eos_id is not None:
                    break
        if eos_id is None:
            raise UserError(
                f"tokenizer {spec.get('name', 'bpe')} has no end-of-text token; set tokenizer.eos_token"
            )
        self.eos_id = eos_id
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def spec(self) -> dict:
        return self._spec

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [
            np.asarray(e.ids, dtype=np.int64) for e in self.tok.encode_batch(texts, add_special_tokens=False)
        ]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode(list(ids))


class MQARVocab:
    """The identity 'tokenizer' of MQAR (data/mqar.py): token ids are the data."""

    byte_level = False
    eos_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    @property
    def spec(self) -> dict:
        return {"kind": "mqar", "vocab_size": self.vocab_size}

    def encode(self, text: str) -> np.ndarray:
        return np.asarray([int(t) for t in text.split()], dtype=np.int64)

    def decode(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def train_bpe(texts: Iterator[str], vocab_size: int, cache_dir: Path, key: str) -> HFTokenizer:
    """Byte-level BPE trained on `texts` (the training split), cached under `cache_dir/bpe-<key>.json`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = cache_dir / f"bpe-{key}.json"
    if not path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(texts, trainer=trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(tok.to_str())
        tmp.replace(path)
    return from_spec({"kind": "bpe", "json": path.read_text()})


def from_spec(spec: dict):
    """Rebuild a tokenizer from its spec (as saved in a checkpoint)."""
    from tokenizers import Tokenizer

    kind = spec.get("kind")
    if kind == "byte":
        return ByteTokenizer()
    if kind == "mqar":  # MQAR's token ids are the data (data/mqar.py)
        return MQARVocab(int(spec["vocab_size"]))
    if kind in ("bpe", "hf") and "json" in spec:
        return HFTokenizer(Tokenizer.from_str(spec["json"]), spec, spec.get("eos_token"))
    if kind == "hf":
        try:
            tok = Tokenizer.from_pretrained(spec["name"])
        except Exception as e:  # network or unknown name
            raise UserError(
                f"could not load Hugging Face tokenizer '{spec['name']}' ({type(e).__name__}); "
                "check the name and that the hub is reachable, or use data.tokenizer.kind=byte"
            ) from None
        return HFTokenizer(tok, {**spec, "json": tok.to_str()}, spec.get("eos_token"))
    raise UserError(f"unknown tokenizer kind '{kind}'; use one of: byte, bpe, hf, mqar")


def fingerprint(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
