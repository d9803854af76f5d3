"""The engine end to end on a tiny synthetic job, in process."""

from conftest import compose_cfg
from runner.engine.train import train

SUMMARY_KEYS = {
    "samples_per_sec",
    "step_time_ms_median",
    "step_time_ms_p90",
    "data_wait_fraction",
    "peak_memory_mb",
    "flops_per_sample",
    "mfu",
    "train_loss",
    "eval_accuracy",
    "time_to_target_s",
    "steps",
    "warmup_steps",
    "global_batch_size",
    "world_size",
    "device",
    "device_name",
    "torch_version",
    "git_sha",
    "techniques",
    "config",
}


def test_tiny_job_writes_summary_with_every_key(tmp_path):
    summary = train(compose_cfg(), job_dir=tmp_path)
    assert SUMMARY_KEYS <= summary.keys()
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "metrics.jsonl").is_file()
    assert summary["steps"] == 4 and summary["warmup_steps"] == 1
    assert summary["samples_per_sec"] > 0 and summary["flops_per_sample"] > 0
    assert summary["global_batch_size"] == 16
