"""`train.model.llama`: transformers.LlamaConfig's keywords, checked without transformers."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable
from typing import Any

from ..errors import SpecError
from .common import MAX_SEQ_LEN, show, type_name

# transformers.LlamaConfig's keyword arguments: name → (type, default), copied here so
# that `validate` and `render` need no transformers (nor the torch it imports).
# tests/test_spec_llama.py rebuilds this table from the installed LlamaConfig and fails
# when the two disagree. Without the check, a typo such as `hiden_size` is swallowed by
# LlamaConfig's **kwargs and the ranks silently build the 6.5B-parameter default.
LLAMA_CONFIG_KEYS: dict[str, tuple[str, Any]] = {
    "vocab_size": ("int", 32000),
    "hidden_size": ("int", 4096),
    "intermediate_size": ("int", 11008),
    "num_hidden_layers": ("int", 32),
    "num_attention_heads": ("int", 32),
    "num_key_value_heads": ("int | None", None),
    "hidden_act": ("str", "silu"),
    "max_position_embeddings": ("int", 2048),
    "initializer_range": ("float", 0.02),
    "rms_norm_eps": ("float", 1e-06),
    "use_cache": ("bool", True),
    "pad_token_id": ("int | None", None),
    "bos_token_id": ("int | None", 1),
    "eos_token_id": ("int | list[int] | None", 2),
    "pretraining_tp": ("int | None", 1),
    "tie_word_embeddings": ("bool", False),
    "rope_parameters": ("dict | None", None),
    "attention_bias": ("bool", False),
    "attention_dropout": ("int | float | None", 0.0),
    "mlp_bias": ("bool", False),
    "head_dim": ("int | None", None),
}
# Keys LlamaConfig's base class still understands and that Llama configs on the Hub
# (config.json) commonly carry: the pre-5.0 RoPE spelling, folded into rope_parameters,
# and the attention kernel. The test proves transformers still honours each one. The
# base class's other keys (architectures, id2label, problem_type, return_dict ...)
# describe a saved checkpoint or a task head, not the model built here: refused.
LLAMA_EXTRA_KEYS: dict[str, tuple[str, Any]] = {
    "rope_theta": ("int | float", 10000.0),
    "rope_scaling": ("dict | None", None),
    "attn_implementation": ("str | None", None),
}
# Understood by LlamaConfig but refused, with the reason.
LLAMA_REFUSED_KEYS: dict[str, str] = {
    key: "the dtype is train.model.dtype (the model is built and cast in it, so a dtype "
    "here would be ignored); set it there"
    for key in ("dtype", "torch_dtype")
}
# Counts: more than any released model's width, depth, vocabulary or context.
LLAMA_COUNTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "head_dim",
    "pretraining_tp",
)  # fmt: skip
LLAMA_MAX_COUNT = MAX_SEQ_LEN
# Numbers with a meaningful range: the test, and the range as messages say it.
LLAMA_RANGES: dict[str, tuple[Callable[[float], bool], str]] = {
    "initializer_range": (lambda x: 0 <= x <= 1, "0 to 1"),  # LlamaConfig's own interval
    "rms_norm_eps": (lambda x: 0 < x <= 1, "more than 0, at most 1"),
    "attention_dropout": (lambda x: 0 <= x < 1, "0 to less than 1"),
    "rope_theta": (lambda x: 0 < x <= 1e12, "more than 0, at most 1e12"),
}


def _llama_type_ok(value: Any, type_text: str) -> bool:
    for alternative in type_text.split(" | "):
        ok = {
            "None": value is None,
            "bool": isinstance(value, bool),
            "int": isinstance(value, int) and not isinstance(value, bool),
            "float": isinstance(value, int | float) and not isinstance(value, bool),
            "str": isinstance(value, str),
            "dict": isinstance(value, dict),
            "list[int]": isinstance(value, list)
            and all(isinstance(x, int) and not isinstance(x, bool) for x in value),
        }[alternative]
        if ok:
            return True
    return False


def llama_problems(cfg: dict[str, Any]) -> list[str]:
    """Every problem of `train.model.llama`, one line each, each naming its key."""
    accepted = {**LLAMA_CONFIG_KEYS, **LLAMA_EXTRA_KEYS}
    problems: list[str] = []
    for key, value in cfg.items():
        field = f"train.model.llama.{SpecError.show_text(key)}"
        if key in LLAMA_REFUSED_KEYS:
            problems.append(f"{field}: {LLAMA_REFUSED_KEYS[key]}")
            continue
        if key not in accepted:
            hint = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
            did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
            problems.append(
                f"unknown key {field!r} in train.model.llama (a LlamaConfig){did_you_mean} "
                f"(accepted: {', '.join(sorted(accepted))})"
            )
            continue
        type_text = accepted[key][0]
        if not _llama_type_ok(value, type_text):
            problems.append(f"{field}: {show(value)} is {type_name(value)}; accepted: {type_text}")
            continue
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{field}: {show(value)} is not a finite number")
        elif key in LLAMA_COUNTS and value is not None and not 0 < value <= LLAMA_MAX_COUNT:
            problems.append(
                f"{field}: {show(value)} is not a positive integer of at most "
                f"{LLAMA_MAX_COUNT}; accepted: 1..{LLAMA_MAX_COUNT}"
            )
        elif key in LLAMA_RANGES and value is not None and not LLAMA_RANGES[key][0](value):
            problems.append(
                f"{field}: {show(value)} is out of range; accepted: {LLAMA_RANGES[key][1]}"
            )
    if problems:
        return problems
    return _llama_shape_problems(cfg)


def _llama_shape_problems(cfg: dict[str, Any]) -> list[str]:
    """Shapes LlamaConfig or the model would reject only on the nodes, with defaults
    filled in: `hidden_size: 100` alone fails against the default 32 heads."""

    def get(key: str) -> Any:
        return cfg[key] if cfg.get(key) is not None else LLAMA_CONFIG_KEYS[key][1]

    def said(key: str) -> str:
        return "" if cfg.get(key) is not None else ", the default"

    problems: list[str] = []
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    if hidden % heads:
        problems.append(
            f"train.model.llama.hidden_size ({hidden}{said('hidden_size')}) must be divisible "
            f"by train.model.llama.num_attention_heads ({heads}{said('num_attention_heads')}); "
            "each head gets hidden_size / num_attention_heads dimensions"
        )
    kv = cfg.get("num_key_value_heads")
    if kv is not None and heads % kv:
        problems.append(
            f"train.model.llama.num_attention_heads ({heads}{said('num_attention_heads')}) "
            f"must be divisible by train.model.llama.num_key_value_heads ({kv}) "
            "(grouped-query attention)"
        )
    vocab = get("vocab_size")
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        value = cfg.get(key)
        for token in value if isinstance(value, list) else [value]:
            if token is not None and not 0 <= token < vocab:
                problems.append(
                    f"train.model.llama.{key}: {token} is not a token id of the vocabulary; "
                    f"accepted: 0..{vocab - 1} (vocab_size {vocab}{said('vocab_size')})"
                )
    return problems
