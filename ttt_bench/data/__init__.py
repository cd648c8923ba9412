"""Data pipeline: corpora (synthetic, Pile-format files, hub) -> tokenizers -> cached, packed sequences;
and MQAR, the synthetic recall task with a loss mask (mqar.py)."""

from .corpora import HubCorpus, LocalCorpus, SyntheticCorpus
from .datamodule import LMDataModule
from .mqar import MQARDataModule

__all__ = ["HubCorpus", "LMDataModule", "LocalCorpus", "MQARDataModule", "SyntheticCorpus"]
