#!/usr/bin/env bash
# The README's main job: set up, export the built-in model's LoRA training step to a .pte, show what
# was lowered, then train it on the Vulkan device (printing the loss per step) and write the adapters.
#   scripts/demo.sh [MODEL] [STEPS]      defaults: tiny-llama, 40 steps; outputs go to out/
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
model="${1:-tiny-llama}"
steps="${2:-40}"
alpha=16
scripts/setup.sh
.venv/bin/python -m vktrain.runtime_shaders.build >/dev/null
mkdir -p out
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore::FutureWarning}"  # torch.export's deprecation chatter

echo "== export: $model training step (q4gsw base + LoRA rank 8, alpha $alpha) -> out/$model.pte"
.venv/bin/vktrain export --model "$model" --lora-rank 8 --lora-alpha "$alpha" --batch 4 --seq 64 --out "out/$model.pte"
.venv/bin/vktrain inspect "out/$model.pte" | head -n 25

echo "== train: $steps steps on the Vulkan device, built-in corpus"
.venv/bin/vktrain train "out/$model.pte" --steps "$steps" --lr 3e-3 --warmup 4 --schedule cosine \
  --checkpoint "out/$model.ckpt.safetensors" --checkpoint-every 10 --json "out/$model.losses.json" \
  --plot "out/$model.loss.png" --out-adapters "out/$model.adapters" --lora-alpha "$alpha" --no-progress
