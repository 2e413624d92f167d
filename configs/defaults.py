"""Defaults that the config schema and the code below it share.

`configs/schema.py` declares the settings; the engine core (which must not load
pydantic's config tree) and the router read these constants from here, so that
a default has one source without the config layer importing the engine.
Standard library only.
"""

from __future__ import annotations

DEFAULT_HASH_SEED = "spur-kv-v1"
"""Seed of the chained block hashes (`scheduler.hash_seed`): every engine and
the router must agree on it; changing it invalidates every cached prefix."""
