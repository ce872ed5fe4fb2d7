"""What the ranks will read, checked on this machine before any rank starts.

A spec can be valid and still name a corpus that is not there, a resume folder that
was deleted or a factory that does not import; each rank would find out on its own,
after the launcher started them all. Where a cluster's ranks read the spec's paths
where this machine does (its section's `reads_local_paths`: local, Slurm on a shared
file system), `validate` and `submit` refuse such a spec with one line per problem
naming the field, and `doctor` reports the same lines.

`input_problems` is cheap (file system lookups, `importlib.util.find_spec`): it runs in
`validate` and `submit --dry-run` too. `import_problems` imports the spec's factories in
a child interpreter (a factory may import torch: seconds), so only a real `submit`
and `doctor` run it; the CLI process itself never imports the user's code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from .errors import MissingDependencyError, SpecError
from .spec import JobSpec
from .storage import COMMIT_MARKER, is_object_url

# Paths are shown whole up to this length (the usual 80-character cut would hide
# which folder is meant); longer ones are cut like any value.
PATH_SHOWN_CHARS = 500


def _show(value: str) -> str:
    return repr(value) if len(value) <= PATH_SHOWN_CHARS else SpecError.show_value(value)


# A relative path was taken from the spec file's folder (spec/paths.py): say so.
RELATIVE_NOTE = " (a relative path is taken from the spec file's folder)"
# How long a factory's import may take before the check gives up without a verdict.
IMPORT_TIMEOUT_S = 120
# Folder entries looked at (a corpus, a resume folder) before giving up without a verdict.
CORPUS_WALK_LIMIT = 100_000
# A token file up to this size is read whole for its largest id (a second or two);
# a larger one is left to the ranks, which check every batch.
TOKEN_SCAN_BYTES = 256 * 2**20
TOKEN_SCAN_CHUNK = 16 * 2**20  # ids per read: bounded memory
# transformers.LlamaConfig's own default (spec.LLAMA_CONFIG_KEYS mirrors the class).
LLAMA_DEFAULT_VOCAB = 32000
# Files whose presence makes a folder some tool's checkpoint: shardctl's manifest, DCP's
# metadata, DeepSpeed's pointer, the Trainer's state; and weights or state files.
CHECKPOINT_MARKS = frozenset({COMMIT_MARKER, ".metadata", "latest", "trainer_state.json"})
CHECKPOINT_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".distcp", ".pkl"})
# The module classes of transformers' LlamaForCausalLM, and the activation classes
# its `hidden_act` may pick (transformers.activations.ACT2CLS), copied here so that
# `validate` imports no transformers; tests/test_config_errors.py rebuilds both from
# the installed library and fails when they disagree.
LLAMA_MODULE_CLASSES = frozenset(
    {
        "Embedding", "Linear", "LlamaAttention", "LlamaDecoderLayer", "LlamaForCausalLM",
        "LlamaMLP", "LlamaModel", "LlamaRMSNorm", "LlamaRotaryEmbedding", "ModuleList",
    }
)  # fmt: skip
LLAMA_ACTIVATION_CLASSES = frozenset(
    {
        "AccurateGELUActivation", "ClippedGELUActivation", "FastGELUActivation",
        "GELUActivation", "GELUTanh", "Hardswish", "LaplaceActivation", "LeakyReLU",
        "LinearActivation", "MishActivation", "NewGELUActivation", "PReLU",
        "QuickGELUActivation", "ReLU", "ReLU6", "ReLUSquaredActivation", "SiLU",
        "SiLUActivation", "Sigmoid", "SqrtSoftplusActivation", "Tanh", "XIELUActivation",
    }
)  # fmt: skip
# A GPU torch can use shows up as a device node: /dev/nvidiaN, ROCm's or WSL's.
GPU_DEVICE_NODES = ("/dev/kfd", "/dev/dxg")


def _missing(
    field: str, value: str, ok: Callable[[Path], bool], kind: str, accepted: str
) -> list[str]:
    """`field`'s path is not what the ranks need (`kind`), with what is accepted."""
    if ok(Path(value)):
        return []
    state = "does not exist" if not os.path.lexists(value) else f"is not {kind}"
    return [f"{field} {_show(value)} {state} here; accepted: {accepted}{RELATIVE_NOTE}"]


def script_problems(spec: JobSpec, where: str) -> list[str]:
    """An entrypoint's script (and code_dir) must exist where the nodes read it: on this
    machine's file system, which `where` says the nodes share."""
    ep = spec.entrypoint
    problems: list[str] = []
    if ep is None:
        return problems
    for name, path, ok in (
        ("entrypoint.script", ep.script, Path.is_file),
        ("entrypoint.code_dir", ep.code_dir, Path.is_dir),
    ):
        if path is not None and not ok(Path(path)):
            what = "a Python file" if name.endswith("script") else "a folder"
            problems.append(f"{name} {_show(path)} is not {what}; accepted: {what} that {where}")
    return problems


def _file_or_folder(path: Path) -> bool:
    # A FIFO or a device (/dev/null) exists, yet holds no corpus: the ranks would block
    # on it or read nothing, then each say the corpus "does not exist".
    return path.is_file() or path.is_dir()


def input_problems(spec: JobSpec, cluster: str | None = None) -> list[str]:
    """The local files and packages the ranks will read that are not there or cannot be
    trained on (cheap); `cluster`: the one this machine's ranks run on, if known."""
    problems = script_problems(spec, "exists here")
    t, c = spec.train, spec.checkpoint
    if t is not None:
        d, m = t.data, t.model
        if d.text is not None:
            what = "a text file or a folder of them"
            found = _missing(
                "train.data.text", d.text, _file_or_folder, "a regular file or folder", what
            )
            problems += found or _text_problems(d.text, t.seq_len + 1)
        if d.tokens is not None:
            what = "a token file (.npy, or raw .bin)"
            found = _missing("train.data.tokens", d.tokens, Path.is_file, what, what)
            problems += found or _token_problems(d.tokens, d.token_dtype, spec)
        if m.pretrained is not None:
            what = "a folder from_pretrained reads (config.json and the weights)"
            found = _missing("train.model.pretrained", m.pretrained, Path.is_dir, "a folder", what)
            problems += found or _pretrained_problems(m.pretrained)
        problems += _vocab_problems(spec)
    # One in a bucket is fetched and checked by the ranks, with their AWS settings.
    if c.resume not in ("auto", "never") and not is_object_url(c.resume):
        what = "'auto', 'never' or the path of a complete step-NNNNNNNN folder"
        found = _missing("checkpoint.resume", c.resume, Path.is_dir, "a folder", what)
        problems += found or _resume_problems(c.resume)
    problems += _wrap_problems(spec)
    if cluster == "local":  # only here does this machine run the ranks
        problems += _device_problems(spec)
    tensorboard = spec.logging.tensorboard_dir
    if tensorboard is not None and os.path.lexists(tensorboard) and not Path(tensorboard).is_dir():
        problems.append(
            f"logging.tensorboard_dir {_show(tensorboard)} is a file; accepted: a folder "
            "(made if missing) for TensorBoard's event files"
        )
    blockers: set[Path] = set()  # one file in the way is said once
    for field, folder in (("run_dir", spec.run_dir), ("checkpoint.dir", c.dir)):
        local = folder and not is_object_url(folder)
        blocker = _file_in_the_way(folder) if local else None
        if blocker is not None and blocker not in blockers:
            blockers.add(blocker)
            itself = blocker == Path(folder).absolute()
            where = " (it is a file)" if itself else f" ({_show(str(blocker))} is a file)"
            problems.append(
                f"{field} {_show(str(folder))} cannot be a folder here{where}; accepted: a "
                f"folder, or a path where one can be made{RELATIVE_NOTE}"
            )
    return problems + tracker_problems(spec)


def _text_problems(text: str, need: int) -> list[str]:
    """A text corpus the ranks would find shorter than one sequence (`need` tokens:
    bytes, one newline after each file, as `train/data.py` joins them)."""
    root, tokens, files = Path(text), 0, 0
    paths = [root] if root.is_file() else root.rglob("*")
    for seen, path in enumerate(paths):
        if seen >= CORPUS_WALK_LIMIT:
            return []  # a huge tree: no verdict here, the ranks will say
        if (path.name.startswith(".") and path != root) or not path.is_file():
            continue
        files += 1
        tokens += path.stat().st_size + 1
        if tokens >= need:
            return []
    if files == 0:
        return [
            f"train.data.text {_show(text)} holds no files; accepted: a text file or a "
            "folder of them"
        ]
    return [
        f"train.data.text {_show(text)} has {tokens} tokens (bytes, a newline after each "
        f"file), fewer than one sequence of train.seq_len + 1 = {need}; accepted: a corpus "
        "of at least that many tokens, or a smaller train.seq_len"
    ]


def _token_problems(tokens: str, token_dtype: str, spec: JobSpec) -> list[str]:
    """A token file the ranks could not train on: not a whole number of tokens, not a
    1-D integer array, shorter than one sequence, or (when reading it all is cheap)
    holding an id past the model's vocab_size. Opened as the ranks open it."""
    from ..train.data import check_token_ids, open_tokens  # numpy, no torch
    from .errors import PermanentError

    assert spec.train is not None
    need = spec.train.seq_len + 1
    try:
        ids = open_tokens(tokens, token_dtype)
    except PermanentError as exc:
        return [str(exc)]
    if len(ids) < need:
        return [
            f"train.data.tokens {_show(tokens)} has {len(ids)} tokens, fewer than one "
            f"sequence of train.seq_len + 1 = {need}; accepted: a corpus of at least that "
            "many tokens, or a smaller train.seq_len"
        ]
    vocab = _vocab_size(spec)
    if vocab is None or ids.nbytes > TOKEN_SCAN_BYTES:
        return []  # the ranks check every batch they read
    try:
        for start in range(0, len(ids), TOKEN_SCAN_CHUNK):
            check_token_ids(
                ids[start : start + TOKEN_SCAN_CHUNK], vocab, f"train.data.tokens {_show(tokens)}"
            )
    except PermanentError as exc:
        return [str(exc)]
    return []


def _pretrained_problems(folder: str) -> list[str]:
    from ..train.model import pretrained_config_problem  # torch-free at import

    problem = pretrained_config_problem(folder)
    if problem is None:
        return []
    return [
        f"train.model.pretrained {_show(folder)} {problem}; accepted: a directory written "
        "by save_pretrained or `shardctl consolidate` (nothing is downloaded)"
    ]


def _vocab_size(spec: JobSpec) -> int | None:
    """The model's vocab_size where the spec or the pretrained config.json says it."""
    assert spec.train is not None
    m = spec.train.model
    if m.llama is not None:
        vocab = m.llama.get("vocab_size", LLAMA_DEFAULT_VOCAB)
    elif m.pretrained is not None:
        try:
            config = json.loads((Path(m.pretrained) / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # said by _pretrained_problems
        vocab = config.get("vocab_size") if isinstance(config, dict) else None
    else:
        return None  # a factory's model: only the ranks know it
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


def _vocab_problems(spec: JobSpec) -> list[str]:
    """Byte-level text (ids 0..255) needs a vocab_size of at least 256."""
    assert spec.train is not None
    d, vocab = spec.train.data, _vocab_size(spec)
    if (d.text is None and d.builtin is None) or vocab is None or vocab >= 256:
        return []
    field = "train.model.llama.vocab_size" if spec.train.model.llama else "the model's vocab_size"
    return [
        f"{field} is {vocab} but train.data is byte-level text (token ids 0..255); "
        "accepted: vocab_size >= 256"
    ]


def _wrap_problems(spec: JobSpec) -> list[str]:
    """`strategy.wrap` class names a `llama:` model does not have (FSDP wraps them; the
    ranks would find out after building the model). Other models: the ranks check."""
    wrap, t = spec.strategy.wrap, spec.train
    if wrap == "auto" or spec.strategy.backend != "fsdp" or t is None or t.model.llama is None:
        return []
    missing = [n for n in wrap if n not in LLAMA_MODULE_CLASSES | LLAMA_ACTIVATION_CLASSES]
    if not missing:
        return []
    return [
        f"strategy.wrap names {missing} but a train.model.llama model has no module of "
        f"that class; accepted: 'auto' or some of {', '.join(sorted(LLAMA_MODULE_CLASSES))} "
        "(usually [LlamaDecoderLayer])"
    ]


def _resume_problems(resume: str) -> list[str]:
    """A resume folder that holds no checkpoint of any kind. Only that: a folder in
    another tool's layout (DCP, DeepSpeed, accelerate, the Trainer) is judged by the
    ranks, which know the formats."""
    folder = Path(resume)
    for seen, path in enumerate(folder.rglob("*")):
        if seen >= CORPUS_WALK_LIMIT or path.name in CHECKPOINT_MARKS:
            return []
        if path.suffix in CHECKPOINT_SUFFIXES and path.is_file():
            return []
    return [
        f"checkpoint.resume {_show(resume)} holds no checkpoint (no manifest.json, no "
        "DCP .metadata, no DeepSpeed 'latest', no weights file); accepted: 'auto', "
        f"'never' or the path of a complete step-NNNNNNNN folder{RELATIVE_NOTE}"
    ]


def _device_problems(spec: JobSpec) -> list[str]:
    """`device: cuda` on a machine with no GPU device node (NVIDIA, ROCm or WSL's):
    torch would see none either. Asked only where this machine runs the ranks."""
    if spec.resources.device != "cuda" or any(Path(p).exists() for p in GPU_DEVICE_NODES):
        return []
    if any(Path("/dev").glob("nvidia[0-9]*")):
        return []
    return [
        "resources.device is 'cuda' but this machine, where the local cluster runs the "
        "ranks, has no GPU (no /dev/nvidia*, /dev/kfd or /dev/dxg); accepted here: "
        "device: cpu"
    ]


def _file_in_the_way(folder: str | Path) -> Path | None:
    """`folder` itself or the nearest existing folder above it, when that is a file:
    a run dir that could never be made."""
    here = Path(folder).absolute()
    while not os.path.lexists(here) and here != here.parent:
        here = here.parent
    return None if here.is_dir() else here


def credential_problems(spec: JobSpec) -> list[str]:
    """A checkpoint dir or resume in a bucket on a machine with no AWS credentials at
    all: the ranks started here would each fail at their first save or fetch. Only a
    plain absence (`s3.credentials`, no boto3, no request); whether the credentials
    are accepted is for the ranks, and `doctor`'s write probe, to find out."""
    c = spec.checkpoint
    urls = [
        f"{field} {url}"
        for field, url in (("checkpoint.dir", spec.checkpoint_dir), ("checkpoint.resume", c.resume))
        if is_object_url(url)
    ]
    if not urls:
        return []
    from .s3.credentials import WHERE_LOOKED, credentials_absent

    if not credentials_absent():
        return []
    return [
        f"{' and '.join(urls)}: no AWS credentials were found on this machine, where the "
        f"local cluster's ranks run; accepted: credentials in {WHERE_LOOKED}"
    ]


def tracker_problems(spec: JobSpec) -> list[str]:
    """Each tracker `logging.backends` lists whose package is not installed here."""
    # The table the ranks check (train/trackers.py is torch-free: stdlib only).
    from ..train.trackers import PACKAGES

    problems = []
    for name in spec.logging.backends or []:
        module, extra = PACKAGES[name]
        if importlib.util.find_spec(module) is None:
            missing = MissingDependencyError(module, extra, f"logging.backends {name!r}")
            problems.append(str(missing))
    return problems


# The child interpreter's side of `import_problems`: import, look the function up, and
# print why not (exit 3); another exit code or a timeout is no verdict.
_IMPORT_PROBE = """
import importlib, sys
ref = sys.argv[1]
module_name, _, attr = ref.partition(":")
try:
    module = importlib.import_module(module_name)
except Exception as exc:
    print(f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})")
    sys.exit(3)
if not callable(getattr(module, attr, None)):
    print(f"module {module_name!r} has no function {attr!r}")
    sys.exit(3)
"""


def import_problems(spec: JobSpec, python: str | None = None) -> list[str]:
    """Each `factory` of the spec that does not import, imported as a rank would: in
    `python` (default this interpreter), from the current directory, with `env:`."""
    t = spec.train
    refs = [] if t is None else [("train.model.factory", t.model.factory)]
    refs += [] if t is None else [("train.data.factory", t.data.factory)]
    problems = []
    env = {**os.environ, **spec.env}
    for field, ref in refs:
        if ref is None:
            continue
        try:
            proc = subprocess.run(
                [python or sys.executable, "-c", _IMPORT_PROBE, ref],
                env=env,
                capture_output=True,
                text=True,
                timeout=IMPORT_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue  # no verdict: the ranks will say
        if proc.returncode == 3:
            why = " ".join(proc.stdout.split()) or "it does not import"
            problems.append(
                f"{field} {_show(ref)}: {why}; accepted: 'package.module:function' "
                "importable on every node (installed, or on PYTHONPATH)"
            )
    return problems
