#!/usr/bin/env bash
# Build a retrieval index over a corpus with the model's tokenizer, show what it holds, query it.
# Pass the index to generate/rewrite/serve with --index OUT_DIR to draft from the corpus.
#
#   examples/build_index.sh [CORPUS] [OUT_DIR] [TOKENIZER]    # from the repository root
#   QUERY="Receiving block" examples/build_index.sh ../shared/data/loghub/HDFS_2k.log
set -euo pipefail
CORPUS="${1:-../shared/data/loghub}"
OUT="${2:-indexes/loghub}"
TOKENIZER="${3:-builtin}"
QUERY="${QUERY:-Receiving block blk_}"

python -m lookupdec index build "$CORPUS" --include '*.log' --tokenizer "$TOKENIZER" --out "$OUT" --force
python -m lookupdec index info "$OUT"
python -m lookupdec index query "$OUT" --text "$QUERY" --k 3
