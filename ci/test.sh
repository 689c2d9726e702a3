#!/usr/bin/env bash
# The README's test command, and all that .ci/run does: installs nox if it is missing, then runs `nox`, whose
# default sessions (noxfile.py: nox.options.sessions) are exactly what CI runs. Arguments go to nox, e.g.
#   bash ci/test.sh -s core        one session
#   bash ci/test.sh -s gpu         on a GPU host
# CPU sessions pin torch to the CPU build in ci/constraints-cpu.txt; see the README.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}

if ! "$python" -m nox --version >/dev/null 2>&1; then
  echo "ci/test.sh: nox is missing; installing it with pip"
  "$python" -m pip install --quiet nox || exit 1
fi

rm -rf .nox/junit
"$python" -m nox "$@"
status=$?

# One closing line over every pytest run of the sessions above (their JUnit files in .nox/junit/).
"$python" -c "import noxfile; print(noxfile.junit_summary())"
exit $status
