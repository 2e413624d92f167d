"""`spur dashboards push`: create or update, in a Grafana, the Prometheus data
source spur's dashboards use, a `spur` folder and the three dashboards
(`spur.cluster.dashboards`), with grafana-client.

Idempotent: the data source and the folder are found by their fixed uids and
updated in place; dashboards are posted with `overwrite: true` under their
fixed uids, so a second push updates them (Grafana bumps their version) and
never duplicates. An existing data source is read and spur's fields merged into
it (`merged_datasource`): what an operator added there (basic auth, TLS, headers,
other jsonData, secure settings) stays. Failures are one-line `PushError`s: an
unreachable Grafana, refused credentials (401 / 403), a conflict (409 / 412),
anything else Grafana answers with an error, and an answer that is not Grafana's
API at all (a login page, another web app on the port: a 200 text/html).

grafana-client is pinned below 4 (pyproject.toml): 3.11 is the last release on
`requests`; 4.x and 5.x use niquests, whose urllib3-future replaces the
environment's urllib3 module and breaks every `requests`-based tool.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from spur.cluster.dashboards import (
    DASHBOARDS,
    DATASOURCE_UID,
    FOLDER_TITLE,
    FOLDER_UID,
    dashboard_json,
)

DATASOURCE_NAME = "spur-prometheus"


class PushError(Exception):
    """A push that failed; the message is one line naming the cause and the fix."""


def datasource_body(prometheus_url: str) -> dict[str, Any]:
    return {
        "uid": DATASOURCE_UID,
        "name": DATASOURCE_NAME,
        "type": "prometheus",
        "access": "proxy",
        "url": prometheus_url,
        "isDefault": False,
        "jsonData": {"httpMethod": "POST", "timeInterval": "15s"},
    }


def merged_datasource(existing: dict[str, Any], prometheus_url: str) -> dict[str, Any]:
    """The body that updates `existing` (Grafana's GET of spur's data source): spur's
    uid, name, type, access and url over it, its jsonData keys only where the existing
    one has none (an operator's timeInterval or httpMethod stays), everything else
    (basicAuth, basicAuthUser, withCredentials, isDefault, version, other jsonData) as
    it is. Secure settings are never read back; Grafana keeps them when an update
    sends none."""
    ours = datasource_body(prometheus_url)
    body = {**existing}
    for key in ("uid", "name", "type", "access", "url"):
        body[key] = ours[key]
    body["jsonData"] = {**ours["jsonData"], **(existing.get("jsonData") or {})}
    body.pop("secureJsonFields", None)  # read-only: which secure keys are set
    return body


def push(
    grafana_url: str,
    *,
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
    prometheus_url: str = "http://prometheus:9090",
    timeout_s: float = 10.0,
) -> dict[str, Any]:
    """Push the data source, folder and dashboards. Returns what was done:
    {"datasource": "created" | "updated", "folder": ..., "dashboards": [uid, ...]}.
    Raises PushError."""
    import requests
    from grafana_client import GrafanaApi
    from grafana_client.client import GrafanaClientError, GrafanaException

    credential: Any = token if token else ((user, password or "") if user else None)
    api = GrafanaApi.from_url(grafana_url, credential=credential, timeout=timeout_s)
    where = grafana_url.split("@")[-1]  # never echo credentials of a user:pass@ URL
    base = where.rstrip("/") + "/api"

    def answer(path: str, reply: Any, ok: Callable[[dict[str, Any]], bool] = bool) -> Any:
        """`reply` when it is a JSON object `ok` accepts; else a PushError (grafana-client
        returns a text/* body as a string: a login page, another web app)."""
        if isinstance(reply, dict) and ok(reply):
            return reply
        raise PushError(_not_grafana(f"{base}{path}", reply))

    try:
        answer("/health", api.health.check(), lambda r: r.get("database") == "ok")
        done: dict[str, Any] = {}
        ds_path = f"/datasources/uid/{DATASOURCE_UID}"
        existing = _get(lambda: api.datasource.get_datasource_by_uid(DATASOURCE_UID))
        if existing is not None:
            existing = answer(ds_path, existing, lambda r: r.get("uid") == DATASOURCE_UID)
            body = merged_datasource(existing, prometheus_url)
            answer(ds_path, api.datasource.update_datasource_by_uid(DATASOURCE_UID, body))
            done["datasource"] = "updated"
        else:
            body = datasource_body(prometheus_url)
            answer("/datasources", api.datasource.create_datasource(body))
            done["datasource"] = "created"
        folder = _get(lambda: api.folder.get_folder(FOLDER_UID))
        if folder is not None:
            answer(f"/folders/{FOLDER_UID}", folder, lambda r: r.get("uid") == FOLDER_UID)
            done["folder"] = "exists"
        else:
            created = api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
            answer("/folders", created, lambda r: r.get("uid") == FOLDER_UID)
            done["folder"] = "created"
        done["dashboards"] = []
        for d in DASHBOARDS:
            model = {**dashboard_json(d), "id": None}
            posted = api.dashboard.update_dashboard(
                {
                    "dashboard": model,
                    "folderUid": FOLDER_UID,
                    "overwrite": True,
                    "message": "spur dashboards push",
                }
            )
            answer(
                "/dashboards/db",
                posted,
                lambda r, uid=d.uid: r.get("status") == "success" and r.get("uid") == uid,
            )
            done["dashboards"].append(d.uid)
        return done
    except json.JSONDecodeError as exc:  # a 2xx body that is neither JSON nor text/*
        raise PushError(_not_grafana(base, f"{type(exc).__name__}: {exc}")) from None
    except requests.exceptions.RequestException as exc:
        raise PushError(
            f"cannot reach Grafana at {where} ({type(exc).__name__}): check --grafana-url"
        ) from None
    except GrafanaClientError as exc:
        code = exc.status_code
        if code in (401, 403):
            raise PushError(
                f"Grafana at {where} refused the credentials ({code}): pass --token (a "
                "service-account token with the Editor role) or --user/--password"
            ) from None
        if code in (409, 412):
            raise PushError(
                f"Grafana at {where} reports a conflict ({code}: {_message(exc)}): another "
                f"object holds spur's uid or name; rename or delete it and push again"
            ) from None
        raise PushError(f"Grafana at {where} answered {code}: {_message(exc)}") from None
    except GrafanaException as exc:
        raise PushError(f"Grafana at {where} failed ({exc.status_code}: {_message(exc)})") from None


def _get(get: Callable[[], Any]) -> Any:
    """`get()`'s answer; None for a 404."""
    from grafana_client.client import GrafanaClientError

    try:
        return get()
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return None
        raise


def _not_grafana(url: str, reply: Any) -> str:
    shown = " ".join(str(reply).split())[:80] if reply not in (None, "") else "an empty body"
    return (
        f"{url} answered {shown!r}: not a Grafana API answer; check --grafana-url (Grafana's "
        "own root URL, not a login page, proxy or other web app)"
    )


def _message(exc: Any) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    return str(getattr(exc, "message", exc)).splitlines()[0][:200]
