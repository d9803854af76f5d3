"""The engine: ``train`` a config: ``build`` every part (runner/engine/build.py), ``fit`` (the one training loop),
``summarize``.

    parts, state = build(cfg, env, job_dir)   # task, data, model + its techniques, optimizer, ... ; TrainState
    fit(state, parts, profiler)               # the loop: changes nothing but ``state`` (and the model/optimizer)
    summary = summarize(state, parts)         # summary.json

The loop never names a loss or a metric: it asks the task. A tool drives it only through ``Parts``: the tracker
(each log row), ``stop`` (end after a logged step), ``gate`` (a comparison's pauses between slices); ``batches``
is the stream of micro-batches it draws from.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf

from runner import checkpoint, distributed, launch, measure, models
from runner.checkpoint import resume
from runner.engine import bad_data, evaluation, jobdir, loop_guards as guards, slice_gate
from runner.engine.build import Parts, agree, build, checkpoint_state
from runner.engine.state import TrainState
from runner.engine.validate import validate
from runner.errors import EXIT_PREEMPTED, ConfigError, Preempted, TrainingDiverged
from runner.measure import hardware, machine_load
from runner.techniques import compile_cache, debug, parallel, prepare
from runner.track import git_sha, job_folder, sweep_group


def train(
    cfg: DictConfig,
    job_dir: Path | None = None,
    gate: slice_gate.SliceGate | None = None,
    on_evaluation: Callable[[dict, int, int, int | None], str | None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` and return the summary written to ``<job_dir>/summary.json``.

    ``job_dir`` defaults to the Hydra job's folder. ``gate``: the pause point of an interleaved comparison
    (runner/engine/slice_gate.py; the comparison's job process passes it), None for every other run.
    ``on_evaluation(metrics, step, global samples, ends)``: asked on rank 0 after each evaluation, its answer (a
    reason) ends the run there (``stopped_early``; a recipe search's pruner: runner/sweeps/pruning.py); ``ends`` is
    None, or, at the evaluation that met the targets of ``trainer.stop_at_target``, the global samples the run
    would have trained to (its answer is then ignored). Raises
    ``ConfigError`` for bad input, before any result file is written.
    """
    validate(cfg)
    env = distributed.setup(cfg.distributed, cfg.trainer.device)
    locked = False
    try:
        job_dir = job_dir or job_folder()
        locked = agree(lambda: jobdir.claim(job_dir, cfg), env)  # one run per folder (jobdir.py), paths checked
        if sweep_group() is not None:  # a sweep rerun into its folder: a job that finished there is skipped
            resolved = OmegaConf.to_container(cfg, resolve=True)
            done = agree(lambda: resume.finished_job(job_dir, resolved), env)
            if done is not None:
                if env.is_main:
                    print(f"{job_dir}: finished already (summary.json, step {done.get('steps')}); skipped", flush=True)
                return done
        parts, state = build(cfg, env, job_dir, gate)
        parts.on_evaluation = on_evaluation
        try:
            with debug.build(cfg.debug, parts.job_dir, env.device) as (profiler, status), parts.preemption:
                parts.techniques |= status
                with prepare.deterministic_or_refused(cfg.trainer.deterministic):
                    fit(state, parts, profiler)
            if parts.at_end:  # the weights first: a final checkpoint that fails (a full disk) does not lose them
                checkpoint.save_weights(parts.model, parts.job_dir / "model.safetensors", env.is_main)
                if parts.ema is not None:
                    with parts.ema.swapped():
                        checkpoint.save_weights(parts.model, parts.job_dir / "model_ema.safetensors", env.is_main)
            try:
                if parts.at_end:
                    save_checkpoint(state, parts)
                elif parts.compile_store is not None:
                    parts.compile_store.save()
                parts.checkpointer.finish()
            except ConfigError as e:
                raise ConfigError(
                    f"{e}"
                    + (f". The trained weights are in {parts.job_dir / 'model.safetensors'}" if parts.at_end else "")
                ) from e
            parts.task.finish(parts.model, parts.data, parts.job_dir, env, cfg.trainer.seed)
        except Preempted:
            parts.checkpointer.finish()
            parts.tracker.abort(exit_code=EXIT_PREEMPTED)
            raise
        except KeyboardInterrupt:  # a second Ctrl-C: stopped by the user, not failed (MLflow: KILLED)
            parts.tracker.abort(exit_code=130)
            raise
        except BaseException:
            parts.tracker.abort(exit_code=1)
            raise
        finally:
            parts.data.train.close()  # the loaders' worker processes end with the run, however it ends
            parts.data.eval.close()
        summary = summarize(state, parts)
        if env.is_main:
            launch.forget_elastic_pointer()  # finished: no restart will look for this job folder again
        return summary
    finally:
        jobdir.release(job_dir, taken=locked)  # a lock this call took (a no-op on ranks > 0: not theirs)
        distributed.teardown()


def save_checkpoint(state: TrainState, parts: Parts) -> None:
    """Write the checkpoint of ``state.step`` (every rank; outside the timed steps and ``train_time_s``)."""
    p = parts
    p.meter.flush()  # pending timing marks become figures of the state being saved
    parallel.sync_ddp_buffers(p.model, p.env)  # one copy of a replicated buffer is kept: make it rank 0's
    meta = {
        "config": p.resolved,
        "world_size": p.env.world_size,
        "wandb_run_id": p.tracker.wandb_run_id,
        "mlflow_run_id": p.tracker.mlflow_run_id,
        "time": time.time(),
        "epoch": state.epoch,
        "batch_in_epoch": state.batch_in_epoch,
        **({"vocab": p.data.vocab} if p.data.vocab is not None else {}),
    }
    before = p.checkpointer.time_s
    p.checkpointer.save(checkpoint_state(state, parts), state.step, meta)
    state.checkpoint_time_s += p.checkpointer.time_s - before
    if p.compile_store is not None:  # beside the checkpoint: a resume on any node compiles from it (compile_cache.py)
        p.compile_store.save()


def fit(state: TrainState, parts: Parts, profiler) -> None:
    """The training loop: from ``state.step`` to ``plan.total_steps`` optimizer steps.

    One optimizer step = ``plan.accumulate`` micro-batches (forward under autocast, scaled backward;
    DDP/FSDP reduce gradients on the last one only), clipping, the optimizer and LR-schedule steps. Every
    ``log_every`` steps the loss is read (the interval's only host-device sync) and the meter flushed;
    every ``eval_every`` steps (and at the last) the task evaluates, outside the timed steps.
    """
    p, plan = parts, parts.plan
    if state.pending_eval == state.step and state.step:  # a signal cut this step's evaluation short: redo it
        evaluation.evaluate(state, parts)
    stream = batches(p.data.train, state)
    segment_start = time.perf_counter()
    while state.step < plan.total_steps and state.stopped_early is None:
        if p.gate is not None and p.gate.due(state.step):  # interleaved: a slice ended; wait, untimed, for the next
            state.train_time_s += measure.wall_clock(p.env.device) - segment_start
            p.meter.pause()
            if p.compile_store is not None:  # what it compiled so far, for the comparison's jobs still to start
                p.compile_store.save()
            if not p.gate.wait(state.step, state.train_time_s, plan.global_batch, p.env):
                plan.total_steps = state.step + 1  # finish: one last step, then the final log and evaluation
            p.meter.resume()
            segment_start = time.perf_counter()
        try:  # free on the happy path; bad data or a bad model output is diagnosed only once it failed
            for micro in range(plan.accumulate):
                p.meter.start_fetch()
                batch = next(stream)
                p.meter.batch_ready()
                with parallel.no_sync(p.model, last=micro == plan.accumulate - 1), p.amp.autocast():
                    loss = p.task.loss(p.model, batch) / plan.accumulate
                p.amp.scaler.scale(loss).backward()
                state.loss_sum += loss.detach()  # stays on the device: no sync
        except (IndexError, TypeError, ValueError, RuntimeError, OSError, AttributeError) as e:
            found = (
                None
                if isinstance(e, ConfigError)
                else bad_data.diagnose(
                    e, state.step + 1, state.batch_in_epoch, state.epoch, p.data.train, p.data.item, p.data.num_classes
                )
            )
            if found is None:
                raise
            raise found from e
        logging = (state.step + 1) % plan.log_every == 0 or state.step + 1 == plan.total_steps
        norm = p.clip(p.optimizer, logging)  # the norm before clipping: on the device, read at the log step
        if logging:
            state.grad_norm = norm
        if plan.skip_nonfinite and not guards.finite_gradients(p.model):  # one sync per step, only when asked for
            state.skipped_steps += 1
            state.interval_skipped += 1
        else:
            p.amp.scaler.step(p.optimizer)
            p.amp.scaler.update()
        p.optimizer.zero_grad(set_to_none=plan.set_to_none)
        lr = float(p.scheduler.get_last_lr()[0])  # the LR this step used (a float, or compile.optimizer's CPU tensor)
        p.scheduler.step()
        profiler.step()
        state.step += 1
        state.interval_steps += 1
        if p.ema is not None:
            p.ema.update(state.step)
        last = state.step == plan.total_steps
        if state.step % plan.log_every == 0 or last:
            p.meter.log_started()
            log(state, parts, lr)
            p.meter.log_done()
            if p.stop is not None and (why := p.stop(state)) is not None:  # a tool's own end (the LR range test)
                state.stopped_early = why
        p.meter.end_step()  # after logging, so the cost of the sync above is part of the step
        evaluating = state.step % plan.eval_every == 0 or last
        save, stop = guards.checkpoint_due(state, parts, logged=state.step % plan.log_every == 0 or last)
        if evaluating or save or stop:
            state.train_time_s += measure.wall_clock(p.env.device) - segment_start  # queued kernels count as training
            p.meter.pause()  # the machine-load window covers training only
            if evaluating:
                stop = not evaluation.evaluate(state, parts) or stop  # False: a signal cut it short (one process)
                last = last or state.stopped_early is not None
            if stop or (save and not (last and p.at_end)):  # the end-of-run checkpoint follows the loop
                save_checkpoint(state, parts)
            if stop:
                guards.stop_for_signal(state, parts, launch.discover().launcher)
            p.meter.resume()
            segment_start = time.perf_counter()
    state.train_time_s += time.perf_counter() - segment_start
    p.meter.pause()


def batches(loader, state: TrainState):
    """Yield micro-batches forever, epoch after epoch (reshuffled by ``set_epoch``), keeping
    ``state.epoch`` and ``state.batch_in_epoch`` current. A resumed state starts ``batch_in_epoch`` batches
    into its epoch, so it sees exactly the batches the interrupted run had left."""
    while True:
        loader.set_epoch(state.epoch, skip=state.batch_in_epoch)
        for batch in loader:
            state.batch_in_epoch += 1
            yield batch
        state.epoch += 1
        state.batch_in_epoch = 0


def log(state: TrainState, parts: Parts, lr: float) -> None:
    """One ``metrics.jsonl`` row: the global batch's mean loss over the interval (one ``.item()``), the LR,
    the meter's interval figures and peak memory."""
    distributed.all_reduce_mean(state.loss_sum, parts.env)  # the global batch's loss, not rank 0's share
    read = [state.loss_sum] + ([state.grad_norm.detach().float()] if state.grad_norm is not None else [])
    values = torch.stack(read).tolist()  # host-device sync, only at log steps: loss and gradient norm at once
    state.train_loss = values[0] / state.interval_steps
    grad_norm = values[1] if len(values) > 1 else None
    state.loss_sum.zero_()
    state.grad_norm = None
    if parts.plan.skip_nonfinite:
        guards.check_skipped(state, parts, state.interval_skipped, state.interval_steps)
    state.interval_steps = state.interval_skipped = 0
    if not math.isfinite(state.train_loss):
        if not parts.plan.skip_nonfinite:
            raise TrainingDiverged(guards.diverged_message(state, parts))
    else:
        state.last_finite = (state.step, state.train_loss)
    parts.tracker.log(
        {
            "step": state.step,
            "epoch": state.epoch,
            "loss": state.train_loss,
            "lr": lr,
            **({"grad_norm": grad_norm} if grad_norm is not None else {}),
            **parts.meter.flush(),
            "peak_memory_mb": measure.peak_memory_mb(parts.env.device),
        }
    )


def one_time_costs(parts: Parts, figures: dict[str, Any]) -> dict[str, Any]:
    """This process's one-time costs, in seconds (rank 0's): ``startup_s`` (runner's import to the first step:
    imports, data, model, checkpoint), ``warmup_s`` (the warm-up steps' wall time) and ``warmup_excess_s`` (its excess
    over as many steady steps: compilation, autotuning, allocator growth), ``compile_s`` and ``graphs_compiled``
    (torch.compile's own wall time and graphs, recompiles included), ``graph_breaks`` (dynamo's, with a note when
    there are any), ``compile_cache`` (compile_cache.load),
    ``first_eval_s`` and ``job_s`` (runner's import to this summary)."""
    import runner

    m, median = parts.meter, figures["step_time_ms_median"]
    compiled = parts.compile_store is not None
    (s0, g0, b0), (s1, g1, b1) = parts.compiled_before, compile_cache.compiled_so_far() if compiled else (0.0, 0, 0)
    excess = m.warmup_s - min(m.warmup_steps, m.step) * median / 1e3 if m.warmup_s is not None and median else None
    if b1 > b0 and parts.env.is_main:
        print(
            f"note: torch.compile broke the graph {b1 - b0} time(s), each break a piece run eager between compiled "
            f"ones ({'; '.join(compile_cache.graph_break_reasons())}); TORCH_LOGS=graph_breaks shows where",
            flush=True,
        )
    return {
        "startup_s": m.first_step_at - runner.STARTED_S if m.first_step_at else None,
        "warmup_s": m.warmup_s,
        "warmup_excess_s": excess,
        "compile_s": s1 - s0 if compiled else None,
        "graphs_compiled": g1 - g0 if compiled else None,
        "graph_breaks": b1 - b0 if compiled else None,
        "compile_cache": parts.compile_cache,
        "first_eval_s": m.first_eval_s,
        "job_s": time.perf_counter() - runner.STARTED_S,
    }


def summarize(state: TrainState, parts: Parts) -> dict[str, Any]:
    """The run's figures (``summary.json``), global over the ranks; written by rank 0's tracker."""
    p, plan, env, t = parts, parts.plan, parts.env, parts.cfg.trainer
    p.meter.flush()
    figures = distributed.reduce_figures(p.meter.totals(), measure.peak_memory_mb(env.device), env)
    peak = hardware.peak_flops(env.device, p.amp.mfu_dtype, t.peak_tflops)  # fp8: its fp8 peak
    flops, sps = p.flops_per_sample, figures["samples_per_sec"]
    workers = p.cfg.dataloader.num_workers if p.data.techniques.get("num_workers") == "applied" else 0
    load = p.meter.machine_load(torch.get_num_threads(), workers)  # rank 0's machine: summary.json is rank 0's
    probe = p.meter.gpu_probe
    achieved = flops * sps if flops and sps else None
    throughput: dict[str, Any] = {"samples_per_sec": sps}
    tokens = p.task.tokens_per_sample(p.data)
    if tokens is not None:  # the task counts tokens: throughput and FLOPs in its unit too
        throughput |= {
            "tokens_per_sec": sps * tokens if sps else None,
            "tokens_per_sample": tokens,
            "flops_per_token": flops / tokens if flops else None,
        }
    summary = {
        **throughput,
        "step_time_ms_median": figures["step_time_ms_median"],
        "step_time_ms_p90": figures["step_time_ms_p90"],
        "data_wait_fraction": figures["data_wait_fraction"],
        "peak_memory_mb": figures["peak_memory_mb"],
        "memory_limit_mb": hardware.memory_limit_mb(env.device),
        "flops_per_sample": flops,
        "achieved_tflops": achieved / 1e12 if achieved else None,
        "mfu": achieved / peak if achieved and peak else None,
        "peak_tflops": peak / 1e12 if peak else None,  # the peak MFU divides by (trainer.peak_tflops, or the device's)
        # what the speed doctor (runner/doctor/) reads besides the figures above
        "log_time_fraction": figures["log_time_fraction"],  # measured time spent logging (loss read, metrics row)
        "host_syncs_per_step": 1 / plan.log_every + (1 if plan.skip_nonfinite else 0),  # the loop's own
        "gpu_idle_fraction": probe.idle_fraction if probe else None,  # GPU idle between kernels (warm-up window)
        "gpu_profile": probe.note if probe else ("CPU run: no GPU" if env.device.type != "cuda" else "off"),
        "train_loss": state.train_loss,
        **state.eval,
        "time_to_target_s": state.time_to_target_s,
        "steps_to_target": state.steps_to_target,  # the step of the first evaluation meeting the targets, or null
        "samples_to_target": state.samples_to_target,  # global samples by then (step x global batch), or null
        "train_time_s": state.train_time_s,
        "eval_time_s": state.eval_time_s,
        "checkpoint_time_s": state.checkpoint_time_s,
        "one_time": one_time_costs(parts, figures),  # what the job pays once, beside the steady figures above
        "restarts": state.restarts,
        "restart_lost_time_s": state.restart_lost_time_s,
        "skipped_steps": state.skipped_steps,
        "steps": state.step,
        "total_steps": plan.total_steps,  # the optimizer steps the run was configured for
        "stopped_early": state.stopped_early,  # why early stopping or stop_at_target ended the run, or null
        "best": {**p.best.as_dict(), "metric": p.best.metric, "weights": "best/model.safetensors"} if p.best else None,
        "weights_sha256": checkpoint.weights_sha256(p.job_dir, p.at_end, p.ema, p.best) if env.is_main else None,
        "ema_update_ms": p.details["ema"]["update_ms"] if p.ema is not None else None,
        "deterministic": t.deterministic,
        "warmup_steps": min(t.warmup_steps, state.step),
        "measured_steps": figures["measured_steps"],
        "measured_time_s": figures["measured_time_s"],  # samples_per_sec = global batch x measured_steps / this
        "measurement": figures["measurement"],  # what the speed figures cover, or why they are null
        "machine_load": load,  # how busy the machine was during the measured steps (machine_load.LoadWindow.record)
        "warnings": machine_load.load_warnings(load, env.device.type),  # why the figures cannot be trusted, if so
        "global_batch_size": plan.global_batch,
        "micro_batch_size": plan.micro_batch,
        "accumulate_steps": plan.accumulate,
        "world_size": env.world_size,
        "nodes": env.nodes,
        "parameters": parallel.parameter_report(p.model, env),  # per-rank checksums: replicas must agree
        "scaling_efficiency": (
            sps / (t.reference_samples_per_sec * env.world_size) if t.reference_samples_per_sec and sps else None
        ),
        "device": env.device.type,
        "device_name": hardware.device_name(env.device),
        "torch_version": torch.__version__,
        "git_sha": git_sha(),
        "techniques": p.techniques,
        "technique_details": p.details,
        "model_details": models.model_report(parallel.unwrap(p.model), p.cfg.model)[1],  # weights, frozen, trainable
        "config": p.resolved,
    }
    p.tracker.finish(summary)
    return summary
