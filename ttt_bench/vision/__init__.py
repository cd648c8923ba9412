"""MTTT ("Learning to (Learn at Test Time)"): image classification with TTT layers in a ViT (docs/mttt.md)."""

from .mixers import LinearAttention, MTTTLayer, NadarayaWatson, SelfAttention
from .vit import ViTClassifier

__all__ = ["LinearAttention", "MTTTLayer", "NadarayaWatson", "SelfAttention", "ViTClassifier"]
