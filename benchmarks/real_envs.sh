#!/usr/bin/env bash
# The warm-up curve in a venv as users have it (Note [Threads libraries start] in
# overmind.warm.fork_safety). Whole processes from the shell, a fresh server per mode, runs 1-5
# and one after a restart, ratios to plain python timed in the same round:
#
#     benchmarks/real_envs.sh users      # this venv (the test extra: scipy, scikit-learn, pandas,
#                                        # pyarrow), both scripts importing pandas after torch
#     benchmarks/real_envs.sh many-cpus  # the same, every process seeing 16 CPUs (tests/shims/many_cpus.c)
#     benchmarks/real_envs.sh stranger   # the LM script also importing a module whose native library
#                                        # starts a thread nobody vouches for (tests/shims/stranger.c)
#     benchmarks/real_envs.sh minimal    # a venv of torch, diffusers, transformers, accelerate only
#                                        # (made in /tmp/overmind-minimal-venv): no regression there
#
# ROUNDS (default 2) sets --curve-rounds; results in out/real_envs/<case>.json (copied into
# docs/results/, overmind-bench --report renders them into docs/benchmarks.md). KEEP_LOGS=1 keeps
# the servers' and runs' logs (the bench prints where; OVERMIND_LOG_LEVEL=DEBUG reaches the server).
set -euo pipefail
case ${1:-} in -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROUNDS=${ROUNDS:-2}
OUT=out/real_envs
mkdir -p "$OUT"
case=${1:?usage: benchmarks/real_envs.sh users|many-cpus|stranger|minimal}
bench=(-m overmind.bench --scenarios warmup_curve --curve-rounds "$ROUNDS" --no-progress --json "$OUT/$case.json")
[ "${KEEP_LOGS:-0}" = 1 ] && bench+=(--keep-logs)
work=$(mktemp -d /tmp/overmind-real-envs.XXXXXX)
trap 'rm -rf "$work"' EXIT

case $case in
users)
    "$PY" "${bench[@]}" --imports pandas --about "In a venv as users have it: \`benchmarks/real_envs.sh users\`, \
the project's venv (\`make venv\`: torch, diffusers, transformers, accelerate and the test extra's scipy, \
scikit-learn, pandas and pyarrow), both scripts importing pandas after torch." ;;
many-cpus)
    cc -shared -fPIC -O2 -o "$work/libmany_cpus.so" tests/shims/many_cpus.c -ldl
    LD_PRELOAD=$work/libmany_cpus.so "$PY" -c "import os; assert os.cpu_count() == 16, os.cpu_count()"
    LD_PRELOAD=$work/libmany_cpus.so "$PY" "${bench[@]}" --imports pandas --about "Every process seeing 16 \
CPUs: \`benchmarks/real_envs.sh many-cpus\`, the users' venv with os.cpu_count() 16 (tests/shims/many_cpus.c)." ;;
stranger)
    site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    name=overmind_bench_stranger
    cc -shared -fPIC -O2 -o "$site/lib$name.so" tests/shims/stranger.c -lpthread
    printf 'import ctypes, os\nctypes.CDLL(os.path.join(os.path.dirname(__file__), "lib%s.so"))\n' "$name" \
        > "$site/$name.py"
    touch -d '1 minute ago' "$site/$name.py" "$site/lib$name.so"
    trap 'rm -rf "$work" "$site/$name.py" "$site/lib$name.so"' EXIT
    "$PY" "${bench[@]}" --curve-scripts lm --imports "pandas,$name" --about "A module nobody vouches for: \
\`benchmarks/real_envs.sh stranger\`, the LM script also importing a module whose library starts an unknown \
thread (tests/shims/stranger.c)." ;;
minimal)
    venv=/tmp/overmind-minimal-venv
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv"
        "$venv/bin/pip" install -q "torch==2.13.0"
        "$venv/bin/pip" install -q "setuptools>=64" wheel ninja
        "$venv/bin/pip" install -q --no-build-isolation -e ".[hf]"
    fi
    if "$venv/bin/python" -c "import scipy" 2>/dev/null; then
        echo "$venv holds scipy: not a minimal venv" >&2; exit 2
    fi
    "$venv/bin/python" "${bench[@]}" --about "In a minimal venv: \`benchmarks/real_envs.sh minimal\`, a venv of \
torch, diffusers, transformers and accelerate only." ;;
*)
    echo "unknown case $case: users, many-cpus, stranger or minimal" >&2; exit 2 ;;
esac
