"""The server with API keys of these modules (package scope: started once for them,
stopped when the last of them is done, so it never runs beside another test server).

    keyed_server     `spur serve` (lane tiny only) with API keys in SPUR_API_KEYS:
                     tenants, per-key limits, an admin key; at teardown the server's
                     log must not contain any key
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import Launched, running, server_data, tiny_lane

# -- a second server, with API keys ----------------------------------------------------------
# alice, alice2: tenant acme (two keys of one tenant); bob: tenant globex; solo:
# max_concurrent_requests 1; meter: tokens_per_minute 600; quota: 400; burst: 500;
# cap, refund: 300 each; ops: the admin key.
KEYS = {
    "alice": "sk-alice-8c1f0e2a",
    "alice2": "sk-alice2-77d3b0aa",
    "bob": "sk-bob-4b9d61e0",
    "solo": "sk-solo-0a6e2f19",
    "meter": "sk-meter-5e80c3d4",
    "quota": "sk-quota-3f5a9b27",
    "burst": "sk-burst-91c7e4b2",
    "cap": "sk-cap-6d02b8e5",
    "refund": "sk-refund-c4a1973f",
    "ops": "sk-ops-d2c48a11",
}
KEYS_TEXT = yaml.safe_dump(
    {
        "keys": [
            {"key": KEYS["alice"], "name": "alice", "tenant": "acme"},
            {"key": KEYS["alice2"], "name": "alice2", "tenant": "acme"},
            {"key": KEYS["bob"], "name": "bob", "tenant": "globex"},
            {"key": KEYS["solo"], "name": "solo", "max_concurrent_requests": 1},
            {"key": KEYS["meter"], "name": "meter", "tokens_per_minute": 600},
            {"key": KEYS["quota"], "name": "quota", "tokens_per_minute": 400},
            {"key": KEYS["burst"], "name": "burst", "tokens_per_minute": 500},
            {"key": KEYS["cap"], "name": "cap", "tokens_per_minute": 300},
            {"key": KEYS["refund"], "name": "refund", "tokens_per_minute": 300},
            {"key": KEYS["ops"], "name": "ops", "admin": True},
        ]
    }
)


CORS_ORIGIN = "http://app.example:3000"
"""The one origin browsers may call the keyed server from."""


class KeyedServer(Launched):
    """The server with API keys (`keyed_server`)."""

    def client(self, who: str | None) -> Any:
        """An httpx client sending `who`'s key (None: no key)."""
        import httpx

        headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120.0)


@pytest.fixture(scope="package")
def keyed_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KeyedServer]:
    data = server_data(
        [tiny_lane(tiny_model_dir, "tiny")],
        num_cpus=4,
        requests={"cors_allowed_origins": [CORS_ORIGIN]},
    )
    work = tmp_path_factory.mktemp("e2e-keyed")
    with running(data, work, {"SPUR_API_KEYS": KEYS_TEXT}) as srv:
        server = KeyedServer(**vars(srv))
        yield server
    log_text = server.log()
    leaked = [name for name, key in KEYS.items() if key in log_text]
    assert not leaked, f"keys of {leaked} appear in the server's log"
