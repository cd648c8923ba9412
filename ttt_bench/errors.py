"""User-facing errors: one line that says what is wrong and how to fix it."""


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint). The CLI prints it as one line, exit code 2."""
