"""The ``fdq`` command line (click + rich): commands call fdq's Python API, build
rows and render them as tables for people or JSON for scripts.

``params`` judges command-line values with FDQ's own rules; ``rows`` builds rows from
the API; ``render`` prints them; ``commands`` is the click app."""
from .commands import cli, main
from . import web  # noqa: F401,E402 - registers ``fdq web`` on cli

__all__ = ["cli", "main"]
