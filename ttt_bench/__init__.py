"""ttt-bench: reproduce 'Learning to (Learn at Test Time): RNNs with Expressive Hidden States'."""

__version__ = "0.1.0"
