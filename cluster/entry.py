"""The Serve application builder for a RayService (`import_path: spur.cluster.entry:app_builder`).

The Helm chart embeds the spur config in its serveConfigV2 as the application's args,
either as structure or as a whole file's text:

    args: {config: {lanes: [...], ...}}              values' `spur:` tree
    args: {config_yaml: "version: 1\\nlanes: ..."}    values' `spurConfigYaml`

Serve calls `app_builder(args)` when it deploys the application on the cluster; the
config is validated there by spur's own loader, so a bad config fails the deployment
with the same message `spur serve` prints (the RayService's status shows it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from spur.configs.loader import ConfigError, parse_config, read_yaml
from spur.configs.schema import SpurConfig

ARGS_KEYS = ("config", "config_yaml")
"""The args the builder accepts; exactly one of them must be given."""


def config_from_args(args: Mapping[str, Any]) -> SpurConfig:
    """The SpurConfig embedded in a Serve application's args. Does not touch Ray.

    Raises:
        ConfigError: no config, both forms, unknown args, or an invalid config (every
            problem listed with its path).
    """
    if not isinstance(args, Mapping):
        raise ConfigError(
            [
                f"the application's args must be a mapping with one of {ARGS_KEYS}, "
                f"not a {type(args).__name__}"
            ],
            "serveConfigV2",
        )
    unknown = sorted(set(args) - set(ARGS_KEYS))
    given = [key for key in ARGS_KEYS if args.get(key) is not None]
    if unknown or len(given) != 1:
        problems = [f"unknown arg {key!r}" for key in unknown]
        if len(given) != 1:
            problems.append(
                f"give exactly one of args.config (the config tree) and args.config_yaml "
                f"(a config file's text); got {', '.join(given) or 'neither'}"
            )
        raise ConfigError(problems, "serveConfigV2")
    if given[0] == "config_yaml":
        text = args["config_yaml"]
        if not isinstance(text, str):
            raise ConfigError(["args.config_yaml must be a config file's text"], "serveConfigV2")
        return parse_config(read_yaml(text, "spurConfigYaml"), source="spurConfigYaml")
    return parse_config(args["config"], source="spur (Helm values)")


def app_builder(args: dict[str, Any]) -> Application:
    """Serve's application builder: the spur application for the embedded config.

    Raises:
        ConfigError: see `config_from_args`.
    """
    from spur.cluster.app import build_app

    return build_app(config_from_args(args))
