"""OpenAI-compatible HTTP server (``pip install "lookupdec[server]"``): ``create_app(engine,
model_name)`` builds the FastAPI app, ``serve(model, ...)`` loads a model and runs uvicorn."""
from lookupdec.server.app import create_app, serve

__all__ = ["create_app", "serve"]
