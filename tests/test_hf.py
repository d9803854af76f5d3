"""Hugging Face causal LMs trained by runner: ``model=hf_causal_lm`` and ``model._target_=transformers.<Class>``.

A tiny GPT-2 (2 layers, 2 heads, 32 wide, context 16) built from ``GPT2Config`` trains on the text the tests
write (``conftest.tiny_text``); the whole module is skipped when ``transformers`` is not installed (the
message a user gets then is tested in test_bad_input.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import TINY_GPT, TINY_LOOP, compose_cfg, job_dirs, read_summary, run_cli
from runner.engine.train import train
from runner.errors import ConfigError
from runner.models import gpt, hf

transformers = pytest.importorskip("transformers")

#: TINY_GPT's language-model job with a Hugging Face GPT-2 of the same size (add ``data.path=<a text>``).
TINY_HF = [o if o != "model=gpt" else "model=hf_causal_lm" for o in TINY_GPT]
#: The same model named by its class, with a nested GPT2Config.
TINY_HF_TARGET = [
    "task=language_model",
    "data=text",
    "data.block_size=16",
    "model._target_=transformers.GPT2LMHeadModel",
    "model.config._target_=transformers.GPT2Config",
    "model.config.n_layer=2",
    "model.config.n_head=2",
    "model.config.n_embd=32",
    "model.config.n_positions=16",
    "task.sample_tokens=20",
]


def run_hf(job_dir: Path, text_path: Path, *overrides: str, spec=TINY_HF) -> dict:
    job_dir.mkdir(parents=True, exist_ok=True)
    return train(compose_cfg(*spec, f"data.path={text_path}", *overrides), job_dir=job_dir)


@pytest.mark.cli
def test_hf_gpt2_trains_through_the_cli(tiny_text, tmp_path):
    proc = run_cli(*TINY_LOOP, *TINY_HF, f"data.path={tiny_text}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job = job_dirs(tmp_path)[0]
    s = read_summary(job)
    vocab = json.loads((job / "vocab.json").read_text())
    assert s["steps"] == 4 and math.isfinite(s["train_loss"]) and math.isfinite(s["eval_loss"])
    assert s["tokens_per_sec"] > 0 and s["tokens_per_sec"] == pytest.approx(s["samples_per_sec"] * 16)
    n_params = 2 * 12 * 32 * 32  # matmul weights of the blocks; 6 N FLOPs per token (+ head, attention)
    assert 6 * n_params < s["flops_per_token"] < 3 * 6 * n_params
    weights = load_file(job / "model.safetensors")  # Hugging Face's names, sized by the data
    assert weights["transformer.wte.weight"].shape == (len(vocab), 32)
    assert weights["transformer.wpe.weight"].shape == (16, 32)  # the context follows data.block_size
    assert "transformer.h.1.attn.c_attn.weight" in weights
    sample = (job / "samples.txt").read_text()  # 21 tokens > the context of 16: sampling crops its input
    assert len(sample) == 1 + 20 and sample[0] == "\n" and set(sample) <= set(vocab)


@pytest.mark.cli
def test_a_class_with_a_nested_config_is_the_same_model(tiny_text, tmp_path, spy):
    by_type = run_hf(tmp_path / "type", tiny_text, "trainer.max_steps=2")
    by_class = run_hf(tmp_path / "class", tiny_text, "trainer.max_steps=2", spec=TINY_HF_TARGET)
    model = spy.model
    assert type(model).__name__ == "GPT2LMHeadModel" and model.config.vocab_size == len(spy.datas[-1].vocab)
    assert by_class["train_loss"] == pytest.approx(by_type["train_loss"], rel=1e-6)  # same seed, same weights
    assert by_class["eval_loss"] == pytest.approx(by_type["eval_loss"], rel=1e-6)
    assert (tmp_path / "class" / "samples.txt").read_text() == (tmp_path / "type" / "samples.txt").read_text()


@pytest.mark.cli
def test_activation_checkpointing_recomputes_the_hf_blocks(tiny_text, tmp_path, spy, monkeypatch):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    calls = []
    forward = GPT2Block.forward

    def counted(self, *args, **kwargs):
        if self.training:
            calls.append(torch.is_grad_enabled())
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(GPT2Block, "forward", counted)
    s = run_hf(tmp_path, tiny_text, "memory=checkpointing", "precision=bf16")
    assert s["techniques"]["activation_checkpointing"] == "applied" and s["techniques"]["bf16"] == "applied"
    assert {k: v for k, v in s["technique_details"].items() if k != "host_allocator"} == {
        "checkpointed_blocks": ["GPT2Block"],
        "checkpointed_modules": 2,
    }
    blocks = list(spy.model.transformer.h)
    assert all(isinstance(b, CheckpointWrapper) and isinstance(b._checkpoint_wrapped_module, GPT2Block) for b in blocks)
    # per block: 1 forward counting FLOPs (before wrapping), then each of the 4 steps runs it twice: once in
    # forward, once again in backward (the recomputation)
    assert len(calls) == 2 * (1 + 2 * 4)
    assert all(c.out_dtype == torch.bfloat16 for c in spy.train_calls())  # .logits under bf16 autocast
    assert math.isfinite(s["train_loss"]) and (tmp_path / "samples.txt").is_file()


def test_fsdp_shards_each_hf_block(tiny_text, tmp_path, spy):
    from torch.distributed.fsdp import FSDPModule

    s = run_hf(tmp_path, tiny_text, "distributed=fsdp", "trainer.max_steps=2")
    assert s["techniques"]["fsdp"] == "applied"
    assert all(isinstance(b, FSDPModule) for b in spy.model.transformer.h) and isinstance(spy.model, FSDPModule)
    assert s["parameters"]["dtensor_count"] == s["parameters"]["count"]
    assert (tmp_path / "samples.txt").is_file()


def test_sampling_follows_the_model_s_logits():
    torch.manual_seed(0)
    model = hf.causal_lm(11, block_size=8, n_layer=1, n_head=2, n_embd=16).eval()
    prompt = torch.tensor([[1, 2, 3]])
    out = gpt.generate(model, prompt, 12, top_k=1, context=8)  # greedy: the argmax of each step's logits
    assert out.shape == (1, 15) and torch.equal(out[:, :3], prompt)
    for t in range(3, 15):
        window = out[:, max(0, t - 8) : t]
        assert out[0, t] == model(window).logits[0, -1].argmax()


# ------------------------------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    "overrides,words",
    [
        (["model.model_type=gpt3"], ["model.model_type='gpt3'", "gpt2", "llama", "not a causal language model type"]),
        (["model.model_type=vit"], ["model.model_type='vit'", "not a causal language model type"]),
        (["model.n_layr=2"], ["model.n_layr=2", "did you mean model.n_layer?", "GPT2Config"]),
        (["model.n_head=3"], ["model=hf_causal_lm could not build a gpt2 model", "model.n_head=3"]),
        (["model.block_size=8"], ["data.block_size=16", "GPT2Config.max_position_embeddings=8"]),
        (["model.vocab_size=50"], ["model.vocab_size=50 cannot be set", "follows the data"]),
    ],
)
def test_bad_hf_settings_are_one_config_error(tiny_text, tmp_path, overrides, words):
    with pytest.raises(ConfigError) as caught:
        run_hf(tmp_path, tiny_text, *overrides)
    message = str(caught.value)
    assert all(w in message for w in words), message
    assert "\n" not in message.strip() and not (tmp_path / "summary.json").exists()


def test_a_vocabulary_size_in_the_nested_config_is_refused(tiny_text, tmp_path):
    with pytest.raises(ConfigError, match=r"model.config.vocab_size=50257 cannot be set: it follows the data"):
        run_hf(tmp_path, tiny_text, "model.config.vocab_size=50257", spec=TINY_HF_TARGET)


def test_a_causal_lm_on_labelled_data_says_which_task(tmp_path):
    with pytest.raises(ConfigError, match=r"model=hf_causal_lm is a causal language model: .*task=language_model"):
        train(compose_cfg("model=hf_causal_lm"), job_dir=tmp_path)  # TINY: classification on synthetic images
