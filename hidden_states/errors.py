"""Errors the extractor reports in one clear line (naming the file, line or argument)."""


class ExtractError(Exception):
    """Base: a problem the user can fix; printed without a traceback, exit code 2."""

    exit_code = 2


class InputError(ExtractError):
    """Bad input data, named ``file:line``."""


class UsageError(ExtractError):
    """A bad argument, named by its flag."""


class OutputError(ExtractError):
    """The output directory cannot take the results (not writable, full, another run's files)."""


class PreflightError(ExtractError):
    """A check before any weight is loaded failed."""
