"""spur.cluster.entry: the Serve application builder a RayService imports builds the
application from the config embedded in serveConfigV2 (no Ray cluster needed)."""

from __future__ import annotations

import pytest
from ray._common.utils import import_attr
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

from spur.cluster.entry import app_builder, config_from_args
from spur.configs.loader import ConfigError, config_to_dict, load_config, preset_path


@pytest.mark.parametrize("form", ["config", "config_yaml"])
def test_builder_builds_the_application_of_the_embedded_config(form: str) -> None:
    cfg = load_config("two-lanes")
    args = (
        {"config": config_to_dict(cfg)}
        if form == "config"
        else {"config_yaml": preset_path("two-lanes").read_text()}
    )
    assert config_from_args(args) == cfg
    # The way Serve calls an import path's builder when it deploys a config.
    builder = import_attr("spur.cluster.entry:app_builder")
    app = call_user_app_builder_with_args_if_necessary(builder, args)
    assert isinstance(app, Application)
    # The ingress binds one engine deployment per lane plus the spare.
    engines = app._bound_deployment.init_args[0]
    assert sorted(engines) == ["chat", "reasoning", "spare"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        ({}, ["exactly one of args.config", "neither"]),
        ({"config": {"lanes": [{"name": "a"}]}, "config_yaml": "x"}, ["config, config_yaml"]),
        ({"config": {"lanes": [{"name": "a"}]}, "port": 1}, ["unknown arg 'port'"]),
        (
            {"config": {"lanes": [{"name": "a", "replicas": 0}]}},
            ["lanes[0].replicas: must be >= 1"],
        ),
        ({"config_yaml": "lanes: [{name: a}]\nlanes: []\n"}, ["spurConfigYaml", "appears twice"]),
    ],
)
def test_builder_rejects_bad_args_with_the_loaders_message(args: dict, words: list[str]) -> None:
    with pytest.raises(ConfigError) as failure:
        app_builder(args)
    for word in words:
        assert word in str(failure.value)
