"""The language-model task end to end: the GPT, character-level text, the task, every technique on it.

A tiny GPT (2 layers, 2 heads, 32 wide, windows of 16 characters; ``conftest.TINY_GPT``) trains on a
few thousand characters of real text the tests write (``conftest.tiny_text``); the real corpus runs in
the ``slow`` test only. Each technique test runs the real engine and checks the effect, not only the status.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import runner
from conftest import TINY_GPT, TINY_LOOP, compose_cfg, cuda_only, job_dirs, metrics_rows, read_summary, run_cli
from runner import REPO_ROOT, task as task_mod
from runner.data import text
from runner.engine.train import train
from runner.errors import ConfigError
from runner.models import gpt, hf
from runner.models.gpt import GPT, Block
from runner.techniques import parallel, prepare


def run_lm(job_dir: Path, text_path: Path, *overrides: str) -> dict:
    job_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_cfg(*TINY_GPT, f"data.path={text_path}", *overrides), job_dir=job_dir)


# ------------------------------------------------------------------------------------------------ GPT


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(**{"vocab_size": 11, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32, **kw})


def test_gpt_maps_tokens_to_next_token_logits_with_tied_embeddings():
    model = tiny_gpt()
    logits = model(torch.randint(0, 11, (3, 16)))
    assert logits.shape == (3, 16, 11) and logits.dtype == torch.float32
    assert model.transformer.wte.weight is model.lm_head.weight
    # tied embedding/head, positions, 2 blocks (4 matrices = 12 n_embd^2, 2 LayerNorms), final LayerNorm; no biases
    assert sum(p.numel() for p in model.parameters()) == 11 * 32 + 16 * 32 + 2 * (12 * 32 * 32 + 2 * 32) + 32


def test_gpt_is_causal():
    model = tiny_gpt().eval()
    x = torch.randint(0, 11, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % 11  # change only the future of position 9
    torch.testing.assert_close(model(x)[:, :10], model(y)[:, :10])
    assert not torch.allclose(model(x)[:, 10:], model(y)[:, 10:])


@pytest.mark.parametrize("upcast", [False, True])
def test_upcast_attention_runs_the_attention_in_fp32_under_bf16_autocast(monkeypatch, upcast):
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype, torch.is_autocast_enabled("cpu")))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(gpt.F, "scaled_dot_product_attention", recording)
    model = tiny_gpt(upcast_attention=upcast)
    x = torch.randint(0, 11, (3, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
    logits.float().sum().backward()  # the fp32 attention's backward flows into the bf16 projections
    want = (torch.float32,) * 3 + (False,) if upcast else (torch.bfloat16,) * 3 + (True,)
    assert seen == [want] * 2 and logits.dtype == torch.bfloat16
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    seen.clear()
    model(x)  # without autocast nothing changes: fp32 throughout
    assert seen == [(torch.float32,) * 3 + (False,)] * 2
    # bf16 weights without autocast (FSDP's mixed precision): the fp32 attention's output goes back to bf16
    assert model.to(torch.bfloat16)(x).dtype == torch.bfloat16


def test_gpt_init_follows_nanogpt():
    model = tiny_gpt(n_layer=8, n_embd=256, n_head=4)
    proj = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")])
    fc = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_fc.weight")])
    assert proj.std().item() == pytest.approx(0.02 / math.sqrt(2 * 8), rel=0.02)
    assert fc.std().item() == pytest.approx(0.02, rel=0.02)
    assert all(m.weight.eq(1).all() for m in model.modules() if isinstance(m, nn.LayerNorm))


def test_gpt_generate_extends_the_prompt_reproducibly():
    model = tiny_gpt().eval()
    prompt = torch.tensor([[1, 2, 3]])
    a = model.generate(prompt, 30, top_k=5, generator=torch.Generator().manual_seed(0))
    b = model.generate(prompt, 30, top_k=5, generator=torch.Generator().manual_seed(0))
    assert a.shape == (1, 33) and torch.equal(a, b) and torch.equal(a[:, :3], prompt)
    assert int(a.max()) < 11  # longer than block_size (16): the context is cropped


def test_gpt_blocks_are_the_repeated_blocks():
    model = tiny_gpt()
    assert prepare.repeated_blocks(model) == ["Block"]
    status, names, wrapped = prepare.apply_activation_checkpointing(model, None)
    assert (status, names, wrapped) == ("applied", ["Block"], 2)


def test_the_chunked_loss_is_the_full_loss_and_never_holds_the_logits():
    """``task.loss=chunked``: the same loss and gradients as the head's full logits and the cross-entropy (float
    tolerance), with no (B x T, vocab) tensor saved for the backward, and the same counted FLOPs (MFU unchanged)."""
    from torch.utils.flop_counter import FlopCounterMode

    model = tiny_gpt(vocab_size=257)
    x, y = torch.randint(0, 257, (4, 16)), torch.randint(0, 257, (4, 16))
    full = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    full.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        chunked = model(x, targets=y, chunk_tokens=24)  # 64 positions: chunks of 24, 24 and 16
    chunked.backward()
    assert chunked.item() == pytest.approx(full.item(), rel=1e-6)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-6, msg=name)
    assert max(saved) < 64 * 257, max(saved)  # nothing the size of the logits is kept for the backward
    counts = []
    for loss in (
        lambda: nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()),
        lambda: model(x, targets=y, chunk_tokens=24),
    ):
        with FlopCounterMode(display=False) as counter:
            loss().backward()
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1]


def test_the_chunked_loss_trains_the_gpt_and_refuses_what_it_cannot_act_on(tiny_text, tmp_path):
    """``task.loss=chunked`` trains runner's GPT as the full loss does (the same losses to float tolerance); a model
    whose forward returns its logits whole, a bad name and ``task.loss=liger`` on a CPU are one error each."""
    full = run_lm(tmp_path / "full", tiny_text, "trainer.max_steps=4", "trainer.log_every=1")
    chunked = run_lm(
        tmp_path / "chunked",
        tiny_text,
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "task.loss=chunked",
        "task.loss_chunk_tokens=50",
    )
    assert chunked["train_loss"] == pytest.approx(full["train_loss"], rel=1e-5)
    assert chunked["eval_loss"] == pytest.approx(full["eval_loss"], rel=1e-5)
    for bad, words in (
        ("task.loss=liger", "on CUDA only; on this device use task.loss=chunked"),
        ("task.loss=sparse", "task.loss=sparse must be full, chunked or liger"),
    ):
        with pytest.raises(ConfigError, match=words):
            run_lm(tmp_path / bad.split("=")[1], tiny_text, bad)
    task = task_mod.LanguageModel(loss="chunked")
    with pytest.raises(ConfigError, match="needs a model whose forward computes its loss from targets"):
        task._check_loss(nn.Linear(2, 2))


def test_tokens_per_sec_and_mfu_count_every_micro_batch_of_an_accumulated_step(tiny_text, tmp_path):
    """Users of other runners report MFU wrong under gradient accumulation (litgpt #403, Composer #271): here an
    optimizer step of 2 micro-batches counts both in samples/s, tokens/s and MFU, the FLOPs per sample do not change
    with the accumulation, and summary.json names the peak MFU divided by."""
    runs = {
        k: run_lm(
            tmp_path / f"acc{k}",
            tiny_text,
            "dataloader.batch_size=4",
            f"memory.accumulate_steps={k}",
            "trainer.max_steps=6",
            "trainer.warmup_steps=2",
            "trainer.peak_tflops=0.5",
        )
        for k in (1, 2)
    }
    for k, s in runs.items():
        assert (s["micro_batch_size"], s["global_batch_size"]) == (4, 4 * k)
        assert s["samples_per_sec"] * s["measured_time_s"] == pytest.approx(4 * k * s["measured_steps"])
        assert s["tokens_per_sec"] == pytest.approx(s["samples_per_sec"] * 16)
        assert s["mfu"] == pytest.approx(s["flops_per_sample"] * s["samples_per_sec"] / 0.5e12)
        assert s["peak_tflops"] == 0.5
    assert runs[1]["flops_per_sample"] == runs[2]["flops_per_sample"]


def test_selective_checkpointing_recomputes_the_cheap_ops_and_not_the_matmuls():
    """``memory=selective``: a step of the GPT runs as many matmuls as without checkpointing (they were saved) and
    recomputes its GELUs as full checkpointing does; the gradients are the same in all three."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls: dict[str, int] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    x, y = torch.randint(0, 11, (2, 16)), torch.randint(0, 11, (2, 16))
    counts, grads = {}, {}
    for policy in ("none", "full", "selective"):
        model = tiny_gpt()
        if policy != "none":
            prepare.apply_activation_checkpointing(model, None, policy)
        with Count() as c:
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        counts[policy] = c.calls
        grads[policy] = torch.cat([p.grad.flatten() for p in model.parameters()])
    matmuls = {k: v.get("mm", 0) + v.get("addmm", 0) for k, v in counts.items()}
    assert matmuls["selective"] == matmuls["none"] < matmuls["full"], matmuls
    assert counts["selective"]["gelu"] == counts["full"]["gelu"] == 2 * counts["none"]["gelu"]
    torch.testing.assert_close(grads["selective"], grads["none"])
    with pytest.raises(ConfigError, match="memory.checkpoint_policy=some must be full or selective"):
        prepare.apply_activation_checkpointing(tiny_gpt(), None, "some")


def test_memory_selective_trains_the_gpt_with_its_blocks_wrapped(tiny_text, tmp_path):
    s = run_lm(tmp_path, tiny_text, "memory=selective", "trainer.max_steps=3")
    assert s["techniques"]["selective_checkpointing"] == "applied" and "activation_checkpointing" not in s["techniques"]
    assert s["technique_details"]["checkpointed_modules"] == 2 and math.isfinite(s["train_loss"])


def test_the_activation_memory_budget_needs_compile_and_is_reset_for_the_next_job():
    import torch._functorch.config as functorch_config

    with pytest.raises(ConfigError, match="acts in torch.compile's partitioner; add compile=default"):
        prepare.apply_memory_budget(0.5, None)
    with pytest.raises(ConfigError, match=r"memory.budget=1.5 must be in \[0, 1\]"):
        prepare.apply_memory_budget(1.5, "default")
    assert prepare.apply_memory_budget(0.3, "default") == "applied"
    assert functorch_config.activation_memory_budget == 0.3
    assert prepare.apply_memory_budget(None, "default") is None and functorch_config.activation_memory_budget == 1.0


@pytest.mark.parametrize(
    "obj",
    [
        gpt,
        GPT,
        text,
        text.OnDeviceWindows,
        task_mod.LanguageModel,
        gpt.generate,
        hf,
        hf.causal_lm,
        parallel.repeated_blocks,
    ],
    ids=lambda o: o.__name__,
)
def test_docstrings_cite_their_sources(obj):
    assert "https://" in (obj.__doc__ or ""), obj


# ----------------------------------------------------------------------------------------------- text


def test_text_tokens_vocabulary_and_split(tiny_text):
    tokens, vocab = text.read_corpus(str(tiny_text))
    raw = tiny_text.read_text()
    assert vocab == sorted(set(raw)) and text.decode(tokens.tolist(), vocab) == raw
    assert tokens.dtype == torch.int64 and tokens.shape == (len(raw),)
    train_tokens, val_tokens = text.split(tokens, 16, str(tiny_text))
    assert len(train_tokens) == int(0.9 * len(raw)) and len(train_tokens) + len(val_tokens) == len(raw)


def test_windows_are_next_token_pairs(tiny_text):
    tokens, _ = text.read_corpus(str(tiny_text))
    windows = text.TokenWindows(tokens, 16)
    x, y = windows[7]
    assert x.shape == y.shape == (16,) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x, tokens[7:23]) and torch.equal(y, tokens[8:24])
    assert len(windows) == len(tokens) - 16
    tiled = text.TokenWindows(tokens, 16, stride=16)
    assert torch.equal(tiled[2][0], tokens[32:48]) and len(tiled) == (len(tokens) - 17) // 16 + 1


def test_on_device_windows_one_gather_per_batch(tiny_text):
    tokens, _ = text.read_corpus(str(tiny_text))
    g = torch.Generator().manual_seed(0)
    batches = text.OnDeviceWindows(tokens, 16, 8, num_batches=3, generator=g)
    got = list(batches)
    assert len(got) == len(batches) == 3
    every_window = tokens.unfold(0, 17, 1)  # (N - 16, 17): each start's 16 inputs and the next token
    for x, y in got:
        assert x.shape == y.shape == (8, 16)
        assert torch.equal(x[:, 1:], y[:, :-1])  # y is x shifted by one token
        drawn = torch.cat([x, y[:, -1:]], dim=1)
        assert (drawn[:, None, :] == every_window[None]).all(-1).any(1).all()  # real windows of the text
    starts = torch.arange(5) * 16
    fixed = text.OnDeviceWindows(tokens, 16, 2, starts=starts)
    first, second = list(fixed), list(fixed)
    assert len(fixed) == 3 and all(torch.equal(a[0], b[0]) for a, b in zip(first, second))
    assert torch.equal(first[1][0][0], tokens[32:48])


def build_data(text_path, *overrides):
    from runner import data as data_mod
    from runner.distributed import Env

    cfg = compose_cfg(*TINY_GPT, f"data.path={text_path}", *overrides)
    env = Env(rank=0, local_rank=0, world_size=1, nodes=1, device=torch.device("cpu"))
    return data_mod.build(cfg.data, cfg.dataloader, env, seed=0)


def test_host_and_device_paths_evaluate_the_same_fixed_windows(tiny_text):
    host, device = (build_data(tiny_text, "data.train_size=null", *more) for more in ([], ["dataloader=device"]))
    assert device.techniques == {"on_device_data": "applied"}
    assert isinstance(device.train.batches, text.OnDeviceWindows)
    assert host.sample_shape == device.sample_shape == (16,) and host.vocab == device.vocab
    host_eval, device_eval = list(host.eval), list(device.eval)
    assert len(host_eval) == len(device_eval) > 1
    for (xh, yh), (xd, yd) in zip(host_eval, device_eval):
        assert torch.equal(xh, xd) and torch.equal(yh, yd)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(host_eval, host.eval))  # the same every evaluation
    windows = int(0.9 * len(tiny_text.read_text())) // 16  # train tokens // block_size: ~every token once an epoch
    assert host.train_samples == windows and len(host.train) == len(device.train) == windows // 16


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "does not exist"),
        (b"", "is empty"),
        (b"caf\xe9 au lait\n" * 50, "is not UTF-8 text"),
        (b"\x00\x01binary" * 100, "NUL bytes"),
        (b"short text\n", "does not fit in the text"),
    ],
)
def test_bad_text_is_one_config_error(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ConfigError, match=message) as info:
        build_data(path)
    assert "data.path" in str(info.value) or "data.block_size" in str(info.value)


def test_text_without_a_path_says_which_key(tmp_path):
    with pytest.raises(ConfigError, match="data=text needs data.path"):
        train(compose_cfg(*TINY_GPT), job_dir=tmp_path)


def test_block_size_longer_than_the_model_s_context(tiny_text, tmp_path):
    with pytest.raises(ConfigError, match=r"data.block_size=16 is longer than the model's context model.block_size=8"):
        run_lm(tmp_path, tiny_text, "model.block_size=8")
    assert not (tmp_path / "summary.json").exists()


def test_classification_on_text_says_which_task(tiny_text, tmp_path):
    with pytest.raises(ConfigError, match="task=classification needs labelled samples.*task=language_model"):
        train(compose_cfg("data=text", f"data.path={tiny_text}", "data.block_size=16"), job_dir=tmp_path)


def test_a_language_model_needs_token_data(tmp_path):
    cfg = compose_cfg("task=language_model", "model=gpt", "model.n_layer=1", "model.n_head=1", "model.n_embd=8")
    with pytest.raises(ConfigError, match="task=language_model needs token data"):
        train(cfg, job_dir=tmp_path)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["trainer.target_accuracy=0.5"], "reports no eval_accuracy"),
        (["task.sample_prompt=XYZ"], "task.sample_prompt"),
    ],
)
def test_task_and_data_must_match(tiny_text, tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        run_lm(tmp_path, tiny_text, *overrides)


# ------------------------------------------------------------------------------------ task and engine


def test_the_training_loop_never_names_a_loss():
    source = (REPO_ROOT / "runner" / "engine" / "train.py").read_text()
    assert "cross_entropy" not in source and "task.loss(" in source


def test_language_model_run_reports_tokens_and_writes_samples_and_vocab(tiny_text, tmp_path):
    s = run_lm(tmp_path, tiny_text, "trainer.eval_every=2", "trainer.target_loss=100")
    assert s["tokens_per_sample"] == 16
    assert s["tokens_per_sec"] == pytest.approx(s["samples_per_sec"] * 16)
    assert s["flops_per_token"] == pytest.approx(s["flops_per_sample"] / 16)
    n_params = 2 * 12 * 32 * 32  # matmul weights of the blocks; 6 N FLOPs per token (+ head, attention)
    assert 6 * n_params < s["flops_per_token"] < 3 * 6 * n_params
    assert s["eval_perplexity"] == pytest.approx(math.exp(s["eval_loss"]))
    assert s["eval_bits_per_char"] == pytest.approx(s["eval_loss"] / math.log(2))
    assert "eval_accuracy" not in s
    assert s["time_to_target_s"] is not None and s["time_to_target_s"] <= s["train_time_s"]  # first evaluation
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert vocab == sorted(set(tiny_text.read_text()))
    sample = (tmp_path / "samples.txt").read_text()
    assert len(sample) == 1 + 20 and sample[0] == "\n" and set(sample) <= set(vocab)  # prompt + sample_tokens
    all_rows = metrics_rows(tmp_path)
    train_rows = [r for r in all_rows if "loss" in r]
    eval_rows = [r for r in all_rows if "eval_loss" in r]
    assert train_rows[-1]["tokens_per_sec"] == pytest.approx(train_rows[-1]["samples_per_sec"] * 16)
    assert [r["step"] for r in eval_rows] == [2, 4]
    assert set(eval_rows[0]) == {"step", "epoch", "eval_loss", "eval_perplexity", "eval_bits_per_char"}


def test_sampling_feeds_a_model_that_declares_no_context_only_the_trained_window(tiny_text, tmp_path):
    """A user's model with learned positions for 16 tokens and neither ``block_size`` nor a Hugging Face
    config: 20 tokens sampled after the prompt mean inputs of up to 21 tokens, which it cannot take.
    Sampling must crop them to data.block_size, the length it was trained on."""
    cfg = compose_cfg(
        "task=language_model",
        "data=text",
        f"data.path={tiny_text}",
        "data.block_size=16",
        "model._target_=user_data.FixedContextLM",
        "model.context=16",
        "task.sample_tokens=20",
    )
    s = train(cfg, job_dir=tmp_path)
    sample = (tmp_path / "samples.txt").read_text()
    assert math.isfinite(s["train_loss"]) and len(sample) == 1 + 20 and sample[0] == "\n"


def test_target_loss_dates_the_first_evaluation_at_or_below_it(tiny_text, tmp_path, monkeypatch):
    losses = iter([3.0, 1.5, 1.4, 1.0])
    monkeypatch.setattr(
        task_mod.LanguageModel,
        "evaluate",
        lambda self, *a, **k: {
            "eval_loss": (v := next(losses)),
            "eval_perplexity": math.exp(v),
            "eval_bits_per_char": v / math.log(2),
        },
    )
    s = run_lm(tmp_path, tiny_text, "trainer.eval_every=1", "trainer.target_loss=1.47")
    evals = [r for r in metrics_rows(tmp_path) if "eval_loss" in r]
    assert [r["eval_loss"] for r in evals] == [3.0, 1.5, 1.4, 1.0]
    assert 0 < s["time_to_target_s"] < s["train_time_s"]  # reached at the third of four evaluations


def test_the_loss_falls_on_real_text(tiny_text, tmp_path):
    s = run_lm(
        tmp_path, tiny_text, "optimizer=adamw", "trainer.max_steps=60", "trainer.log_every=10", "trainer.eval_every=60"
    )
    losses = [r["loss"] for r in metrics_rows(tmp_path) if "loss" in r]
    assert losses[0] > 3.0 and s["eval_loss"] < 2.6  # from ~ln(30) = 3.4 towards the text's statistics


# ------------------------------------------------------------------------------ techniques on the LM


def test_image_only_techniques_are_recorded_as_skipped(tiny_text, tmp_path, spy):
    s = run_lm(
        tmp_path,
        tiny_text,
        "channels_last=true",
        "cudnn_benchmark=true",
        "model.drop_bias_before_bn=true",
        "data.normalize=true",
        "data.augment=true",
    )
    for key in ("channels_last", "cudnn_benchmark", "drop_bias_before_bn", "normalize", "augment"):
        assert s["techniques"][key].startswith("skipped: ") and "image technique" in s["techniques"][key], key
    assert torch.backends.cudnn.benchmark is False
    assert all(c.x_dtype == torch.int64 for c in spy.calls)  # token ids, untouched by image transforms
    assert s["steps"] == 4 and math.isfinite(s["train_loss"])


@pytest.mark.filterwarnings("ignore:precision=bf16")  # a CPU without native bf16 emulates it
def test_bf16_autocast_runs_the_gpt_in_bf16(tiny_text, tmp_path, spy):
    s = run_lm(tmp_path, tiny_text, "precision=bf16")
    assert s["techniques"]["bf16"] == "applied"
    calls = spy.train_calls()
    assert calls and all(c.x_dtype == torch.int64 and c.out_dtype == torch.bfloat16 for c in calls)
    assert all(p.dtype == torch.float32 for p in spy.model.parameters())  # autocast: fp32 master weights
    assert math.isfinite(s["train_loss"]) and math.isfinite(s["eval_loss"])


@pytest.mark.parametrize("impl", ["fused", "foreach"])
def test_fused_and_foreach_adamw_on_the_gpt(tiny_text, tmp_path, spy, impl):
    s = run_lm(tmp_path, tiny_text, "optimizer=adamw", f"optimizer.impl={impl}")
    assert s["techniques"][f"optimizer_{impl}"] == "applied"
    assert isinstance(spy.optimizer, torch.optim.AdamW) and spy.optimizer.defaults[impl] is True
    assert len(spy.steps) == 4


def test_activation_checkpointing_wraps_the_transformer_blocks(tiny_text, tmp_path, spy):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    s = run_lm(tmp_path, tiny_text, "memory=checkpointing")
    assert s["techniques"]["activation_checkpointing"] == "applied"
    assert s["technique_details"]["checkpointed_blocks"] == ["Block"]
    assert s["technique_details"]["checkpointed_modules"] == 2
    blocks = list(spy.model.transformer.h)
    assert all(isinstance(b, CheckpointWrapper) and isinstance(b._checkpoint_wrapped_module, Block) for b in blocks)
    assert math.isfinite(s["train_loss"]) and (tmp_path / "samples.txt").is_file()


def test_accumulated_gradients_equal_one_big_batch_on_the_gpt(tiny_text, tmp_path, spy):
    # the training windows are one seeded stream: batch 16 and 2 x 8 see the same 16 windows in step 1
    spy.keep_grads = True
    run_lm(tmp_path / "big", tiny_text, "trainer.max_steps=1", "dataloader.batch_size=16")
    big = spy.steps[0].grads
    s = run_lm(tmp_path / "acc", tiny_text, "trainer.max_steps=1", "dataloader.batch_size=8", "memory=accumulate")
    assert s["techniques"]["gradient_accumulation"] == "applied" and s["global_batch_size"] == 16
    acc = spy.steps[-1].grads
    assert big.keys() == acc.keys()
    for name in big:
        torch.testing.assert_close(acc[name], big[name], rtol=1e-4, atol=1e-6, msg=name)


def test_clipping_on_the_gpt(tiny_text, tmp_path, spy):
    s = run_lm(tmp_path, tiny_text, "optimizer.clip_grad_norm=0.01")
    assert s["techniques"]["clip_grad_norm"] == "applied"
    assert [st.grad_norm for st in spy.steps] == pytest.approx([0.01] * 4, rel=1e-3)


@pytest.mark.parametrize("name", ["cosine", "onecycle", "cyclic"])
def test_schedulers_drive_the_gpt_s_lr(tiny_text, tmp_path, spy, name):
    s = run_lm(tmp_path, tiny_text, f"scheduler={name}", "scheduler.warmup_steps=2", "trainer.max_steps=6")
    assert s["techniques"][f"scheduler_{name}"] == "applied"
    lrs = [st.lr for st in spy.steps]
    assert len(lrs) == 6 and len(set(lrs)) > 3  # the LR moves every step


def test_decay_all_false_spares_the_layernorm_gains(tiny_text, tmp_path, spy):
    run_lm(tmp_path, tiny_text, "optimizer=adamw", "optimizer.weight_decay=0.1", "optimizer.decay_all=false")
    decayed, spared = spy.optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and spared["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decayed["params"]) and all(p.dim() == 1 for p in spared["params"])
    assert len(spared["params"]) == 2 * 2 + 1  # ln_1, ln_2 per block and ln_f (bias=False: no biases)


def test_on_device_text_in_the_engine(tiny_text, tmp_path, spy):
    s = run_lm(tmp_path, tiny_text, "dataloader=device")
    assert s["techniques"]["on_device_data"] == "applied"
    assert isinstance(spy.datas[-1].train.batches, text.OnDeviceWindows)
    assert s["steps"] == 4 and math.isfinite(s["eval_loss"])


@pytest.mark.slow
def test_compile_on_the_gpt(tiny_text, tmp_path, spy):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spy.hook = False  # keep the compiled graph free of test hooks
    s = run_lm(tmp_path, tiny_text, "compile=default", "trainer.max_steps=2", "trainer.eval_max_batches=1")
    assert s["techniques"]["compile"] == "applied"
    assert spy.model._compiled_call_impl is not None
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1
    assert math.isfinite(s["train_loss"]) and (tmp_path / "samples.txt").is_file()  # sampling runs eagerly
    torch._dynamo.reset()


def test_fsdp_shards_each_transformer_block(tiny_text, tmp_path, spy):
    from torch.distributed.fsdp import FSDPModule

    s = run_lm(tmp_path, tiny_text, "distributed=fsdp")
    assert s["techniques"]["fsdp"] == "applied"
    assert all(isinstance(b, FSDPModule) for b in spy.model.transformer.h) and isinstance(spy.model, FSDPModule)
    assert s["parameters"]["dtensor_count"] == s["parameters"]["count"]
    assert (tmp_path / "samples.txt").is_file()


# --------------------------------------------------------------------- two real processes (torchrun)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_data_parallel_gpt_over_two_processes(tmp_path, name):
    from conftest import make_tiny_text
    from test_distributed import make_root, only_job, torchrun

    root = make_root(tmp_path)
    corpus = make_tiny_text(tmp_path / "input.txt")
    proc = torchrun(
        f"distributed={name}",
        *TINY_LOOP,
        *TINY_GPT,
        f"data.path={corpus}",
        "precision=bf16",
        "memory=checkpointing",
        cwd=root,
    )
    s = only_job(root, proc)
    assert s["techniques"][name] == "applied" and s["world_size"] == 2
    assert s["techniques"]["activation_checkpointing"] == "applied"
    assert s["global_batch_size"] == 32 and s["tokens_per_sec"] == pytest.approx(s["samples_per_sec"] * 16)
    params = s["parameters"]
    assert params["identical_across_ranks"] is True
    if name == "fsdp":
        assert params["dtensor_count"] == params["count"] and params["local_numel"] < params["numel"]
        assert s["techniques"]["fsdp_mixed_precision"] == "applied"
    job = job_dirs(root)[0]
    assert (job / "vocab.json").is_file() and len((job / "samples.txt").read_text()) == 21


# ------------------------------------------------------------------------------------------ presets


@pytest.mark.cli
def test_shakespeare_char_preset_through_the_cli(tiny_text, tmp_path):
    proc = run_cli(
        "+experiment=shakespeare_char",
        f"data.path={tiny_text}",
        "logger=none",
        "trainer.device=cpu",
        "trainer.max_steps=6",
        "trainer.eval_every=3",
        "trainer.eval_max_batches=2",
        "trainer.warmup_steps=1",
        "trainer.log_every=3",
        "trainer.progress=off",
        "scheduler.warmup_steps=2",
        "model.n_layer=2",
        "model.n_embd=32",
        "data.block_size=16",
        "task.sample_tokens=40",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = job_dirs(tmp_path)[0]
    s = read_summary(job)
    assert s["tokens_per_sec"] > 0 and s["flops_per_token"] > 0 and s["step_time_ms_median"] > 0
    assert s["config"]["trainer"]["target_loss"] == 1.88 and s["config"]["model"]["n_head"] == 4
    assert s["techniques"]["scheduler_cosine"] == "applied" and s["techniques"]["clip_grad_norm"] == "applied"
    assert json.loads((job / "vocab.json").read_text()) == sorted(set(tiny_text.read_text()))
    assert len((job / "samples.txt").read_text()) == 41


@pytest.mark.parametrize("preset", ["shakespeare_char", "shakespeare_char_gpu"])
@pytest.mark.parametrize("layer", ["fast", "baseline"])
def test_presets_compose_with_fast_and_baseline_on_top(preset, layer):
    cfg = compose_cfg(f"+experiment=[{preset},{layer}]", "trainer.device=cpu", tiny=False)
    assert (cfg.task._target_, cfg.model._target_, cfg.data.name) == (
        "runner.task.LanguageModel",
        "runner.models.gpt.GPT",
        "text",
    )
    assert cfg.dataloader.on_device == (layer == "fast")  # text is in memory: fast puts it on the device
    assert cfg.dataloader.batch_size == cfg.optimizer.base_batch_size == (12 if preset == "shakespeare_char" else 64)


@pytest.mark.parametrize("preset", ["shakespeare_char", "shakespeare_char_gpu"])
def test_the_presets_read_the_embedded_corpus_by_default(preset, monkeypatch):
    """A fresh clone has Tiny Shakespeare in data/ (nanoGPT's input.txt: 1,115,394 characters), so the README's
    ``+experiment=shakespeare_char`` commands need no data.path; ``RUNNER_DATA_ROOT`` moves it."""
    monkeypatch.delenv("RUNNER_DATA_ROOT", raising=False)
    path = Path(compose_cfg(f"+experiment={preset}", tiny=False).data.path)
    assert path == runner.DATA_DIR / "tinyshakespeare" / "input.txt"
    assert hashlib.sha256(path.read_bytes()).hexdigest().startswith("86c4e6aa9db7c042")
    assert len(path.read_text(encoding="utf-8")) == 1_115_394
    monkeypatch.setenv("RUNNER_DATA_ROOT", "/elsewhere")
    assert compose_cfg(f"+experiment={preset}", tiny=False).data.path == "/elsewhere/tinyshakespeare/input.txt"


@pytest.mark.slow
def test_shakespeare_char_on_the_embedded_corpus_learns(tmp_path, monkeypatch):
    monkeypatch.delenv("RUNNER_DATA_ROOT", raising=False)  # the preset's own default, as a fresh clone runs it
    proc = run_cli(
        "+experiment=shakespeare_char",
        "logger=none",
        "trainer.device=cpu",
        "trainer.max_steps=50",
        "trainer.eval_every=50",
        "trainer.eval_max_batches=20",
        "scheduler.warmup_steps=10",
        "trainer.progress=off",
        cwd=tmp_path,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = read_summary(job_dirs(tmp_path)[0])
    assert s["config"]["data"]["path"] == str(runner.DATA_DIR / "tinyshakespeare" / "input.txt")
    assert len(json.loads((job_dirs(tmp_path)[0] / "vocab.json").read_text())) == 65
    assert s["eval_loss"] < 3.3  # ln(65) = 4.17 at the start


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@cuda_only
def test_gpt_attention_uses_the_flash_kernel_on_cuda():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = tiny_gpt(n_embd=128, n_head=2).cuda()
    x = torch.randint(0, 11, (4, 16), device="cuda")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION), torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(x)  # raises if FlashAttention cannot run these inputs
        logits.float().sum().backward()
    assert logits.dtype == torch.bfloat16 and logits.shape == (4, 16, 11)


@pytest.mark.gpu
@cuda_only
def test_gpu_preset_runs_on_the_device(tiny_text, tmp_path):
    # data=text first: compose_cfg then leaves out the tiny image job's data.* keys
    s = train(
        compose_cfg(
            "data=text",
            "+experiment=shakespeare_char_gpu",
            f"data.path={tiny_text}",
            "trainer.device=cuda",
            "trainer.max_steps=20",
            "trainer.eval_every=10",
            "data.block_size=64",
            "scheduler.warmup_steps=2",
            "dataloader.batch_size=16",
        ),
        job_dir=tmp_path,
    )
    assert s["device"] == "cuda" and s["techniques"]["bf16"] == "applied"
    assert s["techniques"]["on_device_data"] == "applied" and s["mfu"] is not None and s["mfu"] > 0
    assert math.isfinite(s["eval_loss"]) and (tmp_path / "samples.txt").is_file()
