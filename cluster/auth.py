"""API keys, tenants and the ASGI middleware that checks them. No Ray, no tensors.

    keys text (env SPUR_API_KEYS / keys_file) --parse_keys--> [KeyEntry]  (digests only)
    KeyStore.lookup(bearer token)  -> KeyEntry | None      constant time over every key
    AuthGuard.check(path, header)  -> Principal | None      or raises ProtocolError 401/403
    AuthMiddleware (ASGI)          -> scope["state"]["principal"] for the route handlers

Keys are held as SHA-256 digests only: a key never sits in memory as text after
parsing, never reaches a log line, an error message or `/admin/config` (the
config holds the *name* of the variable or file, not its content). A lookup
hashes the presented token and compares it with every stored digest through
`hmac.compare_digest`, without stopping at a match, so its time does not depend
on which key (or how much of one) matched.

Routes, once at least one key exists (with none, everything stays open):

    open_paths (default /health, /health/live, /metrics)    no key
    /admin/*                                                an admin key
    everything else (/v1/*, /tokenize, /detokenize, ...)    a non-admin key

A key's `tenant` (default: the key's name) scopes its prefix-cache entries: see
`spur.actors.engine.core.hashing.tenant_salt`.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette._utils import get_route_path

from spur.actors.engine.core.hashing import tenant_salt
from spur.cluster.errors import ERROR_CODE_HEADER, ProtocolError, error_body

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ENTRY_FIELDS = (
    "key",
    "key_sha256",
    "name",
    "tenant",
    "admin",
    "max_concurrent_requests",
    "tokens_per_minute",
)
"""The fields of one entry of a keys file."""


class AuthConfigError(ValueError):
    """A keys file or variable that cannot be used; the message names the entry
    and the fix, never the key itself."""


def digest(token: str) -> bytes:
    """SHA-256 of a key's UTF-8 bytes (what a KeyStore keeps)."""
    return hashlib.sha256(token.encode("utf-8", errors="surrogatepass")).digest()


@dataclass(frozen=True)
class KeyEntry:
    """One API key, as the server keeps it (no key text).

    `tenant`: the prefix-cache scope of the key's requests (default: its name).
    `max_concurrent_requests` / `tokens_per_minute`: per-key limits, None meaning
    the config's default (which may be unlimited)."""

    name: str
    tenant: str
    admin: bool
    key_digest: bytes
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None

    @property
    def key_id(self) -> str:
        """A stable, non-secret id of the key (for limit accounting): a prefix of
        the SHA-256 of its digest, so it reveals nothing usable."""
        return hashlib.sha256(b"spur-key-id\x00" + self.key_digest).hexdigest()[:16]


@dataclass(frozen=True)
class Principal:
    """Who sent a request: the key's public identity and its effective limits."""

    key_id: str
    name: str
    tenant: str
    admin: bool
    max_concurrent_requests: int | None
    tokens_per_minute: int | None

    @property
    def limited(self) -> bool:
        return self.max_concurrent_requests is not None or self.tokens_per_minute is not None


def _positive(value: Any, where: str, field: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise AuthConfigError(f"{where}.{field}: must be an integer >= 1 (or absent)")
    return value


def _unknown_fields(unknown: Sequence[str], known: Sequence[str]) -> str:
    """How an error names unknown field names without ever quoting a key: a file
    written as `sk-...: alice` has its keys as field names. A name close to a known
    field (a typo) is named with its correction; the others are only counted."""
    import difflib

    typos = {
        name: close[0]
        for name in unknown
        if (close := difflib.get_close_matches(name, known, n=1, cutoff=0.8))
    }
    parts = [f"unknown field {name!r} (did you mean {fix!r}?)" for name, fix in typos.items()]
    others = len(unknown) - len(typos)
    if others:
        parts.append(
            f"{others} unknown field name(s), not shown (one may be a key written as a "
            "field: write entries as {key: ..., name: ...})"
        )
    return "; ".join(parts)


def parse_keys(text: str, source: str) -> list[KeyEntry]:
    """The entries of a keys file's text (YAML or JSON): a mapping {"keys": [...]}
    or a bare list; an entry is a key string or a mapping with `key` (or
    `key_sha256`, the hex digest of the key) and optional `name`, `tenant`,
    `admin`, `max_concurrent_requests`, `tokens_per_minute`. Pure.

    Raises:
        AuthConfigError: unreadable text, an unknown field, a missing or repeated
            key, a bad value; the message names `source` and the entry's index.
    """
    import yaml

    try:
        data = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise AuthConfigError(f"{source}: not valid YAML or JSON{where}") from None
    if isinstance(data, Mapping):
        unknown = sorted(set(map(str, data)) - {"keys"})
        if unknown:
            raise AuthConfigError(
                f"{source}: {_unknown_fields(unknown, ('keys',))} at the top level; only 'keys'"
            )
        data = data.get("keys")
    if not isinstance(data, list) or not data:
        raise AuthConfigError(
            f"{source}: holds no keys; give a list of keys, or {{keys: [{{key: ..., "
            "name: ..., tenant: ...}]}}"
        )
    entries: list[KeyEntry] = []
    seen: dict[bytes, int] = {}
    for i, item in enumerate(data):
        where = f"{source}: keys[{i}]"
        if isinstance(item, str):
            item = {"key": item}
        if not isinstance(item, Mapping):
            raise AuthConfigError(f"{where}: must be a key string or a mapping")
        unknown = sorted(set(map(str, item)) - set(ENTRY_FIELDS))
        if unknown:
            raise AuthConfigError(
                f"{where}: {_unknown_fields(unknown, ENTRY_FIELDS)}; known: {ENTRY_FIELDS}"
            )
        key, hexdigest = item.get("key"), item.get("key_sha256")
        if (key is None) == (hexdigest is None):
            raise AuthConfigError(f"{where}: give exactly one of 'key' and 'key_sha256'")
        if key is not None:
            if (
                not isinstance(key, str)
                or len(key) < 8
                or not key.isascii()
                or not key.isprintable()
                or any(c.isspace() for c in key)
            ):
                raise AuthConfigError(
                    f"{where}.key: a key must be a string of at least 8 printable ASCII "
                    "characters without whitespace (an HTTP header carries it)"
                )
            key_digest = digest(key)
        else:
            try:
                key_digest = bytes.fromhex(str(hexdigest))
            except ValueError:
                key_digest = b""
            if len(key_digest) != 32:
                raise AuthConfigError(f"{where}.key_sha256: must be 64 hex digits (a SHA-256)")
        if key_digest in seen:
            raise AuthConfigError(f"{where}: the same key as keys[{seen[key_digest]}]")
        seen[key_digest] = i
        name = item.get("name", f"key-{i}")
        tenant = item.get("tenant", name)
        for field, value in (("name", name), ("tenant", tenant)):
            if not isinstance(value, str) or not value or len(value) > 128:
                raise AuthConfigError(f"{where}.{field}: must be a string of 1 to 128 characters")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise AuthConfigError(f"{where}.admin: must be true or false")
        entries.append(
            KeyEntry(
                name=name,
                tenant=tenant,
                admin=admin,
                key_digest=key_digest,
                max_concurrent_requests=_positive(
                    item.get("max_concurrent_requests"), where, "max_concurrent_requests"
                ),
                tokens_per_minute=_positive(
                    item.get("tokens_per_minute"), where, "tokens_per_minute"
                ),
            )
        )
    return entries


class KeyStore:
    """The configured keys. Empty: authentication is off."""

    def __init__(self, entries: Sequence[KeyEntry] = ()) -> None:
        self.entries = list(entries)
        digests = [e.key_digest for e in self.entries]
        if len(set(digests)) != len(digests):
            raise AuthConfigError("the same key is configured twice (in the variable and the file)")

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def has_admin(self) -> bool:
        return any(e.admin for e in self.entries)

    def lookup(self, token: str) -> KeyEntry | None:
        """The entry whose key is `token`, or None. Compares the token's digest with
        every entry's (no early exit): the time does not depend on the match."""
        presented = digest(token)
        found: KeyEntry | None = None
        for entry in self.entries:
            if hmac.compare_digest(presented, entry.key_digest):
                found = entry
        return found

    def summary(self) -> list[dict[str, Any]]:
        """Names, tenants and roles (no key material): what a log or status may show."""
        return [{"name": e.name, "tenant": e.tenant, "admin": e.admin} for e in self.entries]


def load_keys(auth: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> KeyStore:
    """The keys of a `server.auth` config (a dict of AuthConfig): the text of the
    variable `keys_env` (unset or empty: none) plus the file `keys_file`.

    Raises:
        AuthConfigError: a keys file that is missing or unreadable, or keys that
            do not parse (see `parse_keys`).
    """
    from spur.configs.env import api_keys_text

    entries: list[KeyEntry] = []
    var = auth.get("keys_env")
    if var:
        text = api_keys_text(var, environ)
        if text and text.strip():
            entries += parse_keys(text, f"environment variable {var}")
    path = auth.get("keys_file")
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise AuthConfigError(
                f"server.auth.keys_file {path!r} cannot be read ({exc.strerror or exc}): "
                "create it or set keys_file to null"
            ) from None
        entries += parse_keys(text, f"keys file {path}")
    return KeyStore(entries)


def is_open_path(path: str, open_paths: Sequence[str]) -> bool:
    """Whether `path` is listed (exactly, or under an entry that ends with "/")."""
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in open_paths)


def needs_admin(path: str) -> bool:
    return path == "/admin" or path.startswith("/admin/")


def request_salt(principal: Principal | None, keys_on: bool, cache_salt: str | None) -> str | None:
    """The prefix-cache salt of a request (`tenant_salt`): its key's tenant's scope.
    A request without a key while keys are on (an open path serving the API) gets a
    scope of its own, the empty tenant, which no key can have (tenants are 1 to 128
    characters): else its raw `cache_salt` could spell a tenant's scope ("t4:acme") and
    share that tenant's cached blocks. Keys off (no tenants): `cache_salt` unchanged."""
    if principal is not None:
        return tenant_salt(principal.tenant, cache_salt)
    return tenant_salt("", cache_salt) if keys_on else cache_salt


def bearer_token(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header (None when absent or
    of another scheme)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def bearer_challenge(error: str | None = None) -> dict[str, str]:
    """The `WWW-Authenticate` header of a refusal, as RFC 6750 section 3 words it: no
    error code when the request carried no bearer token, `invalid_token` for a key
    that is not valid, `insufficient_scope` for a valid key of the wrong role."""
    challenge = 'Bearer realm="spur"'
    if error is not None:
        challenge += f', error="{error}"'
    return {"WWW-Authenticate": challenge}


def unauthorized(message: str, code: str, error: str | None = None) -> ProtocolError:
    """A 401; `error`: the RFC 6750 code of its challenge (None: no token was sent)."""
    return ProtocolError(
        401,
        message,
        type="invalid_request_error",
        code=code,
        headers=bearer_challenge(error),
    )


class AuthGuard:
    """Decides, per request, whether it may pass and as whom."""

    def __init__(
        self,
        store: KeyStore,
        open_paths: Sequence[str] = ("/health", "/health/live", "/metrics"),
        *,
        default_max_concurrent_requests: int | None = None,
        default_tokens_per_minute: int | None = None,
    ) -> None:
        self.store = store
        self.open_paths = tuple(open_paths)
        self.default_max_concurrent = default_max_concurrent_requests
        self.default_tpm = default_tokens_per_minute

    @classmethod
    def from_config(
        cls, auth: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> AuthGuard:
        """The guard of a `server.auth` dict (keys read now; see `load_keys`).

        Raises:
            AuthConfigError: `require_keys` is on and no keys were found (fail closed),
                or a keys source is bad (`load_keys`).
        """
        store = load_keys(auth, environ)
        if auth.get("require_keys") and not store:
            raise AuthConfigError(
                "server.auth.require_keys is on but no API keys were found here (environment "
                f"variable {auth.get('keys_env')!r}, keys_file {auth.get('keys_file')!r}): "
                "export the keys on every node that may run an ingress replica (on a joined "
                "cluster: in the environment of `ray start` on its nodes, as the Helm chart "
                "does from apiKeys.secretName), or give a keys_file those nodes can read, or "
                "pin the ingress with server.ingress_resources"
            )
        return cls(
            store,
            auth.get("open_paths", ("/health", "/health/live", "/metrics")),
            default_max_concurrent_requests=auth.get("default_max_concurrent_requests"),
            default_tokens_per_minute=auth.get("default_tokens_per_minute"),
        )

    @property
    def enabled(self) -> bool:
        return bool(self.store)

    def principal(self, entry: KeyEntry) -> Principal:
        return Principal(
            key_id=entry.key_id,
            name=entry.name,
            tenant=entry.tenant,
            admin=entry.admin,
            max_concurrent_requests=(
                entry.max_concurrent_requests
                if entry.max_concurrent_requests is not None
                else self.default_max_concurrent
            ),
            tokens_per_minute=(
                entry.tokens_per_minute if entry.tokens_per_minute is not None else self.default_tpm
            ),
        )

    def check(self, path: str, authorization: str | None) -> Principal | None:
        """The request's principal; None when authentication is off or the path is
        open. Raises ProtocolError: 401 without a valid key, 403 with a key of the
        wrong role (an API key on /admin/*, an admin key elsewhere)."""
        if not self.store or is_open_path(path, self.open_paths):
            return None
        admin = needs_admin(path)
        token = bearer_token(authorization)
        if token is None:
            raise unauthorized(
                "no API key given: send the header 'Authorization: Bearer YOUR_KEY'"
                + (" with an admin key" if admin else ""),
                "missing_api_key",
            )
        entry = self.store.lookup(token)
        if entry is None:
            raise unauthorized(
                "the API key is not valid: check the key the server's operator gave you",
                "invalid_api_key",
                "invalid_token",
            )
        if admin and not entry.admin:
            raise ProtocolError(
                403,
                f"key {entry.name!r} may not use {path}: /admin/* needs an admin key",
                type="permission_error",
                code="admin_key_required",
                headers=bearer_challenge("insufficient_scope"),
            )
        if not admin and entry.admin:
            raise ProtocolError(
                403,
                f"key {entry.name!r} is an admin key, valid for /admin/* only: use an API key",
                type="permission_error",
                code="api_key_required",
                headers=bearer_challenge("insufficient_scope"),
            )
        return self.principal(entry)


# -- the middleware ----------------------------------------------------------------------
_GUARD: AuthGuard | None = None


def install_guard(guard: AuthGuard | None) -> None:
    """Set the guard the middleware of this process uses (the ingress replica calls
    it from its constructor: Serve runs one replica per process, and the FastAPI
    app it serves is a copy of the module's, so the guard cannot live on it)."""
    global _GUARD
    _GUARD = guard


def current_guard() -> AuthGuard | None:
    return _GUARD


def route_path(scope: Scope) -> str:
    """The path the router matches: `scope["path"]` less the `root_path` in front of it
    (Serve puts its `http_options.root_path` and a `route_prefix` other than "/" in
    both). The guard must judge this path, not the raw one: with root_path "/spur",
    "/spur/admin/config" is routed to /admin/config and needs an admin key. Starlette's
    own function, so that the guard and the router can never disagree."""
    return get_route_path(scope) if "path" in scope else ""


class AuthMiddleware:
    """ASGI middleware: every HTTP request passes `AuthGuard.check` before any
    route runs (routes added later are covered too: default deny). A refusal is
    answered here with OpenAI's error body; an accepted request carries its
    Principal in `request.state.principal` (None: open path or auth off).

    A plain ASGI class rather than Starlette's BaseHTTPMiddleware, which would
    buffer streaming responses and hide client disconnects from the routes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        guard = _GUARD
        if scope["type"] != "http" or guard is None:
            await self.app(scope, receive, send)
            return
        header = None
        for name, value in scope.get("headers") or ():
            if name == b"authorization":
                header = value.decode("latin-1")
                break
        try:
            principal = guard.check(route_path(scope), header)
        except ProtocolError as exc:
            await send_error(send, exc)
            return
        scope.setdefault("state", {})["principal"] = principal
        await self.app(scope, receive, send)


async def send_error(send: Send, exc: ProtocolError) -> None:
    """Answer an ASGI request with `exc` as OpenAI's error body."""
    body = json.dumps(error_body(exc)).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ] + [(k.lower().encode(), v.encode()) for k, v in (exc.headers or {}).items()]
    if exc.code:  # for the metrics' counting middleware (it removes the header)
        headers.append((ERROR_CODE_HEADER, exc.code.encode()))
    await send({"type": "http.response.start", "status": exc.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts this machine's connections."""
    import ipaddress

    if host in ("localhost",):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
