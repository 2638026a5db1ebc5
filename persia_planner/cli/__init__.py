"""The ``persia`` command (``python -m persia_planner.cli`` runs it too): a thin shell over the Python API."""

from persia_planner.cli.commands import app, main

__all__ = ["app", "main"]
