"""`longspec serve`: an OpenAI-compatible HTTP server over the engine."""

from longspec.serve.app import ServeOptions, create_app

__all__ = ["ServeOptions", "create_app"]
