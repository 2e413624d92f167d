"""`spur dashboards push`: create or update, in a Grafana, the Prometheus data
source spur's dashboards use, a `spur` folder and the three dashboards
(`spur.cluster.dashboards`), with grafana-client.

Idempotent: the data source and the folder are found by their fixed uids and
updated in place; dashboards are posted with `overwrite: true` under their
fixed uids, so a second push updates them (Grafana bumps their version) and
never duplicates. Failures are one-line `PushError`s: an unreachable Grafana,
refused credentials (401 / 403), a conflict (409 / 412), anything else Grafana
answers with an error.

grafana-client is pinned below 4 (pyproject.toml): 3.11 is the last release on
`requests`; 4.x and 5.x use niquests, whose urllib3-future replaces the
environment's urllib3 module and breaks every `requests`-based tool.
"""

from __future__ import annotations

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
    try:
        api.health.check()
        done: dict[str, Any] = {}
        body = datasource_body(prometheus_url)
        if _exists(lambda: api.datasource.get_datasource_by_uid(DATASOURCE_UID)):
            api.datasource.update_datasource_by_uid(DATASOURCE_UID, body)
            done["datasource"] = "updated"
        else:
            api.datasource.create_datasource(body)
            done["datasource"] = "created"
        if _exists(lambda: api.folder.get_folder(FOLDER_UID)):
            done["folder"] = "exists"
        else:
            api.folder.create_folder(FOLDER_TITLE, uid=FOLDER_UID)
            done["folder"] = "created"
        done["dashboards"] = []
        for d in DASHBOARDS:
            model = {**dashboard_json(d), "id": None}
            api.dashboard.update_dashboard(
                {
                    "dashboard": model,
                    "folderUid": FOLDER_UID,
                    "overwrite": True,
                    "message": "spur dashboards push",
                }
            )
            done["dashboards"].append(d.uid)
        return done
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


def _exists(get: Any) -> bool:
    from grafana_client.client import GrafanaClientError

    try:
        get()
        return True
    except GrafanaClientError as exc:
        if exc.status_code == 404:
            return False
        raise


def _message(exc: Any) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and response.get("message"):
        return str(response["message"])
    return str(getattr(exc, "message", exc)).splitlines()[0][:200]
