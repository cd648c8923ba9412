"""User-facing errors: one line that says what is wrong and how to fix it."""


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint). The CLI prints it as one line, exit code 2."""


class Interrupted(Exception):
    """Ctrl-C or SIGTERM: training saved a checkpoint at its last finished step and stopped. The CLI prints
    the message as one line, exit code 130; a sweep stops instead of recording a failed run."""

    def __init__(self, step: int | None = None, total: int | None = None):
        where = "" if step is None else f" at step {step} of {total}"
        super().__init__(f"interrupted{where}; the same command resumes")
