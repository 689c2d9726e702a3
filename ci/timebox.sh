# Sourced by the time-boxed GPU sweep scripts (gpu_t1_tune.sh, gpu_t1_bulk.sh): `run NAME SECONDS CMD...` runs one
# stage under `timeout` (a hung kernel costs that stage, not the device budget), logs its start and remembers a
# failure in $status so that the later stages still run and the script's exit status says whether any failed.
status=0

run() {  # run NAME SECONDS CMD...: time-boxed, remember a failure, keep going
  local name=$1 limit=$2; shift 2
  echo "=== $name (t=${SECONDS}s, limit ${limit}s): $*"
  timeout "$limit" "$@"
  local rc=$?
  [ "$rc" -eq 0 ] || { echo "=== $name FAILED (rc=$rc)"; status=1; }
}
