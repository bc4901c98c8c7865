"""Subcommands of the ``jaxpar`` CLI (see :mod:`jaxpar.cli`)."""
