"""Run the Hugging Face libraries' own test files plain and patched, and diff the outcomes per test.

Each selection (an upstream test file, optionally narrowed with ``-k``) runs three times, each in a
fresh pytest process: ``plain``; ``fill``, with ``monkey_patch_all()`` in place before anything is
imported, against a private ``overmind-server`` started for this selection (the cache fills);
``hit``, patched again against the same server (the cache serves what it can). The server is
stopped after ``hit``; the next selection gets a new one, so every ``hit`` pass sees only what its
own ``fill`` cached.

    .venv/bin/python benchmarks/hf_suites.py \\
        --diffusers-tests /tmp/om/harness/diffusers/tests \\
        --transformers-tests /tmp/om/harness/transformers/tests \\
        --preset first --out /tmp/om/harness/runs --report /tmp/om/harness/REPORT.md

    # one file, narrowed (the words after the path are pytest arguments):
    .venv/bin/python benchmarks/hf_suites.py --diffusers-tests DIR \\
        --select "diffusers tests/schedulers/test_scheduler_ddim.py -k 'save or pretrained'"

The upstream ``tests`` trees are not in PyPI's sdists. ``--fetch`` downloads the tagged GitHub
tarball of the installed version (needs GitHub); otherwise check out ``tests/`` of the installed
version yourself and pass the folder. What the upstream tests import beyond our ``[hf,test]``
extras (``parameterized``, ``requests-mock``, ``pytest-timeout``) is checked first; a missing one
stops the run with the pip command that installs it.

Always set: HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1 (a test that needs the Hub fails or skips
the same way in every pass). Per test: ``--timeout`` (pytest-timeout); per pass: ``--pass-timeout``.
Each pass holds ``--lock`` (flock; /tmp/overmind-measure.lock) while it runs and releases it after,
so others can measure between passes. Results are kept per selection under ``--out``; a selection
whose three passes are complete is not run again (``--force`` reruns), so a stopped run resumes.

A test that fails patched after passing plain is run plain once more, alone (``replain``), so a flaky one
is told apart from a difference the cache made (``--no-recheck`` skips it). To run against other overmind
code (e.g. the commit before a fix), put its ``src`` first on PYTHONPATH: the harness, the server and every
pass inherit it.

Note [Aged saves] in ``hf_suites_plugin``: by default (``--age 60``) what a test saves is dated 60 s
back, in every pass, so that loads of just-saved folders reach the cache instead of being refused as
racy (Note [Racy files] in overmind.shared.calls.keys); ``--age 0`` runs the tests as they are.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
PASSES = ("plain", "fill", "hit")
BAD = {"failed", "error", "xpassed", "collect-error", "missing"}
REQUIRED_MODULES = {"parameterized": "parameterized", "requests_mock": "requests-mock", "pytest_timeout": "pytest-timeout"}
LIBRARIES = {"transformers": "huggingface/transformers", "diffusers": "huggingface/diffusers"}

# Each pass of each of these stays within a few minutes on 2 cores.
PRESETS = {
    "first": [
        "transformers tests/models/llama/test_modeling_llama.py",
        "diffusers tests/models/unets/test_models_unet_2d_condition.py",
        "diffusers tests/models/unets/test_models_unet_2d.py",
        "diffusers tests/schedulers/test_scheduler_ddim.py",
        "diffusers tests/schedulers/test_scheduler_euler.py",
        "diffusers tests/schedulers/test_scheduler_dpm_multi.py",
        "diffusers tests/schedulers/test_schedulers.py",
    ],
}
PRESETS["all"] = PRESETS["first"] + [
    *(f"transformers tests/models/{m}/test_modeling_{m}.py" for m in ("gpt2", "qwen2", "mistral", "gemma", "phi3", "gpt_neox")),
    "diffusers tests/models/autoencoders/test_models_autoencoder_kl.py",
    "diffusers tests/schedulers/test_scheduler_pndm.py",
    "diffusers tests/schedulers/test_scheduler_lms.py",
    "diffusers tests/schedulers/test_scheduler_unipc.py",
    "diffusers tests/schedulers/test_scheduler_ddpm.py",
    "diffusers tests/pipelines/stable_diffusion/test_stable_diffusion.py",
    "diffusers tests/pipelines/stable_diffusion/test_stable_diffusion_img2img.py",
    "diffusers tests/pipelines/controlnet/test_controlnet.py",
    "diffusers tests/pipelines/kandinsky/test_kandinsky.py",
    "diffusers tests/pipelines/kandinsky2_2/test_kandinsky.py",
    "diffusers tests/pipelines/shap_e/test_shap_e.py",
]


@dataclass
class Selection:
    library: str
    path: str  # relative to the folder that holds ``tests``
    pytest_args: list[str] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> "Selection":
        words = shlex.split(text)
        if len(words) < 2 or words[0] not in LIBRARIES:
            raise SystemExit(f"hf_suites: a selection is 'LIBRARY PATH [pytest args]', LIBRARY one of "
                             f"{sorted(LIBRARIES)}; got {text!r}")
        return cls(words[0], words[1], words[2:])

    @property
    def slug(self) -> str:
        # The folders too: kandinsky/test_kandinsky.py and kandinsky2_2/test_kandinsky.py are two files.
        inside = Path(self.path).with_suffix("").parts[1:]  # without the leading "tests"
        name = re.sub(r"[^A-Za-z0-9]+", "_", "_".join([self.library, *inside])).strip("_")
        if self.pytest_args:
            name += "_" + hashlib.sha1(" ".join(self.pytest_args).encode()).hexdigest()[:8]
        return name

    def __str__(self) -> str:
        return " ".join([self.library, self.path, *map(shlex.quote, self.pytest_args)])


# -- the upstream test trees -------------------------------------------------------------------


def installed_version(library: str) -> str:
    from importlib.metadata import version

    return version(library)


def fetch_tests(library: str, into: Path) -> Path:
    """The ``tests`` folder of the installed version's GitHub tarball, unpacked under ``into``."""
    version = installed_version(library)
    dest = into / f"{library}-{version}"
    if (dest / "tests").is_dir():
        return dest / "tests"
    url = f"https://github.com/{LIBRARIES[library]}/archive/refs/tags/v{version}.tar.gz"
    print(f"hf_suites: fetching {url}", flush=True)
    try:
        with urllib.request.urlopen(url, timeout=30) as response, tempfile.TemporaryFile() as tmp:
            shutil.copyfileobj(response, tmp)
            tmp.seek(0)
            with tarfile.open(fileobj=tmp, mode="r:gz") as tar:
                members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["tests"]]
                for m in members:
                    m.name = m.name.split("/", 1)[1]
                tar.extractall(dest, members=members, filter="data")
    except OSError as err:
        raise SystemExit(f"hf_suites: cannot download the {library} {version} tests ({err}).\n"
                         f"Check out the tests/ folder of {LIBRARIES[library]} at tag v{version} on a machine that "
                         f"reaches GitHub and pass it with --{library}-tests DIR.") from None
    return dest / "tests"


def check_requirements() -> None:
    missing = [pip for module, pip in REQUIRED_MODULES.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise SystemExit(f"hf_suites: the upstream tests need {', '.join(missing)}: "
                         f"{sys.executable} -m pip install {' '.join(missing)}")


# -- the private server ------------------------------------------------------------------------


class PrivateServer:
    """``overmind-server --foreground`` in its own runtime folder; stopped by ``stop()``."""

    def __init__(self, root: Path, log_copy: Path, max_memory: Optional[str], hf_home: Optional[str]) -> None:
        self.runtime = Path(tempfile.mkdtemp(prefix="rt-", dir=root))
        self.log_copy = log_copy
        self.env = {**os.environ, "OVERMIND_RUNTIME_DIR": str(self.runtime), "OVERMIND_NO_AUTOSTART": "1",
                    "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **({"HF_HOME": hf_home} if hf_home else {})}
        command = [sys.executable, "-m", "overmind.server", "--foreground"]
        if max_memory:
            command += ["--max-memory", max_memory]
        self.proc = subprocess.Popen(command, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, start_new_session=True)
        line = self.proc.stdout.readline()
        if "ready" not in line:
            self.stop()
            raise RuntimeError(f"overmind-server did not start: {line!r}; see {self.log_copy}")

    def counters(self) -> Optional[dict]:
        from overmind.shared import protocol as P
        from overmind.client.connection import LoadingConnection
        from overmind.shared.settings.config import Config

        try:
            with LoadingConnection.open(Config.from_env(self.env), autostart=False) as conn:
                info = conn.simple(P.Status(), P.StatusReply, timeout=10).info
        except Exception as err:
            return {"error": str(err)}
        return {k: v for k, v in info.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        log = self.runtime / "server.log"
        if log.exists():
            shutil.copyfile(log, self.log_copy)
        shutil.rmtree(self.runtime, ignore_errors=True)


# -- one pass ----------------------------------------------------------------------------------


class MeasureLock:
    """flock on a shared file, held for one pass (shared rules: one measurement at a time)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.fd = -1

    def __enter__(self) -> "MeasureLock":
        if self.path:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        if self.fd >= 0:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def run_pass(sel: Selection, root: Path, name: str, out: Path, args, server: Optional[PrivateServer],
             targets: Optional[list[str]] = None) -> dict:
    """One fresh pytest process over ``sel`` (or just the test ids ``targets``); its records go to
    ``out/<name>.jsonl``."""
    results = out / f"{name}.jsonl"
    results.unlink(missing_ok=True)
    env = dict(server.env if server else os.environ)
    for key in [k for k in env if k.startswith("OVERMIND_")] if server is None else []:
        del env[key]
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
               HF_SUITES_RESULTS=str(results), HF_SUITES_PATCH="1" if server else "0", HF_SUITES_AGE=str(args.age),
               PYTHONHASHSEED="0")
    if args.hf_home:
        env["HF_HOME"] = args.hf_home
    if server is None:
        env["OVERMIND_DISABLE"] = "1"  # plain: nothing of overmind runs, whatever the user's settings
    else:
        env["OVERMIND_COLD"] = args.cold
        if args.strict:
            env["OVERMIND_STRICT"] = "1"
    command = [sys.executable, "-m", "pytest", "-p", "hf_suites_plugin", "-p", "no:cacheprovider", "-q", "-rN",
               "--tb=short", f"--timeout={args.timeout}", "-W", "ignore::DeprecationWarning",
               *(targets if targets else [sel.path, *sel.pytest_args])]
    with MeasureLock(args.lock):
        before = server.counters() if server else None
        start = time.monotonic()
        with open(out / f"{name}.log", "w") as log:
            proc = subprocess.Popen(command, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                status = proc.wait(timeout=args.pass_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                status = "pass-timeout"
        wall = time.monotonic() - start
        after = server.counters() if server else None
    summary = {"pass": name, "exit": status, "wall_s": round(wall, 1), "command": shlex.join(command),
               "server_before": before, "server_after": after}
    (out / f"{name}.done").write_text(json.dumps(summary, indent=1))
    print(f"  {name:5s} exit {status} in {wall:.0f}s" + (f"  server {_delta(before, after)}" if server else ""),
          flush=True)
    return summary


def _delta(before: Optional[dict], after: Optional[dict]) -> str:
    if not before or not after or "error" in before or "error" in after:
        return "counters unavailable"
    keys = [k for k in ("hits", "misses", "entries", "evictions", "stale") if k in after]
    return " ".join(f"{k} +{after[k] - before.get(k, 0)}" if k != "entries" else f"entries {after[k]}" for k in keys)


def run_selection(sel: Selection, root: Path, args) -> None:
    out = Path(args.out) / sel.slug
    out.mkdir(parents=True, exist_ok=True)
    # Two harness runs sharing --out never run one selection at once (they would share its files).
    claim = os.open(out / "selection.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(claim, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(claim)
        print(f"{sel}\n  being run by another hf_suites process; skipped", flush=True)
        return
    try:
        _run_selection(sel, root, args, out)
    finally:
        os.close(claim)


def _run_selection(sel: Selection, root: Path, args, out: Path) -> None:
    (out / "selection.txt").write_text(str(sel) + "\n")
    print(f"{sel}", flush=True)
    if args.force or not (out / "plain.done").exists():
        run_pass(sel, root, "plain", out, args, None)
    else:
        print("  plain done already", flush=True)
    # fill and hit share one server: a resumed run redoes both
    if args.force or not ((out / "fill.done").exists() and (out / "hit.done").exists()):
        for stale in ("fill", "hit"):
            (out / f"{stale}.done").unlink(missing_ok=True)
        server = PrivateServer(Path(args.out), out / "server.log", args.max_memory, args.hf_home)
        try:
            run_pass(sel, root, "fill", out, args, server)
            run_pass(sel, root, "hit", out, args, server)
        finally:
            server.stop()
    else:
        print("  fill and hit done already", flush=True)
    # A test that failed patched is run plain once more, alone: if it fails again it is flaky (or
    # order-dependent), not a difference the cache made.
    regressed = sorted({r["nodeid"] for r in summarize(out)["regressions"]})
    if args.recheck and regressed and (args.force or not (out / "replain.done").exists()):
        run_pass(sel, root, "replain", out, args, None, targets=regressed)


# -- the diff ----------------------------------------------------------------------------------


def read_pass(out: Path, name: str) -> tuple[dict[str, dict], Optional[dict]]:
    records: dict[str, dict] = {}
    path = out / f"{name}.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a killed process
            records[rec["nodeid"]] = rec
    done = out / f"{name}.done"
    return records, json.loads(done.read_text()) if done.exists() else None


def error_line(text: str) -> str:
    """The first ``E   ...`` line of a short traceback, else its last line: the cause in one line."""
    lines = [line for line in (text or "").splitlines() if line.strip()]
    for line in lines:
        if line.startswith("E "):
            return line[1:].strip()[:240]
    return (lines[-1].strip() if lines else "(no traceback)")[:240]


def cause_key(text: str) -> str:
    """The error line with numbers, addresses and quoted names blurred, to group alike failures."""
    line = error_line(text)
    line = re.sub(r"0x[0-9a-f]+", "0x.", line)
    line = re.sub(r"\d+(\.\d+)?(e-?\d+)?", "N", line)
    return line[:160]


def counts(records: dict[str, dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for rec in records.values():
        if rec["outcome"] not in ("session", "overmind-warning"):
            out[rec["outcome"]] = out.get(rec["outcome"], 0) + 1
    return out


def summarize(out: Path) -> dict:
    passes = {name: read_pass(out, name) for name in PASSES}
    replain = read_pass(out, "replain")[0]
    plain = passes["plain"][0]
    regressions = []
    improvements = []
    cache = {}
    for name in ("fill", "hit"):
        records, done = passes[name]
        uncached: dict[str, int] = {}
        fallbacks = 0
        served = 0
        for rec in records.values():
            for why, n in rec.get("uncached", {}).items():
                uncached[why] = uncached.get(why, 0) + n
            fallbacks += len(rec.get("fallbacks", [])) + (rec["outcome"] == "overmind-warning")
            served += rec.get("server", {}).get("hits", 0)
        server = _delta(done.get("server_before"), done.get("server_after")) if done else "not run"
        cache[name] = {"server": server, "uncached": uncached, "fallbacks": fallbacks, "hits_in_tests": served}
        if done is None:
            continue
        for nodeid, rec in plain.items():
            if rec["outcome"] != "passed":  # a skip in one pass and a failure in another is no regression
                continue
            other = records.get(nodeid, {"outcome": "missing", "text": "no record: the pass stopped before it "
                                         f"(exit {done['exit']})"})
            if other["outcome"] in BAD:
                regressions.append({"nodeid": nodeid, "pass": name, "plain": rec["outcome"],
                                    "patched": other["outcome"], "text": other.get("text", ""),
                                    "server": other.get("server"), "uncached": other.get("uncached"),
                                    "replain": replain.get(nodeid, {}).get("outcome")})
        for nodeid, other in records.items():
            if plain.get(nodeid, {}).get("outcome") in BAD and other["outcome"] == "passed":
                improvements.append({"nodeid": nodeid, "pass": name})
    return {"selection": (out / "selection.txt").read_text().strip() if (out / "selection.txt").exists() else out.name,
            "counts": {name: counts(passes[name][0]) for name in PASSES},
            "walls": {name: (passes[name][1] or {}).get("wall_s") for name in PASSES},
            "exits": {name: (passes[name][1] or {}).get("exit") for name in PASSES},
            "cache": cache, "regressions": regressions, "improvements": improvements}


def _fmt_counts(c: dict[str, int]) -> str:
    order = ("passed", "failed", "error", "skipped", "xfailed", "xpassed", "collect-error")
    return " ".join(f"{c[k]}{k[0] if k != 'collect-error' else 'C'}" for k in order if c.get(k)) or "-"


def report(args, selections: list[Selection]) -> str:
    summaries = [summarize(Path(args.out) / sel.slug) for sel in selections if (Path(args.out) / sel.slug).exists()]
    git = subprocess.run(["git", "-C", str(HERE.parent), "describe", "--always", "--dirty"], capture_output=True,
                         text=True).stdout.strip()
    lines = [f"# hf_suites: upstream HF tests, plain vs patched ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})",
             "",
             f"overmind {git}; transformers {installed_version('transformers')}, diffusers "
             f"{installed_version('diffusers')}, torch {installed_version('torch')}; "
             f"--age {args.age} --cold {args.cold} --timeout {args.timeout}{' --strict' if args.strict else ''}",
             "", f"    {shlex.join([sys.executable, *sys.argv])}", "",
             "Counts: p passed, f failed, e error, s skipped, x xfailed/xpassed, C collection error. "
             "Server: hits/misses the private server counted during the pass. Uncached: calls the patched "
             "wrapper sent to the original (reason: count).", "",
             "| selection | plain | fill | hit | wall s (plain/fill/hit) | fill: server | hit: server | hit: uncached | regressions |",
             "|---|---|---|---|---|---|---|---|---|"]
    if args.notes and Path(args.notes).exists():
        lines[4:4] = [Path(args.notes).read_text().rstrip(), ""]
    for s in summaries:
        walls = "/".join("-" if s["walls"][p] is None else f"{s['walls'][p]:.0f}" for p in PASSES)
        uncached = ", ".join(f"{k}: {v}" for k, v in s["cache"]["hit"]["uncached"].items()) or "-"
        lines.append(f"| `{s['selection']}` | {_fmt_counts(s['counts']['plain'])} | {_fmt_counts(s['counts']['fill'])}"
                     f" | {_fmt_counts(s['counts']['hit'])} | {walls} | {s['cache']['fill']['server']} | "
                     f"{s['cache']['hit']['server']} | {uncached} | {len(s['regressions'])} |")
    all_regressions = [dict(r, selection=s["selection"]) for s in summaries for r in s["regressions"]]
    lines += ["", f"## Plain passes, patched fails: {len(all_regressions)} (test x pass)", ""]
    by_cause: dict[str, list[dict]] = {}
    for r in all_regressions:
        by_cause.setdefault(cause_key(r["text"]), []).append(r)
    for cause, group in sorted(by_cause.items(), key=lambda kv: -len(kv[1])):
        lines += [f"### {len(group)} x `{cause}`", ""]
        for r in group:
            again = f"; plain again alone: {r['replain']}" if r.get("replain") else ""
            lines.append(f"- `{r['nodeid']}` ({r['pass']}: {r['plain']} -> {r['patched']}; server {r['server']}, "
                         f"uncached {r['uncached']}{again})")
        first = group[0]["text"].strip()
        lines += ["", "```", first[-1800:], "```", ""]
    improved = [dict(i, selection=s["selection"]) for s in summaries for i in s["improvements"]]
    if improved:
        lines += ["", f"## Plain fails, patched passes: {len(improved)} (flaky or order-dependent)", ""]
        lines += [f"- `{i['nodeid']}` ({i['pass']})" for i in improved]
    fallbacks = {s["selection"]: (s["cache"]["fill"]["fallbacks"], s["cache"]["hit"]["fallbacks"]) for s in summaries}
    if any(a or b for a, b in fallbacks.values()):
        lines += ["", "## Fallback messages from overmind (fill, hit)", ""]
        lines += [f"- `{k}`: {a}, {b}" for k, (a, b) in fallbacks.items() if a or b]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--transformers-tests", help="the upstream transformers tests/ folder")
    parser.add_argument("--diffusers-tests", help="the upstream diffusers tests/ folder")
    parser.add_argument("--fetch", action="store_true", help="download the installed versions' tests from GitHub "
                        "where a --*-tests folder is not given")
    parser.add_argument("--select", action="append", default=[], metavar="'LIB PATH [pytest args]'",
                        help="a test file (relative to the folder holding tests/), e.g. "
                             "\"diffusers tests/schedulers/test_scheduler_ddim.py -k save\"; repeatable")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a built-in list of selections")
    parser.add_argument("--only", help="run only the selections whose text matches this regular expression")
    parser.add_argument("--out", default="/tmp/hf_suites", help="results, one folder per selection (resumable)")
    parser.add_argument("--report", help="write the markdown report here too (always printed)")
    parser.add_argument("--notes", help="a markdown file put at the top of the report (what a reader should know)")
    parser.add_argument("--report-only", action="store_true", help="run nothing; report what --out holds")
    parser.add_argument("--force", action="store_true", help="rerun selections that are complete")
    parser.add_argument("--age", type=float, default=60.0, help="date saved files this many seconds back (0: off)")
    parser.add_argument("--cold", choices=("wait", "background"), default="wait",
                        help="OVERMIND_COLD for the patched passes (wait: a miss is served from the cache too)")
    parser.add_argument("--strict", action="store_true", help="OVERMIND_STRICT=1: a cache failure fails the test")
    parser.add_argument("--no-recheck", dest="recheck", action="store_false",
                        help="do not rerun plain, alone, the tests that failed patched (to tell flaky ones apart)")
    parser.add_argument("--timeout", type=int, default=180, help="seconds per test (pytest-timeout)")
    parser.add_argument("--pass-timeout", type=int, default=1200, help="seconds per pytest process")
    parser.add_argument("--hf-home", help="HF_HOME for every pass and the server: an offline Hub cache holding what "
                        "the fast tests fetch (tiny tokenizers); default: the caller's")
    parser.add_argument("--max-memory", help="the private server's budget (default: its own)")
    parser.add_argument("--lock", default="/tmp/overmind-measure.lock", help="flock file held during each pass ('' none)")
    args = parser.parse_args(argv)

    texts = list(PRESETS.get(args.preset, [])) + args.select
    if not texts:
        parser.error("give --select or --preset")
    selections = [Selection.parse(t) for t in texts]
    if args.only:
        selections = [s for s in selections if re.search(args.only, str(s))]
    if not args.report_only:
        check_requirements()
        roots: dict[str, Path] = {}
        for library in sorted({s.library for s in selections}):
            given = getattr(args, f"{library}_tests")
            if given:
                tests = Path(given).resolve()
            elif args.fetch:
                tests = fetch_tests(library, Path(args.out) / "upstream")
            else:
                raise SystemExit(f"hf_suites: no {library} tests: pass --{library}-tests DIR (the tests/ folder of "
                                 f"{LIBRARIES[library]} at v{installed_version(library)}) or --fetch")
            if tests.name != "tests" or not tests.is_dir():
                raise SystemExit(f"hf_suites: {tests} is not a tests/ folder")
            roots[library] = tests.parent
        for sel in selections:
            if not (roots[sel.library] / sel.path).exists():
                print(f"hf_suites: skipping {sel}: no {roots[sel.library] / sel.path}", file=sys.stderr)
                continue
            run_selection(sel, roots[sel.library], args)
            if args.report:
                Path(args.report).write_text(report(args, selections))
    text = report(args, selections)
    if args.report:
        Path(args.report).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
