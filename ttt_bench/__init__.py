"""ttt-bench: reproduce 'Learning to (Learn at Test Time): RNNs with Expressive Hidden States'."""

import os

# torch's OpenMP threads spin while they wait for work by default. On a CPU shared with another job (a sweep
# beside `make test`, two runs on two cores) a spinning thread holds the core its partner needs, and small
# ops wait for the scheduler: a tiny model's evaluation took 11.7 s instead of 0.14 s beside a 2-job sweep
# (docs/speed.md). Sleeping waiters avoid that. It must be set before torch loads OpenMP, i.e. before
# the first `import torch`; a value the user set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
