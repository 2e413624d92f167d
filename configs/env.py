"""Every environment variable spur reads, in one place.

Other modules import the accessors below instead of touching `os.environ`, so
that the full list of knobs is visible here and documented once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path


def cache_dir() -> Path:
    """Where converted models and other derived artefacts are kept.

    `SPUR_CACHE_DIR`, else `$XDG_CACHE_HOME/spur`, else `~/.cache/spur`; always an
    absolute path (`~` expanded; a relative one is taken from the working directory of
    the process that reads it, and Ray workers run elsewhere: give an absolute one).
    """
    explicit = os.environ.get("SPUR_CACHE_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "spur" if xdg else Path.home() / ".cache" / "spur"


def is_ci() -> bool:
    """True on the CI machine (`CI=true`)."""
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def attention_backend_override() -> str | None:
    """`SPUR_ATTENTION_BACKEND` (auto | torch | triton) forces a backend over the
    config; None when unset or blank."""
    value = os.environ.get("SPUR_ATTENTION_BACKEND", "").strip()
    return value or None


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (`TRITON_INTERPRET=1`)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def native_kernels_enabled() -> bool:
    """False when `SPUR_NATIVE_KERNELS` is 0 / false / off: the CPU path then runs
    pure torch (SDPA for fp32 / bf16 decodes, torch norms, RoPE and KV store) instead
    of the C++ ops in kernels/native.py."""
    value = os.environ.get("SPUR_NATIVE_KERNELS", "1").strip().lower()
    return value not in ("0", "false", "off")


def cpu_target() -> str:
    """`SPUR_CPU_TARGET`: the x86-64 level spur treats this CPU as (native, x86-64-v3,
    x86-64-v4; default native), to run, test and bench an older CPU class's code path
    on this machine (configs/cpu.py)."""
    return os.environ.get("SPUR_CPU_TARGET", "").strip() or "native"


def cxx_compiler() -> str | None:
    """`CXX`, if set: the compiler that builds kernels/native.py's C++ extension."""
    return os.environ.get("CXX") or None


def test_settings_allowed() -> bool:
    """`SPUR_ALLOW_TEST_SETTINGS=1`: config fields documented as TESTS ONLY (a
    deliberately broken engine) are accepted; otherwise `build_app` refuses them."""
    return os.environ.get("SPUR_ALLOW_TEST_SETTINGS", "") == "1"


def grafana_token() -> str | None:
    """`SPUR_GRAFANA_TOKEN`: the Grafana token `spur dashboards push` uses (--token wins)."""
    return os.environ.get("SPUR_GRAFANA_TOKEN") or None


def api_keys_text(var: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The server's API keys file text from the variable named by
    `server.auth.keys_env` (default `SPUR_API_KEYS`, which the Helm chart exports
    from its Secret); None when unset."""
    return (os.environ if environ is None else environ).get(var)


def checked_client_key(value: str | None, source: str) -> str | None:
    """`value` stripped of surrounding whitespace (a key read from a file or a Secret
    often ends with a newline or CR), None when that leaves nothing. Pure.

    Raises:
        ValueError: what is left holds whitespace, a control character or a non-ASCII
            character, which no HTTP header can carry (and no server key has: see
            `spur.cluster.auth.parse_keys`). The message names `source` (a flag or a
            variable), never the key.
    """
    key = (value or "").strip()
    if not key:
        return None
    if not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(
            f"{source} holds whitespace, a control character or a non-ASCII character "
            "inside the key: give the key alone, on one line"
        )
    return key


def client_api_key(
    admin: bool = False, given: str | None = None, flag: str = "--api-key"
) -> str | None:
    """The key spur's own clients (`spur bench serve`, `spur config diff`, `spur top`)
    send: `given` (the value of the command's `flag`) when not empty, else from the
    environment: `SPUR_ADMIN_KEY` for /admin/* calls (falling back to `SPUR_API_KEY`),
    else `SPUR_API_KEY`. Stripped and checked by `checked_client_key` (ValueError)."""
    if given and given.strip():
        return checked_client_key(given, flag)
    if admin and os.environ.get("SPUR_ADMIN_KEY", "").strip():
        return checked_client_key(os.environ["SPUR_ADMIN_KEY"], "SPUR_ADMIN_KEY")
    return checked_client_key(os.environ.get("SPUR_API_KEY"), "SPUR_API_KEY")


def cuda_visible_devices() -> str | None:
    """`CUDA_VISIBLE_DEVICES` of this process (Ray narrows it to an actor's GPUs)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")
