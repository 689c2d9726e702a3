# Sourced by the time-boxed GPU sweep scripts (gpu_t1_tune.sh, gpu_t1_bulk.sh), after `set -uo pipefail`:
# - OUT (default ./gpu_out, created), py (default python3), parts (a scratch folder for per-stage JSON);
# - `start_log NAME`: from then on everything goes to the terminal and to $OUT/NAME, which starts with the GPU and
#   the commit;
# - `run NAME SECONDS CMD...`: one stage under `timeout` (a hung kernel costs that stage, not the device budget),
#   its start logged and a failure remembered in $status, so that the later stages still run and the script's exit
#   status says whether any failed.
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
py=${PYTHON:-python3}
parts=$(mktemp -d)
status=0

start_log() {  # start_log NAME: tee everything to $OUT/NAME, which starts with the GPU and the commit
  exec > >(tee -a "$OUT/$1") 2>&1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv,noheader || true
  git log -1 --format='commit %H %s' 2>/dev/null || true
}

run() {  # run NAME SECONDS CMD...: time-boxed, remember a failure, keep going
  local name=$1 limit=$2; shift 2
  echo "=== $name (t=${SECONDS}s, limit ${limit}s): $*"
  timeout "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (rc=$rc)"; status=1; }
}
