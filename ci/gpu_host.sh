#!/usr/bin/env bash
# The eager host path on the GPU host, repeated (the host's noise moves one run by up to 1.5x): HOST_RUNS (default 3)
# separate processes each of the T=1 benchmark's eager figure at B=1 (packed entry, output given; FLA's eager call in
# the first run) and the facade benchmark's overhead part (facade call, full and hot-path validation, routing), then
# one host profile (`profile_t1_host.py`: the split into validation, launch glue and the compiled call).
# Targets: packed entry <= 12 us (issue 3), facade <= 15 us and routing <= 2 us (issue 4).
# Run from the repository root after `source .gpu*/setup.sh`. Output: $OUT/host.log, $OUT/host_runs.json (one record
# a run and figure), $OUT/t1_host_profile.json; default OUT=./gpu_out. Stages are time-boxed; the exit status says
# whether any failed.
set -uo pipefail
source "$(dirname "$0")/timebox.sh"  # OUT, py, parts, start_log, run NAME SECONDS CMD..., $status
start_log host.log

for i in $(seq 1 "${HOST_RUNS:-3}"); do
  fla=$([ "$i" -eq 1 ] || echo --no-fla)
  run "t1_eager_$i" 90 "$py" benchmarks/bench_packed_kda_decode.py --mode cuda_graph --batch-size 1 \
      --eager-calls 2000 ${fla:+--no-fla} --json "$parts/t1_$i.json"
  mkdir -p "$parts/facade_$i"
  run "facade_$i" 90 "$py" benchmarks/bench_recurrent_kda.py --parts overhead $fla --out-dir "$parts/facade_$i"
done
run profile 90 "$py" benchmarks/profile_t1_host.py --json "$OUT/t1_host_profile.json"

"$py" - "$parts" "$OUT/host_runs.json" <<'PY'
import glob, json, os, sys
parts, dest = sys.argv[1], sys.argv[2]
rows = []
for path in sorted(glob.glob(os.path.join(parts, "t1_*.json"))):
    for r in json.load(open(path)):
        rows.append(dict(run=path, figure="t1_packed_eager_us", value=r.get("ours_eager_call_us"),
                         fla_eager_us=r.get("fla_eager_call_us"), gpu=r.get("gpu")))
for path in sorted(glob.glob(os.path.join(parts, "facade_*", "*.json"))):
    for r in json.load(open(path)):
        if r.get("part") == "overhead":
            for key in ("facade_us", "validate_us", "revalidate_us", "route_us", "t1_launch_us", "fla_eager_us"):
                if key in r:
                    rows.append(dict(run=path, figure=key, value=r[key]))
json.dump(rows, open(dest, "w"), indent=1)
for figure in dict.fromkeys(r["figure"] for r in rows):
    values = [r["value"] for r in rows if r["figure"] == figure and r["value"] is not None]
    print(f"{figure:20s} " + " ".join(f"{v:6.2f}" for v in values))
print(f"wrote {dest}: {len(rows)} records")
PY
exit $status
