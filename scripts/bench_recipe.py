"""The README's GPU recipe, measured: held-out loss AND task accuracy along one `vktrain train` run.

Three steps, because the GPU machine has no torch export (the accuracy needs the program's model in torch):

    # 1. here: the recipe's .pte (README "A longer run on a GPU")
    vktrain export --model smollm2-135m-instruct --lora-rank 16 --lora-alpha 32 --batch 16 --seq 256 --out big.pte
    # 2. on the GPU machine: the run, a checkpoint every 50 steps kept, and the adapters of the chosen ones
    python3 scripts/bench_recipe.py train big.pte --steps 600 --out-dir OUT
    python3 scripts/bench_recipe.py adapters CK.safetensors... --out-dir OUT   # fp32, split in halves (<= 16 MiB)
    # 3. here: greedy answers to every held-out chat by the .pte's own model (vktrain.generate.program_model, the
    #    model `vktrain eval --generate` exports its decode program from) in torch eager, scored as eval --generate
    #    scores them (exact match; last number within rounding), one JSON + a plot of loss and accuracy by step
    python3 scripts/bench_recipe.py score big.pte OUT --out bench/results/recipe_h100_smollm2-135m-instruct.json

Greedy: argmax, the lowest id on ties, at most --max-new-tokens, stopping at the tokenizer's EOS.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "vktrain" / "data"


def cmd_train(args) -> None:
    """The README recipe's `vktrain train`, with an eval every --eval-every and a checkpoint every 50 kept."""
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ck = Path(args.checkpoint_dir)
    ck.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "vktrain.cli", "train", args.pte,
               "--data", str(DATA / "unit_conversions.train.jsonl"),
               "--eval-data", str(DATA / "unit_conversions.heldout.jsonl"),
               "--steps", str(args.steps), "--lr", str(args.lr), "--warmup", str(args.warmup),
               "--eval-every", str(args.eval_every), "--keep-best", "--checkpoint", str(ck / "big.ckpt.safetensors"),
               "--checkpoint-every", "50", "--keep-checkpoints", str(args.steps // 50 + 1),
               "--json", str(out / "recipe_train.json"), "--plot", str(out / "recipe_loss.png"),
               "--no-progress", "--log-every", "50", "--overwrite"]
    subprocess.run(command, check=True)


def cmd_adapters(args) -> None:
    """The LoRA tensors (model.*lora_A/B) of each checkpoint as two fp32 .npz halves: lora_<tag>_{0,1}.npz."""
    from vktrain.train.checkpoint import load_checkpoint

    for path in args.checkpoints:
        checkpoint = load_checkpoint(path)
        lora = {k: v for k, v in checkpoint.tensors.items() if k.startswith("model.") and k.endswith(("lora_A", "lora_B"))}
        keys = sorted(lora)
        for half, part in enumerate((keys[:len(keys) // 2], keys[len(keys) // 2:])):
            np.savez(Path(args.out_dir) / f"lora_step{checkpoint.step}_{half}.npz", **{k: lora[k] for k in part})
        print(f"{path}: step {checkpoint.step}, {len(keys)} LoRA tensors")


def greedy_answers(model, tokenizer, prompts, max_new_tokens: int) -> list[str]:
    import torch

    answers = []
    with torch.no_grad():
        for prompt in prompts:
            ids, new = list(prompt), []
            for _ in range(max_new_tokens):
                token = int(torch.argmax(model(torch.tensor([ids]))[0, -1]))  # argmax: the lowest id on ties
                if token == tokenizer.eos_token_id:
                    break
                ids.append(token)
                new.append(token)
            answers.append(tokenizer.decode(new, skip_special_tokens=True).strip())
    return answers


def cmd_score(args) -> None:
    import torch

    from vktrain.generate.program_model import model_from_program
    from vktrain.generate.task_accuracy import accuracy, read_chats, score
    from vktrain.serialization.pte import PteFile
    from vktrain.serialization.tokenizer import ModelTokenizer

    pte = PteFile.from_bytes(Path(args.pte).read_bytes(), source=args.pte)
    tokenizer = ModelTokenizer.from_named_data(pte.named_data, args.pte)
    chats = read_chats(DATA / "unit_conversions.heldout.jsonl")
    prompts = [tokenizer.encode(tokenizer.render_chat(c.prompt, add_generation_prompt=True), False) for c in chats]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    steps = sorted({int(m.group(1)) for f in glob.glob(str(Path(args.run_dir) / "lora_step*_0.npz"))
                    if (m := re.search(r"lora_step(\d+)_0", f))})
    scored = []
    for step in steps:
        lora = {}
        for half in (0, 1):
            lora.update(dict(np.load(Path(args.run_dir) / f"lora_step{step}_{half}.npz")))
        answers = greedy_answers(model_from_program(args.pte, lora).eval(), tokenizer, prompts, args.max_new_tokens)
        results = [{"answer": a, "reference": c.reference, **score(a, c.reference)} for a, c in zip(answers, chats)]
        scored.append({"step": step, **accuracy(results), "answers": [r["answer"] for r in results]})
        print(f"step {step}: exact match {scored[-1]['exact_match']:.3f}, number {scored[-1]['number_accuracy']:.3f}",
              flush=True)
    records = json.loads((Path(args.run_dir) / "recipe_train.json").read_text())
    result = {"meta": {"script": "scripts/bench_recipe.py", "pte": Path(args.pte).name, "note": args.note,
                       "max_new_tokens": args.max_new_tokens, "examples": len(chats)},
              "eval_loss": [{"step": r["step"], "eval_loss": r["eval_loss"]} for r in records if "eval_loss" in r],
              "accuracy": scored}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out} and its .png")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    losses = result["eval_loss"]
    ax.plot([r["step"] for r in losses], [r["eval_loss"] for r in losses], "o--", color="tab:red", label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out loss", color="tab:red")
    right = ax.twinx()
    accuracy = result["accuracy"]
    right.plot([r["step"] for r in accuracy], [r["exact_match"] for r in accuracy], "s-", color="tab:green",
               label="exact match")
    right.set_ylabel("held-out exact match (48 chats)", color="tab:green")
    right.set_ylim(0, 1)

    ax.set_title("the README's GPU recipe: held-out loss and task accuracy by step", fontsize=10)
    fig.legend(loc="center right", bbox_to_anchor=(0.86, 0.5))
    fig.tight_layout()
    fig.savefig(path)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="on the GPU machine: the recipe's run with checkpoints kept")
    train.add_argument("pte")
    train.add_argument("--steps", type=int, default=600)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--warmup", type=int, default=20)
    train.add_argument("--eval-every", type=int, default=25)
    train.add_argument("--out-dir", required=True)
    train.add_argument("--checkpoint-dir", default="/tmp/recipe_checkpoints")
    adapters = sub.add_parser("adapters", help="the LoRA tensors of checkpoints, as .npz halves")
    adapters.add_argument("checkpoints", nargs="+")
    adapters.add_argument("--out-dir", required=True)
    scoring = sub.add_parser("score", help="here: accuracy by step with the program's model in torch eager")
    scoring.add_argument("pte")
    scoring.add_argument("run_dir", help="the folder with recipe_train.json and the lora_step*_{0,1}.npz")
    scoring.add_argument("--out", required=True)
    scoring.add_argument("--max-new-tokens", type=int, default=32)
    scoring.add_argument("--note", default="")
    args = parser.parse_args(argv)
    {"train": cmd_train, "adapters": cmd_adapters, "score": cmd_score}[args.command](args)


if __name__ == "__main__":
    main()
