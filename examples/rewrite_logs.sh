#!/usr/bin/env bash
# Rewrite real log lines (loghub) as JSON lines with `lookupdec rewrite`: one log line per record,
# one JSON line per record in OUT ({"id", "input_hash", "output", "finish_reason", "stats"}).
# Resumable: run it again after an interruption and it does only what is left.
#
#   examples/rewrite_logs.sh [MODEL] [OUT.jsonl]          # from the repository root (MODEL: smollm2)
#   LIMIT=8 MAX_NEW_TOKENS=32 INDEX=indexes/loghub examples/rewrite_logs.sh
#
# LOGS: the loghub folder (its *_2k.log files are read); LIMIT: the first N records only;
# INDEX: a folder from examples/build_index.sh, to draft from the corpus as well; CHAT: --chat
# (default: prompts in the chat template, for instruction models) or empty for raw prompts.
set -euo pipefail
MODEL="${1:-smollm2}"
OUT="${2:-logs.jsonl}"
LOGS="${LOGS:-../shared/data/loghub}"

python -m lookupdec rewrite --model "$MODEL" --input "$LOGS"/*_2k.log --output "$OUT" \
    --instruction "Rewrite this log line as one JSON object with its fields (date, time, level, component, content)." \
    --split lines --lines-per-record 1 --limit "${LIMIT:-40}" --max-new-tokens "${MAX_NEW_TOKENS:-128}" \
    --stop $'\n' ${INDEX:+--index "$INDEX"} ${CHAT---chat}
head -n 2 "$OUT"
