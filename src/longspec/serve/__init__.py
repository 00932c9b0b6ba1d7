"""`longspec serve`: an OpenAI-compatible HTTP server over the engine. Its modules are
imported where used (`longspec.serve.app`), so the CLI runs without the serve extra."""


def __getattr__(name: str):
    if name in ("ServeOptions", "create_app"):
        from longspec.serve import app

        return getattr(app, name)
    raise AttributeError(name)


__all__ = ["ServeOptions", "create_app"]
