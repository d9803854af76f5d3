"""Tensor parallelism (runner/techniques/model_parallel.py): which plan a model gets, the refusals, the q, k, v rows
regrouped by rank and restored, pipeline stages and refusals, and (slow) 2-D on 4 CPU ranks (tensor parallel x FSDP,
pipeline x DDP) against FSDP alone on 2.

The 2-rank equivalence with one process (the GPT and an MLP, 50 and 20 steps) is in tests/test_two_ranks.py; the
exact resume in tests/test_resume.py."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from conftest import TINY_LOOP, compose_cfg, read_summary
from runner import REPO_ROOT, distributed, launch
from runner.errors import ConfigError
from runner.models import MLP, MnistCNN
from runner.models.gpt import GPT
from runner.techniques import model_parallel as mp


def test_a_gpt_is_split_by_its_own_plan_and_an_mlp_in_linear_pairs():
    gpt = GPT(65, block_size=16, n_layer=2, n_head=4, n_embd=32)
    plan = mp._plan_for(gpt, 2)
    assert plan == {
        f"transformer.h.{i}.{name}": style
        for i in range(2)
        for name, style in [
            ("attn.c_attn", "colwise_qkv"),
            ("attn.c_proj", "rowwise"),
            ("mlp.c_fc", "colwise"),
            ("mlp.c_proj", "rowwise"),
        ]
    }
    # an MLP of 3 Linear layers: the first two a colwise/rowwise pair, the head (odd one out) whole on every rank
    assert mp._plan_for(MLP(768, hidden=32, depth=2), 2) == {"blocks.0.0": "colwise", "blocks.1.0": "rowwise"}
    mlp_seq = nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    assert mp.tp_plan(mlp_seq) == {"1": "colwise", "3": "rowwise"}


def test_a_model_without_a_plan_or_with_widths_the_split_cannot_divide_is_one_config_error():
    with pytest.raises(ConfigError, match="no tensor-parallel plan for MnistCNN: give the model a `tp_plan`"):
        mp._plan_for(MnistCNN(), 2)  # convolutions: no Linear pairs to split
    with pytest.raises(ConfigError, match=r"tp_size=3 does not divide transformer.h.0.attn.c_attn's 32 output"):
        mp._plan_for(GPT(65, block_size=16, n_layer=1, n_head=4, n_embd=32), 3)
    custom = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    custom.tp_plan = {"1": "colwise"}
    with pytest.raises(ConfigError, match=r"tp_plan: 1 -> 'colwise': runner splits nn.Linear layers"):
        mp._plan_for(custom, 2)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["distributed=tp", "distributed.tp_size=3"], 4, "tp_size=3 must divide the world size 4"),
        (["distributed=ddp", "distributed.tp_size=2"], 2, "tp_size=2 is read by distributed=tp only"),
        (["distributed=pp", "distributed.pp_size=3"], 4, "pp_size=3 must divide the world size 4"),
        (["distributed=tp", "distributed.sync_batchnorm=true"], 2, "works with distributed=ddp only"),
    ],
)
def test_impossible_tensor_parallel_layouts_are_refused_before_anything_starts(overrides, world, message, monkeypatch):
    cfg = compose_cfg(*overrides)
    monkeypatch.setattr(
        launch, "discover", lambda: launch.Layout(rank=0, local_rank=0, world_size=world, nodes=1, launcher="torchrun")
    )
    with pytest.raises(ConfigError, match=message):
        distributed.setup(cfg.distributed, "cpu")


def test_qkv_rows_are_regrouped_so_each_rank_s_share_is_contiguous_and_restored_exactly():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3 * 8)  # q, k, v of width 8 side by side
    before = layer.weight.detach().clone()
    restore = mp._group_heads("transformer.h.0.attn._orig_mod.c_attn", layer, tp_size=2)
    assert set(restore) == {"transformer.h.0.attn.c_attn.weight", "transformer.h.0.attn.c_attn.bias"}
    q, k, v = before.split(8)
    rank1 = layer.weight.detach()[12:]  # what a plain colwise split gives rank 1 of 2: its q, k and v rows
    assert torch.equal(rank1, torch.cat([q[4:], k[4:], v[4:]]))
    assert torch.equal(layer.weight.detach()[restore["transformer.h.0.attn.c_attn.weight"]], before)


def test_the_env_of_a_split_model_gives_its_ranks_one_data_share():
    env = distributed.Env(rank=3, local_rank=3, world_size=4, nodes=1, device=torch.device("cpu"), model_parallel=2)
    assert (env.dp_rank, env.dp_size) == (1, 2)
    data = env.data_view()
    assert (data.rank, data.world_size, data.model_parallel) == (1, 2, 1)


def test_a_gpt_cut_into_stages_keeps_its_names_and_each_stage_its_share():
    stages = [GPT(65, block_size=16, n_layer=3, n_head=2, n_embd=16).pipeline_stage(i, 2) for i in range(2)]
    names = [set(dict(s.named_parameters())) for s in stages]
    assert {n.split(".")[2] for n in names[0] if n.startswith("transformer.h.")} == {"0"}
    assert {n.split(".")[2] for n in names[1] if n.startswith("transformer.h.")} == {"1", "2"}
    assert "transformer.wte.weight" in names[0] and "lm_head.weight" in names[1]
    assert not names[0] & names[1]  # no layer on two stages (the tied head: the embedding's name on stage 0)
    hidden = stages[0](torch.randint(0, 65, (2, 8)))
    assert hidden.shape == (2, 8, 16) and stages[1](hidden).shape == (2, 8, 65)


def test_an_nn_sequential_is_cut_into_its_share_of_layers_and_other_models_are_refused():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    assert list(mp.split_stage(seq, 1, 2)._modules) == ["2", "3", "4"]
    with pytest.raises(ConfigError, match="cannot split MnistCNN into stages: give the model a `pipeline_stage"):
        mp.split_stage(MnistCNN(), 0, 2)
    with pytest.raises(ConfigError, match="4 stages .one per rank. exceed the model's 2 blocks; launch fewer"):
        mp.split_stage(GPT(65, block_size=16, n_layer=2, n_head=2, n_embd=16), 0, 4)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["memory.accumulate_steps=2"], "a pipeline's micro-batches are its accumulation"),
        (["distributed.pp_microbatches=5"], "pp_microbatches=5 must divide dataloader.batch_size=16"),
        (["precision=amp"], "precision=amp: its loss scale would have to span the stages"),
        (["task.loss=chunked"], "use task.loss=full"),
        (["trainer.on_nonfinite=skip"], "each stage would decide alone"),
    ],
)
def test_what_a_pipeline_cannot_run_is_one_config_error(overrides, message):
    from runner import task as task_mod
    from runner.engine.build import _plan

    cfg = compose_cfg("distributed=pp", "task=language_model", *overrides)
    env = distributed.Env(rank=0, local_rank=0, world_size=2, nodes=1, device=torch.device("cpu"), model_parallel=2)
    with pytest.raises(ConfigError, match=message):
        mp.pipeline(nn.Linear(2, 2), task_mod.build(cfg.task), env, cfg, _plan(cfg, env, 100))


@pytest.mark.slow
def test_two_dimensional_model_parallelism_trains_as_fsdp_alone(tmp_path):
    """4 CPU ranks, tp_size=2: two model copies (FSDP over them), each split over 2 ranks; pp_size=2: two pipelines
    of 2 stages (DDP over each stage's copies). Their data shares are FSDP's on 2 ranks, so all follow the same
    losses."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text((REPO_ROOT / "README.md").read_text()[:20000])
    job = [
        "+experiment=shakespeare_char",
        *TINY_LOOP,
        f"data.path={corpus}",
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "data.block_size=16",
        "dataloader.batch_size=8",
        "trainer.max_steps=10",
        "scheduler.warmup_steps=2",
        "trainer.log_every=1",
        "trainer.eval_every=10",
        "task.sample_tokens=0",
        "distributed.timeout_s=120",
    ]
    runs = {}
    for name, n, extra in (
        ("fsdp", 2, ["distributed=fsdp"]),
        ("tp2d", 4, ["distributed=tp", "distributed.tp_size=2"]),
        ("pp2d", 4, ["distributed=pp", "distributed.pp_size=2"]),
    ):
        folder = tmp_path / name
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={n}",
                "-m",
                "runner",
                *job,
                *extra,
                f"hydra.run.dir={folder}",
            ],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=400,
            env={**_env(), "OMP_NUM_THREADS": "1"},
        )
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        runs[name] = ([r["loss"] for r in rows if "loss" in r], read_summary(folder))
    (a, fsdp), (b, tp2d), (c, pp2d) = runs["fsdp"], runs["tp2d"], runs["pp2d"]
    assert tp2d["techniques"]["tp"] == tp2d["techniques"]["fsdp"] == "applied" and tp2d["world_size"] == 4
    assert pp2d["techniques"]["pp"] == pp2d["techniques"]["ddp"] == "applied" and pp2d["world_size"] == 4
    assert tp2d["global_batch_size"] == pp2d["global_batch_size"] == fsdp["global_batch_size"] == 16
    assert len(a) == len(b) == len(c) == 10
    assert max(abs(x - y) for x, y in zip(a, b)) <= 1e-3, (a, b)
    assert max(abs(x - y) for x, y in zip(a, c)) <= 1e-2, (a, c)
    assert tp2d["parameters"]["identical_across_ranks"] is True


def _env() -> dict[str, str]:
    import os

    return {
        **{k: v for k, v in os.environ.items() if not k.startswith("WANDB_")},
        "WANDB_MODE": "disabled",
        "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
