"""Models. The registry is the config group `conf/model/`: each entry instantiates a
`LanguageModel` with its own block class (see `lm.py`)."""

from .lm import LanguageModel

__all__ = ["LanguageModel"]
