"""Sessions of the kda monorepo. A plain `nox` runs exactly what CI runs (`bash ci/test.sh`, `.ci/run`).

CPU sessions (CI): lint, core, cute, recurrent, integration, compile, demo.
GPU-host sessions (never in CI; a user with a GPU runs them): gpu, sanitize, bench.

Every CPU session installs with `-c ci/constraints-cpu.txt`, which pins the CPU build of torch that pip finds on
disk, so no session ever pulls a multi-GB CUDA build.

The GPU-host sessions install nothing and need nothing outside this repository: they run in the Python that runs
nox (`venv_backend="none"`), with the host's own packages (a CUDA build of torch, nvidia-cutlass-dsl,
apache-tvm-ffi, pytest, hypothesis; fla-core for the FLA comparisons, compute-sanitizer from the CUDA toolkit for
`sanitize`), and take the kda packages from the repository's sources (`PYTHONPATH=packages/*/src`), so they work on
a GPU host without a package index. Each is a few plain commands, run the same way without nox, from the
repository root:

    export PYTHONPATH=$PWD/packages/kda-core/src:$PWD/packages/kda-cute/src:$PWD/packages/kda-recurrent/src
    # nox -s gpu: every package's GPU-marked tests (`nox -s gpu -- --jobs 8`: in 8 processes at once)
    python -m pytest -m gpu packages/kda-core/tests
    python -m pytest -m gpu packages/kda-cute/tests
    python -m pytest -m gpu packages/kda-recurrent/tests
    # nox -s sanitize: compute-sanitizer memcheck, then racecheck, over the device fuzz tests and the ucache tests
    # that reach its bounds paths (UCACHE_SANITIZE below) and the T=1 kernel's malformed-offsets tests
    for tool in memcheck racecheck; do
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 KDA_FUZZ_CASES=2 compute-sanitizer --tool $tool --report-api-errors no \
          --error-exitcode 1 python -m pytest -q -m "gpu and fuzz" packages/kda-cute/tests
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 \
          python -m pytest -q -m gpu packages/kda-cute/tests/test_ucache.py -k "<UCACHE_SANITIZE>"
      PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 1 \
          python -m pytest -q -m gpu packages/kda-cute/tests/test_decode_t1.py -k "<DECODE_T1_SANITIZE>"
    done
    # nox -s bench: every benchmarks/bench_*.py with its defaults, rewriting benchmarks/baselines/<gpu>/
    python benchmarks/run_all.py

Each pytest run writes a JUnit file under .nox/junit/; `ci/test.sh` prints their totals (`junit_summary`). A test
folder that holds test files but collects nothing (pytest exit 5) fails its session; one with no test file says so.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PACKAGES = ROOT / "packages"
CONSTRAINTS = ROOT / "ci" / "constraints-cpu.txt"
JUNIT_DIR = ROOT / ".nox" / "junit"
CUTE_TESTS = PACKAGES / "kda-cute" / "tests"
COMPILE_ARCHS = ("sm_90a", "sm_100a")
RUFF = "ruff==0.17.6"  # the version the tree was last linted with; a newer ruff may add rules
GPU_MARKER = "gpu: needs a CUDA GPU; skips cleanly without one"
PACKAGE_NAMES = ("kda-core", "kda-cute", "kda-recurrent")
# The GPU-host sessions' environment: the repository's sources first on the path, nothing installed.
GPU_HOST_ENV = {
    "PYTHONPATH": os.pathsep.join([*(str(PACKAGES / name / "src") for name in PACKAGE_NAMES),
                                   *filter(None, [os.environ.get("PYTHONPATH")])]),
}
HOST_PYTEST = (sys.executable, "-m", "pytest")
SANITIZER_TOOLS = ("memcheck", "racecheck")
# kda-cute's ucache GPU tests that reach the kernel's bounds paths (10 tests): out-of-range and inactive slots, a
# padded pool, a misaligned pool, T=4 with w_ring 32, the softplus gate with strong decay, the 4-CTA build, the
# cursor restart, one test each, and the null-policy test's two out_of_range cases, which the first term also selects.
UCACHE_SANITIZE = (
    "out_of_range or only_inactive or padded_pool or misaligned_pool_takes or (w_ring_32 and 4-128) "
    "or (strong_decay and 128) or (four_resident_ctas and mixed-T8) or restart_hist"
)
# kda-cute's T=1 tests of the `[1, N] + cu_seqlens` form on malformed offsets (4 tests: tile 16 and the ring,
# int32 and int64 offsets), the serving call whose offsets are device data bounded in the kernel.
DECODE_T1_SANITIZE = "varlen_malformed_offsets"

nox.options.sessions = ["lint", "core", "cute", "recurrent", "integration", "compile", "demo"]
# ci/test.sh runs this one beside the others (it takes every core; the others one), not after them.
CONCURRENT_SESSION = "compile"
nox.options.default_venv_backend = "venv"
nox.options.error_on_external_run = True


# pip byte-compiles every file it installs (torch: thousands never imported), 45-50 s of each session's install on
# CI's 2-core machine; imports then write the bytecode of what they load, once per session venv (the environment
# may forbid that with PYTHONDONTWRITEBYTECODE, which would make every process parse torch's sources again: 12 s
# against 5 per import). Measured on the development machine: install 82 -> 35 s, first import 12 s, later 4.5 s.
BYTECODE_ON = {"PYTHONDONTWRITEBYTECODE": ""}


def _install_cpu(session: nox.Session, *requirements: str) -> None:
    session.install("--no-compile", "-c", str(CONSTRAINTS), *requirements)
    session.env.update(BYTECODE_ON)


def _package(name: str, extras: str = "") -> str:
    return f"{PACKAGES / name}{extras}"


def _test_files(targets: list[Path]) -> list[Path]:
    found = set()
    for target in targets:
        if target.is_file():
            found.add(target)
        elif target.is_dir():
            found.update([*target.rglob("test_*.py"), *target.rglob("*_test.py")])
    return sorted(found)


def _junit_counts(paths) -> dict[str, int]:
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for path in paths:
        root = ET.parse(path).getroot()
        for suite in [root] if root.tag == "testsuite" else root.iter("testsuite"):
            for key in counts:
                counts[key] += int(suite.get(key, 0))
    return counts


def junit_summary() -> str:
    """One closing line over every pytest run of the last `nox` (ci/test.sh prints it)."""
    counts = _junit_counts(sorted(JUNIT_DIR.glob("*.xml")))
    failed = counts["failures"] + counts["errors"]
    passed = counts["tests"] - failed - counts["skipped"]
    return f"tests: {passed} passed, {failed} failed, {counts['skipped']} skipped"


def _pytest(
    session: nox.Session,
    target: Path | list[Path],
    *args: str,
    label: str,
    env: dict | None = None,
    allow_empty: bool = False,
    runner: tuple[str, ...] = ("pytest",),
) -> int:
    """Run pytest on a test folder (or files); return how many tests it collected and ran (passed, failed, skipped).

    Exit 5 (nothing collected) is accepted from pytest only to be judged here: a folder without test files is
    reported as "no tests yet"; test files that collect nothing fail the session, unless ``allow_empty`` (a
    marker filter such as ``-m gpu`` may leave one package with nothing to run). ``runner`` is the command that
    runs pytest: the session's own ``pytest``, or the host's (``HOST_PYTEST``), under compute-sanitizer for one.
    """
    targets = target if isinstance(target, list) else [target]
    rel = [str(path.relative_to(ROOT)) for path in targets]
    if not _test_files(targets):
        session.log(f"{' '.join(rel)}: no tests yet (no test_*.py file); nothing to run")
        return 0
    JUNIT_DIR.mkdir(parents=True, exist_ok=True)
    junit = JUNIT_DIR / f"{label}.xml"
    junit.unlink(missing_ok=True)
    options = [f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    if targets == [ROOT / "tests"]:  # the top-level folder has no pyproject of its own to configure pytest
        options += ["--import-mode=importlib", "-o", f"markers={GPU_MARKER}"]
    session.run(*runner, *rel, *options, *args, *session.posargs, env=env, success_codes=[0, 5])
    ran = _junit_counts([junit])["tests"] if junit.exists() else 0
    if ran == 0 and not allow_empty:
        session.error(f"{' '.join(rel)}: holds test files but pytest collected no test (exit 5); see above")
    return ran


def _compile_tests() -> list[Path]:
    """kda-cute's CPU compile checks (test_compile.py, test_ucache_compile.py, ...): the `compile` session's."""
    return sorted(CUTE_TESTS.glob("test*compile*.py"))


def _package_tests(session: nox.Session, name: str, *args: str, label: str, allow_empty: bool = False,
                   **run: object) -> int:
    tests = PACKAGES / name / "tests"
    ignore = [f"--ignore={path.relative_to(ROOT)}" for path in _compile_tests() if path.is_relative_to(tests)]
    return _pytest(session, tests, *ignore, *args, label=label, allow_empty=allow_empty, **run)


def _pytest_logged(label: str, python: str, args: list[str], env: dict) -> tuple[str, int, int, Path]:
    """One pytest process (`python -m pytest` with `args`) from the repository root, its JUnit file and its output
    in .nox/junit/<label>.{xml,log}: (label, exit code, tests run, log path)."""
    junit = JUNIT_DIR / f"{label}.xml"
    junit.unlink(missing_ok=True)
    log = JUNIT_DIR / f"{label}.log"
    cmd = [python, "-m", "pytest", *args, f"--junitxml={junit}", "-o", "junit_family=xunit2"]
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    return label, code, _junit_counts([junit])["tests"] if junit.exists() else 0, log


def _pytest_runs_in_parallel(session: nox.Session, runs: list[tuple], workers: int, *,
                             empty_fails: bool) -> tuple[list[str], int]:
    """`_pytest_logged` over `runs` ((label, python, args, env) each), `workers` at a time; each log is printed in
    order as its run ends. Returns the labels that failed (exit != 0, or no test with `empty_fails`) and how many
    tests ran."""
    JUNIT_DIR.mkdir(parents=True, exist_ok=True)
    failed, total = [], 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        for label, code, ran, log in pool.map(lambda run: _pytest_logged(*run), runs):
            print(log.read_text(), end="", flush=True)
            session.log(f"{label}: exit {code}, {ran} tests")
            total += ran
            if code != 0 or (empty_fails and ran == 0):
                failed.append(label if ran else f"{label} (collected nothing)")
    return failed, total


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check over the packages, benchmarks, CI scripts and this file (config: ruff.toml)."""
    _install_cpu(session, RUFF)
    targets = [p for p in ("packages", "benchmarks", "ci", "noxfile.py") if (ROOT / p).exists()]
    session.run("ruff", "check", *targets)


@nox.session
def core(session: nox.Session) -> None:
    """kda-core alone: torch only."""
    _install_cpu(session, _package("kda-core", "[test]"))
    session.run("python", "-c", "import kda_core; print('kda_core', kda_core.__version__)")
    _package_tests(session, "kda-core", label="core")


@nox.session
def cute(session: nox.Session) -> None:
    """kda-cute with kda-core and the CuTe DSL; the kernel compile checks are the `compile` session's."""
    _install_cpu(session, _package("kda-cute", "[test]"))
    session.run("python", "-c", "import kda_cute; print('kda_cute imported')")
    _package_tests(session, "kda-cute", label="cute")


@nox.session
def recurrent(session: nox.Session) -> None:
    """kda-recurrent without kda-cute: the facade's oracle fallback, the demo test."""
    _install_cpu(session, _package("kda-recurrent", "[test]"))
    session.run("python", "-c", "import kda_recurrent; print('kda_recurrent', kda_recurrent.__version__)")
    _package_tests(session, "kda-recurrent", label="recurrent")


@nox.session
def integration(session: nox.Session) -> None:
    """All three packages in one environment: kda-recurrent's tests with kda-cute present (the `recurrent` session
    ran them without it), then the top-level tests/ if any. kda-core's and kda-cute's tests are the `core` and `cute`
    sessions' only: dependencies point down, so a package above changes nothing they import."""
    _install_cpu(session, _package("kda-recurrent", "[cute,test]"))
    _package_tests(session, "kda-recurrent", label="integration-kda-recurrent")
    if (ROOT / "tests").is_dir():
        _pytest(session, ROOT / "tests", label="integration-top")


@nox.session
def compile(session: nox.Session) -> None:
    """kda-cute's kernel compile checks for sm_90a and sm_100a, on the CPU (CUTE_DSL_ARCH, no GPU).

    Runs each of kda-cute's tests/test*compile*.py once per target with CUTE_DSL_ARCH set and ``-k <arch>``: their
    test ids name the target, so each run compiles that target's variants only (and a file whose ids don't fails
    here, having collected nothing). The tests whose ids name no target (cache keys, schedules, shared-memory sizes,
    host paths with a recording compile step) run once, with the first target's run.

    A compile is one single-threaded process, so the (file, target) runs go to one worker per CPU core (the largest
    first); each writes its own log, printed when it ends, and its JUnit file.
    """
    tests = _compile_tests()
    if not tests:
        session.skip("packages/kda-cute/tests/test*compile*.py do not exist yet: no compile check to run")
    _install_cpu(session, _package("kda-cute", "[test]"))
    untargeted = f"not ({' or '.join(COMPILE_ARCHS)})"
    jobs = [(arch, path, arch if i else f"{arch} or {untargeted}")
            for i, arch in enumerate(COMPILE_ARCHS) for path in tests]
    jobs.sort(key=lambda job: (job[0] != COMPILE_ARCHS[0], -job[1].stat().st_size))  # sm_90a's biggest files first
    python = str(Path(session.bin) / "python")
    path_env = f"{session.bin}{os.pathsep}{os.environ.get('PATH', '')}"
    runs = [(f"compile-{arch}-{path.stem}", python,
             [str(path.relative_to(ROOT)), "-k", selection, *session.posargs],
             {**os.environ, "PATH": path_env, "CUTE_DSL_ARCH": arch, **BYTECODE_ON})
            for arch, path, selection in jobs]
    workers = max(1, min(len(jobs), os.cpu_count() or 1))
    session.log(f"compile checks: {len(jobs)} runs ({', '.join(COMPILE_ARCHS)} x {len(tests)} files) "
                f"on {workers} workers")
    failed, _ = _pytest_runs_in_parallel(session, runs, workers, empty_fails=True)
    if failed:
        session.error(f"compile checks failed: {', '.join(failed)}")


@nox.session
def demo(session: nox.Session) -> None:
    """The README's main job: the Kimi K3-shaped decode loop (`python -m kda_recurrent.demo`)."""
    _install_cpu(session, _package("kda-recurrent"))
    session.run("python", "-m", "kda_recurrent.demo", *(session.posargs or ["--steps", "4"]))


def _check_gpu_host(session: nox.Session) -> None:
    """The host's torch sees a GPU, and the repository's kda packages import with the host's packages."""
    session.run(
        sys.executable, "-c",
        "import sys, torch; ok = torch.cuda.is_available(); "
        "print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', ok and torch.cuda.get_device_name()); "
        "ok or sys.exit('this session needs a CUDA GPU and a CUDA build of torch'); "
        "import kda_core, kda_cute, kda_recurrent; print('kda packages from', kda_core.__file__.rsplit('/src/')[0])",
        env=GPU_HOST_ENV,
    )


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU-marked tests (`-m gpu`) of every package, for a GPU host (the host's Python; see the module docstring).

    `nox -s gpu -- --jobs N` runs them in N pytest processes at once (the suite's time is mostly kernel compiles, one
    CPU core each); the other arguments after `--` go to every pytest run. Eight contiguous shares, one per process,
    run by a shell loop on an H100 host (16 cores, 2026-12-07): 1427 tests in 7.5 minutes, the processes' times
    summing to 29 minutes; the slowest share took 7.3 minutes, the others 2.5-4.
    So the session cuts about 3N contiguous shares and hands them to the N processes in order as each finishes.
    """
    _check_gpu_host(session)
    jobs, args = _jobs_option(session)
    for old in JUNIT_DIR.glob("gpu-*"):  # an earlier run's files (other shards), which junit_summary would count
        old.unlink()
    if jobs > 1:
        ran = _gpu_in_shards(session, jobs, args)
    else:
        ran = sum(
            _package_tests(session, name, "-m", "gpu", label=f"gpu-{name}", allow_empty=True, env=GPU_HOST_ENV,
                           runner=HOST_PYTEST)
            for name in PACKAGE_NAMES
        )
    if ran == 0:
        session.error("no GPU-marked test was collected in any package")


def _jobs_option(session: nox.Session) -> tuple[int, list[str]]:
    """`--jobs N` / `--jobs=N` taken out of the session's arguments (default 1), and the arguments left."""
    jobs, args, rest = 1, [], list(session.posargs)
    while rest:
        arg = rest.pop(0)
        if arg == "--jobs" or arg.startswith("--jobs="):
            value = arg.partition("=")[2] or (rest.pop(0) if rest else "")
            if not value.isdigit() or int(value) < 1:
                session.error(f"--jobs takes a positive whole number; given {value!r}")
            jobs = int(value)
        else:
            args.append(arg)
    return jobs, args


def _gpu_node_ids(name: str, args: list[str]) -> list[str]:
    """The GPU-marked test ids of one package, as paths from the repository root (pytest prints them from the
    package's rootdir, which differs between packages)."""
    tests = PACKAGES / name / "tests"
    ignore = [f"--ignore={path.relative_to(ROOT)}" for path in _compile_tests() if path.is_relative_to(tests)]
    # one -q lists the ids; more (or -v) would change what the listing prints
    args = [arg for arg in args if arg not in ("--quiet", "--verbose") and not re.fullmatch(r"-[qv]+", arg)]
    done = subprocess.run([*HOST_PYTEST, str(tests.relative_to(ROOT)), *ignore, "--collect-only", "-q",
                           "-p", "no:cacheprovider", "-m", "gpu", *args],
                          cwd=ROOT, env={**os.environ, **GPU_HOST_ENV}, capture_output=True, text=True)
    if done.returncode not in (0, 5):
        raise RuntimeError(f"collecting {tests.relative_to(ROOT)} failed:\n{done.stdout}{done.stderr}")
    ids = []
    for line in done.stdout.splitlines():
        path, sep, _ = line.partition("::")
        if not sep:
            continue
        base = next((base for base in (ROOT, PACKAGES / name, tests) if (base / path).is_file()), None)
        if base is None:
            raise RuntimeError(f"cannot place the collected test {line!r} under {tests.relative_to(ROOT)}")
        ids.append(str((base / path).relative_to(ROOT)) + line[len(path):])
    return ids


def _gpu_in_shards(session: nox.Session, jobs: int, args: list[str]) -> int:
    """Every package's GPU tests in contiguous shards of about total / (3 jobs) tests (a shard never mixes
    packages: their test modules share names), `jobs` shards at a time, in order; each writes its JUnit file and log
    under .nox/junit/, printed when it ends. Returns how many tests ran."""
    ids = {name: _gpu_node_ids(name, args) for name in PACKAGE_NAMES}
    size = max(1, -(-sum(map(len, ids.values())) // (3 * jobs)))
    shards = [(f"gpu-{name}-{i // size}", found[i:i + size])
              for name, found in ids.items() for i in range(0, len(found), size)]
    session.log(f"gpu tests: {sum(map(len, ids.values()))} in {len(shards)} shards, {jobs} at a time")
    env = {**os.environ, **GPU_HOST_ENV}
    runs = [(label, sys.executable, [*nodes, "-p", "no:cacheprovider", *args], env) for label, nodes in shards]
    failed, total = _pytest_runs_in_parallel(session, runs, jobs, empty_fails=False)
    if failed:
        session.error(f"GPU tests failed: {', '.join(failed)}")
    return total


@nox.session(venv_backend="none")
def sanitize(session: nox.Session) -> None:
    """compute-sanitizer memcheck, then racecheck, over kda-cute's device fuzz tests (`-m "gpu and fuzz"`, two
    cases each: KDA_FUZZ_CASES=2), the ucache GPU tests that reach its bounds paths (UCACHE_SANITIZE) and the T=1
    kernel's `[1, N] + cu_seqlens` tests on malformed offsets (DECODE_T1_SANITIZE), with PyTorch's caching
    allocator off (PYTORCH_NO_CUDA_MEMORY_CACHING=1) so that an access past a tensor's end is past its allocation.
    Any sanitizer error fails the session (--error-exitcode 1)."""
    _check_gpu_host(session)
    if shutil.which("compute-sanitizer") is None:
        session.error("compute-sanitizer is not on PATH (it is in the CUDA toolkit's bin/)")
    env = {**GPU_HOST_ENV, "PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
    for tool in SANITIZER_TOOLS:
        runner = ("compute-sanitizer", "--tool", tool, "--report-api-errors", "no", "--error-exitcode", "1",
                  *HOST_PYTEST)
        _package_tests(session, "kda-cute", "-q", "-m", "gpu and fuzz", label=f"sanitize-{tool}-fuzz",
                       env={**env, "KDA_FUZZ_CASES": "2"}, runner=runner)
        _pytest(session, CUTE_TESTS / "test_ucache.py", "-q", "-m", "gpu", "-k", UCACHE_SANITIZE,
                label=f"sanitize-{tool}-ucache", env=env, runner=runner)
        _pytest(session, CUTE_TESTS / "test_decode_t1.py", "-q", "-m", "gpu", "-k", DECODE_T1_SANITIZE,
                label=f"sanitize-{tool}-decode-t1", env=env, runner=runner)


@nox.session(venv_backend="none")
def bench(session: nox.Session) -> None:
    """Benchmarks on a GPU host: `nox -s bench` runs every benchmarks/bench_*.py with its defaults
    (`python benchmarks/run_all.py`), rewriting the baselines, benchmarks/baselines/<gpu>/<name>.{json,png};
    `nox -s bench -- --only ucache` passes arguments to run_all.py, `nox -s bench -- bench_packed_kda_decode.py
    --batch-size 64 --out /tmp/t1.json` runs one script with those arguments."""
    _check_gpu_host(session)
    if session.posargs and session.posargs[0].endswith(".py"):
        script = ROOT / "benchmarks" / Path(session.posargs[0]).name
        session.run(sys.executable, str(script), *session.posargs[1:])
        return
    session.run(sys.executable, str(ROOT / "benchmarks" / "run_all.py"), *session.posargs)
