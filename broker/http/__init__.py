"""The HTTP layer: Quart-trio routes that turn requests into queue commands and replies into bodies."""

from broker.http.app import create_app

__all__ = ["create_app"]
