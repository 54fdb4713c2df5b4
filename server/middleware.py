"""HTTP options around the app that vLLM's server takes from its command line: CORS
(``--allowed-origins``, ``--allowed-methods``, ``--allowed-headers``,
``--allow-credentials``, through flask-cors, as vLLM adds Starlette's CORSMiddleware) and
``--root-path`` (the path prefix a proxy serves the API under).
"""
from __future__ import annotations

from typing import Optional, Sequence

# What "*" in --allowed-methods stands for (Starlette's list, as vLLM answers a preflight).
ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")
PREFLIGHT_MAX_AGE_S = 600  # Starlette's default, so browsers cache a preflight as with vLLM


def enable_cors(app, origins: Sequence[str] = ("*",), methods: Sequence[str] = ("*",),
                headers: Sequence[str] = ("*",), allow_credentials: bool = False) -> None:
    """Answer CORS preflights and add the CORS headers to every response of ``app`` (a
    Flask app), vLLM's defaults being every origin, method and header. A preflight
    (``OPTIONS``) needs no API key: the app's gate lets it through."""
    from flask_cors import CORS

    methods = ALL_METHODS if "*" in methods else tuple(m.upper() for m in methods)
    # every origin without credentials: "*" (as Starlette); with credentials the caller's
    # origin is echoed, since browsers refuse "*" for a credentialed request
    CORS(app, origins=list(origins), methods=list(methods), allow_headers=list(headers),
         supports_credentials=bool(allow_credentials), max_age=PREFLIGHT_MAX_AGE_S,
         send_wildcard="*" in origins and not allow_credentials)


def mount_at_root_path(app, root_path: Optional[str]) -> None:
    """Serve ``app`` both at ``/`` and under ``root_path`` (e.g. ``/llm``: ``/llm/v1/models``
    is ``/v1/models``, with ``SCRIPT_NAME`` set), so it works behind a proxy that keeps
    the prefix as well as one that strips it. Raises ValueError unless ``root_path``
    starts with "/"."""
    if not root_path or root_path == "/":
        return
    if not root_path.startswith("/"):
        raise ValueError(f"--root-path must start with '/', got {root_path!r}.")
    from werkzeug.middleware.dispatcher import DispatcherMiddleware

    inner = app.wsgi_app
    app.wsgi_app = DispatcherMiddleware(inner, {root_path.rstrip("/"): inner})


def apply_http_options(app, args) -> None:
    """CORS and the root path from ``args`` (the ``vengine serve`` namespace, or any
    object; missing attributes take vLLM's defaults: CORS for every origin, method and
    header, without credentials; no root path)."""
    enable_cors(app, origins=getattr(args, "allowed_origins", None) or ("*",),
                methods=getattr(args, "allowed_methods", None) or ("*",),
                headers=getattr(args, "allowed_headers", None) or ("*",),
                allow_credentials=bool(getattr(args, "allow_credentials", False)))
    mount_at_root_path(app, getattr(args, "root_path", None))
