"""Exceptions that jaxpar raises for the user (one line, naming field, value and rule)."""


class JaxparError(Exception):
    """Base class of errors meant for the user rather than a traceback."""


class ConfigError(JaxparError, ValueError):
    """A configuration value breaks a rule; raised before anything is compiled."""


class CheckpointError(JaxparError):
    """A checkpoint cannot be written or restored safely."""


class JaxparWarning(UserWarning):
    """Base class of jaxpar's warnings (the command line prints each as one line)."""


def one_line(text: object) -> str:
    """``text`` on one line: embedded line breaks shown as ``\\n`` (a refusal is one line)."""
    return str(text).replace("\r\n", "\n").replace("\r", "\n").replace("\n", "\\n")
