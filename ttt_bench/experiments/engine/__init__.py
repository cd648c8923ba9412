"""The engine every experiment shares: plan (typed runs), runner (Hydra multirun, restore, progress),
registry, cost, n-gram floors, statistics and verdicts, tables, plotting conventions, step folders and the
report. It knows no experiment by name."""
