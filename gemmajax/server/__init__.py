"""The OpenAI-compatible HTTP server and the `gemmajax` command line.

`build_app(engine_client, api_key=..., max_queue=...)` gives the Starlette app; `main()` is the console
script. Names load lazily so `gemmajax --help` does not import the web stack.
"""

__all__ = ["EngineClient", "build_app", "main"]


def __getattr__(name: str):
    if name in ("build_app", "EngineClient"):
        from gemmajax.server import app

        return getattr(app, name)
    if name == "main":
        from gemmajax.server.cli import main

        return main
    raise AttributeError(f"module 'gemmajax.server' has no attribute {name!r}")
