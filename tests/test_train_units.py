"""Fast, single-process pieces of the loop: schedule, data order, wrap detection,
preemption flag, entry-point arguments."""

from __future__ import annotations

import itertools
import math
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from helpers.train_run import tiny_spec
from shardctl.orchestrator.errors import ShardctlError
from shardctl.orchestrator.spec import load_spec, parse_spec
from shardctl.train.__main__ import _spec_arg, main
from shardctl.train.data import TokenBatches, build_data, stdlib_files
from shardctl.train.optim import lr_at
from shardctl.train.preemption import EXIT_PREEMPTED, PreemptionFlag


def _train(**over):  # type: ignore[no-untyped-def]
    data = {
        "name": "u",
        "train": {
            "model": {"llama": {"vocab_size": 256}},
            "data": {"builtin": "python-stdlib"},
            "steps": 100,
            "lr": 1e-3,
            "warmup_steps": 10,
            "min_lr_ratio": 0.1,
            **over,
        },
        "checkpoint": {"every_steps": 10},
    }
    return parse_spec(data).train


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_lr_schedule_warms_up_then_decays_to_min(schedule: str) -> None:
    t = _train(schedule=schedule)
    lrs = [lr_at(s, t) for s in range(t.steps)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    if schedule == "constant":
        assert all(v == pytest.approx(1e-3) for v in lrs[10:])
    else:
        assert lrs[10] == pytest.approx(1e-3)
        assert lrs[-1] == pytest.approx(1e-4)  # min_lr_ratio × lr at the last step
        assert all(a >= b for a, b in itertools.pairwise(lrs[10:]))
    mid = lr_at(10 + 89 // 2, t)
    expect = {"cosine": 0.55e-3, "linear": 0.55e-3, "constant": 1e-3}[schedule]
    assert mid == pytest.approx(expect, rel=0.02)


def test_no_warmup_starts_at_full_lr() -> None:
    t = _train(warmup_steps=0)
    assert lr_at(0, t) == pytest.approx(1e-3) and math.isfinite(lr_at(99, t))


def _batches(spec, rank: int, world: int, tokens: np.ndarray) -> TokenBatches:  # type: ignore[no-untyped-def]
    return TokenBatches(tokens, spec, rank, world)


def test_ranks_read_disjoint_slices_in_a_seeded_order(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path, "d"))
    tokens = np.arange(10_000, dtype=np.uint32)  # window k starts at token k*32
    r0, r1 = _batches(spec, 0, 2, tokens), _batches(spec, 1, 2, tokens)
    seen: list[int] = []
    for _ in range(50):
        a, b = r0.next_batch(), r1.next_batch()
        assert a.shape == (2, 33) and a.dtype.is_floating_point is False
        for row in (*a, *b):
            assert int(row[-1] - row[0]) == 32  # contiguous windows of seq_len + 1
            seen.append(int(row[0]) // 32)
    windows = (10_000 - 1) // 32
    # 200 samples of one epoch: no window twice, across both ranks.
    assert len(seen) == len(set(seen)) == 200 and max(seen) < windows
    assert seen[:4] != sorted(seen[:4]) or seen[4:8] != sorted(seen[4:8])  # shuffled
    # Same seed → same order; another seed → another.
    again = _batches(spec, 0, 2, tokens)
    assert int(again.next_batch()[0, 0]) // 32 == seen[0]
    other = load_spec(tiny_spec(tmp_path, "e", train={"seed": 8}))
    assert [int(_batches(other, 0, 2, tokens).next_batch()[0, 0]) // 32] != [seen[0]]


def test_data_position_resumes_exactly_and_across_world_sizes(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path, "d", train={"micro_batch_size": 1}))
    tokens = np.arange(5_000, dtype=np.uint16)
    two = [_batches(spec, r, 2, tokens) for r in range(2)]
    for _ in range(7):
        for b in two:
            b.next_batch()
    state = two[0].state_dict()
    assert state == {"sample_index": 14}
    expect = [int(b.next_batch()[0, 0]) for b in two]
    # Resumed at world size 1: the same global order continues (samples 14, 15).
    one = _batches(spec, 0, 1, tokens)
    one.load_state_dict(state)
    assert [int(one.next_batch()[0, 0]), int(one.next_batch()[0, 0])] == expect


def test_order_crosses_epochs_with_a_new_permutation(tmp_path: Path) -> None:
    spec = load_spec(tiny_spec(tmp_path, "d", train={"micro_batch_size": 1}))
    tokens = np.arange(33 * 5 + 1, dtype=np.uint16)  # exactly 5 windows
    b = _batches(spec, 0, 1, tokens)
    epoch = [sorted(int(b.next_batch()[0, 0]) // 32 for _ in range(5)) for _ in range(3)]
    assert epoch == [[0, 1, 2, 3, 4]] * 3


def test_text_folder_and_errors(tmp_path: Path) -> None:
    folder = tmp_path / "corpus"
    (folder / "b").mkdir(parents=True)
    (folder / "a.txt").write_bytes(b"x" * 100)
    (folder / "b" / "c.txt").write_bytes(b"y" * 100)
    spec = load_spec(
        tiny_spec(tmp_path, "t", train={"data": {"builtin": None, "text": str(folder)}})
    )
    batches = build_data(spec, 0, 1)
    assert batches.tokens[0] == ord("x") and batches.tokens[-2] == ord("y")  # sorted, joined
    missing = load_spec(
        tiny_spec(tmp_path, "m", train={"data": {"builtin": None, "text": str(tmp_path / "no")}})
    )
    with pytest.raises(ShardctlError, match="does not exist"):
        build_data(missing, 0, 1)
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abc")
    short = load_spec(
        tiny_spec(tmp_path, "s", train={"data": {"builtin": None, "text": str(tiny)}})
    )
    with pytest.raises(ShardctlError, match="fewer than one sequence"):
        build_data(short, 0, 1)


def test_token_files_npy_and_bin(tmp_path: Path) -> None:
    arr = (np.arange(4000) % 300).astype(np.uint16)
    np.save(tmp_path / "t.npy", arr)
    arr.tofile(tmp_path / "t.bin")
    for name in ("t.npy", "t.bin"):
        spec = load_spec(
            tiny_spec(
                tmp_path, "k", train={"data": {"builtin": None, "tokens": str(tmp_path / name)}}
            )
        )
        batch = build_data(spec, 0, 1).next_batch()
        assert batch.shape == (2, 33) and int(batch.max()) < 300


def test_stdlib_corpus_is_sorted_and_excludes_site_packages() -> None:
    files = stdlib_files()
    assert len(files) > 200
    assert not any("site-packages" in f.parts for f in files)
    assert any(f.name == "os.py" for f in files)


def test_wrap_classes_auto_and_override(tmp_path: Path) -> None:
    from shardctl.train.backends.fsdp import wrap_class_names
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4)
    )  # fmt: skip
    assert wrap_class_names(model, "auto") == ["LlamaDecoderLayer"]
    assert wrap_class_names(model, ["LlamaMLP"]) == ["LlamaMLP"]
    with pytest.raises(ShardctlError, match=r"strategy\.wrap names"):
        wrap_class_names(model, ["NoSuchLayer"])


def test_preemption_flag_from_signal_and_from_the_testing_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What this process had before (a test run in-process earlier may have left it
    # ignored): uninstall gives exactly that back.
    before = signal.getsignal(signal.SIGUSR2)
    flag = PreemptionFlag()
    flag.install()
    try:
        assert not flag.local(1)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.local(1) and flag.reason(flag.signum) == "signal SIGUSR2"
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is before
    monkeypatch.setenv("SHARDCTL_STOP_AFTER_STEP", "3")
    env_flag = PreemptionFlag()
    assert not env_flag.local(2) and env_flag.local(3)
    assert "SHARDCTL_STOP_AFTER_STEP=3" in env_flag.reason(None)
    assert EXIT_PREEMPTED == 42


def test_entry_point_arguments(tmp_path: Path) -> None:
    # The deepspeed launcher may append --local_rank=N; it is ignored.
    assert _spec_arg(["job.yaml", "--local_rank=1"]) == "job.yaml"
    assert _spec_arg(["--local_rank", "0", "job.yaml"]) == "job.yaml"
    with pytest.raises(SystemExit):
        _spec_arg([])
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: Bad Name\n")
    assert main([str(bad)]) == 2  # invalid spec → exit 2 with the message


def test_run_complete_exits_without_starting(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    spec = tiny_spec(tmp_path, "done")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "DONE").write_text('{"step": 4}\n')
    assert main([str(spec)]) == 0
    assert "run complete" in capsys.readouterr().out


def test_model_from_pretrained_folder_and_from_a_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from shardctl.train.model import build_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    saved = LlamaForCausalLM(
        LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=4)
    )  # fmt: skip
    saved.save_pretrained(tmp_path / "pre")
    source = {"llama": None, "pretrained": str(tmp_path / "pre"), "dtype": "bf16"}
    spec = load_spec(tiny_spec(tmp_path, "p", train={"model": source}))
    model, meta = build_model(spec)
    assert meta["source"] == "pretrained" and meta["dtype"] == "bf16"
    assert next(model.parameters()).dtype == torch.bfloat16
    w = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(model.state_dict()[w], saved.state_dict()[w].bfloat16())
    missing = load_spec(
        tiny_spec(tmp_path, "q", train={"model": {"llama": None, "pretrained": str(tmp_path)}})
    )
    with pytest.raises(ShardctlError, match="nothing is downloaded"):
        build_model(missing)

    (tmp_path / "mymodels.py").write_text(
        "import torch\n"
        "def make(spec):\n"
        "    return torch.nn.Sequential(torch.nn.Embedding(256, 8), torch.nn.Linear(8, 256))\n"
        "def not_a_module():\n"
        "    return 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(
        tiny_spec(tmp_path, "f", train={"model": {"llama": None, "factory": "mymodels:make"}})
    )
    model, meta = build_model(spec)
    assert meta == {"source": "factory", "dtype": "fp32", "hf_config": None}
    bad = load_spec(
        tiny_spec(
            tmp_path, "g", train={"model": {"llama": None, "factory": "mymodels:not_a_module"}}
        )
    )
    with pytest.raises(ShardctlError, match=r"not a torch\.nn\.Module"):
        build_model(bad)


def test_data_factory_resumes_by_skipping_or_by_its_own_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "mydata.py").write_text(
        "import numpy as np\n"
        "def batches(spec, rank, world_size):\n"
        "    n = spec.train.micro_batch_size\n"
        "    k = 0\n"
        "    while True:\n"
        "        yield np.full((n, spec.train.seq_len + 1), (k * world_size + rank) % 256)\n"
        "        k += 1\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(
        tiny_spec(tmp_path, "df", train={"data": {"builtin": None, "factory": "mydata:batches"}})
    )
    first = build_data(spec, 1, 2)
    assert [int(first.next_batch()[0, 0]) for _ in range(3)] == [1, 3, 5]
    state = first.state_dict()
    again = build_data(spec, 1, 2)
    again.load_state_dict(state)
    assert int(again.next_batch()[0, 0]) == 7 == int(first.next_batch()[0, 0])
