"""Data pipeline: corpora (synthetic, Pile-format files, hub) -> tokenizers -> cached, packed sequences."""

from .corpora import HubCorpus, LocalCorpus, SyntheticCorpus
from .datamodule import LMDataModule

__all__ = ["HubCorpus", "LMDataModule", "LocalCorpus", "SyntheticCorpus"]
