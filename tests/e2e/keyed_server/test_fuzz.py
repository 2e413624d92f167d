"""Fuzzing the API from its own /openapi.json with schemathesis (on the keyed
server of conftest: every route, admin included, with and without keys).

For each operation, cases generated from the published schema (positive) and
against it (negative): no response is a 5xx, every 4xx carries OpenAI's error
body, every operation with a request body is answered 2xx at least once (the
fuzzing reaches the engine: a schema the server rejects wholesale, schemathesis's
"schema validation mismatch", fails the test; each schema's published example is
the first positive case, since 30 generated chat requests may all be invalid by
rules a schema cannot state), the server keeps serving, and afterwards every
engine's pool has every block free and no leak reported.

SPUR_FUZZ_EXAMPLES sets the cases per operation and mode (default 30; the
README's figures come from 250).
"""

from __future__ import annotations

import collections
import json
import os
import time
from typing import Any

import pytest

from e2e.keyed_server.conftest import KEYS, KeyedServer

pytestmark = pytest.mark.slow

EXAMPLES = int(os.environ.get("SPUR_FUZZ_EXAMPLES", "30"))
BODY_OPERATIONS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/admin/reset_prefix_cache",
)
OPEN_PATHS = ("/health", "/health/live", "/metrics")
CAPS = {"max_tokens": 8, "max_completion_tokens": 8, "min_tokens": 8, "n": 2}
"""Generation lengths are capped: the point is every input's handling, not long
generations (a fuzzer's max_tokens of 10^9 would otherwise run to max_model_len)."""


def _cap(body: Any) -> None:
    if isinstance(body, dict):
        for key, limit in CAPS.items():
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > limit:
                body[key] = limit


def _check_error_body(op: str, case: Any, response: Any) -> str | None:
    """None when a 4xx response is OpenAI's error object, else the problem."""
    try:
        error = response.json()["error"]
    except (ValueError, KeyError, TypeError):
        return f"{op}: {response.status_code} without an error object: {response.text[:200]}"
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return f"{op}: malformed error object {error!r}"
    if not isinstance(error["message"], str) or not error["message"]:
        return f"{op}: empty error message"
    return None


def _wait_idle(session: Any, url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEYS['ops']}"}
    deadline = time.monotonic() + timeout_s
    while True:
        engines = session.get(f"{url}/admin/engines", headers=headers, timeout=30).json()
        idle = all(
            "error" not in s
            and s["num_running"] == 0
            and s["num_waiting"] == 0
            and s["num_free_blocks"] == s["num_blocks"] - 1
            for s in engines.values()
        )
        if idle:
            return engines
        assert time.monotonic() < deadline, f"blocks not free after {timeout_s} s: {engines}"
        time.sleep(0.25)


def test_fuzz_every_route(keyed_server: KeyedServer, tmp_path: Any) -> None:
    import requests
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    url = keyed_server.url
    api = {"Authorization": f"Bearer {KEYS['alice']}"}
    admin = {"Authorization": f"Bearer {KEYS['ops']}"}
    session = requests.Session()
    doc = session.get(f"{url}/openapi.json", headers=api, timeout=30).json()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert set(BODY_OPERATIONS) <= paths and "/v1/models" in paths
    for op in operations:
        if op.path in BODY_OPERATIONS:
            assert op.body, f"{op.path} publishes no request body schema"

    counts: collections.Counter[tuple[str, str, int]] = collections.Counter()
    problems: list[str] = []
    started = time.monotonic()

    def fuzzer(op: Any, mode: Any, headers: dict[str, str]) -> Any:
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case: Any) -> None:
            _cap(case.body)
            response = case.call(base_url=url, session=session, headers=headers, timeout=120)
            counts[(op.path, mode.value, response.status_code)] += 1
            if response.status_code >= 500:
                problems.append(
                    f"{op.method.upper()} {op.path} {mode.value}: {response.status_code} "
                    f"{response.text[:300]} for body {json.dumps(case.body, default=str)[:300]}"
                )
            elif response.status_code >= 400:
                problem = _check_error_body(op.path, case, response)
                if problem:
                    problems.append(problem)

        return run

    for op in operations:
        headers = admin if op.path.startswith("/admin") else api
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            try:
                fuzzer(op, mode, headers)()
            except Unsatisfiable:  # nothing to negate (no parameters, no body)
                assert mode == GenerationMode.NEGATIVE, op.path
    elapsed = time.monotonic() - started

    # Without a key (and with the wrong role) every operation but the open ones is refused.
    for op in operations:
        response = session.request(op.method.upper(), f"{url}{op.path}", json={}, timeout=30)
        if op.path in OPEN_PATHS:
            assert response.status_code != 401, op.path
            continue
        assert response.status_code == 401, (op.path, response.text)
        assert _check_error_body(op.path, None, response) is None
        role = api if op.path.startswith("/admin") else admin
        wrong = session.request(
            op.method.upper(), f"{url}{op.path}", json={}, headers=role, timeout=30
        )
        assert wrong.status_code == 403, (op.path, wrong.text)

    summary: dict[str, Any] = {
        "cases": sum(counts.values()),
        "seconds": round(elapsed, 1),
        "examples_per_operation_and_mode": EXAMPLES,
    }
    by_status: collections.Counter[int] = collections.Counter()
    for (_, _, status), n in counts.items():
        by_status[status] += n
    summary["by_status"] = {str(k): v for k, v in sorted(by_status.items())}
    print("fuzz summary:", json.dumps(summary))
    assert not problems, "\n".join(problems[:20])
    for path in BODY_OPERATIONS:
        ok = sum(n for (p, m, s), n in counts.items() if p == path and m == "positive" and s < 300)
        assert ok > 0, f"{path}: no generated request was accepted (schema validation mismatch)"

    # still serving, and every block back in the pool
    r = session.post(
        f"{url}/v1/completions",
        json={"model": "tiny", "prompt": "still there?", "max_tokens": 4},
        headers=api,
        timeout=60,
    )
    assert r.status_code == 200, r.text
    engines = _wait_idle(session, url)
    assert all(s.get("kv_leak_violations", 0) == 0 for s in engines.values()), engines
