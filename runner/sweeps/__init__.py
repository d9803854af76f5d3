"""The sweep tools Hydra loads: the interleaved launcher (``hydra/launcher=interleaved``) and the ablation on it."""
