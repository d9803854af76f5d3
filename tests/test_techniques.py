"""Every technique switch of issue 3 is off by default, recorded in ``summary.json`` and really applied.

Each test runs the real engine (``train``) on a tiny CPU job, or the technique's own function, and checks
the effect itself (LR trajectory, wrappers, saved activations, gradients, memory format, ...), not only
that the run finishes. Precision/clipping live in test_precision.py, data techniques in
test_data_techniques.py. GPU-only paths are marked ``gpu`` and skip without CUDA.
"""

from __future__ import annotations

import copy
import json
import math
import sys

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from conftest import ONE_THREAD, compose_cfg, cuda_only, metrics_rows, run_tiny
from runner import data as data_mod, models
from runner.engine.train import train
from runner.errors import ConfigError
from runner.measure import hardware
from runner.task import evaluation_sums
from runner.techniques import debug, optim, precision, prepare, schedule
from technique_helpers import SharedConv, TinyMLP, Untraceable

# ------------------------------------------------------------------------------------------ defaults

#: Every switch of the technique table at its "off" value.
OFF = {
    "scheduler.name": "constant",
    "dataloader.num_workers": 0,
    "dataloader.pin_memory": False,
    "dataloader.persistent_workers": False,
    "dataloader.prefetch_factor": None,
    "dataloader.on_device": False,
    "dataloader.non_blocking": False,
    "optimizer._target_": "torch.optim.SGD",
    "optimizer.lr_scaling": "none",
    "optimizer.impl": None,
    "optimizer.clip_grad_norm": None,
    "precision.name": "fp32",
    "cudnn_benchmark": False,
    "memory.checkpointing": False,
    "memory.checkpoint_modules": None,
    "memory.accumulate_steps": 1,
    "debug.name": "off",
    "model.drop_bias_before_bn": False,
    "compile.mode": None,
    "channels_last": False,
}


#: What the default config keeps on: the engine's standard practice (issue 2), PyTorch's own default for
#: zero_grad and torchvision's standard normalization. +experiment=baseline turns both off.
STANDARD_ON = {"optimizer.set_to_none": True, "data.normalize": True}


def test_every_switch_is_off_in_the_default_config_but_the_engine_s_standard_practice():
    cfg = compose_cfg(tiny=False)
    assert {key: OmegaConf.select(cfg, key) for key in OFF} == OFF
    assert {key: OmegaConf.select(cfg, key) for key in STANDARD_ON} == STANDARD_ON


def test_default_run_applies_only_set_to_none_and_the_tests_one_thread(tmp_path):
    summary = run_tiny(tmp_path)  # TINY: synthetic data, which is not normalized
    assert summary["techniques"] == {"zero_grad_set_to_none": "applied", **ONE_THREAD}
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["techniques"] == summary["techniques"]


DOCUMENTED = [
    prepare.apply_cudnn_benchmark,
    prepare.apply_channels_last,
    prepare.apply_drop_bias_before_bn,
    prepare.apply_activation_checkpointing,
    prepare.apply_compile,
    optim,
    optim.scaled_lr,
    optim.build,
    precision.build,
    schedule.build,
    debug,
    debug.build,
    evaluation_sums,
    data_mod.OnDeviceLoader,
    data_mod.images_as_tensor,
    data_mod.DeviceIterable,
    data_mod.random_crop_flip,
]


@pytest.mark.parametrize("obj", DOCUMENTED, ids=lambda o: o.__name__)
def test_technique_docstring_cites_its_source(obj):
    doc = obj.__doc__ or ""
    assert "https://" in doc or "et al." in doc or "airbench" in doc, f"{obj.__name__} cites no source"


# ------------------------------------------------------------------------------- 1: LR schedules


def lr_trajectory(name: str, total: int, *overrides: str, lr: float = 0.1) -> list[float]:
    """The LR each of ``total`` optimizer steps uses, as the engine steps the scheduler."""
    cfg = compose_cfg(f"scheduler={name}", *overrides).scheduler
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=lr)
    sched, status = schedule.build(cfg, opt, total)
    assert status == ({} if name == "constant" else {f"scheduler_{name}": "applied"})
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


def test_constant_schedule_keeps_the_lr():
    assert lr_trajectory("constant", 20) == [0.1] * 20


def test_onecycle_warms_up_to_the_peak_then_anneals():
    lrs = lr_trajectory("onecycle", 100, "scheduler.max_lr_factor=4", "scheduler.pct_start=0.25")
    peak = max(lrs)
    assert peak == pytest.approx(0.4, rel=1e-3)
    assert 22 <= lrs.index(peak) <= 26  # pct_start of the steps
    assert lrs[0] == pytest.approx(0.4 / 25, rel=1e-3)  # OneCycleLR's div_factor
    assert lrs[-1] < 1e-3
    up, down = lrs[: lrs.index(peak) + 1], lrs[lrs.index(peak) :]
    assert all(a < b for a, b in zip(up, up[1:])) and all(a > b for a, b in zip(down, down[1:]))


def test_cosine_warms_up_linearly_then_decays():
    lrs = lr_trajectory("cosine", 100, "scheduler.warmup_steps=10", "scheduler.min_lr_factor=0.1")
    assert lrs[:10] == pytest.approx([0.1 * (i + 1) / 10 for i in range(10)])
    decay = lrs[10:]
    assert decay[0] == pytest.approx(0.1)
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[45] == pytest.approx(0.1 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5))), rel=1e-6)
    assert 0.01 <= lrs[-1] < 0.0102  # floor: min_lr_factor x LR


def test_cosine_warmup_longer_than_the_run_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduler.warmup_steps"):
        lr_trajectory("cosine", 5, "scheduler.warmup_steps=10")


def test_cyclic_is_a_triangle_between_base_and_max():
    lrs = lr_trajectory(
        "cyclic", 41, "scheduler.base_lr_factor=0.1", "scheduler.max_lr_factor=2", "scheduler.cycle_steps=20"
    )
    assert lrs[0] == pytest.approx(0.01) and lrs[20] == pytest.approx(0.01) and lrs[40] == pytest.approx(0.01)
    assert lrs[10] == pytest.approx(0.2) and lrs[30] == pytest.approx(0.2)
    assert lrs[5] == pytest.approx((0.01 + 0.2) / 2)  # linear, not cosine


def test_engine_steps_the_schedule_once_per_optimizer_step(tmp_path, spy):
    summary = run_tiny(tmp_path, "scheduler=onecycle", "memory=accumulate", "trainer.max_steps=12")
    assert summary["techniques"]["scheduler_onecycle"] == "applied"
    lrs = [s.lr for s in spy.steps]
    assert len(lrs) == 12  # 24 micro-batches, 12 optimizer steps, 12 scheduler steps
    peak = max(lrs)
    assert 0.01 * 2 < peak <= 0.01 * 4 + 1e-9  # sgd lr 0.01 x max_lr_factor 4
    assert lrs[0] < peak and lrs[-1] < lrs[0]  # up from peak / 25, down to peak / 25e4
    logged = [r["lr"] for r in metrics_rows(tmp_path) if "lr" in r]
    assert len(set(logged)) == len(logged)  # the logged LR moves too


# -------------------------------------------------------------------------------- 3: LR scaling


@pytest.mark.parametrize("rule, factor", [("none", 1.0), ("linear", 4.0), ("sqrt", 2.0)])
def test_lr_scaling_relative_to_base_batch_size(tmp_path, spy, rule, factor):
    # global batch = micro 16 x accumulate 2 x world 1 = 32 = 4 x base_batch_size 8
    summary = run_tiny(tmp_path, f"optimizer.lr_scaling={rule}", "optimizer.base_batch_size=8", "memory=accumulate")
    assert summary["global_batch_size"] == 32
    assert [s.lr for s in spy.steps] == pytest.approx([0.01 * factor] * 4)
    assert summary["techniques"].get("lr_scaling") == (None if rule == "none" else "applied")


def test_scaled_lr_numbers():
    cfg = compose_cfg("optimizer.lr=0.1", "optimizer.base_batch_size=256", "optimizer.lr_scaling=linear").optimizer
    assert optim.scaled_lr(cfg, 1024) == pytest.approx(0.4)
    assert optim.scaled_lr(cfg, 64) == pytest.approx(0.025)
    cfg.lr_scaling = "sqrt"
    assert optim.scaled_lr(cfg, 1024) == pytest.approx(0.2)
    cfg.base_batch_size = 0
    with pytest.raises(ConfigError, match="optimizer.base_batch_size"):
        optim.scaled_lr(cfg, 64)


# ----------------------------------------------------------------------- 5: optimizers and kernels

OPTIMIZERS = {"sgd": torch.optim.SGD, "adamw": torch.optim.AdamW}


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars", "muon"])
def test_optimizer_choice_is_built_and_trains(tmp_path, spy, name):
    import timm.optim

    expected = {**OPTIMIZERS, "lamb": timm.optim.Lamb, "lars": timm.optim.Lars, "muon": timm.optim.Muon}[name]
    run_tiny(tmp_path, f"optimizer={name}", "trainer.max_steps=2")
    assert type(spy.optimizer) is expected
    assert len(spy.steps) == 2
    after = dict(spy.model.named_parameters())
    assert any(not torch.equal(spy.initial_params[n], after[n]) for n in after)


@pytest.mark.parametrize("name", ["sgd", "adamw", "lamb", "lars", "muon"])
def test_optimizer_state_is_plain_data_that_a_resume_accepts(name):
    """A resume loads the optimizer state's non-tensor items with ``torch.load(weights_only=True)``
    (``checkpoint.SafeLoadPlanner``): the param groups must hold plain values, not the config's ``ListConfig``
    (timm's optimizers keep ``betas`` as given)."""
    import io

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt, _ = optim.build(compose_cfg(f"optimizer={name}").optimizer, model, 64, torch.device("cpu"))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    assert torch.load(buffer, weights_only=True)["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize(
    "name, impl, status, defaults",
    [
        ("sgd", "fused", "applied", {"fused": True}),
        ("sgd", "foreach", "applied", {"foreach": True}),
        ("sgd", "loop", "applied", {"foreach": False}),
        ("adamw", "fused", "applied", {"fused": True}),
        ("adamw", "foreach", "applied", {"foreach": True}),
        ("lamb", "foreach", "applied", {"foreach": True}),
        ("lamb", "fused", "skipped: timm.optim.Lamb has no fused implementation", {}),
        ("lars", "fused", "skipped: timm.optim.Lars has no fused implementation", {}),
        ("lars", "loop", "applied", {"foreach": False}),
        ("muon", "fused", "skipped: timm.optim.Muon has no fused implementation", {}),
        ("muon", "loop", "skipped: timm.optim.Muon has no loop implementation (no foreach argument)", {}),
    ],
)
def test_optimizer_impl_reaches_the_optimizer(name, impl, status, defaults):
    cfg = compose_cfg(f"optimizer={name}", f"optimizer.impl={impl}").optimizer
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # a hidden matrix: optimizer=muon refuses a model without
    opt, techniques = optim.build(cfg, model, 64, torch.device("cpu"))
    assert techniques[f"optimizer_{impl}"].startswith(status)
    for key, value in defaults.items():
        assert opt.defaults[key] is value
    if status.startswith("skipped"):
        assert not opt.defaults.get("fused")


def test_fused_adamw_runs_in_the_engine(tmp_path, spy):
    summary = run_tiny(tmp_path, "optimizer=adamw", "optimizer.impl=fused", "trainer.max_steps=2")
    assert summary["techniques"]["optimizer_fused"] == "applied"
    assert spy.optimizer.defaults["fused"] is True and len(spy.steps) == 2


# --------------------------------------------------------------------------- 11: set_to_none


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_set_to_none(tmp_path, spy, set_to_none):
    summary = run_tiny(tmp_path, f"optimizer.set_to_none={str(set_to_none).lower()}")
    grads = [p.grad for p in spy.model.parameters()]
    if set_to_none:
        assert all(g is None for g in grads)
        assert summary["techniques"]["zero_grad_set_to_none"] == "applied"
    else:
        assert all(g is not None and not g.any() for g in grads)  # zeros written into kept tensors
        assert "zero_grad_set_to_none" not in summary["techniques"]


# --------------------------------------------------------------------------------- 6: cuDNN


def test_cudnn_benchmark_is_skipped_on_cpu(tmp_path):
    summary = run_tiny(tmp_path, "cudnn_benchmark=true")
    assert summary["techniques"]["cudnn_benchmark"].startswith("skipped: ")
    assert torch.backends.cudnn.benchmark is False


@pytest.mark.gpu
@cuda_only
def test_cudnn_benchmark_on_cuda(tmp_path):
    summary = run_tiny(tmp_path, "cudnn_benchmark=true", "trainer.device=cuda")
    assert summary["techniques"]["cudnn_benchmark"] == "applied"
    assert torch.backends.cudnn.benchmark is True
    run_tiny(tmp_path / "off", "trainer.device=cuda")
    assert torch.backends.cudnn.benchmark is False


# ----------------------------------------------------------------- 7: syncs only at log steps


@pytest.mark.parametrize("log_every, rows", [(1, 6), (3, 2), (4, 2)])
def test_log_every_controls_the_host_device_syncs(tmp_path, monkeypatch, log_every, rows):
    syncs = []  # reads of a device value by the engine (not the DataLoader's host-only seed draw)

    def counting(read):
        def counted(self):
            if sys._getframe(1).f_code.co_filename.endswith("runner/engine/train.py"):
                syncs.append(1)
            return read(self)

        return counted

    monkeypatch.setattr(torch.Tensor, "item", counting(torch.Tensor.item))
    monkeypatch.setattr(torch.Tensor, "tolist", counting(torch.Tensor.tolist))
    run_tiny(tmp_path, "trainer.max_steps=6", f"trainer.log_every={log_every}", "trainer.eval_every=100")
    logged = [r for r in metrics_rows(tmp_path) if "loss" in r]
    assert len(logged) == rows  # every log_every steps, plus the last step
    assert len(syncs) == rows  # one read per log row (the loss and the gradient norm at once), none in between
    assert all(r["grad_norm"] > 0 for r in logged)


# -------------------------------------------------------------------- 8: activation checkpointing


def _mnist_cnn(seed=0):
    torch.manual_seed(seed)
    return models.build(compose_cfg().model, {"num_classes": 10}, 3)


def _saved_tensors(model, x) -> tuple[int, dict[str, torch.Tensor]]:
    """Tensors autograd saves for backward (at the outer level) during one forward, and the gradients."""
    count = 0

    def pack(t):
        nonlocal count
        count += 1
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = nn.functional.cross_entropy(model(x), torch.arange(len(x)) % 10)
    loss.backward()
    return count, {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in model.named_parameters()}


def test_checkpointing_saves_fewer_activations_and_keeps_the_gradients():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain, wrapped = _mnist_cnn(), _mnist_cnn()
    status, names, n = prepare.apply_activation_checkpointing(wrapped, None)
    assert (status, names, n) == ("applied", ["ConvBlock"], 2)
    assert all(isinstance(b, CheckpointWrapper) for b in wrapped.features)
    x = torch.randn(8, 3, 16, 16)
    saved_plain, grads_plain = _saved_tensors(plain, x)
    saved_wrapped, grads_wrapped = _saved_tensors(wrapped, x)
    assert saved_wrapped < saved_plain / 2
    assert grads_plain.keys() == grads_wrapped.keys()
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads_wrapped[name], g, msg=name)


def test_checkpointing_in_the_engine_uses_the_non_reentrant_wrapper(tmp_path, spy):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, CheckpointWrapper

    summary = run_tiny(tmp_path, "memory=checkpointing")
    assert summary["techniques"]["activation_checkpointing"] == "applied"
    assert summary["technique_details"]["checkpointed_blocks"] == ["ConvBlock"]
    assert summary["technique_details"]["checkpointed_modules"] == 2
    blocks = list(spy.model.features)
    assert all(isinstance(b, CheckpointWrapper) for b in blocks)
    assert all(b.checkpoint_impl is CheckpointImpl.NO_REENTRANT for b in blocks)
    assert all(b.checkpoint_fn.keywords["use_reentrant"] is False for b in blocks)


def test_checkpoint_modules_picks_block_types():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    resnet = models.build(compose_cfg("model=resnet18").model, {"num_classes": 10}, 3)
    assert prepare.repeated_blocks(resnet) == ["BasicBlock"]
    assert prepare.apply_activation_checkpointing(resnet, None)[1:] == (["BasicBlock"], 8)
    cnn = _mnist_cnn()
    status, names, n = prepare.apply_activation_checkpointing(cnn, ["Conv2d"])
    assert (status, n) == ("applied", 2)
    assert all(isinstance(b[0], CheckpointWrapper) and not isinstance(b, CheckpointWrapper) for b in cnn.features)


def test_unknown_checkpoint_module_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"memory.checkpoint_modules=\['Bottleneck'\].*ConvBlock"):
        run_tiny(tmp_path, "memory=checkpointing", "memory.checkpoint_modules=[Bottleneck]")
    with pytest.raises(ConfigError, match="memory.checkpointing=false"):
        run_tiny(tmp_path, "memory.checkpoint_modules=[ConvBlock]")


# ----------------------------------------------------------------------- 9: gradient accumulation


def test_accumulated_gradients_equal_one_big_batch(tmp_path, spy):
    mlp = ["model._target_=technique_helpers.TinyMLP", "trainer.max_steps=1", "trainer.warmup_steps=0"]
    spy.keep_grads = True
    big = run_tiny(tmp_path / "big", *mlp, "dataloader.batch_size=16")
    accumulated = run_tiny(tmp_path / "acc", *mlp, "dataloader.batch_size=8", "memory.accumulate_steps=2")
    assert isinstance(spy.model, TinyMLP)
    g_big, g_acc = spy.steps[0].grads, spy.steps[1].grads
    assert g_big.keys() == g_acc.keys() and g_big
    for name in g_big:
        torch.testing.assert_close(g_acc[name], g_big[name], atol=1e-6, rtol=1e-5, msg=name)
    assert big["global_batch_size"] == accumulated["global_batch_size"] == 16
    assert (accumulated["micro_batch_size"], accumulated["accumulate_steps"]) == (8, 2)
    assert accumulated["techniques"]["gradient_accumulation"] == "applied"
    assert "gradient_accumulation" not in big["techniques"]


def test_effective_batch_is_reported(tmp_path):
    summary = run_tiny(tmp_path, "memory=accumulate", "memory.accumulate_steps=3", "dataloader.batch_size=8")
    assert summary["global_batch_size"] == 8 * 3 * summary["world_size"] == 24


# -------------------------------------------------------------------------------- 13: debug


def test_anomaly_detection_is_on_during_the_steps_only(tmp_path, spy):
    summary = run_tiny(tmp_path, "debug=anomaly")
    assert summary["techniques"]["anomaly_detection"] == "applied"
    assert spy.train_calls() and all(c.anomaly for c in spy.train_calls())
    assert not torch.is_anomaly_enabled()


def test_anomaly_detection_is_off_by_default(tmp_path, spy):
    run_tiny(tmp_path)
    assert spy.train_calls() and not any(c.anomaly for c in spy.train_calls())


def test_profile_writes_a_trace_into_the_job_folder(tmp_path):
    summary = run_tiny(
        tmp_path, "debug=profile", "debug.profile_wait=1", "debug.profile_warmup=1", "debug.profile_active=2"
    )
    assert summary["techniques"]["profiler"] == "applied"
    traces = list((tmp_path / "profile").glob("*.pt.trace.json*"))
    assert len(traces) == 1  # one window (repeat=1), not one per cycle
    trace = json.loads(traces[0].read_text())
    steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}
    assert any("conv" in e.get("name", "") for e in trace["traceEvents"])


# --------------------------------------------------------------------- 15: no bias before BatchNorm


def test_drop_bias_before_bn_in_the_engine(tmp_path, spy):
    summary = run_tiny(tmp_path, "model.drop_bias_before_bn=true")
    assert summary["techniques"]["drop_bias_before_bn"] == "applied"
    assert summary["technique_details"]["biases_removed"] == 2
    assert [b[0].bias for b in spy.model.features] == [None, None]
    assert spy.model.head.bias is not None  # the classifier feeds no BatchNorm
    assert "features.0.0.bias" not in spy.initial_params  # the optimizer never saw them


def test_drop_bias_keeps_train_mode_outputs():
    model = _mnist_cnn()
    for block in model.features:  # a visible bias, so a wrong removal would change the outputs
        nn.init.uniform_(block[0].bias, 0.5, 1.0)
    fixed = copy.deepcopy(model)
    assert prepare.apply_drop_bias_before_bn(fixed) == ("applied", 2)
    assert sum(p.numel() for p in fixed.parameters()) == sum(p.numel() for p in model.parameters()) - 32 - 64
    x = torch.randn(8, 3, 16, 16)
    torch.testing.assert_close(fixed.train()(x), model.train()(x), atol=1e-5, rtol=1e-4)


def test_drop_bias_skips_an_untraceable_model():
    model = Untraceable()
    status, removed = prepare.apply_drop_bias_before_bn(model)
    assert removed == 0 and model.conv.bias is not None
    assert status.startswith("skipped: torch.fx cannot trace Untraceable (TraceError")


def test_drop_bias_leaves_a_layer_that_also_feeds_something_else():
    model = SharedConv()
    status, removed = prepare.apply_drop_bias_before_bn(model)
    assert (removed, model.conv.bias is not None) == (0, True)
    assert status == "skipped: no conv/linear with a bias feeds a BatchNorm in this model"


# --------------------------------------------------------------------- 16: evaluation without autograd


def test_evaluation_builds_no_autograd_graph(tmp_path, spy):
    summary = run_tiny(tmp_path)
    evals = spy.eval_calls()
    assert evals and summary["eval_accuracy"] is not None
    assert all(c.inference_mode and not c.grad_enabled for c in evals)
    assert not any(c.out_requires_grad or c.out_has_grad_fn for c in evals)
    assert all(c.out_requires_grad and c.out_has_grad_fn for c in spy.train_calls())  # control


# ----------------------------------------------------------------------------- 19: channels_last


@pytest.mark.parametrize("on", [True, False])
def test_channels_last_weights_and_inputs(tmp_path, spy, on):
    summary = run_tiny(tmp_path, f"channels_last={str(on).lower()}")
    assert spy.calls and all(c.x_channels_last is on and c.weights_channels_last is on for c in spy.calls)
    assert summary["techniques"].get("channels_last") == ("applied" if on else None)


def test_channels_last_skips_a_model_without_convolutions():
    assert prepare.apply_channels_last(TinyMLP()).startswith("skipped: ")


# ---------------------------------------------------------------------------------- 18: compile


@pytest.mark.slow
def test_compile_reduce_overhead_on_cpu_compiles_without_cuda_graphs(tmp_path, spy):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    spy.hook = False  # keep the compiled graph free of test hooks
    summary = run_tiny(
        tmp_path,
        "compile=reduce-overhead",
        "model._target_=technique_helpers.TinyMLP",
        "trainer.max_steps=2",
        "trainer.eval_max_batches=1",
    )
    assert summary["techniques"]["compile"] == "applied"
    assert summary["techniques"]["cuda_graphs"].startswith("skipped: CUDA graphs need a CUDA device")
    assert spy.model._compiled_call_impl is not None  # nn.Module.compile, in place
    assert counters["stats"]["unique_graphs"] >= 1 and counters["aot_autograd"]["ok"] >= 1
    assert summary["steps"] == 2 and math.isfinite(summary["train_loss"])
    torch._dynamo.reset()


@pytest.mark.slow  # two compiles of the optimizer step (~13 s on 2 cores)
def test_the_compiled_optimizer_step_follows_the_eager_one_and_the_schedule_recompiles_nothing(tmp_path):
    """``compile.optimizer=true``: AdamW's step under torch.compile, its LR a tensor the cosine schedule fills in place:
    the same losses and LRs as eager, and one graph for 8 steps of changing LR (a float LR recompiles every step)."""
    runs = {}
    for name, extra in (("eager", []), ("compiled", ["compile.optimizer=true"])):
        s = train(
            compose_cfg(
                "optimizer=adamw",
                "scheduler=cosine",
                "scheduler.warmup_steps=2",
                "trainer.max_steps=8",
                "trainer.log_every=1",
                *extra,
            ),
            job_dir=tmp_path / name,
        )
        runs[name] = (s, [(r["loss"], r["lr"]) for r in metrics_rows(tmp_path / name) if "loss" in r])
    assert runs["compiled"][0]["techniques"]["compiled_optimizer_step"] == "applied"
    for (a, lr_a), (b, lr_b) in zip(runs["eager"][1], runs["compiled"][1]):
        assert b == pytest.approx(a, rel=1e-4) and lr_b == pytest.approx(lr_a)
    assert runs["compiled"][0]["one_time"]["graphs_compiled"] <= 2, runs["compiled"][0]["one_time"]


def test_bad_compile_mode_is_a_config_error():
    cfg = compose_cfg("compile=default").compile
    cfg.mode = "fastest"
    with pytest.raises(ConfigError, match="compile.mode"):
        prepare.apply_compile(nn.Linear(2, 2), cfg, torch.device("cpu"))


def compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None  # nn.Module.compile, in place


def test_regional_compile_compiles_each_block_and_not_the_model():
    from runner.models.gpt import GPT

    gpt = GPT(32, block_size=16, n_layer=3, n_head=2, n_embd=32)
    cfg = compose_cfg("compile=default", "compile.regional=true").compile
    status, details = prepare.apply_compile(gpt, cfg, torch.device("cpu"))
    assert status == {"compile": "applied", "compile_regional": "applied"}
    assert details == {"compiled_blocks": 3, "compiled_block_class": ["Block"]}
    assert all(compiled(b) for b in gpt.transformer.h) and not compiled(gpt)
    assert not any(compiled(m) for m in gpt.modules() if type(m).__name__ != "Block")  # the head, embeddings: eager
    resnet = models.build(compose_cfg("model=resnet18").model, {"num_classes": 10}, 3)
    status, details = prepare.apply_compile(resnet, cfg, torch.device("cpu"))
    assert details["compiled_blocks"] == 8 and details["compiled_block_class"] == ["BasicBlock"]
    assert all(compiled(b) for layer in (resnet.layer1, resnet.layer2, resnet.layer3, resnet.layer4) for b in layer)
    assert not compiled(resnet) and not compiled(resnet.layer1)
    whole, _ = prepare.apply_compile(
        nn.Sequential(nn.Linear(2, 2)), compose_cfg("compile=default").compile, torch.device("cpu")
    )
    assert whole == {"compile": "applied"}  # compile.regional is off by default


def test_regional_compile_wraps_checkpointed_blocks_and_falls_back_to_the_whole_model():
    from runner.models.gpt import GPT

    gpt = GPT(32, block_size=16, n_layer=2, n_head=2, n_embd=32)
    prepare.apply_activation_checkpointing(gpt, None)
    cfg = compose_cfg("compile=default", "compile.regional=true").compile
    _, details = prepare.apply_compile(gpt, cfg, torch.device("cpu"))
    assert details["compiled_blocks"] == 2  # the wrappers, so the recomputation is compiled too
    assert all(compiled(w) and type(w).__name__ == "CheckpointWrapper" for w in gpt.transformer.h)
    assert not any(compiled(w._checkpoint_wrapped_module) for w in gpt.transformer.h)
    mlp = TinyMLP()
    status, details = prepare.apply_compile(mlp, cfg, torch.device("cpu"))
    assert status["compile_regional"].startswith("skipped: the model has no repeated blocks") and details == {}
    assert compiled(mlp)


@pytest.mark.slow
def test_regional_compile_traces_the_block_once_and_trains(tmp_path, tiny_text, spy):
    from torch._dynamo.utils import counters

    from conftest import TINY_GPT

    torch._dynamo.reset()
    counters.clear()
    spy.hook = False  # keep the compiled graphs free of test hooks
    summary = run_tiny(
        tmp_path,
        *TINY_GPT,
        f"data.path={tiny_text}",
        "model.n_layer=3",
        "compile=default",
        "compile.regional=true",
        "trainer.max_steps=2",
        "trainer.eval_max_batches=1",
        "task.sample_tokens=0",
    )
    assert summary["techniques"]["compile_regional"] == "applied" and summary["steps"] == 2
    assert summary["technique_details"]["compiled_blocks"] == 3 and math.isfinite(summary["train_loss"])
    # three blocks of one class: one graph for training (their parameters are inputs), one more for evaluation
    assert 1 <= counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
    torch._dynamo.reset()


@pytest.mark.gpu
@cuda_only
def test_compile_reduce_overhead_uses_cuda_graphs_on_cuda(tmp_path):
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    summary = run_tiny(tmp_path, "compile=reduce-overhead", "trainer.device=cuda", "trainer.max_steps=6")
    assert summary["techniques"]["compile"] == "applied"
    assert summary["techniques"]["cuda_graphs"] == "applied"
    assert counters["inductor"]["cudagraph_skips"] == 0
    torch._dynamo.reset()


# ------------------------------------------------------------------------------- all together


def test_switches_combine(tmp_path, spy, monkeypatch):
    monkeypatch.setattr(hardware, "cpu_has_native_bf16", lambda: True)
    summary = run_tiny(
        tmp_path,
        "scheduler=onecycle",
        "dataloader=device",
        "data.augment=true",
        "data.normalize=true",
        "optimizer=adamw",
        "optimizer.impl=foreach",
        "optimizer.lr_scaling=sqrt",
        "optimizer.set_to_none=true",
        "optimizer.clip_grad_norm=1.0",
        "precision=amp",
        "memory=checkpointing",
        "memory.accumulate_steps=2",
        "model.drop_bias_before_bn=true",
        "channels_last=true",
        "debug=anomaly",
        "trainer.max_steps=3",
    )
    applied = {k for k, v in summary["techniques"].items() if v == "applied"}
    assert applied == {
        "scheduler_onecycle",
        "on_device_data",
        "normalize",
        "optimizer_foreach",
        "lr_scaling",
        "zero_grad_set_to_none",
        "clip_grad_norm",
        "amp",
        "activation_checkpointing",
        "gradient_accumulation",
        "drop_bias_before_bn",
        "channels_last",
        "anomaly_detection",
        *ONE_THREAD,
    }
    assert len(spy.steps) == 3 and math.isfinite(summary["train_loss"])
    assert all(c.out_dtype == torch.bfloat16 and c.x_channels_last for c in spy.calls)
    details = {k: v for k, v in summary["technique_details"].items() if k != "host_allocator"}  # the machine's
    said = details.pop("precision", None)  # amp on a CPU with native bf16 says it is bf16 autocast (else skipped)
    assert said is None or said.startswith("precision=amp on a CPU: bf16 autocast"), said
    assert details == {"biases_removed": 2, "checkpointed_blocks": ["ConvBlock"], "checkpointed_modules": 2}
