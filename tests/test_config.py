"""TrainConfig: defaults, precedence (defaults < file < flags), refusals by name, TOML round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from veil.config import (
    TrainConfig,
    config_to_toml,
    load_config_file,
    make_config,
    resolve_config,
    write_config,
)
from veil.errors import ConfigError, InvalidParameterError
from veil.presets import PRESETS, apply_presets, preset_for


def test_defaults_are_the_documented_ones() -> None:
    c = TrainConfig()
    assert (c.dataset, c.model, c.epsilon, c.delta, c.accountant) == ("digits", "auto", 3.0, 1e-5, "pld")
    assert c.reproducible is False and c.secure_rng is True  # secure randomness by default
    assert c.baseline is True and c.noise_multiplier is None and c.classes is None
    assert c.epochs is None and c.batch_size is None  # tuned presets fill them per data kind


def test_precedence_defaults_file_flags(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('dataset = "breast-cancer"\nepsilon = 1.5\nmax-grad-norm = 2.0\nepochs = 7\n')
    c = resolve_config(f, {"epsilon": 0.5, "lr": None})
    assert c.dataset == "breast-cancer"  # file over default
    assert c.epsilon == 0.5  # flag over file
    assert c.max_grad_norm == 2.0 and c.epochs == 7  # dashed keys accepted
    assert c.delta == 1e-5  # default kept
    assert c.lr is None  # a None flag means "not given"


def test_unknown_key_is_refused_by_name_with_a_suggestion(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("epoch = 3\n")
    with pytest.raises(ConfigError) as info:
        resolve_config(f)
    assert "'epoch'" in str(info.value) and "did you mean 'epochs'?" in str(info.value)
    with pytest.raises(ConfigError, match="did you mean 'max_grad_norm'"):
        make_config({"max_grad_nrom": 1.0})


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("epochs", "ten", "an integer"),
        ("epsilon", "3", "a number"),
        ("secure_rng", 1, "true or false"),
        ("reproducible", 1, "true or false"),
        ("classes", 3, "a list"),
        ("epochs", 2.5, "an integer"),
    ],
)
def test_wrong_type_names_key_value_and_expected_type(key: str, value: object, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        make_config({key: value})
    message = str(info.value)
    assert message.startswith(f"{key}={value!r}") and expected in message


def test_wrong_type_in_a_file(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('epsilon = "three"\n')
    with pytest.raises(ConfigError, match=r"epsilon='three': expected a number"):
        resolve_config(f)


@pytest.mark.parametrize("eps", [0, -1.0, float("inf")])
def test_epsilon_must_be_positive_and_finite(eps: float) -> None:
    with pytest.raises(InvalidParameterError, match="epsilon"):
        make_config({"epsilon": eps})


def test_other_ranges_and_literals() -> None:
    for bad in ({"delta": 1.0}, {"epochs": 0}, {"test_fraction": 1.0}, {"momentum": 1.0}, {"seed": -1}):
        with pytest.raises((ConfigError, InvalidParameterError)):
            make_config(bad)
    with pytest.raises(ConfigError, match="'pld' or 'rdp'"):
        make_config({"accountant": "moments"})
    with pytest.raises(ConfigError, match="low < high"):
        make_config({"feature_bounds": [[1.0, 0.0]]})


def test_missing_or_broken_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config_file(tmp_path / "nope.toml")
    broken = tmp_path / "b.toml"
    broken.write_text("epsilon = = 3\n")
    with pytest.raises(ConfigError, match="TOML"):
        load_config_file(broken)


def test_toml_round_trip_including_tables(tmp_path: Path) -> None:
    c = make_config(
        {
            "dataset": 'csv:/d/x "q".csv',
            "epsilon": 1.25,
            "feature_bounds": {"age": [0.0, 120.0], "a b": [-1.0, 1.0]},
        }
    )
    path = tmp_path / "config.toml"
    write_config(c, path)
    assert resolve_config(path) == c
    listed = make_config({"feature_bounds": [[0.0, 1.0], [2.0, 3.0]], "noise_multiplier": 1.1})
    assert make_config(_parse(config_to_toml(listed))) == listed


def _parse(text: str) -> dict[str, object]:
    import tomllib

    return tomllib.loads(text)


def test_presets_fill_only_unset_values() -> None:
    c = apply_presets(make_config({"lr": 0.3}), "table", n_train=455)
    assert c.lr == 0.3  # the user's value wins
    assert c.epochs == PRESETS["table"]["epochs"] and c.batch_size is not None and 1 <= c.batch_size <= 455
    small = apply_presets(make_config({}), "image-small", n_train=100)
    assert small.batch_size == 100  # a preset never exceeds N (q ≤ 1)


def test_lora_lr_only_with_lora() -> None:
    with pytest.raises(ConfigError, match="lora_lr"):
        make_config({"model": "hf:m", "fine_tune": "head", "lora_lr": 1e-3})
    with pytest.raises(ConfigError, match="lora_lr"):
        make_config({"model": "mlp", "fine_tune": "lora", "lora_lr": 1e-3})
    with pytest.raises(InvalidParameterError, match="lora_lr"):
        make_config({"model": "hf:m", "fine_tune": "lora", "lora_lr": -1.0})
    assert make_config({"model": "hf:m", "fine_tune": "lora", "lora_lr": 1e-3}).lora_lr == 1e-3


def test_the_preset_follows_the_resolved_model() -> None:
    from types import SimpleNamespace

    def preset(model: str, shape: tuple[int, ...], kind: str, data_preset: str) -> str:
        data = SimpleNamespace(preset=data_preset, kind=kind, input_shape=shape)
        return preset_for(model, data)  # type: ignore[arg-type]

    assert preset("auto", (1, 28, 28), "image", "image") == "image-scatternet"
    assert preset("scatternet", (1, 28, 28), "image", "image") == "image-scatternet"
    assert preset("cnn", (1, 28, 28), "image", "image") == "image"  # the CNN keeps its own settings
    assert preset("auto", (1, 8, 8), "image", "image-small") == "image-rff"
    assert preset("logreg", (1, 8, 8), "image", "image-small") == "image-small"
    assert preset("auto", (30,), "table", "table") == "table"
    c = apply_presets(make_config({}), "image-scatternet", n_train=60_000)
    assert (c.batch_size, c.max_grad_norm, c.lr, c.epochs) == (16384, 0.1, 16.0, 60)
    assert c.physical_batch_size == 1024  # memory only: the logical batch (and ε) stay the preset's
    assert apply_presets(make_config({}), "image-scatternet", n_train=500).physical_batch_size == 500
    mine = apply_presets(make_config({"physical_batch_size": 64}), "image-scatternet", n_train=60_000)
    assert mine.physical_batch_size == 64  # the user's own choice is kept
