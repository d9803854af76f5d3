"""How far apart can two validation losses of the *same* trained GPT be, by the way they are estimated?

runner evaluates a language model on every window that tiles the validation split (the same windows each
time). nanoGPT's ``estimate_loss`` averages ``eval_iters`` random batches instead (its CPU Shakespeare recipe:
``--eval_iters=20``, batches of 12 x 64 characters), one draw per evaluation. This script loads a finished
``model=gpt data=text`` job folder (``model.safetensors``, ``vocab.json``, ``.hydra/config.yaml``), computes
the tiled loss, then draws nanoGPT's estimate ``--draws`` times from the same weights and prints the spread:

    python scripts/gpt_eval_noise.py outputs/gpt-cpu/recipe
    python scripts/gpt_eval_noise.py outputs/gpt-cpu/recipe --eval-iters 200 --target 1.88

The draws use nanoGPT's sampler (``torch.randint(len(val) - block_size, (batch_size,))``) with seed 0.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from safetensors.torch import load_file
from torch.utils.data import DataLoader, default_collate

from runner import models
from runner.data import text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("job", type=Path, help="a finished job folder of model=gpt data=text")
    ap.add_argument("--eval-iters", type=int, default=20, help="random batches per estimate (nanoGPT's CPU recipe: 20)")
    ap.add_argument("--draws", type=int, default=300, help="estimates drawn from the same weights")
    ap.add_argument("--target", type=float, default=1.88, help="report how often an estimate is at or below it")
    args = ap.parse_args()

    cfg = OmegaConf.load(args.job / ".hydra" / "config.yaml")
    if not str(cfg.model.get("_target_", "")).endswith("GPT") or cfg.data.get("name") != "text":
        raise SystemExit(f"{args.job} is not a model=gpt data=text job")
    vocab = json.loads((args.job / "vocab.json").read_text(encoding="utf-8"))
    tokens, corpus_vocab = text.read_corpus(cfg.data.path)
    if corpus_vocab != vocab:
        raise SystemExit(f"{cfg.data.path} no longer has the vocabulary of {args.job}/vocab.json")
    block, batch = cfg.data.block_size, cfg.dataloader.batch_size
    _, val = text.split(tokens, block, cfg.data.path)
    model = models.build(cfg.model, {"vocab_size": len(vocab)})  # the job's model, as the engine built it
    model.load_state_dict(load_file(str(args.job / "model.safetensors")))
    model.eval()

    @torch.no_grad()
    def loss_of(x: torch.Tensor, y: torch.Tensor) -> float:
        return F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()

    tiles = text.TokenWindows(val, block, stride=block)  # runner's evaluation: windows that tile the split once
    tiled = sum(loss_of(x, y) * len(x) for x, y in DataLoader(tiles, batch_size=batch)) / len(tiles)
    windows = text.TokenWindows(val, block)  # every start position, the ones nanoGPT's sampler draws from

    def estimate() -> float:
        batches = (default_collate([windows[i] for i in torch.randint(len(windows), (batch,)).tolist()])
                   for _ in range(args.eval_iters))
        return sum(loss_of(x, y) for x, y in batches) / args.eval_iters

    torch.manual_seed(0)
    draws = torch.tensor([estimate() for _ in range(args.draws)])
    q = torch.quantile(draws, torch.tensor([0.025, 0.5, 0.975])).tolist()
    print(f"runner's tiled validation loss: {tiled:.4f} ({len(tiles)} windows of {block})")
    print(f"nanoGPT's estimate ({args.eval_iters} random batches of {batch} x {block}), {args.draws} draws: "
          f"mean {draws.mean():.4f}, sd {draws.std():.4f}, median {q[1]:.4f}, 95 % of draws in {q[0]:.4f}-{q[2]:.4f}; "
          f"at or below {args.target}: {(draws <= args.target).float().mean():.1%} of draws")


if __name__ == "__main__":
    main()
