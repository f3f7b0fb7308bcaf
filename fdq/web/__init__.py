"""``fdq web``: a live dashboard of topics, subscriptions, consumers and dead letters.

``app.WebApp`` is the whole of it behind one call (``handle``): a JSON API over
``fdq.Supervisor`` and the page's static files (``static/``: hand-written HTML, CSS and
JavaScript, charts drawn on a canvas; nothing loaded from elsewhere). ``server`` serves
it with the standard library; the broker mounts it under a path (``--web-path``).
``history`` samples stats for the charts; ``access`` says who may read and act.
"""
from .app import WebApp

__all__ = ["WebApp"]
