"""Benchmark suites of `ttt-bench bench`: each module exposes add_arguments(parser) and
run(args) -> DataFrame, and optionally summary(df) -> lines printed after the table (docs/speed.md)."""

SUITES = {
    "models": "prefill/decode latency vs context, training throughput and MFU, peak memory of whole models",
    "forms": "TTT-Linear forward+backward: primal vs dual form (and the Triton kernel on CUDA)",
    "scan": "Mamba's selective scan: C++ kernel vs chunked vs sequential vs mambapy (forward+backward, CPU)",
    "step": "one optimizer step of each language model at a paper size (125m): time and peak memory (CPU)",
    "profile": "where one block's forward+backward spends its time: top operators by device time (profiler)",
}
