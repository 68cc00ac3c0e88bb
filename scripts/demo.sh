#!/usr/bin/env bash
# The default training run: prepares the English text of the `fortunes` package (installed by
# scripts/setup.sh) into SentencePiece BPE token shards once, then trains configs/fortunes.json
# on them (CPU when there is no GPU). Extra arguments go to `moe-train train`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-build/moe-train}
DATA=${DATA:-data/fortunes}
CORPUS=/usr/share/games/fortunes
[ -x "$BIN" ] || { echo "demo.sh: $BIN not found; run scripts/build.sh first" >&2; exit 2; }
if [ ! -f "$DATA/train_000000.bin" ]; then
  mapfile -t files < <(find "$CORPUS" -maxdepth 1 -type f ! -name '*.dat' ! -name '*.u8' | sort)
  [ "${#files[@]}" -gt 0 ] || { echo "demo.sh: no text in $CORPUS (apt-get install fortunes)" >&2; exit 2; }
  "$BIN" prepare --input "${files[@]}" --tokenizer spm --vocab-size 2000 --out "$DATA"
fi
exec "$BIN" train --config configs/fortunes.json "$@"
