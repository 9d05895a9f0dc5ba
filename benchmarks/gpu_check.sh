#!/usr/bin/env bash
# The GPU check: one command for a lent GPU machine (and, doing its CPU steps, for any machine).
#
#     bash benchmarks/gpu_check.sh                 # from the repo root; results under ${OUT:-./out/gpu_check}
#     PYTHON=.venv/bin/python bash benchmarks/gpu_check.sh
#
# Steps, each under its own `timeout`, a failing one never stopping the next:
#   setup    wheels from ./.whl, for what the python lacks, with pip --target $GPU_CHECK_SITE, then
#            on PYTHONPATH (default: the python's user site folder, e.g. ~/.local/lib/python3.12/
#            site-packages: overmind.warm.installed counts only modules under an installed prefix,
#            the user site among them, as installed code a warm interpreter may pre-import; under
#            /tmp/site diffusers would be taken for the user's own code and never pre-imported,
#            hiding what this check looks for); overmind installed editable (the C extension, else
#            OVERMIND_NO_EXT=1); torch, CUDA, GPU, CPUs. Starts generating the bench's models
#            (overmind.bench.models, into $OVERMIND_BENCH_CACHE, default /tmp/overmind-bench-cache)
#            in the background.
#   imports  benchmarks/gpu_imports.py: threads, libcuda and CUDA initialisation after each import
#            of a diffusers/transformers script, in an interpreter started as a warm one is (in the
#            background, beside the tests)
#   tests    GPU tests (CUDA only): tests/{integration,unit}/test_gpu.py (marked gpu), the
#            bitsandbytes tests (not marked: on a GPU they quantise there) and the bench's
#            --device cuda test; pytest --timeout=GPU_CHECK_TEST_TIMEOUT, -n 8 where pytest-xdist is
#            installed
#   bench    CUDA: the warm-up curve of the ControlNet script (SD1.5 sizes, fp16) with
#            .to('cuda'): plain python, then `overmind run` (bench-run) and monkey_patch_all()
#            (bench-patched), one bench each, in that order, runs 1-5 and after a restart, one
#            round (overmind-bench --scenarios warmup_curve --curve-scripts controlnet
#            --curve-modes MODE --curve-rounds 1 --device cuda); a mode the budget has no room
#            for is skipped. No CUDA: skipped, and the same on CPU with small models stands in
#            (bench-cpu; GPU_CHECK_CPU_BENCH=0 leaves it out)
#   h2d      benchmarks/h2d.py: host-to-device GB/s of .to('cuda'): plain, warm hit, pinned
#   summary  a table here and in $OUT/summary.json (rewritten after every step)
#
# $OUT holds at most 8 files: console.log (everything printed), summary.json, imports.jsonl,
# bench-run.json, bench-patched.json (or bench-cpu.json), h2d.json, extra.tar.gz (step logs,
# pip's log, the bench's worker logs and its servers' logs).
# Nothing is written inside the repo but $OUT, except what `pip install -e .` builds there
# (build/, src/*.egg-info, src/overmind/_C*.so) and Python's __pycache__ folders.
# GPU_CHECK_BUDGET (default 450 s) bounds the steps: each step's timeout leaves the later steps
# their minimum; a step killed at its timeout, the cleanup after it and the summary add < 40 s.
# GPU_CHECK_NO_EXT=1 installs without the C extension (a minute less); GPU_CHECK_CURVE_MODES picks the
# curve's modes and their order (default run,patched).
# GPU_CHECK_INSTALL=auto|always|never (auto: install unless `import overmind` already finds
# this checkout's src/overmind).
# GPU_CHECK_STEPS picks the steps after setup for a rerun (default imports,tests,bench,h2d), e.g.
# GPU_CHECK_STEPS=tests,bench GPU_CHECK_CURVE_MODES=run. The bench keeps its worker logs and each
# curve server's log (--keep-logs); extra.tar.gz holds them.
# GPU_CHECK_TEST_TIMEOUT (default 120 s) is pytest's limit for one GPU test.
set -u
case ${1:-} in -h|--help) sed -n '2,/^set -u$/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;; esac

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
PY=${PYTHON:-python3}
OUT=${OUT:-$REPO/out/gpu_check}
BUDGET=${GPU_CHECK_BUDGET:-450}
SITE=${GPU_CHECK_SITE:-$("$PY" -c "import site; print(site.getusersitepackages())" 2>/dev/null || echo /tmp/site)}
BENCH_CACHE=${OVERMIND_BENCH_CACHE:-/tmp/overmind-bench-cache}
export OVERMIND_BENCH_CACHE=$BENCH_CACHE
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_TELEMETRY=1 PYTHONUNBUFFERED=1
STEPS_WANTED=",${GPU_CHECK_STEPS:-imports,tests,bench,h2d},"
GPU_CHECK_CURVE_MODES=${GPU_CHECK_CURVE_MODES:-run,patched}
wanted() { [[ $STEPS_WANTED == *",$1,"* ]]; }
START=$(date +%s)
DEADLINE=$((START + BUDGET))
# Every process this run starts inherits it: how reap_servers knows the servers that are its own.
export GPU_CHECK_RUN="$$-$START"

mkdir -p "$OUT"
rm -f "$OUT"/{console.log,summary.json,imports.jsonl,bench*.json,h2d.json,extra.tar.gz}
WORK=$(mktemp -d /tmp/gpu-check.XXXXXX)
CONSOLE=$OUT/console.log
STEPS=$WORK/steps.tsv
: > "$CONSOLE"
: > "$STEPS"
HAVE_CUDA=0
SKIPWHY=""

say() { echo "[gpu_check $(( $(date +%s) - START ))s] $*" | tee -a "$CONSOLE"; }

# The seconds the steps after this one keep for themselves: later STEP SECONDS [STEP SECONDS...],
# counting only the steps GPU_CHECK_STEPS wants.
later() {
    local sum=0
    while (( $# >= 2 )); do
        wanted "$1" && sum=$((sum + $2))
        shift 2
    done
    echo "$sum"
}

# The seconds a step may take: at most CAP, leaving LATER seconds to the steps after it.
budget() {
    local cap=$1 later=$2 left
    left=$((DEADLINE - $(date +%s) - later - 10))
    (( left > cap )) && left=$cap
    echo "$left"
}

# The seconds a part of the setup may take: at most CAP, the whole setup at most 170 s.
sbudget() {
    local left=$((START + 170 - $(date +%s)))
    (( left > $1 )) && left=$1
    (( left < 5 )) && left=5
    echo "$left"
}

# record NAME STATUS SECONDS RC NOTE: one row of the summary; summary.json is rewritten.
record() {
    printf '%s\t%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" "${5//$'\t'/ }" >> "$STEPS"
    say "step $1: $2 (${3} s${4:+, rc $4})${5:+: $5}"
    write_summary > /dev/null
}

# Servers a step left behind (a timeout kills a step's process group; a daemonised server and
# its warm interpreters live in sessions of their own): asked to shut down, then killed. Only
# those started by this run (GPU_CHECK_RUN in their environment), never another user's.
servers_before() { ls -d /tmp/om-* 2>/dev/null | sort > "$WORK/om-before"; }
reap_servers() {
    local dir pid
    for dir in $(ls -d /tmp/om-* 2>/dev/null | sort | comm -13 "$WORK/om-before" -); do
        [ -f "$dir/server.pid" ] || continue
        pid=$(awk '{print $1; exit}' "$dir/server.pid" 2>/dev/null)
        [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || continue
        tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qxF "GPU_CHECK_RUN=$GPU_CHECK_RUN" || continue
        say "a server the step left running: pid $pid in $dir; shutting it down (its log: extra.tar.gz)"
        cp "$dir/server.log" "$WORK/server-$(basename "$dir").log" 2>/dev/null
        timeout 10 "$PY" -m overmind.frontend.cli --runtime-dir "$dir" shutdown > /dev/null 2>&1
        sleep 1
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    done
}

# run_step NAME CAP LATER MIN -- CMD...: CMD under `timeout`, output to the console; sets RC, SECS.
run_step() {
    local name=$1 cap=$2 later=$3 min=$4 t t0
    shift 5
    t=$(budget "$cap" "$later")
    SKIPWHY=""
    if (( t < min )); then
        RC=skip; SECS=0; SKIPWHY="out of time (${t} s left for it, needs ${min}); "
        return
    fi
    say "=== $name (timeout ${t} s): $*"
    servers_before
    t0=$(date +%s)
    timeout -k 10 "$t" "$@" 2>&1 | tee -a "$CONSOLE"
    RC=${PIPESTATUS[0]}
    SECS=$(( $(date +%s) - t0 ))
    reap_servers
}

status_of() {  # RC -> passed / failed / timed out / skipped
    case $1 in
        0) echo passed ;; skip) echo skipped ;; 124|137) echo "timed out" ;; *) echo failed ;;
    esac
}

# -- a. setup ------------------------------------------------------------------------------------

step_setup() {
    local t0 picked rc note="" ext
    t0=$(date +%s)
    say "=== setup: python $PY ($(command -v "$PY" 2>/dev/null || echo "not found")), repo $REPO, OUT $OUT, budget ${BUDGET} s"
    if ! "$PY" -c "import sys" 2>/dev/null; then
        record setup failed 0 "" "no python: $PY"
        return
    fi
    if compgen -G "$REPO/.whl/*.whl" > /dev/null; then
        # A wheel is installed unless the python already has its distribution at that version or newer.
        picked=$("$PY" - "$REPO"/.whl/*.whl <<'EOF'
import os, re, sys
from importlib import metadata
try:
    from packaging.version import Version
except ImportError:
    Version = None
for path in sys.argv[1:]:
    name, version = os.path.basename(path).split("-")[:2]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    newer = have is not None and (have == version or (Version is not None and Version(have) >= Version(version)))
    print(f"  {name} {version}: {'have ' + have + ', not installed' if newer else 'installing' + (' (have ' + have + ')' if have else '')}",
          file=sys.stderr)
    if not newer:
        print(path)
EOF
        )
        if [ -n "$picked" ]; then
            mkdir -p "$SITE"
            # shellcheck disable=SC2086
            timeout "$(sbudget 90)" "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$SITE" $picked > "$WORK/pip-wheels.log" 2>&1
            rc=$?
            tail -20 "$WORK/pip-wheels.log" | tee -a "$CONSOLE"
            if [ "$rc" != 0 ]; then note="wheels: pip exited $rc; "; fi
            export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
            export PATH="$SITE/bin:$PATH"
            # Installed with --no-compile: compiled once now, so no later import pays for it.
            timeout "$(sbudget 60)" "$PY" -m compileall -q -j 0 "$SITE" > /dev/null 2>&1
            note+="wheels into $SITE: $(echo "$picked" | xargs -n1 basename | sed 's/-[^-]*-[^-]*-[^-]*\.whl$//' | tr '\n' ' ')"
        else
            note+="wheels: every one already installed; "
        fi
    else
        note+="no .whl folder; "
    fi 2> >(tee -a "$CONSOLE" >&2)
    local where
    where=$("$PY" -c "import os, overmind; print(os.path.dirname(os.path.abspath(overmind.__file__)))" 2>/dev/null)
    case ${GPU_CHECK_INSTALL:-auto} in
        never) note+=" overmind: not installed (GPU_CHECK_INSTALL=never)" ;;
        auto|always)
            if [ "${GPU_CHECK_INSTALL:-auto}" = auto ] && [ "$where" = "$REPO/src/overmind" ]; then
                note+=" overmind: already installed from this checkout"
            else
                say "installing overmind: $PY -m pip install --no-build-isolation --no-deps --no-index -e ."
                if [ "${GPU_CHECK_NO_EXT:-0}" = 1 ] && OVERMIND_NO_EXT=1 timeout "$(sbudget 60)" "$PY" -m pip install \
                        --no-build-isolation --no-deps --no-index -e . > "$WORK/pip-overmind.log" 2>&1; then
                    note+=" overmind: installed without the C extension (GPU_CHECK_NO_EXT=1: a minute less)"
                elif timeout "$(sbudget 110)" "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . \
                        > "$WORK/pip-overmind.log" 2>&1; then
                    note+=" overmind: installed with its C extension"
                else
                    tail -25 "$WORK/pip-overmind.log" | tee -a "$CONSOLE"
                    say "the build with the C extension failed (log above); again with OVERMIND_NO_EXT=1"
                    if OVERMIND_NO_EXT=1 timeout "$(sbudget 60)" "$PY" -m pip install --no-build-isolation --no-deps --no-index \
                            -e . > "$WORK/pip-overmind-noext.log" 2>&1; then
                        note+=" overmind: installed WITHOUT the C extension (its build failed; OVERMIND_NO_EXT=1)"
                    else
                        tail -25 "$WORK/pip-overmind-noext.log" | tee -a "$CONSOLE"
                        note+=" overmind: install FAILED, with and without the extension"
                    fi
                fi
            fi ;;
    esac
    command -v nvidia-smi > /dev/null && timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version \
        --format=csv 2>&1 | tee -a "$CONSOLE"
    timeout "$(sbudget 90)" "$PY" - > "$WORK/env.json" 2> >(tee -a "$CONSOLE" >&2) <<'EOF'
import json, os, sys
from importlib import metadata
info = {"python": sys.version.split()[0], "executable": sys.executable, "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)), "PYTHONPATH": os.environ.get("PYTHONPATH")}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 1e9, 1)
except Exception as err:  # noqa: BLE001
    info["torch_error"] = f"{type(err).__name__}: {err}"
try:
    import overmind
    import overmind.shared.segments.native as native
    info["overmind"] = os.path.dirname(overmind.__file__)
    info["overmind_extension"] = bool(native.HAVE_EXTENSION)
except Exception as err:  # noqa: BLE001
    info["overmind_error"] = f"{type(err).__name__}: {err}"
versions = {}
for name in ("diffusers", "transformers", "accelerate", "safetensors", "huggingface_hub", "dill", "bitsandbytes",
             "peft", "triton", "numpy", "scipy", "pandas", "pyarrow", "setuptools", "pytest", "pytest-timeout",
             "pytest-xdist"):
    try:
        versions[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        versions[name] = None
info["versions"] = versions
try:  # what overmind.warm.installed counts as installed code (what a warm interpreter may pre-import)
    import importlib
    for name in ("torch", "diffusers", "transformers", "dill", "bitsandbytes"):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001
            pass
    from overmind.warm.installed import installed_modules
    held = set(installed_modules())
    info["counted_as_installed"] = {n: n in held for n in ("torch", "diffusers", "transformers", "dill", "bitsandbytes")
                                    if n in sys.modules}
except Exception as err:  # noqa: BLE001
    info["counted_as_installed"] = f"{type(err).__name__}: {err}"
print(json.dumps(info))
EOF
    cat "$WORK/env.json" | tee -a "$CONSOLE"
    HAVE_CUDA=$("$PY" -c "import json,sys; print(1 if json.load(open(sys.argv[1])).get('cuda_available') else 0)" \
        "$WORK/env.json" 2>/dev/null || echo 0)
    ext=$("$PY" -c "import json,sys; d=json.load(open(sys.argv[1])); print('overmind' in d, d.get('torch') is not None)" \
        "$WORK/env.json" 2>/dev/null)
    if [ "$ext" = "True True" ]; then
        record setup passed $(( $(date +%s) - t0 )) 0 "$note"
    else
        record setup failed $(( $(date +%s) - t0 )) 1 "$note; torch or overmind not importable (env.json)"
    fi
}

# -- models, in the background -------------------------------------------------------------------

GEN_PID=""
start_models() {
    local scale=base
    [ "$HAVE_CUDA" = 1 ] || scale=small
    MODELS_SCALE=$scale
    say "generating the bench's models (sd, controlnet_a, controlnet_b, scale $scale) into $BENCH_CACHE, in the background"
    ( t0=$(date +%s)
      timeout -k 10 "$(budget 240 0)" "$PY" -m overmind.bench.models "$BENCH_CACHE" "$scale" sd controlnet_a controlnet_b \
          --no-progress > "$WORK/models.log" 2>&1
      echo "$? $(( $(date +%s) - t0 ))" > "$WORK/models.rc" ) &
    GEN_PID=$!
}
wait_models() {
    [ -n "$GEN_PID" ] || return
    local t0 rc secs
    t0=$(date +%s)
    wait "$GEN_PID"
    GEN_PID=""
    read -r rc secs < "$WORK/models.rc" 2>/dev/null || { rc=1; secs=0; }
    tail -5 "$WORK/models.log" | tee -a "$CONSOLE"
    record models "$(status_of "$rc")" "$secs" "$rc" "scale $MODELS_SCALE in $BENCH_CACHE, in the background; waited $(( $(date +%s) - t0 )) s for it"
}

# -- b. import census ----------------------------------------------------------------------------

# Beside the tests (neither is timed against anything; its import times are then only indicative).
IMP_PID=""
start_imports() {
    local t
    t=$(budget 120 180)
    if (( t < 25 )); then record imports skipped 0 "" "out of time"; return; fi
    say "=== imports, in the background (timeout ${t} s): $PY benchmarks/gpu_imports.py > $OUT/imports.jsonl"
    ( t0=$(date +%s)
      timeout -k 10 "$t" "$PY" benchmarks/gpu_imports.py --timeout $(( t / 2 - 5 )) > "$OUT/imports.jsonl" \
          2> "$WORK/imports.err"
      echo "$? $(( $(date +%s) - t0 ))" > "$WORK/imports.rc" ) &
    IMP_PID=$!
}
wait_imports() {
    [ -n "$IMP_PID" ] || return
    local rc secs
    wait "$IMP_PID"
    IMP_PID=""
    read -r rc secs < "$WORK/imports.rc" 2>/dev/null || { rc=1; secs=0; }
    say "--- imports: its stderr, then its summary line"
    tee -a "$CONSOLE" < "$WORK/imports.err"
    tail -1 "$OUT/imports.jsonl" | tee -a "$CONSOLE"; echo | tee -a "$CONSOLE"
    record imports "$(status_of "$rc")" "$secs" "$rc" ""
}

# -- c. GPU tests --------------------------------------------------------------------------------

step_tests() {
    if [ "$HAVE_CUDA" != 1 ]; then record tests skipped 0 "" "skipped: no CUDA"; return; fi
    local files=() f xdist=()
    for f in tests/integration/test_gpu.py tests/unit/test_gpu.py tests/integration/test_bitsandbytes.py \
             tests/unit/test_bitsandbytes.py tests/integration/test_bench.py::test_device_cuda_runs_or_skips_cleanly; do
        [ -f "${f%%::*}" ] && files+=("$f")
    done
    if [ ${#files[@]} = 0 ]; then record tests skipped 0 "" "no test files"; return; fi
    # test_gpu.py is marked gpu as a whole; the bitsandbytes tests are not (`-m gpu` would deselect them).
    "$PY" -c "import xdist" 2>/dev/null && xdist=(-n 8)
    # A test's own limit well inside the step's, so that pytest lives to print what failed.
    run_step tests 170 $(later bench 180 h2d 60) 40 -- "$PY" -m pytest -q -rfEsxX --tb=short -p no:cacheprovider \
        --timeout="${GPU_CHECK_TEST_TIMEOUT:-120}" \
        "${xdist[@]+"${xdist[@]}"}" "${files[@]}"
    record tests "$(status_of "$RC")" "$SECS" "$RC" "$SKIPWHY${files[*]}"
}

# -- d. the bench's warm-up curve ----------------------------------------------------------------

step_bench() {
    wait_models
    if [ "$HAVE_CUDA" = 1 ]; then
        # One bench per mode, `overmind run` first: what is cut when time runs out is the last.
        local mode
        for mode in ${GPU_CHECK_CURVE_MODES//,/ }; do
            run_step "bench-$mode" 200 $(later h2d 60) 100 -- "$PY" -m overmind.bench --scenarios warmup_curve \
                --curve-scripts controlnet --curve-modes "$mode" --curve-rounds 1 --scale base --device cuda \
                --cache-dir "$BENCH_CACHE" --no-progress --keep-logs --json "$OUT/bench-$mode.json"
            record "bench-$mode" "$(status_of "$RC")" "$SECS" "$RC" \
                "${SKIPWHY}ControlNet, SD1.5 sizes, .to('cuda'), 1 round, mode $mode"
        done
    else
        record bench skipped 0 "" "skipped: no CUDA"
        if [ "${GPU_CHECK_CPU_BENCH:-1}" = 1 ]; then
            run_step bench-cpu 200 20 60 -- "$PY" -m overmind.bench --scenarios warmup_curve --curve-scripts controlnet \
                --curve-rounds 1 --scale small --device cpu --cache-dir "$BENCH_CACHE" --no-progress --keep-logs \
                --json "$OUT/bench-cpu.json"
            record bench-cpu "$(status_of "$RC")" "$SECS" "$RC" "${SKIPWHY}CPU stand-in: ControlNet, small models, .to('cpu'), 1 round"
        fi
    fi
    grep -o "worker logs in /tmp/overmind-bench-logs-[A-Za-z0-9_]*" "$CONSOLE" | awk '{print $4}' | sort -u \
        > "$WORK/bench-logdirs"
}

# -- e. host to device ---------------------------------------------------------------------------

step_h2d() {
    wait_models
    if [ "$HAVE_CUDA" = 1 ]; then
        run_step h2d 120 0 30 -- "$PY" benchmarks/h2d.py --scale base --cache-dir "$BENCH_CACHE" --timeout 90 \
            --json "$OUT/h2d.json"
    else
        run_step h2d 60 0 10 -- "$PY" benchmarks/h2d.py --json "$OUT/h2d.json"
        if [ "$RC" = 0 ]; then RC=skip; SKIPWHY="skipped: no CUDA (h2d.py said so)"; fi
    fi
    local note=$SKIPWHY
    record h2d "$(status_of "$RC")" "$SECS" "$RC" "$note"
}

# -- f. summary ----------------------------------------------------------------------------------

write_summary() {
    "$PY" - "$STEPS" "$WORK" "$OUT" "$START" "$BUDGET" <<'EOF'
import json, os, re, sys, time
steps_tsv, work, out, start, budget = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5]

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None

def last_json_line(path):
    try:
        with open(path) as f:
            lines = [l for l in f if l.startswith("{")]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError):
        return None

rows = []
with open(steps_tsv) as f:
    for line in f:
        name, status, secs, rc, note = (line.rstrip("\n").split("\t") + [""] * 5)[:5]
        rows.append({"step": name, "status": status, "seconds": int(secs or 0), "rc": rc or None, "note": note,
                     "figures": {}})
env = load(os.path.join(work, "env.json")) or {}
for row in rows:
    fig = row["figures"]
    if row["step"] == "setup":
        fig.update({k: env.get(k) for k in ("torch", "torch_cuda", "cuda_available", "gpu", "cpu_count",
                                            "overmind_extension")})
        counted = env.get("counted_as_installed")
        if isinstance(counted, dict) and not all(counted.values()):
            fig["NOT_counted_as_installed"] = sorted(n for n, ok in counted.items() if not ok)
    elif row["step"] == "imports":
        s = last_json_line(os.path.join(out, "imports.jsonl")) or {}
        first = s.get("probe_first_cuda_init")
        fig["first_module_after_which_cuda_was_initialised"] = first and first.get("module")
        fig["list_first_step_with_cuda_initialised"] = s.get("list_first_step_with_cuda_initialised")
        fig["libcuda_mapped_by"] = (s.get("probe_libcuda_mapped_by") or {}).get("blame")
        fig["threads_started_by_step"] = s.get("threads_started_by_step")
        fig["threads_a_fork_would_miss_at_end"] = sorted({t["comm"] for t in s.get("threads_a_fork_would_miss_at_end") or []})
    elif row["step"] == "tests":
        try:
            with open(os.path.join(out, "console.log")) as f:
                text = f.read()
            found = re.findall(r"^=*\s*((?:\d+ (?:passed|failed|skipped|xfailed|xpassed|errors?|deselected|warnings?)"
                               r"(?:, )?)+)(?: in [\d.]+s)?", text, re.M)
            fig["pytest"] = found[-1].strip() if found else None
        except OSError:
            pass
    elif row["step"].startswith("bench") and row["status"] != "skipped":
        doc = load(os.path.join(out, row["step"] + ".json")) or {}
        for script in (doc.get("warmup_curve") or {}).get("scripts", []):
            fig[script["name"]] = {
                "status": script["status"], "reason": (script.get("reason") or "")[:300] or None,
                "plain_s": script["plain"] and round(script["plain"]["median"], 2),
                **{m["mode"]: {r["run"]: r["x_plain"] and round(r["x_plain"], 3) for r in m["runs"]}
                   for m in script["modes"]},
                "forked_runs": sum(x["forked"] for m in script["modes"] for r in m["runs"] for x in r["runs"]),
                "fallbacks": sum(x["fallback"] for m in script["modes"] for r in m["runs"] for x in r["runs"]),
            }
    elif row["step"] == "h2d":
        doc = load(os.path.join(out, "h2d.json")) or {}
        fig["status"] = doc.get("status")
        if doc.get("reason"):
            fig["reason"] = doc["reason"]
        for name, entry in (doc.get("loaders") or {}).items():
            s = entry.get("summary") or {}
            fig[name] = {k: (round(v, 2) if isinstance(v, float) else v) for k, v in s.items()}
            if entry.get("status") != "ok":
                fig[name]["reason"] = (entry.get("reason") or "")[:300]
summary = {"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(start)), "wall_s": round(time.time() - start),
           "budget_s": int(budget), "environment": env, "steps": rows}
with open(os.path.join(out, "summary.json"), "w") as f:
    json.dump(summary, f, indent=2, default=str)
    f.write("\n")

def short(fig):
    parts = []
    for k, v in fig.items():
        if v in (None, {}, []):
            continue
        parts.append(f"{k}={json.dumps(v, separators=(',', ':'), default=str)}")
    return "; ".join(parts)

print(f"{'step':<10} {'status':<10} {'s':>5}  key figures / note")
print(f"{'-' * 10} {'-' * 10} {'-' * 5}  {'-' * 60}")
for row in rows:
    text = "; ".join(x for x in (row["note"], short(row["figures"])) if x)
    print(f"{row['step']:<10} {row['status']:<10} {row['seconds']:>5}  {text}")
print(f"wall {summary['wall_s']} s of a {budget} s budget; {os.path.join(out, 'summary.json')}")
EOF
}

pack() {
    local dirs=()
    [ -f "$WORK/bench-logdirs" ] && while read -r d; do [ -d "$d" ] && dirs+=("$d"); done < "$WORK/bench-logdirs"
    tar czf "$OUT/extra.tar.gz" -C / "${WORK#/}" "${dirs[@]+"${dirs[@]#/}"}" 2>/dev/null
}

step_setup
if wanted bench || wanted h2d; then start_models; fi
if wanted imports; then start_imports; fi
if wanted tests; then step_tests; fi
wait_imports
if wanted bench; then step_bench; fi
if wanted h2d; then step_h2d; fi
say "=== summary"
write_summary | tee -a "$CONSOLE"
pack
say "files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
FAILED=$(awk -F'\t' '$2 == "failed" || $2 == "timed out"' "$STEPS" | wc -l)
rm -rf "$WORK"
[ "$FAILED" = 0 ]
