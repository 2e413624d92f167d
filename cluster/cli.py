"""`spur`: the command line. The only module that prints.

    spur serve [CONFIG] [--address RAY_ADDRESS] [--host HOST] [--port PORT]
    spur config show CONFIG | spur config diff CONFIG --url URL
    spur generate --model PATH_OR_NAME --prompt TEXT [--chat] [sampling flags]
    spur capacity --model DIR_OR_CONFIG [--block-size N] [--num-blocks N | --kv-bytes N] ...
    spur bench core|engine|serve|routing|autoscale|spec|gpu [--json]
    spur dashboards export DIR | spur dashboards push --grafana-url URL [--token T] ...
    spur top --url URL [--once] [--admin-key KEY]

Misuse (an unknown or repeated subcommand, a missing file, a bad value) is a
one-line error with the usage and exit status 2, never a traceback; Ctrl-C ends any
command with exit status 130 and one line.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

COMMANDS = ("serve", "config", "generate", "capacity", "bench", "dashboards", "top")
BENCHES = ("core", "engine", "routing", "serve", "autoscale", "spec", "gpu")


class UsageError(Exception):
    """A mistake in how spur was called; printed with the usage, exit 2."""


def _positive(text: str) -> int:
    try:
        value = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def _non_negative(text: str) -> int:
    if text.strip() in ("0", "-0"):
        return 0
    return _positive(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value:g} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spur", description="spur: a paged-KV LLM serving cluster"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    srv = sub.add_parser(
        "serve", help="serve the OpenAI-compatible API (default: configs/local.yaml)"
    )
    srv.add_argument("config", nargs="?", default="local", help="config file or preset name")
    srv.add_argument("--address", help="join this Ray cluster instead of starting one")
    srv.add_argument("--host", help="override server.host")
    srv.add_argument("--port", type=_positive, help="override server.port")

    cfg = sub.add_parser("config", help="show a resolved config or diff it against a live one")
    cfg_sub = cfg.add_subparsers(dest="config_command", metavar="ACTION")
    show = cfg_sub.add_parser("show", help="print the config with every default filled in")
    show.add_argument("config", help="config file or preset name")
    diff = cfg_sub.add_parser("diff", help="where a file and a running deployment differ")
    diff.add_argument("config", help="config file or preset name")
    diff.add_argument("--url", required=True, help="the running server, e.g. http://127.0.0.1:8000")
    diff.add_argument(
        "--api-key", default=None, help="admin key of a server with keys (env SPUR_ADMIN_KEY)"
    )

    gen = sub.add_parser("generate", help="generate text offline, streamed to the terminal")
    gen.add_argument(
        "--model", default=None, help="folder, .gguf or demo name (default: engine.model.path)"
    )
    gen.add_argument(
        "--config",
        default=None,
        help="take the engine settings of a lane of this config file (flags override them)",
    )
    gen.add_argument("--lane", default=None, help="the lane of --config (default: the first)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--max-tokens", type=_positive, default=128, help="default 128")
    gen.add_argument("--min-tokens", type=int, default=0, help="default 0")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0, help="default 1.0 (off)")
    gen.add_argument("--top-k", type=int, default=0, help="default 0 (off)")
    gen.add_argument("--min-p", type=float, default=0.0, help="default 0.0 (off)")
    gen.add_argument("--repetition-penalty", type=float, default=1.0, help="default 1.0 (off)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="default 0.0 (off)")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="default 0.0 (off)")
    gen.add_argument("--seed", type=int, default=None, help="default: none (unseeded)")
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument(
        "--dtype",
        default=None,
        help="auto | float32 | bfloat16 | float16 (default: engine.model.dtype)",
    )
    gen.add_argument(
        "--tensor-parallel-size",
        type=_positive,
        default=None,
        help="default: engine.parallelism.tensor_parallel_size",
    )

    cap = sub.add_parser("capacity", help="how many requests the KV pool holds (JSON with --json)")
    cap.add_argument("--model", required=True, help="model folder, config.json, or geometry YAML")
    cap.add_argument(
        "--block-size",
        type=_positive,
        default=_engine_default("cache", "block_size"),
        help="tokens per KV block (default: the engine's, cache.block_size)",
    )
    size = cap.add_mutually_exclusive_group()
    size.add_argument("--num-blocks", type=_positive, help="pool size in blocks (null included)")
    size.add_argument(
        "--kv-bytes",
        type=_positive,
        help="pool size in bytes (default: the engine's on CPU, cache.kv_cache_bytes unset)",
    )
    cap.add_argument(
        "--kv-dtype",
        default=None,
        help="float32 | bfloat16 | float16 | fp8 (default: a geometry YAML's dtype, else the "
        "engine's, cache.kv_cache_dtype)",
    )
    cap.add_argument(
        "--state-dtype",
        default=_engine_default("cache", "state_dtype"),
        help="dtype of state layers (default: the engine's, cache.state_dtype)",
    )
    cap.add_argument("--max-model-len", type=_positive, default=None, help="default: the model's")
    cap.add_argument(
        "--max-num-batched-tokens",
        type=_positive,
        default=None,
        help="default: --chunk, else the engine's (scheduler.max_num_batched_tokens)",
    )
    cap.add_argument("--simulate-prompt", type=_positive, help="run one request of N prompt tokens")
    cap.add_argument(
        "--chunk", type=_positive, default=None, help="prefill chunk of the simulation"
    )
    cap.add_argument(
        "--decode",
        type=_non_negative,
        default=0,
        help="decode steps of the simulation (0: the prefill and its first token)",
    )
    cap.add_argument("--json", action="store_true", help="print machine-readable JSON")

    bench = sub.add_parser("bench", help="benchmarks (machine-readable with --json)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH")
    core = bench_sub.add_parser("core", help="KV manager and scheduler bookkeeping trace")
    core.add_argument("--requests", type=_positive, default=2000)
    core.add_argument("--seed", type=int, default=0)
    core.add_argument("--json", action="store_true")
    serve_b = bench_sub.add_parser("serve", help="HTTP path vs the offline engine, same workload")
    serve_b.add_argument("--url", default=None, help="a running spur server (not with --peer)")
    serve_b.add_argument("--model", default=None, help="model name (default: the first lane)")
    serve_b.add_argument("--concurrency", default=None, help="default 1,8,32; --peer: 1,4,16")
    serve_b.add_argument("--requests", type=_positive, default=None, help="per level")
    serve_b.add_argument("--seed", type=int, default=0)
    serve_b.add_argument(
        "--rounds",
        type=_positive,
        default=3,
        help="paired runs of both arms per level, alternating order; reports the median",
    )
    serve_b.add_argument(
        "--baseline-url",
        default=None,
        help="compare against this second server over HTTP instead of the offline engine",
    )
    serve_b.add_argument("--json", action="store_true")
    serve_b.add_argument("--api-key", default=None, help="API key (env SPUR_API_KEY)")
    serve_b.add_argument(
        "--admin-key", default=None, help="admin key for /admin/* (env SPUR_ADMIN_KEY)"
    )
    # --peer: spur serve side by side with another server, both started by the bench.
    serve_b.add_argument("--peer", choices=["llama-cpp"], default=None, help="builds it once")
    serve_b.add_argument("--dtypes", default="float32,bfloat16", help="--peer: spur dtypes")
    serve_b.add_argument("--threads", type=_positive, default=2, help="--peer: CPU threads each")
    serve_b.add_argument("--max-tokens", type=_positive, default=128, help="--peer: per request")
    serve_b.add_argument("--config", default="local", help="--peer: spur's config (one lane)")
    serve_b.add_argument(
        "--stream-interval",
        type=_positive,
        default=None,
        help="--peer: spur's engine.runtime.stream_interval (default: the config's)",
    )
    serve_b.add_argument("--llama-sdist", default=None, help="--peer: llama-cpp-python sdist")
    serve_b.add_argument("--plot", default=None, metavar="PATH.png", help="draw the result")
    serve_b.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    routing = bench_sub.add_parser(
        "routing", help="round robin vs power of two vs prefix routing, multi-turn workload"
    )
    routing.add_argument("--model", default="SmolLM2-135M-Instruct")
    routing.add_argument("--replicas", type=_positive, default=4)
    routing.add_argument("--block-size", type=_positive, default=16)
    routing.add_argument("--groups", type=_positive, default=4)
    routing.add_argument("--users-per-group", type=_positive, default=4)
    routing.add_argument("--rounds", type=_positive, default=3)
    routing.add_argument("--system-prompt-tokens", type=int, default=512)
    routing.add_argument("--question-tokens", type=_positive, default=32)
    routing.add_argument("--answer-tokens", type=_positive, default=16)
    routing.add_argument("--request-rate", type=float, default=8.0, help="new users per second")
    routing.add_argument("--seed", type=int, default=0)
    routing.add_argument("--arms", default="round_robin,power_of_two,prefix")
    routing.add_argument("--address", default=None, help="a Ray cluster (default: a local one)")
    routing.add_argument("--quick", action="store_true", help="a small workload (smoke test)")
    routing.add_argument("--json", action="store_true")
    engine = bench_sub.add_parser("engine", help="offline engine vs transformers static batches")
    engine.add_argument(
        "--requests", type=_positive, default=None, help="requests (default 64; 8 with --quick)"
    )
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--dtypes", default="float32,bfloat16")
    engine.add_argument("--model", default="SmolLM2-135M-Instruct")
    engine.add_argument("--quick", action="store_true", help="a small workload (CI smoke test)")
    engine.add_argument(
        "--prefix-hit",
        type=int,
        default=None,
        help="also time a prefill with a cached prefix of N tokens vs cold "
        "(default: 2048 for --model hybrid, else 0)",
    )
    engine.add_argument(
        "--matmul-floor",
        action="store_true",
        help="also time the spur run's matmuls alone, on torch's path as transformers "
        "computes them (the ceiling: the ratio if nothing else cost time) and on spur's",
    )
    engine.add_argument(
        "--share-rounds",
        type=int,
        default=1,
        metavar="N",
        help="with --matmul-floor: measure the run and its matmul replay N times in "
        "back-to-back pairs and report the median share (ceiling_share_median; "
        "ceiling_share_at_fastest_replay: against the fastest replay)",
    )
    engine.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="draw where spur's time went per dtype, as stacked bars",
    )
    engine.add_argument(
        "--plot-with",
        action="append",
        default=[],
        metavar="LABEL=RUN.json",
        help="--plot: earlier runs' JSON (before a lever) drawn beside this run",
    )
    engine.add_argument(
        "--plot-label", default="this run", help="--plot: this run's label under its bars"
    )
    engine.add_argument("--json", action="store_true")
    auto = bench_sub.add_parser(
        "autoscale", help="step load on a lane autoscaling 1 -> 2 replicas on fake Ray nodes"
    )
    auto.add_argument("--model", default="SmolLM2-135M-Instruct")
    auto.add_argument("--low", type=_positive, default=2, help="streams of the low load")
    auto.add_argument("--high", type=_positive, default=16, help="streams of the high load")
    auto.add_argument("--low-seconds", type=float, default=10.0)
    auto.add_argument("--high-hold-seconds", type=float, default=20.0)
    auto.add_argument("--max-tokens", type=_positive, default=48)
    auto.add_argument("--upscale-delay", type=float, default=2.0)
    auto.add_argument("--downscale-delay", type=float, default=6.0)
    auto.add_argument("--json", action="store_true")
    spec = bench_sub.add_parser(
        "spec", help="n-gram speculative decoding on vs off (repeat and chat workloads)"
    )
    spec.add_argument("--model", default="SmolLM2-135M-Instruct")
    spec.add_argument("--dtype", default="float32")
    spec.add_argument("--concurrency", default="1,16", help="comma-separated levels")
    spec.add_argument("--workloads", default="repeat,chat")
    spec.add_argument("--requests", type=_positive, default=4, help="requests per level (>= c)")
    spec.add_argument("--rounds", type=_positive, default=2)
    spec.add_argument("--num-speculative-tokens", type=_positive, default=4)
    spec.add_argument("--prompt-lookup-min", type=_positive, default=2)
    spec.add_argument("--prompt-lookup-max", type=_positive, default=4)
    spec.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="draft only while fewer requests run (engine.speculative.disable_by_batch_size; "
        "default: the schema's; 0: at any batch size)",
    )
    spec.add_argument("--seed", type=int, default=0)
    spec.add_argument("--max-tokens", type=_positive, default=None, help="cap every output")
    spec.add_argument("--num-threads", type=_positive, default=None, help="torch threads")
    spec.add_argument("--quick", action="store_true", help="a small workload (CI smoke test)")
    spec.add_argument(
        "--plot",
        default=None,
        metavar="PATH.png",
        help="draw ITL p50 / p99 and tokens/s with speculation off and on",
    )
    spec.add_argument(
        "--plot-from",
        default=None,
        metavar="RUN.json",
        help="--plot: draw an earlier run's JSON (spur bench spec --json) instead of running",
    )
    spec.add_argument("--json", action="store_true")
    gpu = bench_sub.add_parser(
        "gpu", help="Triton kernels, decode HBM bandwidth, CUDA graphs (actors/gpu_check.py)"
    )
    gpu.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (no GPU needed)")
    gpu.add_argument("--skip", default="", help="sections to skip: kernels,bandwidth,engine")
    gpu.add_argument("--budget-s", type=float, default=420.0, help="start no section after")
    gpu.add_argument("--peak-tbs", type=float, default=None, help="HBM peak (default by GPU)")
    gpu.add_argument("--json", action="store_true")
    _observability_parsers(sub)
    return parser


def _observability_parsers(sub: Any) -> None:
    """`spur dashboards ...` and `spur top` (cluster/dashboards.py, grafana.py, top.py)."""
    dash = sub.add_parser("dashboards", help="Grafana dashboards and alert rules (as code)")
    dash_sub = dash.add_subparsers(dest="dashboards_command", metavar="ACTION")
    export = dash_sub.add_parser("export", help="write the dashboards' JSON and alerts.yaml")
    export.add_argument("dir", help="output folder")
    push = dash_sub.add_parser("push", help="create or update them in Grafana (grafana-client)")
    push.add_argument("--grafana-url", required=True, help="e.g. http://grafana:3000")
    push.add_argument("--token", help="service-account token (or SPUR_GRAFANA_TOKEN)")
    push.add_argument("--user", help="basic auth user")
    push.add_argument("--password", help="basic auth password")
    push.add_argument(
        "--prometheus-url",
        default="http://prometheus:9090",
        help="the data source URL, as Grafana's server reaches Prometheus",
    )
    top = sub.add_parser("top", help="live view of a running deployment (rich)")
    top.add_argument("--url", required=True, help="the running server, e.g. http://127.0.0.1:8000")
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.add_argument(
        "--interval", type=_positive_seconds, default=2.0, help="seconds between refreshes"
    )
    top.add_argument("--admin-key", help="admin API key (or SPUR_ADMIN_KEY / SPUR_API_KEY)")


def cmd_dashboards(args: argparse.Namespace) -> int:
    from pathlib import Path

    if args.dashboards_command == "export":
        from spur.cluster.dashboards import export

        try:
            paths = export(Path(args.dir))
        except OSError as e:
            raise UsageError(
                f"cannot write the dashboards to {args.dir}: {e.strerror or e}"
            ) from None
        for path in paths:
            print(path)
        return 0
    if args.dashboards_command == "push":
        from spur.cluster.grafana import PushError, push
        from spur.configs.env import grafana_token

        try:
            done = push(
                args.grafana_url,
                token=args.token or grafana_token(),
                user=args.user,
                password=args.password,
                prometheus_url=args.prometheus_url,
            )
        except PushError as e:
            print(f"spur: error: {e}", file=sys.stderr)
            return 1
        print(json.dumps(done))
        return 0
    raise UsageError("choose an action: export, push")


def cmd_top(args: argparse.Namespace) -> int:
    from spur.cluster.top import TopError, run
    from spur.configs.env import client_api_key

    if not args.url.startswith(("http://", "https://")):
        raise UsageError(f"--url {args.url!r}: give the server's URL, e.g. http://127.0.0.1:8000")
    try:
        admin_key = client_api_key(admin=True, given=args.admin_key, flag="--admin-key")
    except ValueError as e:  # names the flag or variable, never the key
        raise UsageError(str(e)) from None
    try:
        return run(args.url, once=args.once, interval_s=args.interval, admin_key=admin_key)
    except TopError as e:
        print(f"spur: error: {e}", file=sys.stderr)
        return 1


def json_stdout() -> TextIO:
    """Keep stdout for one JSON document: point file descriptor 1 (print, logging
    to stdout, child processes, Ray's forwarded worker log lines such as
    "(raylet) Task ... failed") at stderr, and return a stream on the original
    stdout for the result, so that `spur ... --json | jq` always parses.

    When `sys.stdout` is not file descriptor 1 (replaced or captured, as under
    pytest or when the CLI is called as a library), it is returned as it is."""
    try:
        if sys.stdout.fileno() != 1:
            return sys.stdout
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return sys.stdout
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    return os.fdopen(saved, "w", encoding="utf-8")


def print_json(out: TextIO, result: Any) -> None:
    out.write(json.dumps(result, indent=2) + "\n")
    out.flush()


def _load(path: str) -> Any:
    from spur.configs.loader import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as e:
        raise UsageError(str(e)) from None


def cmd_serve(args: argparse.Namespace) -> int:
    from spur.configs.loader import ConfigError, apply_overrides, to_yaml

    cfg = _load(args.config)
    overrides: dict[str, Any] = {}
    if args.address is not None:  # "" too: the schema names what is wrong with it
        overrides["server.ray_address"] = args.address
    if args.host is not None:
        overrides["server.host"] = args.host
    if args.port is not None:
        overrides["server.port"] = args.port
    try:
        cfg = apply_overrides(cfg, overrides) if overrides else cfg
    except ConfigError as e:
        raise UsageError(str(e)) from None
    from spur.cluster.app import (
        refuse_bad_backend_override,
        refuse_bad_generation_overrides,
        refuse_speculation_on_state_models,
        refuse_test_settings,
    )
    from spur.cluster.auth import AuthConfigError, AuthGuard, is_loopback
    from spur.cluster.server import run_server

    try:  # before Ray starts: a config error, not a traceback from the deployment
        every_lane = [*cfg.lanes, *([cfg.spare] if cfg.spare else [])]
        refuse_test_settings(every_lane)
        refuse_speculation_on_state_models(every_lane)
        refuse_bad_generation_overrides(every_lane)
        backend = refuse_bad_backend_override(every_lane)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if backend is not None:
        print(
            f"spur: SPUR_ATTENTION_BACKEND={backend} overrides every lane's "
            "runtime.attn_backend (in the workers of this machine's cluster; on a joined "
            "cluster, set it where the workers run)",
            file=sys.stderr,
        )

    try:  # the ingress's own check (require_keys included), here before Ray starts
        keys = AuthGuard.from_config(cfg.server.auth.model_dump()).store
    except AuthConfigError as e:
        raise UsageError(str(e)) from None
    if keys:
        roles = sum(1 for e in keys.entries if e.admin)
        print(f"API keys: {len(keys) - roles} API key(s), {roles} admin key(s)", file=sys.stderr)
        # The ingress reads the keys again in its own process: on a joined cluster
        # (--address) a worker of that cluster, with the cluster's environment, not this
        # one's. Keys found here mean the API must not run without them there: fail
        # closed (a replica that finds none refuses to start, naming the fix).
        try:
            cfg = apply_overrides(cfg, {"server.auth.require_keys": True})
        except ConfigError as e:
            raise UsageError(str(e)) from None
    elif not is_loopback(cfg.server.host):
        print(
            f"spur: warning: serving on {cfg.server.host} without API keys: anyone who can "
            "reach this port can use the API and /admin/*; set keys in "
            f"${cfg.server.auth.keys_env or 'SPUR_API_KEYS'} or server.auth.keys_file "
            "(README: Security)",
            file=sys.stderr,
        )
    print("effective configuration:")
    print(to_yaml(cfg))
    return run_server(cfg, announce=lambda url: print(f"spur is serving at {url}/v1", flush=True))


def cmd_config(args: argparse.Namespace) -> int:
    from spur.configs.loader import diff, show

    if args.config_command == "show":
        _load(args.config)
        print(show(args.config))
        return 0
    if args.config_command == "diff":
        import urllib.error
        import urllib.request

        from spur.configs.env import client_api_key

        cfg = _load(args.config)
        url = args.url.rstrip("/") + "/admin/config"
        try:
            key = client_api_key(admin=True, given=args.api_key)
        except ValueError as e:  # names the flag or variable, never the key
            raise UsageError(str(e)) from None
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            request = urllib.request.Request(url, headers=headers)
        except ValueError as e:  # the URL's own words (no header is checked here)
            raise UsageError(f"--url: {e}") from None
        try:
            with urllib.request.urlopen(request, timeout=10) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (401, 403):
                raise UsageError(_admin_key_refused(url, e.code, given=key is not None)) from None
            raise UsageError(f"cannot read the live config at {url}: {e}") from None
        except (urllib.error.URLError, OSError) as e:
            raise UsageError(f"cannot read the live config at {url}: {e}") from None
        except ValueError:  # http.client's header check quotes the header: never shown
            raise UsageError(f"cannot send the request to {url}: a header is invalid") from None
        try:
            live = json.loads(body)
        except ValueError:
            raise UsageError(f"{url} did not answer with a JSON config") from None
        if not isinstance(live, dict) or "lanes" not in live:
            raise UsageError(_not_a_config(url, live))
        lines = diff(cfg, live)
        for line in lines:
            print(line)
        if not lines:
            print("no differences")
        return 1 if lines else 0
    raise UsageError("choose an action: show, diff")


def _admin_key_refused(url: str, status: int, *, given: bool) -> str:
    """`config diff`'s words for a 401 / 403 of GET /admin/config (never the key)."""
    if given:
        return (
            f"{url} refused the admin key (HTTP {status}): give the server's admin key with "
            "--api-key or SPUR_ADMIN_KEY"
        )
    return f"{url} needs an admin key (HTTP {status}): give it with --api-key or SPUR_ADMIN_KEY"


def _not_a_config(url: str, live: Any) -> str:
    """`config diff`'s words for JSON that is not a spur config (a list, a string, null,
    an error object): one line, not a diff against it."""
    error = live.get("error") if isinstance(live, dict) else None
    if isinstance(error, dict):
        error = error.get("message", error)
    if error is not None:
        return f"{url} answered with an error, not a config: {' '.join(str(error).split())[:200]}"
    what = type(live).__name__ if not isinstance(live, dict) else "an object without lanes"
    what = {"NoneType": "null", "list": "a list", "str": "a string"}.get(what, what)
    return f"{url} did not answer with a spur config (it sent {what}): is it a spur server?"


def cmd_generate(args: argparse.Namespace) -> int:
    from spur.actors.step import SamplingParams

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            min_tokens=args.min_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    from spur.actors.llm import LLM
    from spur.actors.worker.executors import WorkerError
    from spur.actors.worker.loader import ModelLoadError

    try:
        llm = LLM(**_generate_engine_args(args))
    except (ModelLoadError, ValueError) as e:
        raise UsageError(str(e)) from None
    except WorkerError as e:  # tensor_parallel_size > 1: the first rank's own words
        raise UsageError(e.reason) from None
    try:
        prompt = (
            llm.chat_prompt(
                [{"role": "user", "content": args.prompt}],
                instead="drop --chat and give --prompt the whole prompt, formatted yourself",
            )
            if args.chat
            else args.prompt
        )
        finish = None
        for delta in llm.stream(prompt, params):
            sys.stdout.write(delta.text)
            sys.stdout.flush()
            finish = delta.finish_reason or finish
        sys.stdout.write("\n")
        logging.getLogger("spur.cli").info("finish_reason=%s", finish)
    except ValueError as e:
        raise UsageError(str(e)) from None
    except KeyboardInterrupt:
        sys.stdout.write("\n")  # end the streamed line; main() reports the interrupt
        raise
    finally:
        llm.shutdown()
    return 0


def _check_repeats(argv: Sequence[str], parser: argparse.ArgumentParser) -> None:
    """`spur serve serve x.yaml`: the command word twice in a row (a flag's value that
    happens to be a command's name, `--prompt generate`, is not a repeat)."""
    first = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    words = list(argv[first : first + 2]) if first is not None else []
    if len(words) == 2 and words[0] in COMMANDS and words[1] == words[0]:
        usage = parser.format_usage().strip().removeprefix("usage: ")
        raise UsageError(f"'{words[0]}' given twice; usage: {usage}")


def _generate_engine_args(args: argparse.Namespace) -> dict[str, Any]:
    """`spur generate`'s engine: the schema's defaults, or the settings of a lane of
    `--config` (every engine field), then the flags that were given."""
    flat: dict[str, Any] = {}
    if args.config:
        from spur.configs.engine_args import flat_engine_args

        cfg = _load(args.config)
        try:
            lane = cfg.lane(args.lane) if args.lane else cfg.lanes[0]
        except KeyError as e:
            raise UsageError(str(e.args[0])) from None
        flat = flat_engine_args(lane.engine)
    elif args.lane:
        raise UsageError("--lane needs --config: the lane of which config file?")
    flags = {"model": args.model, "dtype": args.dtype}
    flags["tensor_parallel_size"] = args.tensor_parallel_size
    flat.update({k: v for k, v in flags.items() if v is not None})
    return flat


def _engine_default(section: str, name: str) -> Any:
    """The schema's default of engine.<section>.<name> (one source for every setting):
    `spur capacity` sizes a pool as the engine would."""
    from spur.configs.schema import EngineConfig

    section_model = EngineConfig.model_fields[section].annotation
    return section_model.model_fields[name].default  # type: ignore[union-attr]


def _engine_kv_dtype() -> tuple[str, str]:
    """(the KV dtype an engine with the schema's defaults stores, in words where it
    comes from): cache.kv_cache_dtype, whose "auto" follows model.dtype."""
    kv = _engine_default("cache", "kv_cache_dtype")
    if kv != "auto":
        return kv, f"the engine's default: cache.kv_cache_dtype {kv}"
    model = _engine_default("model", "dtype")
    if model != "auto":
        return model, f"the engine's default: cache.kv_cache_dtype auto = model.dtype {model}"
    return "bfloat16", "the engine's default follows the checkpoint's dtype: bfloat16 assumed"


def _engine_kv_bytes() -> tuple[int, str]:
    """(the pool's bytes an engine with the schema's defaults takes on CPU, in words)."""
    configured = _engine_default("cache", "kv_cache_bytes")
    if configured is not None:
        return int(configured), "the engine's default: cache.kv_cache_bytes"
    from spur.actors.cache_spec import DEFAULT_CPU_KV_BYTES  # what the worker reads

    return DEFAULT_CPU_KV_BYTES, (
        "the engine's CPU default, cache.kv_cache_bytes unset; on CUDA the engine sizes "
        "the pool by gpu_memory_utilization: give --kv-bytes or --num-blocks for that"
    )


def cmd_capacity(args: argparse.Namespace) -> int:
    from spur.actors.engine.core import capacity as cap

    engine_dtype, engine_dtype_source = _engine_kv_dtype()
    try:
        found = cap.read_geometry(
            args.model,
            kv_dtype=args.kv_dtype,
            default_kv_dtype=engine_dtype,
            state_dtype=args.state_dtype,
        )
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    geometry = found.geometry
    if args.kv_dtype:
        dtype_source = "--kv-dtype"
    elif found.kv_dtype_from_file:
        dtype_source = "the geometry file's dtype"
    else:
        dtype_source = engine_dtype_source
    max_len = args.max_model_len or found.max_position_embeddings or 4096
    if args.max_model_len:
        len_source = "--max-model-len"
    elif found.max_position_embeddings:
        len_source = "the model's max_position_embeddings"
    else:
        len_source = "a default: a geometry file names none"
    chunk = (
        args.max_num_batched_tokens
        or args.chunk
        or _engine_default("scheduler", "max_num_batched_tokens")
    )
    kv_bytes = args.kv_bytes if args.num_blocks is None else None
    if args.num_blocks is not None:
        pool_source = "--num-blocks"
    elif kv_bytes is not None:
        pool_source = "--kv-bytes"
    else:
        kv_bytes, pool_source = _engine_kv_bytes()
    if args.simulate_prompt:
        total = args.simulate_prompt + max(1, args.decode)
        if total > max_len:
            raise UsageError(
                f"--simulate-prompt {args.simulate_prompt:,} plus --decode {args.decode:,} "
                f"(at least 1 token) is {total:,} tokens, more than max_model_len "
                f"{max_len:,} ({len_source}): simulate a shorter request or raise "
                "--max-model-len"
            )
    try:
        report = cap.capacity(
            geometry,
            block_size=args.block_size,
            max_model_len=max_len,
            max_num_batched_tokens=chunk,
            num_blocks=args.num_blocks,
            kv_bytes=kv_bytes,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    result: dict[str, Any] = report.to_dict()
    result["kv_dtype"] = found.kv_dtype
    result["kv_bytes"] = kv_bytes  # None: --num-blocks
    result["assumes"] = {  # the same, in words, with where each comes from
        "pool": f"{report.num_blocks:,} blocks"
        + (f" from {kv_bytes / 2**30:.4g} GiB" if kv_bytes is not None else "")
        + f" ({pool_source})",
        "kv_dtype": f"{found.kv_dtype} ({dtype_source})",
        "max_model_len": f"{max_len:,} ({len_source})",
    }
    if args.simulate_prompt:
        groups, _ = cap.build_groups(geometry)
        try:
            sim = cap.simulate_request(
                groups,
                block_size=args.block_size,
                num_blocks=report.num_blocks,
                prompt_tokens=args.simulate_prompt,
                chunk=args.chunk or chunk,
                decode_tokens=args.decode,
            )
        except cap.PoolTooSmall as e:
            raise UsageError(
                f"the pool's {e.usable:,} usable blocks ({pool_source}) cannot hold the "
                f"simulated request of --simulate-prompt {args.simulate_prompt:,} plus "
                f"--decode {args.decode:,} tokens, which needs {e.need:,}: give a larger "
                "--num-blocks or --kv-bytes, or a smaller --simulate-prompt"
            ) from None
        except ValueError as e:  # the scheduler refuses the block size / chunk
            raise UsageError(str(e)) from None
        result["simulation"] = sim.to_dict()
        result["peak_blocks_held"] = sim.peak_blocks_held
        result["geometry_blocks"] = sim.geometry_blocks
    if args.json:
        print_json(json_stdout(), result)
    else:
        _print_capacity(result)
    return 0


def _print_capacity(r: dict[str, Any]) -> None:
    print(f"model {r['model']}: {r['num_blocks']:,} blocks of {r['block_size']} tokens")
    for name, value in r["assumes"].items():
        print(f"  assumes {name}: {value}")
    print(
        f"  tokens {r['tokens']:,} (the longest context one request holds alone), "
        f"block {r['block_bytes']:,} B, padding {r['padding_percent']}%"
    )
    print(f"  max concurrency at {r['max_model_len']:,} tokens: {r['max_concurrency']:,}")
    for g in r["groups"]:
        print(
            f"  group {g['group_id']} {g['kind']:>5} x{g['num_layers']}: page {g['page_bytes']:,} B"
            f" (+{g['padding_percent']}% pad), {g['blocks_per_request']} blocks/request"
        )
    if "simulation" in r:
        print(f"  simulation: peak {r['peak_blocks_held']} vs formula {r['geometry_blocks']}")


def _levels(text: str) -> tuple[int, ...]:
    try:
        return tuple(_positive(c) for c in text.split(",") if c)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"--concurrency {text!r}: {e}") from None


def _plot_ready() -> bool:
    """matplotlib is there (checked before a long bench, not after it)."""
    from spur.cluster.bench import plot

    try:
        plot.pyplot()
    except RuntimeError as e:
        print(f"spur: error: {e}", file=sys.stderr)
        return False
    return True


def _bench_peer(args: argparse.Namespace) -> Any:
    """`bench serve --peer llama-cpp`: both servers started here (cluster/bench/peer.py)."""
    from pathlib import Path

    from spur.cluster.bench import peer

    if args.url:
        raise UsageError("--peer starts its own servers: drop --url")
    try:
        result = peer.run(
            dtypes=tuple(d for d in args.dtypes.split(",") if d),
            concurrencies=_levels(args.concurrency or "1,4,16"),
            requests_per_level=args.requests or 64,
            max_tokens=args.max_tokens,
            rounds=args.rounds,
            seed=args.seed,
            threads=args.threads,
            config=args.config,
            stream_interval=args.stream_interval,
            sdist=Path(args.llama_sdist) if args.llama_sdist else None,
            progress=not args.no_progress,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    except RuntimeError as e:
        print(f"spur: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    return result


def _earlier_runs(specs: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """`LABEL=RUN.json` of --plot-with, read before the bench starts (a typo fails fast)."""
    runs = []
    for spec in specs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise UsageError(f"--plot-with {spec!r}: give LABEL=RUN.json")
        try:
            runs.append((label, json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            raise UsageError(f"--plot-with {spec!r}: cannot read {path}: {e}") from None
    return runs


def _spec_run_from(path: str, plot_path: str | None) -> dict[str, Any]:
    """--plot-from RUN.json of `bench spec`: the earlier run, checked to be one (UsageError
    otherwise); only with --plot (it replaces the bench, which then does not run)."""
    from spur.cluster.bench import plot

    if not plot_path:
        raise UsageError("--plot-from RUN.json redraws an earlier run: give --plot PATH.png too")
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--plot-from {path}: cannot read it: {e}") from None
    try:
        plot.spec_levels(result)
    except ValueError as e:
        raise UsageError(f"--plot-from {path}: {e}") from None
    return result


def cmd_bench(args: argparse.Namespace) -> int:
    out = json_stdout() if getattr(args, "json", False) else None
    if args.bench == "core":
        from spur.cluster.bench import core

        result = core.run(num_requests=args.requests, seed=args.seed)
    elif args.bench in ("serve", "engine", "spec") and args.plot and not _plot_ready():
        return 1
    elif args.bench == "serve" and args.peer:
        result = _bench_peer(args)
    elif args.bench == "serve":
        from spur.cluster.bench import serve
        from spur.configs.env import client_api_key

        if not args.url:
            raise UsageError("give --url of a running spur server (or --peer llama-cpp)")
        try:  # the errors name the flag or variable, never the key
            api_key = client_api_key(given=args.api_key)
            admin_key = client_api_key(admin=True, given=args.admin_key, flag="--admin-key")
        except ValueError as e:
            raise UsageError(str(e)) from None
        try:
            result = serve.run(
                url=args.url,
                model=args.model,
                concurrencies=_levels(args.concurrency or "1,8,32"),
                seed=args.seed,
                requests_per_level=args.requests,
                rounds=args.rounds,
                baseline_url=args.baseline_url,
                api_key=api_key,
                admin_key=admin_key,
                progress=not args.no_progress,
            )
        except (OSError, ValueError) as e:
            raise UsageError(f"cannot benchmark {args.url}: {e}") from None
    elif args.bench == "routing":
        from spur.cluster.bench import routing
        from spur.cluster.bench.workload import WorkloadSpec

        try:
            spec = WorkloadSpec(
                groups=args.groups,
                users_per_group=args.users_per_group,
                rounds=args.rounds,
                system_prompt_tokens=args.system_prompt_tokens,
                question_tokens=args.question_tokens,
                answer_tokens=args.answer_tokens,
                request_rate=args.request_rate,
                seed=args.seed,
            )
            result = routing.run(
                model=args.model,
                replicas=args.replicas,
                block_size=args.block_size,
                spec=spec,
                arms=tuple(a for a in args.arms.split(",") if a),
                address=args.address,
                quick=args.quick,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.bench == "engine":
        from spur.cluster.bench import engine

        earlier = _earlier_runs(args.plot_with)

        try:
            result = engine.run(
                num_requests=args.requests,
                seed=args.seed,
                dtypes=tuple(d for d in args.dtypes.split(",") if d),
                model=args.model,
                quick=args.quick,
                matmul_floor=args.matmul_floor,
                share_rounds=args.share_rounds,
                prefix_hit_tokens=(
                    args.prefix_hit
                    if args.prefix_hit is not None
                    else (2048 if args.model == "hybrid" else 0)
                ),
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.bench == "autoscale":
        from spur.cluster.bench import autoscale

        try:
            result = autoscale.run(
                model=args.model,
                low=args.low,
                high=args.high,
                low_s=args.low_seconds,
                high_hold_s=args.high_hold_seconds,
                max_tokens=args.max_tokens,
                upscale_delay_s=args.upscale_delay,
                downscale_delay_s=args.downscale_delay,
            )
        except RuntimeError as e:
            raise UsageError(f"the autoscale benchmark could not run: {e}") from None
    elif args.bench == "spec" and args.plot_from:
        result = _spec_run_from(args.plot_from, args.plot)
    elif args.bench == "spec":
        from spur.cluster.bench import spec

        try:
            result = spec.run(
                model=args.model,
                dtype=args.dtype,
                concurrencies=tuple(int(c) for c in args.concurrency.split(",") if c),
                workloads=tuple(w for w in args.workloads.split(",") if w),
                requests=args.requests,
                rounds=args.rounds,
                num_speculative_tokens=args.num_speculative_tokens,
                prompt_lookup_min=args.prompt_lookup_min,
                prompt_lookup_max=args.prompt_lookup_max,
                disable_by_batch_size=args.disable_by_batch_size,
                seed=args.seed,
                quick=args.quick,
                max_tokens=args.max_tokens,
                num_threads=args.num_threads,
            )
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.bench == "gpu":
        from spur.cluster.bench import gpu

        try:
            result = gpu.run(
                dry_run=args.dry_run,
                skip=tuple(s for s in args.skip.split(",") if s),
                budget_s=args.budget_s,
                peak_tbs=args.peak_tbs,
            )
        except RuntimeError as e:
            raise UsageError(str(e)) from None
    else:
        raise UsageError(f"choose a benchmark: {', '.join(BENCHES)}")
    if args.bench == "serve" and args.plot:
        from spur.cluster.bench import plot

        result["plot"] = str(plot.draw(result, args.plot))
    elif args.bench == "engine" and args.plot:
        from spur.cluster.bench import plot

        runs = [*earlier, (args.plot_label, result)]
        result["plot"] = str(plot.engine_profile(runs, args.plot))
    elif args.bench == "spec" and args.plot:
        from spur.cluster.bench import plot

        result["plot"] = str(plot.spec_itl(result, args.plot))
    if out is not None:
        print_json(out, result)
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 1 if args.bench == "gpu" and not result.get("ok") else 0


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "serve": cmd_serve,
    "config": cmd_config,
    "generate": cmd_generate,
    "capacity": cmd_capacity,
    "bench": cmd_bench,
    "dashboards": cmd_dashboards,
    "top": cmd_top,
}


def _apply_cpu_target() -> None:
    """SPUR_CPU_TARGET (configs/cpu.py): check it, and cap torch's libraries at that level
    before anything loads torch, here and in the processes spur starts."""
    from spur.configs import cpu

    try:
        cpu.export_torch_isa()
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None
    if cpu.here().target != "native":
        logging.getLogger("spur").warning("running as %s", cpu.describe(cpu.here()))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        _check_repeats(argv, parser)
        args = parser.parse_args(argv)
        logging.basicConfig(
            level=logging.INFO if args.verbose else logging.WARNING,
            format="%(levelname)s %(name)s: %(message)s",
        )
        if args.command is None:
            raise UsageError(f"choose a command: {', '.join(COMMANDS)}")
        _apply_cpu_target()
        return HANDLERS[args.command](args)
    except UsageError as e:
        print(f"spur: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: the shell's status for SIGINT, no traceback
        print("spur: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
