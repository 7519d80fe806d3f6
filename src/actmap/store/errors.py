"""The store's error type, in a module of its own so the store's parts can raise it."""

from actmap.errors import ActmapUserError


class StoreError(ActmapUserError, RuntimeError):
    """A store folder, manifest or shard is missing, corrupt or of another schema."""
