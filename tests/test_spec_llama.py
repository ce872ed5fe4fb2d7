"""train.model.llama is checked against a torch-free copy of LlamaConfig's keyword arguments.

The first test is the guard of that copy: it rebuilds the table from the installed
`transformers.LlamaConfig` (its `__init__` signature: names, types, defaults) and
fails when the two disagree, so a transformers upgrade cannot leave the spec
accepting a key the model ignores or refusing one it needs.
"""

from __future__ import annotations

import copy
import inspect
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import transformers
import yaml
from shardctl.orchestrator.errors import SpecError
from shardctl.orchestrator.spec import (
    LLAMA_CONFIG_KEYS,
    LLAMA_EXTRA_KEYS,
    LLAMA_REFUSED_KEYS,
    parse_spec,
)

ROOT = Path(__file__).resolve().parent.parent
BASE: dict[str, Any] = yaml.safe_load((ROOT / "examples" / "tiny-llama.yaml").read_text())


def _type_text(tp: Any) -> str:
    """A type annotation in the table's notation: `int | list[int] | None`, `dict`."""
    if tp is type(None):
        return "None"
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        # dict.fromkeys: RopeParameters | dict is "dict" once
        return " | ".join(dict.fromkeys(_type_text(arg) for arg in typing.get_args(tp)))
    if origin is list:
        return f"list[{_type_text(typing.get_args(tp)[0])}]"
    if typing.is_typeddict(tp) or tp is dict:
        return "dict"  # RopeParameters is a TypedDict: a plain mapping in YAML
    assert isinstance(tp, type), f"no table notation for {tp!r}"
    return tp.__name__


def _real_table() -> dict[str, tuple[str, Any]]:
    params = inspect.signature(transformers.LlamaConfig.__init__).parameters.values()
    own = [p for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY]
    return {p.name: (_type_text(p.annotation), p.default) for p in own}


def test_table_matches_the_installed_llama_config() -> None:
    real = _real_table()
    assert real, "LlamaConfig.__init__ has no keyword-only arguments any more"
    missing = sorted(set(real) - set(LLAMA_CONFIG_KEYS))
    extra = sorted(set(LLAMA_CONFIG_KEYS) - set(real))
    assert not missing and not extra, (
        f"orchestrator/spec/llama.py LLAMA_CONFIG_KEYS is out of date with transformers "
        f"{transformers.__version__}: add {missing}, remove {extra}"
    )
    for key, (type_text, default) in real.items():
        assert LLAMA_CONFIG_KEYS[key] == (type_text, default), (
            f"LLAMA_CONFIG_KEYS[{key!r}] is {LLAMA_CONFIG_KEYS[key]!r}; transformers "
            f"{transformers.__version__} says {(type_text, default)!r}"
        )


def test_extra_keys_are_still_honoured_by_transformers() -> None:
    config = transformers.LlamaConfig(rope_theta=12345.0)
    assert config.rope_parameters["rope_theta"] == 12345.0
    config = transformers.LlamaConfig(rope_scaling={"rope_type": "linear", "factor": 2.0})
    assert config.rope_parameters["rope_type"] == "linear"
    config = transformers.LlamaConfig(attn_implementation="eager")
    assert config._attn_implementation == "eager"
    assert set(LLAMA_EXTRA_KEYS).isdisjoint(LLAMA_CONFIG_KEYS)


def test_refused_keys_are_ones_transformers_understands() -> None:
    base = inspect.signature(transformers.PretrainedConfig.__init__).parameters
    for key in LLAMA_REFUSED_KEYS:
        assert key in base or key == "torch_dtype"  # torch_dtype: the pre-5.0 spelling


def test_transformers_itself_swallows_a_typo() -> None:
    """Why the table exists: LlamaConfig takes any keyword and keeps its default."""
    config = transformers.LlamaConfig(hiden_size=64)
    assert config.hidden_size == 4096


def test_the_example_builds_the_same_config() -> None:
    llama = parse_spec(BASE).train.model.llama
    assert llama is not None
    config = transformers.LlamaConfig(**llama)
    assert (config.hidden_size, config.num_hidden_layers) == (128, 4)


def _llama(**changes: Any) -> dict[str, Any]:
    data = copy.deepcopy(BASE)
    data["train"]["model"]["llama"].update(changes)
    return data


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"hiden_size": 64},
            [
                "unknown key 'train.model.llama.hiden_size'",
                "did you mean 'hidden_size'?",
                "accepted: attention_bias",
            ],
        ),
        ({"num_layers": 2}, ["'train.model.llama.num_layers'", "'num_hidden_layers'"]),
        ({"architectures": ["LlamaForCausalLM"]}, ["unknown key", "llama.architectures"]),
        ({"torch_dtype": "bfloat16"}, ["train.model.llama.torch_dtype", "train.model.dtype"]),
        ({"hidden_size": "128"}, ["train.model.llama.hidden_size: '128' is a string", "int"]),
        ({"hidden_size": 128.0}, ["train.model.llama.hidden_size: 128.0 is a number", "int"]),
        ({"use_cache": "yes"}, ["train.model.llama.use_cache: 'yes' is a string", "bool"]),
        ({"tie_word_embeddings": 1}, ["tie_word_embeddings: 1 is an integer", "bool"]),
        ({"hidden_act": 3}, ["hidden_act: 3 is an integer", "accepted: str"]),
        ({"rope_theta": "big"}, ["rope_theta: 'big' is a string", "int | float"]),
        ({"hidden_size": 10**30}, ["hidden_size: 10000000000", "1..16777216"]),
        ({"num_hidden_layers": 0}, ["num_hidden_layers: 0 is not a positive integer"]),
        ({"rms_norm_eps": 0.0}, ["rms_norm_eps: 0.0 is out of range", "more than 0"]),
        ({"initializer_range": 2.0}, ["initializer_range: 2.0 is out of range", "0 to 1"]),
        ({"attention_dropout": 1.0}, ["attention_dropout: 1.0 is out of range"]),
        ({"rope_theta": float("nan")}, ["rope_theta: nan is not a finite number"]),
        ({"eos_token_id": [2, "x"]}, ["eos_token_id: [2, 'x'] is a list"]),
        ({"pad_token_id": 256}, ["pad_token_id: 256 is not a token id", "0..255"]),
        ({"eos_token_id": [2, 300]}, ["eos_token_id: 300 is not a token id"]),
        (
            {"hidden_size": 100, "num_attention_heads": None},
            ["hidden_size (100) must be divisible", "num_attention_heads (32, the default)"],
        ),
    ],
)
def test_bad_llama_keys_are_refused(changes: dict[str, Any], expected: list[str]) -> None:
    data = _llama(**changes)
    if changes.get("num_attention_heads", 0) is None:
        del data["train"]["model"]["llama"]["num_attention_heads"]
        del data["train"]["model"]["llama"]["num_key_value_heads"]
    with pytest.raises(SpecError) as exc:
        parse_spec(data, "job.yaml")
    message = str(exc.value)
    for part in expected:
        assert part in message, f"{part!r} not in {message!r}"
    assert exc.value.exit_code == 2


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_theta": 500000.0},
        {"rope_theta": 10000},
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"attn_implementation": "sdpa"},
        {"tie_word_embeddings": True, "head_dim": 32, "eos_token_id": [1, 2]},
        {"num_key_value_heads": 2, "attention_dropout": 0, "pad_token_id": None},
    ],
)
def test_good_llama_keys_pass_and_transformers_agrees(changes: dict[str, Any]) -> None:
    llama = parse_spec(_llama(**changes)).train.model.llama
    assert llama is not None
    config = transformers.LlamaConfig(**llama)  # what the ranks do with it
    # LlamaConfig takes any keyword, so building it proves nothing: every key the spec
    # passes must be one transformers reads, and must land where the model looks for it.
    own = inspect.signature(transformers.LlamaConfig.__init__).parameters
    honoured = {  # keywords LlamaConfig reads outside its signature, and where they land
        "rope_theta": lambda value: config.rope_parameters["rope_theta"] == value,
        "rope_scaling": lambda value: value.items() <= config.rope_parameters.items(),
        "attn_implementation": lambda value: config._attn_implementation == value,
    }
    for key, value in llama.items():
        if key in own and key != "self":
            assert getattr(config, key) == value, f"{key}: {getattr(config, key)!r} != {value!r}"
        else:
            assert key in honoured, f"LlamaConfig does not read {key!r}"
            assert honoured[key](value), f"{key}={value!r} did not reach the config"
    for key, value in changes.items():
        assert llama[key] == value  # the spec passed the user's value on unchanged
