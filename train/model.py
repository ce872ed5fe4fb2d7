"""Build the model a spec names: a Llama from a config, a local pretrained folder, or a factory.

Nothing is downloaded: `llama` builds `LlamaForCausalLM(LlamaConfig(**kwargs))` from
the spec's keyword arguments, `pretrained` must be a local directory, and a factory
is the user's own `package.module:function`.

Every rank builds the same full model from the same seed (so the weights agree before
sharding) and returns it on CPU in the spec's `model.dtype`; the backend decides the
training dtype from `strategy.precision`.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path
from typing import Any

from shardctl.orchestrator.errors import PermanentError
from shardctl.orchestrator.spec import JobSpec

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def load_factory(ref: str, field: str) -> Any:
    """Import `package.module:function`, with an error that names the spec field."""
    module_name, _, attr = ref.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise PermanentError(
            f"{field} {ref!r}: cannot import module {module_name!r} ({exc}); it must be "
            "importable on every node (installed, or on PYTHONPATH)"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise PermanentError(f"{field} {ref!r}: module {module_name!r} has no function {attr!r}")
    return fn


def pretrained_config_problem(folder: str) -> str | None:
    """Why `folder`'s config.json cannot be read (missing, not JSON, not an object), as
    the end of a sentence that starts with the field; None when it reads. `shardctl
    validate` asks the same before any rank starts (`orchestrator/inputs.py`)."""
    path = Path(folder) / "config.json"
    if not path.is_file():
        return "is not a local model folder (no config.json in it)"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        return f"has a config.json that cannot be read ({exc})"
    except json.JSONDecodeError as exc:
        return f"has a config.json that is not JSON (line {exc.lineno}: {exc.msg})"
    if not isinstance(config, dict):
        return f"has a config.json that holds a {type(config).__name__}, not an object"
    return None


def _from_pretrained(folder: str, dtype: Any) -> Any:
    accepted = (
        "accepted: a directory written by save_pretrained or `shardctl consolidate` — "
        "nothing is downloaded"
    )
    problem = pretrained_config_problem(folder)
    if problem is not None:
        raise PermanentError(f"train.model.pretrained {folder!r} {problem}; {accepted}")
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # transformers' own words (an unknown model_type, missing weights), first line only.
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise PermanentError(
            f"train.model.pretrained {folder!r}: transformers cannot load it ({why}); {accepted}"
        ) from None


def build_model(spec: JobSpec) -> tuple[Any, dict[str, Any]]:
    """The model (on CPU, in `train.model.dtype`) and its manifest description.

    The description is what the checkpoint manifest stores under `model`:
    `{"source", "dtype", "hf_config"}` (+ `state_keys` with an `hf_config`); `hf_config`
    lets consolidation write a folder that `transformers` loads.
    """
    import torch

    src = spec.train.model
    dtype = getattr(torch, DTYPES[src.dtype])
    if src.llama is not None:
        from transformers import LlamaConfig, LlamaForCausalLM

        try:
            config = LlamaConfig(**src.llama)
        except (TypeError, ValueError) as exc:
            raise PermanentError(f"train.model.llama: not a valid LlamaConfig: {exc}") from None
        model = LlamaForCausalLM(config)
        source = "llama"
    elif src.pretrained is not None:
        model = _from_pretrained(src.pretrained, dtype)
        source = "pretrained"
    else:
        assert src.factory is not None  # the spec guarantees exactly one source
        fn = load_factory(src.factory, "train.model.factory")
        model = fn(spec) if inspect.signature(fn).parameters else fn()
        if not isinstance(model, torch.nn.Module):
            raise PermanentError(
                f"train.model.factory {src.factory!r} returned {type(model).__name__}, "
                "not a torch.nn.Module"
            )
        source = "factory"
    model = model.to(dtype=dtype)
    config = getattr(model, "config", None)
    hf_config = config.to_dict() if hasattr(config, "to_dict") else None
    # Training never reuses a key/value cache; turning it off saves memory and warnings.
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    meta: dict[str, Any] = {"source": source, "dtype": src.dtype, "hf_config": hf_config}
    if hf_config is not None:
        meta["state_keys"] = state_keys(model)
    return model, meta


def state_keys(model: Any) -> dict[str, list[str]]:
    """The unwrapped model's state-dict names and which of them alias an earlier tensor
    (tied weights). Recorded in the manifest so that consolidation can check the names
    it writes without importing transformers to rebuild the model (seconds of start-up)."""
    names: list[str] = []
    tied: list[str] = []
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():
        names.append(name)
        if id(tensor) in seen:
            tied.append(name)
        seen.add(id(tensor))
    return {"names": names, "tied": tied}


def logits_of(output: Any) -> Any:
    """The logits tensor from a model's output (HF output objects, tuples, or a tensor)."""
    logits = getattr(output, "logits", None)
    if logits is not None:
        return logits
    if isinstance(output, tuple | list):
        return output[0]
    return output
