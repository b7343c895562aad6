"""An OpenAI- and Anthropic-compatible HTTP server for one lily model (needs the `serve` extra: fastapi,
uvicorn, llguidance).

    from lily.server import create_app, ServerConfig
    app = create_app(lily.Model.load(path), ServerConfig(api_key="secret"))
"""

from .app import ServerConfig, create_app

__all__ = ["create_app", "ServerConfig"]
