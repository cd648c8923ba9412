"""Tokenizers: byte-level (default, no downloads), a BPE trained on the training split, any Hugging Face
hub tokenizer by name or from a local tokenizer.json (`path`, for machines without the hub), or MQAR's
identity vocabulary (its token ids are the data). Each is described by a small dict (`spec`) saved in
checkpoints, so `eval` and `generate` rebuild exactly the tokenizer a model was trained with."""

import hashlib
import json
import os
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
        """Space-separated token ids, each below the vocabulary size (e.g. "3 17 5")."""
        try:
            ids = np.asarray([int(t) for t in text.split()], dtype=np.int64)
        except ValueError:
            ids = None
        if ids is None or ((ids < 0) | (ids >= self.vocab_size)).any():
            raise UserError(f"an MQAR model reads space-separated token ids in [0, {self.vocab_size}), e.g. "
                            f"'3 17 5', not {text[:40]!r}")
        return ids

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
        tok = _local_tokenizer(spec["path"]) if spec.get("path") else _hub_tokenizer(spec)
        # where the file lay and unset keys are not part of the tokenizer: one tokenizer, one spec and cache
        described = {k: v for k, v in spec.items() if k != "path" and v is not None}
        return HFTokenizer(tok, {**described, "json": tok.to_str()}, spec.get("eos_token"))
    raise UserError(f"unknown tokenizer kind '{kind}'; use one of: byte, bpe, hf, mqar")


def _hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (as huggingface_hub reads it): then the hub is never asked."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def _local_tokenizer(path):
    """data.tokenizer.path: a tokenizer.json, or a folder holding one (a hub snapshot, a copied folder)."""
    from tokenizers import Tokenizer

    path = Path(path).expanduser()
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"data.tokenizer.path={path}: no tokenizer.json there; give the file or the folder "
                        "that holds it (docs/offline.md)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # noqa: BLE001  (the tokenizers library raises a bare Exception)
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"data.tokenizer.path={file} is not a tokenizers tokenizer.json ({first})") from None


def _hub_tokenizer(spec: dict):
    """data.tokenizer.name: the hub tokenizer's tokenizer.json from the local hub cache, downloaded into it
    first when online."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import LocalEntryNotFoundError
    from tokenizers import Tokenizer

    name = spec.get("name")
    if not name:
        raise UserError("data.tokenizer.kind=hf needs data.tokenizer.name=ORG/MODEL (a hub tokenizer) or "
                        "data.tokenizer.path=DIR (a local tokenizer.json)")
    try:
        file = hf_hub_download(name, "tokenizer.json", local_files_only=_hub_offline())
    except LocalEntryNotFoundError:  # offline, or the hub unreachable, and not in the cache
        why = "HF_HUB_OFFLINE is set" if _hub_offline() else "the hub cannot be reached"
        raise UserError(f"Hugging Face tokenizer '{name}' is not in the local hub cache and {why}: set "
                        "data.tokenizer.path=DIR to a folder with its tokenizer.json (docs/offline.md)"
                        ) from None
    except Exception as e:  # noqa: BLE001  (unknown or gated name, no tokenizer.json, HTTP errors)
        raise UserError(f"could not load Hugging Face tokenizer '{name}' ({type(e).__name__}); check the "
                        "name and your access to it (HF_TOKEN), set data.tokenizer.path=DIR to a local "
                        "tokenizer.json, or use data.tokenizer.kind=byte") from None
    return Tokenizer.from_file(file)


def fingerprint(spec: dict) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
