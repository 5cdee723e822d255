#!/usr/bin/env bash
# A short GPU job in one command: each stage runs under `timeout` with its own budget and
# writes its own file under OUT as it goes, so a stage that fails or runs out of time is
# recorded and the next one runs; the table of the stages comes last.
#
#   bash experiments/gpu_check.sh OUT --data_dir data   # on a GPU, 420 s at most
#   bash experiments/gpu_check.sh OUT --dry-run         # the same stages on the CPU, tiny
#
# OUT gets 7 files: summary.txt (the versions, then the table), device_tests.txt,
# reproduce.txt (with its train.py consoles), its check file, bench_<card>.txt (the length
# stage's and its CSVs after the bench's) and .json, and recall.txt (each epoch's test
# accuracy, then the summary rows of the runs it finished). PYTHON replaces python3;
# GPU_CHECK_FAIL=STAGE makes that stage `false`.
# data/ is ignored by git: a copy of the working tree must carry its four files.
set -u
shopt -s nullglob  # (a pattern that matches no file: no word)
PY=${PYTHON:-python3}
# s: a stage is killed 5 s after its TERM; the device runs a command 600 s, and lends
# 15 minutes in all: with its start and idle wait, room to run this twice
TOTAL=420
DATA="train.bin val.bin meta.json tokenizer.tiktoken"  # prepare_data.py's (not raw/)
# the dry run's check: reproduce.py's, of a tiny me, any gap passing (not Table 1's)
TINY="--n_layer=1 --block_size=16 --n_embd=16 --n_hidden=32 --batch_size=4 --n_head=4"
DRY_CHECK='import sys; sys.path.insert(0, "experiments"); import reproduce
reproduce.RUNS = {"me": reproduce.RUNS["me"] + sys.argv[1].split()}
reproduce.TOLERANCE = float("inf")
sys.exit(reproduce.main(sys.argv[2:]))'
VERSIONS='import platform, torch
from importlib.metadata import version
print("python", platform.python_version(), end=" ")
print(*(f"{p} {version(p)}" for p in "torch numpy matplotlib tiktoken pytest".split()))
print("CUDA", torch.version.cuda, "cuDNN", torch.backends.cudnn.version())
for i in range(torch.cuda.device_count()):
    print(torch.cuda.get_device_properties(i))'

die() { echo "error: $*" >&2; exit 1; }
usage="usage: bash experiments/gpu_check.sh OUT [--dry-run] [--data_dir DIR]"
out="" dry="" data=data
while (($#)); do
  case $1 in
    --dry-run) dry=1 ;;
    --data_dir) data=${2-}; shift ;;
    --data_dir=*) data=${1#*=} ;;
    -*) die "unknown option $1; $usage" ;;
    *) [ -z "$out" ] || die "one OUT folder, got $out and $1; $usage"; out=$1 ;;
  esac
  shift
done
[ -n "$out" ] || die "pass OUT, the folder for what it measures; $usage"
for f in train.bin val.bin meta.json; do  # the check's (the tokenizer: sample.py's)
  [ -f "$data/$f" ] || die "no $data/$f: data/ is not in git, so its four files ($DATA;" \
    "20 MB, not raw/) must travel with the tree, or pass --data_dir DIR"
done
if [ -e "$out" ] && [ -n "$(ls -A "$out")" ]; then  # (of a file: its name)
  die "$out is not an empty folder: pass a new one"
fi
out=$(realpath -m "$out") data=$(realpath -m "$data")
cd "$(dirname "$0")/.." || exit 1
dev=cpu card=cpu quick=(--quick) check=(-c "$DRY_CHECK" "$TINY" --device=cpu)
recall=(--quick)
if [ -z "$dry" ]; then
  # the card's name, last; or why not, the last line of the error
  name=$(timeout 60 "$PY" -c 'import torch; print(torch.cuda.get_device_name(0))' 2>&1) ||
    die "no CUDA device here ($(tail -1 <<<"$name")): pass --dry-run to try it on the CPU"
  card=$(tail -1 <<<"$name" | tr 'A-Z' 'a-z' | grep -o '[a-z]*[0-9][a-z0-9]*' | head -1)
  dev=cuda card=${card:-gpu} quick=() check=(experiments/reproduce.py)
  # recall at l = 512 (N = 64) and d = 128, where Zoology's gated convolutions fail
  recall=(--widths=128 --lengths=512 --epochs=6)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$out" "$tmp/csv" "$tmp/results" || exit 1
ln -s "$PWD/results/logs" "$tmp/results/logs"  # the check's: the committed CPU runs

rows=() failed=0
stage() {  # NAME BUDGET FILE COMMAND...: COMMAND's output appended to OUT/FILE
  local name=$1 budget=$2 file=$out/$3 start=$SECONDS status code
  shift 3
  [ "${GPU_CHECK_FAIL-}" != "$name" ] || set -- false
  local limit=$((TOTAL - SECONDS < budget ? TOTAL - SECONDS : budget))
  ((limit > 0)) || limit=1  # (timeout 0 would wait for ever)
  echo "[$(date +%T)] $name: into $file, $limit s at most"
  echo "\$$(printf ' %q' "$@")" >>"$file"
  timeout -k 5 "$limit" "$@" >>"$file" 2>&1
  code=$?
  case $code in
    0) status=ok ;;
    124 | 137) status="timed out ($limit s)" ;;
    *) status="failed (exit $code)" ;;
  esac
  [ $code = 0 ] || failed=1
  rows+=("$(printf '%-13s %-18s %7d' "$name" "$status" $((SECONDS - start)))")
  echo "[$(date +%T)] $name: $status"
}

export PY VERSIONS PYTHONUNBUFFERED=1  # (each line in its file at once)
stage versions 25 summary.txt bash -c '"$PY" -c "$VERSIONS" &&
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; fi'
stage device_tests 60 device_tests.txt env TEST_DEVICE="$dev" \
  "$PY" -m pytest tests.py -m device -q -p no:cacheprovider
stage check 110 reproduce.txt "$PY" "${check[@]}" --check --data_dir="$data" \
  --work="$tmp/work" --results="$tmp/results"
cp "$tmp"/results/gpu/check*.txt "$out"/ 2>/dev/null
for c in "$tmp"/work/check/*/console.txt; do  # how each run computed, or why not
  printf '\n--- %s\n%s\n' "${c#"$tmp"/}" "$(cat "$c")" >>"$out/reproduce.txt"
done
bench=("$PY" experiments/bench.py --device="$dev" "${quick[@]}")
stage bench 100 "bench_$card.txt" "${bench[@]}" --json="$out/bench_$card.json"
stage length 70 "bench_$card.txt" "${bench[@]}" --sections=length,generate \
  --mixers=sa,she,he,we,me --csv="$tmp/csv"
stage recall 55 recall.txt "$PY" experiments/recall.py --mixers=sa,he "${recall[@]}" \
  --device="$dev" --out="$tmp/recall"
cat "$tmp/recall/summary.csv" >>"$out/recall.txt" 2>/dev/null  # the runs it finished
# a new stage goes here: stage NAME BUDGET FILE COMMAND..., its budget taken from
# those above (they sum to TOTAL)
for f in "$tmp"/csv/*.csv; do  # 7 files at most (the device returns 8)
  if (($(ls "$out" | wc -l) < 7)); then
    cp "$f" "$out"/
  else
    printf '\n--- %s\n%s\n' "${f##*/}" "$(cat "$f")" >>"$out/bench_$card.txt"
  fi
done
printf 'stage         status             seconds\n%s\n' "$(printf '%s\n' "${rows[@]}")" |
  tee -a "$out/summary.txt"
exit $failed
