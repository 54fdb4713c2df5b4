"""vengine's OpenAI-compatible HTTP server (Flask on gevent's pywsgi, SSE streaming)."""
from .app import create_app
from .wsgi import BackgroundServer, make_server

__all__ = ["create_app", "make_server", "BackgroundServer"]
