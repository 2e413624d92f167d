"""Errors a client can cause, in the shape OpenAI's API returns them.

Every failure the ingress answers becomes a `ProtocolError` carrying its HTTP
status, and `error_body` turns it into OpenAI's error object:

    HTTP 400
    {"error": {"message": "messages[0].role: input should be ...",
               "type": "invalid_request_error", "param": "messages[0].role", "code": null}}

The constructors below cover each way a request fails before or at admission;
their messages name the fix. Nothing here raises: they build and return the
exception, and the caller raises it.
"""

from __future__ import annotations

import math
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ValidationError

    from spur.actors.engine.core.scheduler import RequestRejected
    from spur.actors.step import SamplingParamsError


ERROR_CODE_HEADER = b"x-spur-error-code"
"""Set on an error answer (its OpenAI error code), by the ingress and the auth
middleware, for the metrics' counting middleware, which removes it before the
answer leaves."""

_DEFAULT_TYPES = {
    400: "invalid_request_error",
    404: "invalid_request_error",  # OpenAI: unknown model is invalid_request_error + code
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class FieldError(ValueError):
    """Raised inside a pydantic validator to name the field at fault.

    `path` is relative to where the validator runs (() for the field itself,
    ("top_logprobs",) from a model validator, (3,) for an item of a list
    field); `from_validation_error` appends it to pydantic's location, so that
    the client hears e.g. "prompt[3]: token ids must be >= 0".
    """

    def __init__(self, path: tuple[int | str, ...], message: str) -> None:
        super().__init__(message)
        self.path = path


class ProtocolError(Exception):
    """A request failed in a way the client should hear about.

    `status`: the HTTP status (4xx for the client's fault, 503 when the service
    cannot take the request now). `type`, `param` and `code` fill OpenAI's error
    object; `param` names the offending field in OpenAI's spelling (a dotted path
    with list indices, e.g. "messages[0].content"). `headers` are extra response
    headers (e.g. Retry-After) the ingress must send along.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"an error status must be 4xx or 5xx, got {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _DEFAULT_TYPES.get(
            status, "invalid_request_error" if status < 500 else "internal_server_error"
        )
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def __repr__(self) -> str:
        return f"ProtocolError({self.status}, {self.message!r}, param={self.param!r})"


def error_body(exc: ProtocolError) -> dict[str, Any]:
    """OpenAI's error object for `exc`: {"error": {message, type, param, code}}.
    Pure; the result is JSON-serialisable. Also what a stream sends (as one SSE
    event) when it fails after the response has started."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.type,
            "param": exc.param,
            "code": exc.code,
        }
    }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProtocolError:
    """A 400 for a request that is well-formed JSON but asks for something invalid."""
    return ProtocolError(400, message, param=param, code=code)


def malformed_json(detail: str) -> ProtocolError:
    """A 400 for a body that is not a JSON object (`detail`: the parser's words)."""
    return ProtocolError(
        400,
        f"the request body is not valid JSON ({detail}): send a JSON object "
        "with Content-Type: application/json",
        code="invalid_json",
    )


def format_loc(loc: tuple[int | str, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'. Pydantic's internal steps
    (union member tags such as 'str' or 'function-after[...]') are expected to
    be filtered out by the caller."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _clean_message(msg: str) -> str:
    """Pydantic's wording, minus its internals: no "Value error, " prefix, no
    class names ("or instance of StreamOptions"), JSON's words for its types."""
    for prefix in ("Value error, ", "Assertion failed, "):
        if msg.startswith(prefix):
            msg = msg[len(prefix) :]
    msg = re.sub(r" or instance of \w+", "", msg)
    msg = msg.replace("a valid dictionary", "a JSON object").replace("a valid list", "a JSON array")
    return msg[:1].lower() + msg[1:] if msg else msg


def from_validation_error(exc: ValidationError) -> ProtocolError:
    """A 400 naming the invalid field, e.g.
    "messages[0].role: input should be 'system', 'developer', 'user', ...".

    OpenAI answers bad values with 400 (never FastAPI's 422), so this does too.
    Of several problems it reports the first field's, and of that field's the
    most specific one (the deepest location: for a value that may be a string or
    a list of parts, the error inside the list rather than "not a string").
    """
    errors = exc.errors(include_url=False)
    if not errors:  # pragma: no cover - pydantic never raises an empty error
        return bad_request("the request is invalid")
    located = [(_field_loc(e), e) for e in errors]
    first_field = located[0][0][:1]
    same_field = [(loc, e) for loc, e in located if loc[:1] == first_field]
    loc, err = max(same_field, key=lambda item: len(item[0]))  # max keeps the first on ties
    kind = err.get("type", "")
    if kind == "missing":
        msg = "field required"
    elif kind in ("model_type", "model_attributes_type", "dict_type") and not loc:
        msg = "the request body must be a JSON object"
    else:
        msg = _clean_message(str(err.get("msg", "invalid value")))
    path = format_loc(loc)
    others = len({_field_loc(e)[:1] for e in errors}) - 1
    more = f" (and problems in {others} other field(s))" if others > 0 else ""
    return bad_request(f"{path}: {msg}{more}" if path else f"{msg}{more}", param=path or None)


def _field_loc(err: Any) -> tuple[int | str, ...]:
    """Pydantic's location without its internal steps, plus a FieldError's path."""
    loc = tuple(p for p in err.get("loc", ()) if _is_field_part(p))
    original = (err.get("ctx") or {}).get("error")
    if isinstance(original, FieldError):
        loc += original.path
    return loc


def _is_field_part(part: int | str) -> bool:
    if isinstance(part, int):
        return True
    # Pydantic adds the union member or validator kind to a location, e.g.
    # ('prompt', 'list[int]', 0) or ('stop', 'function-after[...]'); no field of
    # ours has brackets or dashes in its name or is named like a builtin type.
    return not any(c in part for c in "[]-") and part not in _TYPE_TAGS


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "nullable"}


def from_sampling_params_error(
    exc: SamplingParamsError, param_names: dict[str, str] | None = None
) -> ProtocolError:
    """A 400 for a sampling value the engine rejects; `param_names` maps
    SamplingParams field names to the request's (OpenAI) field names, so that
    e.g. `logprobs` is reported as `top_logprobs` for chat."""
    param = (param_names or {}).get(exc.param, exc.param)
    message = str(exc)
    if param != exc.param:
        message = message.replace(exc.param, param, 1)
    return bad_request(message, param=param)


def from_request_rejected(exc: RequestRejected, param: str = "prompt") -> ProtocolError:
    """A 400 for a request the engine can never serve (its message names both
    numbers, e.g. "prompt has 9,312 tokens, max_model_len is 8,192: ...").
    Use param="messages" for chat requests."""
    return bad_request(str(exc), param=param, code="context_length_exceeded")


def model_not_found(name: str, available: list[str] | tuple[str, ...]) -> ProtocolError:
    """A 404 for an unknown model, listing the ones served (OpenAI's type and code)."""
    listed = ", ".join(repr(a) for a in available) or "none"
    if len(name) > 100:  # the client's string goes back to it: keep the message short
        name = name[:100] + "..."
    return ProtocolError(
        404,
        f"the model {name!r} does not exist: use one of {listed} (GET /v1/models lists them)",
        param="model",
        code="model_not_found",
    )


def queue_full(
    retry_after_s: float, *, lane: str | None = None, max_queued: int | None = None
) -> ProtocolError:
    """A 429 when the queue of pending requests is full; carries a Retry-After
    header (whole seconds, at least 1) telling the client when to try again.

    With `lane` and `max_queued` (the lane's `lanes[].max_queued_requests`, when the
    caller knows which bound it hit) the message names the limit and the settings
    that raise it; without them (Serve's back-pressure, whose bound is Serve's) it
    says only that the server is at capacity."""
    seconds = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    if lane is not None and max_queued is not None:
        message = (
            f"lane {lane!r} holds its max_queued_requests ({max_queued:,}): retry after "
            f"{seconds} s, or raise lanes[].max_queued_requests or autoscaling.max_replicas"
        )
    else:
        message = f"the server is at capacity (request queue full): retry after {seconds} s"
    return ProtocolError(429, message, code="queue_full", headers={"Retry-After": str(seconds)})


def service_unavailable(message: str, retry_after_s: float | None = None) -> ProtocolError:
    """A 503 when no engine can take the request (all down, shutting down)."""
    headers = {}
    if retry_after_s is not None and math.isfinite(retry_after_s):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_s)))
    return ProtocolError(503, message, code="service_unavailable", headers=headers)


SHUTTING_DOWN_CODE = "shutting_down"
"""`code` of the 503 a draining server gives new requests (`readiness.shutting_down`),
and of the error item that ends a stream no other replica can continue during
shutdown. Not retried."""


def engine_error(item: dict[str, Any], *, chat: bool = False) -> ProtocolError:
    """An engine stream's error item ({"status", "message", "param", "code"?}) as the
    error the client gets, wherever in the stream it came: a 503 like every other
    (code service_unavailable, Retry-After 1 s; a drain's internal code is not shown)
    except one that ends a stream during shutdown, which keeps its code
    `shutting_down` (Retry-After 5 s: retry against another instance), a prompt over
    max_model_len as context_length_exceeded, and for chat a prompt's param named
    `messages`."""
    if item["status"] == 503:
        if item.get("code") == SHUTTING_DOWN_CODE:
            return ProtocolError(
                503, item["message"], code=SHUTTING_DOWN_CODE, headers={"Retry-After": "5"}
            )
        return service_unavailable(item["message"], 1.0)
    param = item.get("param")
    code = item.get("code")
    if code is None and param == "prompt" and "max_model_len" in item["message"]:
        code = "context_length_exceeded"
    if param == "prompt" and chat:
        param = "messages"
    return ProtocolError(item["status"], item["message"], param=param, code=code)


def internal_error(exc: BaseException) -> ProtocolError:
    """A 500 for a bug (never for client input). The message names the
    exception type only, so that no internal detail leaks to the client."""
    return ProtocolError(
        500,
        f"internal error ({type(exc).__name__}); the server logged the details",
        code="internal_error",
    )


def rate_limited(message: str, retry_after_s: float, code: str) -> ProtocolError:
    """A 429 for a key over one of its limits (concurrent requests, tokens per
    minute); carries Retry-After in whole seconds (at least 1)."""
    seconds = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 60
    return ProtocolError(
        429, f"{message}: retry after {seconds} s", code=code, headers={"Retry-After": str(seconds)}
    )


def body_too_large(limit: int) -> ProtocolError:
    """A 413 for a request body over `server.requests.max_body_bytes`."""
    return ProtocolError(
        413,
        f"the request body is larger than {limit:,} bytes (server.requests.max_body_bytes): "
        "send fewer or shorter prompts",
        type="invalid_request_error",
        code="request_too_large",
    )


_UNAVAILABLE_NAMES = ("Actor", "Replica", "Unavailable", "NodeDied", "WorkerCrashed", "OwnerDied")


def classify(exc: BaseException) -> ProtocolError:
    """The one mapping of any failure to what the client hears: a ProtocolError
    as it is; Serve's back-pressure (its queue is full) a 429 `queue_full`; a
    replica, actor or node that is gone a 503 with Retry-After; anything else a
    500 that names only the exception's type. Matched by class name over the MRO,
    so that this module needs no Ray import."""
    if isinstance(exc, ProtocolError):
        return exc
    names = [c.__name__ for c in type(exc).__mro__]
    if "BackPressureError" in names:
        return queue_full(1.0)
    if any(part in name for name in names for part in _UNAVAILABLE_NAMES):
        return service_unavailable(
            f"the engine is unavailable ({type(exc).__name__}); retry shortly", 1.0
        )
    return internal_error(exc)
