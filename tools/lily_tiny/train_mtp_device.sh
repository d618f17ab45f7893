#!/usr/bin/env bash
# Train lily-tiny's MTP head on the lent GPU machine (one H200), from the repository root, with
# .tiny_work/data (train.npy, heldout.npy made with the shipped tokenizer) and .tiny_work/wheels
# (transformers 5.24.0 and regex for Python 3.12: the image has transformers 5.17) carried.
# Writes mtp.safetensors, mtp_log.json and train_mtp.log into $OUT (default .tiny_work/mtp_out).
# Extra arguments go to train_mtp.py (e.g. --steps N to repeat a run's step count).
#
#   bash tools/lily_tiny/train_mtp_device.sh
set -euo pipefail
OUT="${OUT:-.tiny_work/mtp_out}"
mkdir -p "$OUT"
for f in .tiny_work/data/train.npy .tiny_work/data/heldout.npy; do
  [ -f "$f" ] || { echo "missing $f (carry .tiny_work/data)" >&2; exit 1; }
done
# --no-deps: the image's torch, numpy, safetensors, tokenizers and huggingface-hub satisfy transformers 5.24
# (the lily-tiny training run used the same two wheels).
shopt -s nullglob
wheels=(.tiny_work/wheels/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install --quiet --no-index --no-deps --target /tmp/site "${wheels[@]}"
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -u tools/lily_tiny/train_mtp.py --data-dir .tiny_work/data --out-dir "$OUT" "$@" 2>&1 | tee "$OUT/train_mtp.log"
ls -l "$OUT"
