"""Benchmark suites of `ttt-bench bench`: each module exposes add_arguments(parser) and run(args) -> DataFrame."""
