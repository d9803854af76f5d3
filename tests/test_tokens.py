"""``data=tokens``: nanoGPT's ``train.bin``/``val.bin`` read through ``numpy.memmap``, sampled as ``data=text``.

The files are written by the tests (``runner.data.tokens.prepare`` on the embedded Shakespeare lines, or raw
``ndarray.tofile`` for the bad ones); the real Tiny Shakespeare in ``../shared/data`` is used where present.
"""

from __future__ import annotations

import math
import pickle
import sys

import numpy as np
import pytest
import torch

from conftest import SHARED_DATA, TINY_GPT, TINY_LOOP, compose_cfg, job_dirs, metrics_rows, run_cli, run_here
from runner import data as data_mod
from runner.data import text, tokens
from runner.distributed import Env
from runner.engine.train import train
from runner.errors import ConfigError

#: TINY_GPT on token files: the same 2-layer GPT, windows of 16 tokens, 20 sampled tokens.
TINY_TOKENS = [o if o != "data=text" else "data=tokens" for o in TINY_GPT]


@pytest.fixture
def bins(tiny_text, tmp_path) -> dict:
    """``prepare`` of the embedded Shakespeare lines: train.bin, val.bin, meta.pkl and their facts."""
    return tokens.prepare(tiny_text, tmp_path / "bins")


def token_overrides(info: dict, *more: str) -> list[str]:
    return [
        *TINY_TOKENS,
        f"data.train_path={info['train_path']}",
        f"data.val_path={info['val_path']}",
        f"data.vocab_size={info['vocab_size']}",
        *more,
    ]


def build(overrides: list[str]):
    cfg = compose_cfg(*overrides)
    env = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))
    return data_mod.build(cfg.data, cfg.dataloader, env, seed=0)


def losses(job_dir) -> list[tuple]:
    return [
        (r["step"], r.get("loss"), r.get("eval_loss")) for r in metrics_rows(job_dir) if "loss" in r or "eval_loss" in r
    ]


# ------------------------------------------------------------------------------------------ the format


def test_prepare_writes_nanogpt_s_shakespeare_char_files(tiny_text, bins, tmp_path):
    """As nanoGPT's data/shakespeare_char/prepare.py: sorted characters -> ids, 90/10, uint16 tofile, meta.pkl."""
    raw = tiny_text.read_text()
    chars = sorted(set(raw))
    ids = np.array([chars.index(c) for c in raw], dtype=np.uint16)
    n = len(raw)
    out = tmp_path / "bins"
    assert np.array_equal(np.fromfile(out / "train.bin", dtype=np.uint16), ids[: int(n * 0.9)])
    assert np.array_equal(np.fromfile(out / "val.bin", dtype=np.uint16), ids[int(n * 0.9) :])
    with open(out / "meta.pkl", "rb") as f:
        meta = pickle.load(f)
    assert meta["vocab_size"] == bins["vocab_size"] == len(chars)
    assert meta["itos"] == dict(enumerate(chars)) and meta["stoi"] == {c: i for i, c in enumerate(chars)}


def test_prepare_through_the_cli_prints_the_overrides(tiny_text, tmp_path):
    from runner.data.tokens import main

    assert main(["prepare", str(tiny_text), str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "train.bin").is_file() and (tmp_path / "out" / "val.bin").is_file()
    assert main(["prepare", str(tmp_path / "nowhere.txt"), str(tmp_path / "out2")]) == 2
    assert not (tmp_path / "out2").exists()


def test_the_files_are_memory_mapped_never_loaded_whole(bins):
    data = build(token_overrides(bins))
    dataset = data.train.batches.dataset
    assert isinstance(dataset, text.TokenWindows) and isinstance(dataset.tokens, tokens.TokenFile)
    assert isinstance(dataset.tokens.memmap, np.memmap) and not isinstance(dataset.tokens, torch.Tensor)
    assert dataset.tokens.memmap.dtype == np.uint16 and dataset.tokens.memmap.mode == "r"
    assert isinstance(data.eval.batches.dataset.tokens.memmap, np.memmap)
    x, y = dataset[5]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    # a DataLoader worker started by spawn gets the path, not a copy of the tokens
    assert len(pickle.dumps(dataset.tokens)) < 500 < dataset.tokens.memmap.nbytes
    again = pickle.loads(pickle.dumps(dataset))
    assert isinstance(again.tokens.memmap, np.memmap) and torch.equal(again[5][0], x)


def test_the_windows_are_data_text_s(tiny_text, bins):
    """Same ids, same sampler: the host loaders and the on-device path give data=text's batches exactly."""
    for more in ([], ["dataloader=device"]):
        from_text = build([*TINY_GPT, f"data.path={tiny_text}", *more])
        from_bins = build(token_overrides(bins, *more))
        assert from_text.train_samples == from_bins.train_samples and from_bins.sample_shape == (16,)
        assert from_text.model_kwargs == from_bins.model_kwargs == {"vocab_size": bins["vocab_size"]}
        assert from_bins.techniques == from_text.techniques
        for a, b in ((from_text.train, from_bins.train), (from_text.eval, from_bins.eval)):
            pairs = list(zip(a, b))
            assert len(pairs) == len(a) == len(b) > 0
            assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in pairs)
    device = build(token_overrides(bins, "dataloader=device"))
    assert isinstance(device.train.batches, text.OnDeviceWindows) and device.train.batches.tokens.dtype == torch.int64


def test_uint32_files(tmp_path):
    ids = (np.arange(3000) * 7919 % 70000).astype(np.uint32)  # ids past uint16's range
    ids[:2700].tofile(tmp_path / "train.bin")
    ids[2700:].tofile(tmp_path / "val.bin")
    data = build(
        [
            *TINY_TOKENS,
            f"data.train_path={tmp_path / 'train.bin'}",
            f"data.val_path={tmp_path / 'val.bin'}",
            "data.vocab_size=70000",
            "data.dtype=uint32",
        ]
    )
    x, _ = data.train.batches.dataset[10]
    assert x.tolist() == ids[10:26].tolist()


# ------------------------------------------------------------------------------------------ training


@pytest.mark.cli
def test_training_through_the_cli_writes_token_ids(bins, tmp_path):
    proc = run_cli(*TINY_LOOP, *token_overrides(bins, "trainer.eval_every=2"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = job_dirs(tmp_path)[0]
    assert [r["step"] for r in metrics_rows(job) if "eval_loss" in r] == [2, 4]
    ids = [int(w) for w in (job / "samples.txt").read_text().split()]
    assert len(ids) == 1 + 20 and ids[0] == 0 and all(0 <= i < bins["vocab_size"] for i in ids)  # prompt: id 0
    notes = [line for line in proc.stdout.splitlines() if "samples.txt will show token ids" in line]
    assert len(notes) == 1 and "data.tokenizer is null" in notes[0], proc.stdout[-3000:]
    assert not (job / "vocab.json").exists()


@pytest.mark.parametrize("loading", ["host", pytest.param("device", marks=pytest.mark.slow)])
def test_same_losses_as_data_text(loading, tiny_text, bins, tmp_path):
    """The embedded Shakespeare lines: bit-identical losses (same ids, windows, seed). On the device the
    batches are checked equal above; the run is left to ``pytest -m slow`` (CI budget)."""
    more = ["dataloader=device"] if loading == "device" else []
    runs = {}
    for name, overrides in (("text", [*TINY_GPT, f"data.path={tiny_text}"]), ("tokens", token_overrides(bins))):
        train(compose_cfg(*overrides, *more, "trainer.log_every=1", "trainer.eval_every=2"), job_dir=tmp_path / name)
        runs[name] = losses(tmp_path / name)
    assert len(runs["text"]) == 4 + 2 and runs["text"] == runs["tokens"]


def test_same_losses_as_data_text_on_tiny_shakespeare(tmp_path):
    corpus = SHARED_DATA / "tinyshakespeare" / "input.txt"
    if not corpus.is_file():
        pytest.skip(f"{corpus} is not present (real datasets live outside a fresh clone)")
    info = tokens.prepare(corpus, tmp_path / "bins")
    assert (info["vocab_size"], info["train_tokens"], info["val_tokens"]) == (65, 1_003_854, 111_540)  # nanoGPT's
    runs = {}
    for name, overrides in (("text", [*TINY_GPT, f"data.path={corpus}"]), ("tokens", token_overrides(info))):
        train(compose_cfg(*overrides, "trainer.log_every=1", "trainer.eval_every=2"), job_dir=tmp_path / name)
        runs[name] = losses(tmp_path / name)
    assert len(runs["text"]) == 4 + 2 and runs["text"] == runs["tokens"]


# ------------------------------------------------------------------------------------------ samples.txt


class FakeEncoding:
    """A stand-in for a tiktoken encoding (tiktoken is optional): one id per byte."""

    n_vocab = 256

    def encode_ordinary(self, s: str) -> list[int]:
        return list(s.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")


def fake_tiktoken(monkeypatch, get_encoding):
    import types

    module = types.ModuleType("tiktoken")
    module.list_encoding_names = lambda: ["gpt2", "cl100k_base"]
    module.get_encoding = get_encoding
    monkeypatch.setitem(sys.modules, "tiktoken", module)


def test_a_tokenizer_decodes_samples(monkeypatch):
    fake_tiktoken(monkeypatch, lambda name: FakeEncoding())
    codec = tokens.codec(300, "gpt2")
    assert codec.note is None and codec.vocab_size == 300
    assert codec.encode("\nHi") == [10, 72, 105] and codec.decode([72, 105, 290, 33]) == "Hi<|290|>!"


def test_without_tiktoken_or_its_files_samples_show_ids_and_say_why(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken -> ImportError
    codec = tokens.codec(65, "gpt2")
    assert "tiktoken package, which is not installed" in codec.note and codec.decode([3, 1]) == "3 1\n"
    assert codec.encode("\n") == [0] and codec.encode("5 7") == [5, 7]
    with pytest.raises(ConfigError, match="task.sample_prompt='hello' is text"):
        codec.encode("hello")

    def offline(name):
        raise ConnectionError("no network")

    fake_tiktoken(monkeypatch, offline)
    assert "could not load the gpt2 encoding offline (ConnectionError: no network)" in tokens.codec(65, "gpt2").note
    with pytest.raises(ConfigError, match="data.tokenizer=gpt3 is not a tiktoken encoding"):
        tokens.codec(65, "gpt3")


# ------------------------------------------------------------------------------------------ bad input


def write(path, ids, dtype=np.uint16):
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def bad_case(case: str, bins: dict, tmp_path) -> tuple[list[str], list[str]]:
    """The overrides of one bad input and the words its error line must hold."""
    ok = token_overrides(bins)
    vocab = bins["vocab_size"]
    if case == "missing file":
        return [*ok, f"data.train_path={tmp_path / 'nowhere.bin'}"], [
            "data.train_path=",
            "nowhere.bin",
            "does not exist",
            "prepare",
        ]
    if case == "odd size":
        odd = tmp_path / "odd.bin"
        odd.write_bytes(b"\x01\x00" * 100 + b"\x01")
        return [*ok, f"data.val_path={odd}"], ["data.val_path=", "201 bytes", "not a multiple of 2", "data.dtype"]
    if case == "id too large":
        big = write(tmp_path / "big.bin", [1] * 500 + [vocab + 3] + [2] * 10)
        return [*ok, f"data.train_path={big}"], [
            "data.train_path=",
            f"token id {vocab + 3}",
            "at token 500",
            f"data.vocab_size={vocab}",
            f"at least {vocab + 4}",
        ]
    if case == "no vocab_size":
        return [o for o in ok if not o.startswith("data.vocab_size")], ["data.vocab_size=<the number of token ids>"]
    if case == "split too short":
        short = write(tmp_path / "short.bin", [1] * 16)
        return [*ok, f"data.val_path={short}"], [
            "data.val_path=",
            "holds 16 tokens",
            "data.block_size + 1 = 17",
            "lower data.block_size",
        ]
    if case == "no path":
        return [o for o in ok if not o.startswith("data.train_path")], ["data=tokens needs data.train_path"]
    if case == "bad dtype":
        return [*ok, "data.dtype=int8"], ["data.dtype=int8", "uint16, uint32"]
    if case == "uint32 read as uint16":  # the default dtype on a file of uint32 ids: every second uint16 is 0
        wide = write(tmp_path / "wide.bin", np.fromfile(bins["train_path"], dtype=np.uint16), dtype=np.uint32)
        return [*ok, f"data.train_path={wide}"], [
            "data.train_path=",
            "read as data.dtype=uint16",
            "every second id <= 0",
            "set data.dtype=uint32",
        ]
    if case == "uint32 ids past 65,535 read as uint16":  # high halves of 0 and 1: the zeros check alone missed it
        ids = (np.arange(3000) * 7919 % 70000).astype(np.uint32)
        wide = write(tmp_path / "wide.bin", ids, dtype=np.uint32)
        return [*ok, f"data.train_path={wide}", "data.vocab_size=70000"], ["every second id <= 1", "data.dtype=uint32"]
    if case == "int64 read as uint32":  # the advice for int64 read as uint16 was uint32, which trained on zeros
        wide = write(tmp_path / "wide.bin", np.fromfile(bins["train_path"], dtype=np.uint16), dtype=np.int64)
        return [*ok, f"data.train_path={wide}", "data.dtype=uint32"], [
            "read as data.dtype=uint32",
            "64-bit ids",
            "write them as uint32",
        ]
    if case == "int64 read as uint16":
        wide = write(tmp_path / "wide.bin", np.fromfile(bins["train_path"], dtype=np.uint16), dtype=np.int64)
        return [*ok, f"data.train_path={wide}"], ["read as data.dtype=uint16", "64-bit ids", "write them as uint32"]
    if case == "empty file":
        empty = tmp_path / "empty.bin"
        empty.write_bytes(b"")
        return [*ok, f"data.train_path={empty}"], ["data.train_path=", "is empty (0 bytes)"]
    raise AssertionError(case)


BAD = [
    "missing file",
    "odd size",
    "id too large",
    "no vocab_size",
    "split too short",
    "no path",
    "bad dtype",
    "uint32 read as uint16",
    "uint32 ids past 65,535 read as uint16",
    "int64 read as uint32",
    "int64 read as uint16",
    "empty file",
]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_is_one_config_error(case, bins, tmp_path):
    overrides, words = bad_case(case, bins, tmp_path)
    with pytest.raises(ConfigError) as info:
        train(compose_cfg(*overrides), job_dir=tmp_path / "job")
    assert all(w in str(info.value) for w in words) and "\n" not in str(info.value), str(info.value)
    assert "below 0" not in str(info.value)  # an empty file is said to be empty, not fixed by a block size
    assert not (tmp_path / "job" / "summary.json").exists()


def test_a_text_too_short_for_any_window_says_so():
    """A text of one character has no window of any size: the message says the text is too short, not "lower
    data.block_size below 0"."""
    with pytest.raises(
        ConfigError,
        match=r"data.path=t.txt holds only 1 characters: too few for a training and a "
        r"validation window",
    ):
        text.split(torch.zeros(1, dtype=torch.int64), 4, "t.txt")


# Through the command line (runner.__main__.run, in this process): exit status 2 and the one error line, nothing
# trained; every case's message is checked through the engine above.
@pytest.mark.parametrize("case", ["missing file", "odd size", "id too large", "no vocab_size", "split too short"])
def test_bad_input_through_the_cli_stops_before_training(case, bins, tmp_path):
    overrides, words = bad_case(case, bins, tmp_path)
    proc = run_here(*TINY_LOOP, *overrides, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and list((tmp_path / "outputs").rglob("metrics.jsonl")) == []


def test_the_id_check_scans_in_chunks(tmp_path, monkeypatch):
    """The largest id is found chunk by chunk (host memory: one chunk), wherever it lies."""
    monkeypatch.setattr(tokens, "CHUNK", 7)
    ids = np.arange(100, dtype=np.uint16) % 13
    ids[61] = 40
    f = tokens.TokenFile(write(tmp_path / "t.bin", ids), "uint16")
    assert f.max() == (40, 61)
    assert torch.equal(f.load(), torch.from_numpy(ids.astype(np.int64)))


# ------------------------------------------------------------------------- synthetic tokens, the GPT-2 preset


def test_synthetic_tokens_stand_in_for_absent_files():
    data = build([*TINY_TOKENS, "data.synthetic_tokens=5000", "data.vocab_size=50"])
    x, y = next(iter(data.train))
    assert x.shape == (16, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next-token windows, as from files
    assert int(x.max()) < 50
    a, b = tokens.synthetic_splits(5000, 50, 16)
    assert (len(a), len(b)) == (5000, 500) and 0 <= int(a.min()) and int(a.max()) < 50
    again = tokens.synthetic_splits(5000, 50, 16)
    assert torch.equal(a, again[0]) and torch.equal(b, again[1])  # the same ids in every run, on every rank
    assert len(tokens.synthetic_splits(100, 50, 16)[1]) == 17  # at least one validation window
    with pytest.raises(ConfigError, match=r"^data.synthetic_tokens=10 is below one window"):
        build([*TINY_TOKENS, "data.synthetic_tokens=10", "data.vocab_size=50"])


def test_without_files_or_synthetic_tokens_the_error_names_both():
    with pytest.raises(ConfigError, match=r"data=tokens needs data.train_path.*data.synthetic_tokens=<N>"):
        build([*TINY_TOKENS, "data.vocab_size=50"])


def test_the_gpt2_124m_preset_is_nanogpt_s_recipe():
    cfg = compose_cfg("+experiment=gpt2_124m", tiny=False)
    assert (cfg.model.n_layer, cfg.model.n_head, cfg.model.n_embd, cfg.model.block_size) == (12, 12, 768, 1024)
    assert (cfg.data.name, cfg.data.vocab_size, cfg.data.train_path, cfg.data.synthetic_tokens) == (
        "tokens",
        50304,
        None,
        10_000_000,
    )
    o = cfg.optimizer
    assert (o._target_, o.lr, list(o.betas), o.weight_decay, o.decay_all, o.clip_grad_norm) == (
        "torch.optim.AdamW",
        6e-4,
        [0.9, 0.95],
        0.1,
        False,
        1.0,
    )
    assert (cfg.scheduler.name, cfg.scheduler.warmup_steps, cfg.scheduler.min_lr_factor) == ("cosine", 2000, 0.1)
    assert (cfg.dataloader.batch_size, cfg.memory.accumulate_steps, cfg.trainer.max_steps) == (12, 40, 600000)
    assert 12 * 1024 * 40 == 491_520  # tokens per optimizer step: nanoGPT's ~0.5 M
    assert (cfg.precision.name, cfg.compile.mode) == ("bf16", "default")


@pytest.mark.cli
def test_the_gpt2_124m_preset_runs_on_synthetic_tokens(tmp_path):
    cfg = compose_cfg(
        "+experiment=gpt2_124m",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=64",
        "data.block_size=32",
        "data.synthetic_tokens=20000",
        "memory.accumulate_steps=1",
        "scheduler.warmup_steps=1",
        "compile=off",
        "precision=fp32",
        "trainer.max_steps=2",
        "trainer.warmup_steps=0",
        "trainer.eval_max_batches=1",
        "task.sample_tokens=5",
        "trainer.device=cpu",
        "trainer.progress=off",
        "logger=none",
        tiny=False,
    )
    summary = train(cfg, job_dir=tmp_path)
    assert summary["steps"] == 2 and summary["tokens_per_sec"] > 0 and summary["flops_per_token"] > 0
    assert abs(summary["eval_loss"] - math.log(50304)) < 0.5  # random ids: nothing learnt in 2 steps
    sample = (tmp_path / "samples.txt").read_text().split()
    assert sample and all(w.isdigit() for w in sample)  # token ids: synthetic data has no text
