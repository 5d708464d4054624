"""Reading the engine key secret the same way in the agent and the gateway.

Both derive each engine's API key from one secret; if they looked for it in different
places, the gateway would send keys the engines refuse.
"""

from __future__ import annotations

from ..settings import Settings


def read_engine_key_secret(settings: Settings) -> str | None:
    """MODELKEEPER_ENGINE_KEY_SECRET, or else the file `up` keeps in its data dir."""
    if settings.engine_key_secret:
        return settings.engine_key_secret
    try:
        return settings.engine_key_secret_file.read_text().strip() or None
    except FileNotFoundError:
        return None
