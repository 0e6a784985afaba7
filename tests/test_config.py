"""Typed configs: every preset under configs/ loads into its dataclass; bad values fail at load time."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from draftsmith.config import CONFIG_KINDS, apply_overrides, from_dict, load_config, to_dict
from draftsmith.errors import ConfigError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# Folders whose YAML is another tool's format, validated by that tool in its own test.
FOREIGN = {"accelerate": "accelerate's config classes (tests/test_training*.py)",
           "schedule": "Kubernetes / systemd examples (tests/test_retrain*.py)"}


@dataclass
class Inner:
    lr: float = 1e-3
    steps: int = 10

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class Outer:
    name: str = "x"
    mode: Literal["a", "b"] = "a"
    layers: list[int] = field(default_factory=lambda: [1, 2])
    inner: Inner = field(default_factory=Inner)
    path: str | None = None


def test_nested_build_and_round_trip():
    cfg = from_dict(Outer, {"mode": "b", "layers": [3], "inner": {"lr": "1e-4"}})
    assert cfg.inner.lr == pytest.approx(1e-4) and cfg.layers == [3] and cfg.mode == "b"
    assert from_dict(Outer, to_dict(cfg)) == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"inner": {"lrr": 1}}, "unknown config key 'inner.lrr'"),
        ({"mode": "c"}, "mode: 'c' is not one of"),
        ({"inner": {"steps": 1.5}}, "inner.steps: expected an integer"),
        ({"inner": {"lr": -1}}, "lr must be > 0"),
        ({"layers": 3}, "layers: expected a list"),
    ],
)
def test_bad_values_fail_with_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Outer, data)


def test_dotted_overrides():
    data = apply_overrides({"inner": {"lr": 1}}, ["inner.steps=5", "name=hello", "layers=[4, 5]"])
    assert data == {"inner": {"lr": 1, "steps": 5}, "name": "hello", "layers": [4, 5]}
    with pytest.raises(ConfigError, match="not key=value"):
        apply_overrides({}, ["oops"])


def test_unknown_kind_is_an_error(tmp_path):
    p = tmp_path / "x.yaml"
    p.write_text("kind: nonsense\n")
    with pytest.raises(ConfigError, match="not a known config kind"):
        load_config(p)


def _presets():
    return sorted(p for p in CONFIGS.rglob("*.yaml"))


@pytest.mark.parametrize("path", _presets(), ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_preset_loads(path):
    rel = path.relative_to(CONFIGS)
    if rel.parts[0] in FOREIGN:
        pytest.skip(f"validated by {FOREIGN[rel.parts[0]]}")
    data = yaml.safe_load(path.read_text())
    assert isinstance(data, dict) and "kind" in data, f"{rel}: every draftsmith preset names its kind"
    cfg = load_config(path)
    assert type(cfg) is CONFIG_KINDS[data["kind"]]
    # the dump of a loaded preset loads back to the same config
    assert from_dict(type(cfg), to_dict(cfg)) == cfg
