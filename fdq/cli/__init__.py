"""The ``fdq`` command line (click + rich): commands call fdq's Python API, build
rows and render them as tables for people or JSON for scripts.

``app`` is the click group (the state, shared options, how a command ends); the
commands live by what they drive: ``topics`` (and stats, consumers), ``messages``
(push, tail), ``peek`` (peek, get), ``admin`` (pause, play, rebalance, replay, trim, dlq), ``subs``,
``broker``, ``web``, ``worker`` (run a handler). ``params`` judges command-line values with FDQ's own rules;
``rows`` builds rows from the API; ``render`` prints them."""
from .app import cli, main
from . import admin, broker, messages, peek, subs, topics, web, worker  # noqa: F401,E402 - each registers its commands

__all__ = ["cli", "main"]
