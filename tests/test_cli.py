"""The `spur` command line: real subprocesses, real exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from spur.actors.ports import free_port

SPUR = [sys.executable, "-m", "spur.cluster.cli"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*SPUR, *args], capture_output=True, text=True, timeout=300)


def usage_error(needle: str, *args: str) -> None:
    """`spur ARGS` ends with exit 2 and `needle` on stderr, not a traceback."""
    res = run(*args)
    assert res.returncode == 2 and needle in res.stderr, res.stderr
    assert "Traceback" not in res.stderr


def test_bench_core_prints_json_with_every_figure():
    res = run("bench", "core", "--requests", "128", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["bench"] == "core" and out["trace"]["requests"] == 128
    assert out["cpu"]["cores"] == os.cpu_count() and out["cpu"]["model"]  # which CPU ran it
    ops = out["manager"]["us_per_op"]
    assert set(ops) == {
        "hash_prompt",
        "prefix_lookup",
        "allocate_prefill",
        "allocate_decode",
        "free",
    }
    assert all(v > 0 for v in ops.values())
    assert out["manager"]["requests_per_s"] > 0 and out["scheduler"]["requests_per_s"] > 0
    # 8 groups share 512 of 1,024 tokens; after each group's first request
    # every request hits exactly 32 blocks.
    assert out["manager"]["prefix_hit_rate"] == round((128 - 8) * 512 / (128 * 1024), 4)
    assert out["hashing"]["speedup"] > 0


def test_misuse_is_a_clear_error_and_exit_2():
    res = run("capacity", "capacity", "--model", "x")
    assert res.returncode == 2 and "'capacity' given twice; usage:" in res.stderr
    res = run("frobnicate")
    assert res.returncode == 2 and "invalid choice" in res.stderr
    res = run()
    assert res.returncode == 2 and "choose a command" in res.stderr
    res = run("capacity", "--model", "cfg.json", "--block-size", "0")
    assert res.returncode == 2 and "must be >= 1" in res.stderr
    assert "Traceback" not in res.stderr


def test_json_stdout_keeps_every_other_line_off_stdout():
    """What `--json` commands do (cluster/cli.json_stdout): print(), child processes
    (Ray's raylet and workers, whose lines the driver forwards) and logging all go
    to stderr; stdout holds exactly the JSON document."""
    code = (
        "import subprocess, logging, sys\n"
        "from spur.cluster.cli import json_stdout, print_json\n"
        "out = json_stdout()\n"
        "print('(raylet) Task ServeController.graceful_shutdown failed')\n"
        "subprocess.run(['sh', '-c', 'echo child noise'])\n"
        "logging.basicConfig(stream=sys.stdout); logging.warning('log noise')\n"
        "print_json(out, {'ok': 1})\n"
        "print('late noise at exit')\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == {"ok": 1}
    for noise in ("(raylet) Task", "child noise", "log noise", "late noise"):
        assert noise in res.stderr


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_size": 64,
    "max_position_embeddings": 256,
}
"""A config.json `spur capacity` reads (a model's geometry, no weights)."""


def test_capacity_json_is_strict_json(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    res = subprocess.run(
        [*SPUR, "capacity", "--model", str(cfg), "--num-blocks", "64", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["num_blocks"] > 0


def test_more_misuse_is_a_clear_error_not_a_traceback(tmp_path):
    """From a review of the CLI: each of these used to end in a traceback (or in a
    false 'given twice')."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    # a prefill-only simulation (--decode defaults to 0) runs
    res = run("capacity", "--model", str(cfg), "--num-blocks", "64", "--simulate-prompt", "40")
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    res = run("capacity", "--model", str(cfg), "--simulate-prompt", "40", "--decode", "-3")
    assert res.returncode == 2 and "must be >= 1" in res.stderr
    broken = tmp_path / "geometry.yaml"
    broken.write_text("layers: [\n")
    usage_error("not valid YAML at line", "capacity", "--model", str(broken))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    usage_error("not a model config object", "capacity", "--model", str(listed))
    res = run("top", "--interval", "-1")
    assert res.returncode == 2 and "must be > 0" in res.stderr
    # a flag's value that is a command's name is not the command given twice
    res = run("top", "--url", "top", "--once")
    assert res.returncode == 2 and "given twice" not in res.stderr
    assert "give the server's URL" in res.stderr and "Traceback" not in res.stderr


def test_a_test_only_setting_is_refused_before_ray_starts(tmp_path):
    cfg = tmp_path / "leaky.yaml"
    cfg.write_text(
        "lanes:\n  - name: chat\n    engine: {runtime: {test_leak_blocks_per_step: 1}}\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "SPUR_ALLOW_TEST_SETTINGS"}
    res = subprocess.run(
        [*SPUR, "serve", str(cfg)], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 2 and "tests only" in res.stderr.lower(), res.stderr
    assert "Traceback" not in res.stderr


def test_an_ipv6_host_gives_a_bracketed_url():
    from spur.configs.loader import parse_config

    cfg = parse_config({"lanes": [{"name": "chat"}], "server": {"host": "::1", "port": 8123}})
    assert cfg.server.url == "http://[::1]:8123"
    wildcard = parse_config({"lanes": [{"name": "chat"}], "server": {"host": "::"}})
    assert wildcard.server.url == "http://127.0.0.1:8000"


def test_a_third_review_of_misuse_gets_clear_errors(tmp_path):
    """Each of these used to end in a traceback (or, for an empty --host, be ignored)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_LLAMA))
    usage_error(
        "usable blocks", "capacity", "--model", str(cfg), "--num-blocks", "8",
        "--simulate-prompt", "200",
    )  # fmt: skip
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    usage_error("cannot write the dashboards", "dashboards", "export", str(a_file))
    usage_error("server.host", "serve", "--host", "")
    missing = str(tmp_path / "no-model")
    for tp in ("1", "2"):  # two ranks: the first rank's error, not the executor's traceback
        res = run("generate", "--model", missing, "--tensor-parallel-size", tp, "--prompt", "hi")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert "does not exist" in res.stderr and res.stderr.count("\n") <= 3, res.stderr


def test_speculation_on_a_hybrid_model_is_refused_before_ray_starts(tmp_path):
    """The engine refuses it too, but only once Ray runs: three replica builds and a
    deployment traceback. By name (a random demo preset) and by a folder here."""
    from spur.actors.worker.random_models import hf_config
    from spur.cluster.app import refuse_speculation_on_state_models
    from spur.configs.loader import parse_config

    cfg = tmp_path / "spec.yaml"
    cfg.write_text(
        "lanes:\n  - name: chat\n    engine:\n      model: {path: hybrid-tiny}\n"
        "      speculative: {num_speculative_tokens: 2}\n"
    )
    res = subprocess.run([*SPUR, "serve", str(cfg)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "speculative decoding is not supported" in res.stderr and "Traceback" not in res.stderr
    folder = tmp_path / "hybrid"
    hf_config("hybrid-tiny").save_pretrained(folder)
    lanes = parse_config(
        {
            "lanes": [
                {"name": "plain", "engine": {"model": {"path": str(folder)}}},
                {
                    "name": "drafting",
                    "engine": {
                        "model": {"path": str(folder)},
                        "speculative": {"num_speculative_tokens": 2},
                    },
                },
            ]
        }
    ).lanes
    refuse_speculation_on_state_models(lanes[:1])  # no speculation: nothing to refuse
    with pytest.raises(ValueError, match="lane 'drafting': speculative decoding"):
        refuse_speculation_on_state_models(lanes)


def test_an_override_generation_config_out_of_range_is_refused_before_ray_starts(tmp_path):
    """Each replica refused it once Ray ran (three builds, a deployment traceback), with
    a fix that did not apply to an override (ignore the model's file)."""
    cfg = tmp_path / "ogc.yaml"
    cfg.write_text(
        "lanes:\n  - name: chat\n    engine:\n"
        "      model: {override_generation_config: {temperature: -1}}\n"
    )
    res = subprocess.run([*SPUR, "serve", str(cfg)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "lane 'chat': engine.model.override_generation_config" in res.stderr
    assert "temperature" in res.stderr and "fix engine.model.override_generation_config" in (
        res.stderr
    )
    assert "Started a local Ray instance" not in res.stderr


def test_a_bad_attention_backend_override_is_refused_before_ray_starts(tmp_path):
    """SPUR_ATTENTION_BACKEND overrides every lane's backend in the workers: a typo, or
    triton on a CPU lane, passed spur serve and failed in every replica."""
    for value, expected in (
        ("trition", "SPUR_ATTENTION_BACKEND 'trition' is unknown"),
        ("triton", "SPUR_ATTENTION_BACKEND is 'triton' but lanes ['chat'] do not run on CUDA"),
    ):
        res = run_env({"SPUR_ATTENTION_BACKEND": value}, "serve", "local")
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert expected in res.stderr, res.stderr


@pytest.mark.slow
def test_a_deployment_that_fails_ends_spur_serve_with_its_reason(tmp_path):
    """Serve's "Deploying application spur failed: Failed to update the deployments"
    ended spur serve in a Python traceback naming no reason (the replicas' errors only
    in Ray's log lines above it). It is now one line with the replica's error, exit 1."""
    cfg = tmp_path / "missing.yaml"
    missing = tmp_path / "no-such-model"
    cfg.write_text(
        f"lanes:\n  - name: chat\n    engine:\n      model: {{path: {missing}}}\n"
        f"server: {{port: {free_port()}}}\n"
    )
    res = subprocess.run([*SPUR, "serve", str(cfg)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1, res.stderr[-3000:]
    (line,) = [x for x in res.stderr.splitlines() if "the application failed to deploy" in x]
    assert f"ModelLoadError: model '{missing}' does not exist" in line, line
    after = res.stderr.split(line)[-1].splitlines()
    assert not any(x.startswith("Traceback") for x in after), after  # none of spur serve's


SECRET = "sk-ops-SECRET-0123456789"
"""A key the client commands below are given; it must never reach their output."""


def run_env(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """`spur ARGS` with `env` over this environment (no SPUR_* key variables of ours)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SPUR_API_KEY", "SPUR_ADM"))}
    return subprocess.run(
        [*SPUR, *args], capture_output=True, text=True, timeout=120, env={**base, **env}
    )


def test_client_commands_strip_keys_and_never_print_them():
    """From a review of auth: a key read with its file's newline (a Secret, `$(cat key;
    echo)`, CRLF) made http.client refuse the header with an error quoting the key,
    which `config diff` and `bench serve` printed and `top` raised as a traceback. Keys
    are stripped now; one that still holds a control character inside is refused with
    exit 2, naming the flag or variable, not the key. Port 9 refuses connections."""
    url = "http://127.0.0.1:9"
    diff = ("config", "diff", "local", "--url", url)
    bench = ("bench", "serve", "--url", url, "--requests", "1", "--concurrency", "1")
    top = ("top", "--url", url, "--once")
    for env, args in (
        ({"SPUR_ADMIN_KEY": SECRET + "\n"}, diff),
        ({}, (*diff, "--api-key", SECRET + "\r")),
        ({"SPUR_API_KEY": SECRET + "\r\n"}, bench),
        ({}, (*bench, "--api-key", SECRET + "\n", "--admin-key", f" {SECRET} ")),
        ({"SPUR_ADMIN_KEY": SECRET + "\n"}, top),
        ({}, (*top, "--admin-key", SECRET + "\r")),
    ):  # stripped: the connection is what fails, in one line
        res = run_env(env, *args)
        assert res.returncode in (1, 2) and "Traceback" not in res.stderr, res.stderr
        assert "SECRET" not in res.stderr + res.stdout, res.stderr
        assert "Connection refused" in res.stderr and res.stderr.count("\n") == 1, res.stderr
    for env, args, source in (
        ({"SPUR_ADMIN_KEY": "sk-ops-SECRET\n0123456789"}, diff, "SPUR_ADMIN_KEY"),
        ({}, (*diff, "--api-key", "sk-ops-SECRET\x070123456789"), "--api-key"),
        ({"SPUR_API_KEY": "sk-ops-SECRET 0123456789"}, bench, "SPUR_API_KEY"),
        ({}, (*bench, "--admin-key", "sk-ops-SECRET\r0123456789"), "--admin-key"),
        ({"SPUR_ADMIN_KEY": "sk-ops-SECRET\n0123456789"}, top, "SPUR_ADMIN_KEY"),
        ({}, (*top, "--admin-key", "sk-ops-SECRET\t0123456789"), "--admin-key"),
    ):  # refused before any request, exit 2
        res = run_env(env, *args)
        assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
        assert f"spur: error: {source} holds whitespace, a control character" in res.stderr
        assert "SECRET" not in res.stderr + res.stdout, res.stderr


def test_require_keys_without_keys_is_refused_before_ray_starts(tmp_path):
    """From a review of auth: the rule ran only in the ingress, after Ray and the
    engines had started: pages of Ray tracebacks and exit 1."""
    from spur.cluster.fake_cluster import ray_test_env

    cfg = tmp_path / "closed.yaml"
    cfg.write_text("lanes:\n  - name: chat\nserver:\n  auth: {require_keys: true}\n")
    env = {k: v for k, v in ray_test_env(tmp_path).items() if k != "SPUR_API_KEYS"}
    res = subprocess.run(
        [*SPUR, "serve", str(cfg)], capture_output=True, text=True, timeout=120, env=env
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.startswith("spur: error: server.auth.require_keys is on but no API keys")
    assert res.stderr.count("\n") == 1 and not list(tmp_path.glob("ray*")), res.stderr


def test_serve_with_keys_fails_closed_wherever_the_ingress_runs(tmp_path, monkeypatch):
    """From a review of auth: with --address the ingress runs in a worker of the joined
    cluster and reads the keys from that cluster's environment, not the CLI's. Keys
    found by the CLI must turn require_keys on in the deployed config, so that an
    ingress without them refuses to start instead of serving /admin/* open."""
    from spur.cluster import cli, server

    deployed = []
    monkeypatch.setattr(server, "run_server", lambda cfg, announce: deployed.append(cfg) or 0)
    cfg = tmp_path / "spur.yaml"
    cfg.write_text("lanes:\n  - name: chat\n")
    args = cli.build_parser().parse_args(["serve", str(cfg), "--address", "127.0.0.1:6379"])
    monkeypatch.delenv("SPUR_API_KEYS", raising=False)
    assert cli.cmd_serve(args) == 0
    assert not deployed[-1].server.auth.require_keys  # no keys: open, as before
    monkeypatch.setenv("SPUR_API_KEYS", f"[{SECRET}]")
    assert cli.cmd_serve(args) == 0
    assert deployed[-1].server.auth.require_keys
    assert deployed[-1].server.ray_address == "127.0.0.1:6379"


def test_bench_engine_quick_runs_the_quick_workload_unless_requests_is_given() -> None:
    """--requests defaulted to 64 and was always passed on, so --quick ran 64 requests,
    not the 8 its help promises (engine.run picks 8 only when given None)."""
    from spur.cluster import cli

    parser = cli.build_parser()
    assert parser.parse_args(["bench", "engine", "--quick"]).requests is None
    assert parser.parse_args(["bench", "engine", "--quick", "--requests", "16"]).requests == 16


def test_config_diff_of_a_refusal_or_a_non_config_is_one_line_and_exit_2(capsys, monkeypatch):
    """From a review of the CLI: a 401 said only "HTTP Error 401: Unauthorized" (not
    which key to give), and JSON that is not a config (a list, a string, null, an error
    object) was diffed against the file: exit 1 and a diff of every field."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from spur.cluster import cli

    for name in list(os.environ):
        if name.startswith(("SPUR_API_KEY", "SPUR_ADM")):
            monkeypatch.delenv(name)
    bodies = {
        "list": (200, "[1, 2]"),
        "str": (200, '"hello"'),
        "null": (200, "null"),
        "err": (200, json.dumps({"error": {"message": "no such\nroute"}})),
        "401": (401, '{"error": "unauthorized"}'),
        "403": (403, '{"error": "forbidden"}'),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = bodies[self.path.split("/")[1]]
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    expected = {
        "list": "did not answer with a spur config (it sent a list)",
        "str": "did not answer with a spur config (it sent a string)",
        "null": "did not answer with a spur config (it sent null)",
        "err": "answered with an error, not a config: no such route",
        "401": "needs an admin key (HTTP 401): give it with --api-key or SPUR_ADMIN_KEY",
        "403": "refused the admin key (HTTP 403): give the server's admin key with --api-key",
    }
    try:
        for case, words in expected.items():
            args = ["config", "diff", "local", "--url", f"{base}/{case}"]
            if case == "403":
                args += ["--api-key", SECRET]
            assert cli.main(args) == 2, case
            out, err = capsys.readouterr()
            assert not out and err.startswith("spur: error: ") and err.count("\n") == 1, err
            assert words in err and SECRET not in err, err
    finally:
        server.shutdown()
