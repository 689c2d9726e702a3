#!/usr/bin/env bash
# The README's test command, and all that .ci/run does: installs nox if it is missing, then runs nox's default
# sessions (noxfile.py: nox.options.sessions), which are exactly what CI runs. Without arguments the compile checks
# (noxfile.CONCURRENT_SESSION, one worker per core) run beside the other sessions (one core each, one after the
# other), their log printed when they end; with arguments, they go to one nox, e.g.
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
if [ $# -gt 0 ]; then
  "$python" -m nox "$@"
  status=$?
else
  read -r side rest < <("$python" -c "import noxfile as n; s = n.nox.options.sessions; \
print(n.CONCURRENT_SESSION, ' '.join(x for x in s if x != n.CONCURRENT_SESSION))")
  mkdir -p .nox
  log=.nox/$side.log
  echo "ci/test.sh: session $side runs beside the others (its log, $log, is printed when it ends)"
  "$python" -m nox -s "$side" >"$log" 2>&1 &
  side_pid=$!
  # shellcheck disable=SC2086  # one word per session name
  "$python" -m nox -s $rest
  status=$?
  wait "$side_pid"
  side_status=$?
  cat "$log"
  echo "ci/test.sh: sessions $rest: exit $status; session $side: exit $side_status"
  [ "$side_status" -eq 0 ] || status=$side_status
fi

# One closing line over every pytest run of the sessions above (their JUnit files in .nox/junit/).
"$python" -c "import noxfile; print(noxfile.junit_summary())"
exit $status
