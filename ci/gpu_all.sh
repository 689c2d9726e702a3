#!/usr/bin/env bash
# Every package's GPU script in one go, for a rationed GPU host: each part under its own time limit, results
# collected in one archive ($OUT/<tag>.tgz, a folder per part) so the host's 8-file return limit never bites.
# Run from the repository root after `source .gpu*/setup.sh`.
#   bash ci/gpu_all.sh TAG PART...     PART in: core t1 generic ucache recurrent host
# Stage choice per part (the tuning sweeps are left out; they have their own scripts):
#   core: tests + validation bench; t1: tests, memcheck, bench; generic: tests, memcheck, quick bench;
#   ucache: tests, main bench (T=8, w16); recurrent: tests, bench; host: the eager host path, 3 runs.
set -uo pipefail
tag=$1; shift
OUT=${OUT:-$PWD/gpu_out}
res=$(mktemp -d)
declare -A limit=([core]=60 [t1]=150 [generic]=120 [ucache]=180 [recurrent]=150 [host]=240)
summary=()
for part in "$@"; do
  dir="$res/$part"; mkdir -p "$dir"
  t0=$SECONDS
  case $part in
    core) OUT=$dir timeout "${limit[core]}" bash ci/gpu_core.sh ;;
    t1) OUT=$dir T1_STAGES="tests memcheck bench" timeout "${limit[t1]}" bash ci/gpu_t1.sh ;;
    generic) OUT=$dir GENERIC_STAGES="tests memcheck bench" GENERIC_BENCH=quick timeout "${limit[generic]}" bash ci/gpu_generic.sh ;;
    ucache) OUT=$dir UCACHE_STAGES="tests bench" timeout "${limit[ucache]}" bash ci/gpu_ucache.sh ;;
    recurrent) OUT=$dir timeout "${limit[recurrent]}" bash ci/gpu_recurrent.sh ;;
    host) OUT=$dir timeout "${limit[host]}" bash ci/gpu_host.sh ;;
    *) echo "unknown part $part"; false ;;
  esac > "$dir/stdout" 2>&1
  rc=$?
  summary+=("$part rc=$rc $((SECONDS - t0))s")
  echo "=== $part rc=$rc ($((SECONDS - t0)) s)"; grep -E "passed|failed|FAILED|ERROR SUMMARY|error" "$dir/stdout" | tail -6
done
mkdir -p "$OUT"; tar czf "$OUT/$tag.tgz" -C "$res" .
printf '%s\n' "${summary[@]}"
