#!/usr/bin/env bash
# The README's first command: sets up .venv with the three kda packages and runs the main job (the demo).
# Arguments go to the demo, e.g. `bash ci/quickstart.sh --steps 20 --state-dtype fp32`.
#
# torch: a CUDA build of torch already in the system Python is reused (the venv sees system site packages);
# on a machine with an NVIDIA driver pip brings the index's (CUDA) torch; anywhere else the CPU build is pinned
# through ci/constraints-cpu.txt, so a CPU machine never downloads a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

venv_args=()
constraints=()
if "$python" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" >/dev/null 2>&1; then
  echo "quickstart: reusing the system's CUDA torch"
  venv_args=(--system-site-packages)
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
  echo "quickstart: NVIDIA driver found; pip installs a CUDA build of torch"
else
  echo "quickstart: no CUDA torch and no NVIDIA driver; pinning the CPU build of torch (ci/constraints-cpu.txt)"
  constraints=(-c ci/constraints-cpu.txt)
fi

if [ ! -x .venv/bin/python ]; then
  "$python" -m venv "${venv_args[@]}" .venv
fi
.venv/bin/python -m pip install --quiet "${constraints[@]}" \
  ./packages/kda-core ./packages/kda-cute "./packages/kda-recurrent[cute]"
.venv/bin/python -m pip list 2>/dev/null | grep -iE "^(kda-|torch |nvidia-cutlass-dsl )" || true
echo "quickstart: running the main job: .venv/bin/python -m kda_recurrent.demo $*"
exec .venv/bin/python -m kda_recurrent.demo "$@"
