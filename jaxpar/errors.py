"""Exceptions that jaxpar raises for the user (one line, naming field, value and rule)."""


class JaxparError(Exception):
    """Base class of errors meant for the user rather than a traceback."""


class ConfigError(JaxparError, ValueError):
    """A configuration value breaks a rule; raised before anything is compiled."""


class CheckpointError(JaxparError):
    """A checkpoint cannot be written or restored safely."""
