"""`ttt-bench runs [FOLDER ...]`: every run folder under the folders (default: the runs folder) with its
model, size, data, context, status, steps, tokens, validation number (its task's, named by val_metric: a
language model's perplexity, recall's or an image classifier's accuracy) and speed."""

from pathlib import Path

from ttt_bench.cli.common import SUBCOMMANDS, ArgumentParser

from ttt_bench.config import runs_root


def run(args: list[str]) -> None:
    p = ArgumentParser(prog="ttt-bench runs", description=SUBCOMMANDS["runs"])
    p.add_argument("folders", nargs="*", type=Path,
                   help="run folders or folders of runs (default: $TTT_BENCH_RUNS, else runs/)")
    p.add_argument("--csv", action="store_true", help="CSV instead of a table")
    a = p.parse_args(args)
    import pandas as pd

    from ttt_bench.training.runs import INTEGER_COLUMNS, list_runs

    folders = a.folders or [runs_root()]
    table = pd.concat([list_runs(f).assign(folder=str(f)) for f in folders], ignore_index=True)
    if a.csv:
        print(table.to_csv(index=False), end="")
    elif table.empty:
        print(f"no runs in {', '.join(map(str, folders))}")
    else:
        for column in INTEGER_COLUMNS:  # 253952, not 253952.0; blank where unknown, not <NA>
            table[column] = table[column].map(lambda v: "" if pd.isna(v) else str(int(v)))
        table["val"] = table["val"].map(lambda v: "" if pd.isna(v) else f"{v:.4g}")
        table["tokens_per_s"] = table["tokens_per_s"].map(lambda v: "" if pd.isna(v) else f"{v:,.0f}")
        shown = table.drop(columns=["folder"] if len(folders) == 1 else [])
        shown = shown[[c for c in shown.columns if c != "run"] + ["run"]]  # the long folder name last
        print(shown.fillna("").to_string(index=False))
