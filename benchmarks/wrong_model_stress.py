"""Stress: cached loads of two same-size fine-tunes under eviction pressure never mix them up.

    .venv/bin/python benchmarks/wrong_model_stress.py [--loads 5000] [--workers 2] [--json FILE]

The bug: an Entry reply names segments by the server's fd numbers; if the entry is evicted
between the reply and the client's open of /proc/<server pid>/fd/<n>, the freed numbers go
to the next loader's segments, and two fine-tunes of one architecture have identical
segment sizes, so the client rebuilds model A's skeleton over model B's weights.

Two tiny Llama LMs (one config, seeds 1 and 2) go into a temp folder; a private server gets
a budget of ``--budget-models`` (1.5) entries, so only one fits. An entry's size is measured
first, by one patched load against a probe server: it is not the file's size (a load_file
entry of this LM maps the file and copies its tensors under 64 KiB into a memfd beside it,
1.8 x the file). ``--workers`` processes, patched with ``OVERMIND_COLD=wait``, load A or B
at random and hash every tensor; a thread here sends ``Evict(all)`` every ``--evict-every``
s on average. Each load is ``correct``, ``wrong`` (the other model's bytes), ``garbage`` or
``error``; ``cached``: its tensors all lie in segments that this load mapped from the
server's reply (memfds or the model file); ``plain``: correct but not cached, a fallback to
the original loader (overmind warns once per process, so mappings are checked, not warnings).
Exit status 1 if a load was wrong or garbage, else 2 if a load raised, a worker failed or
no load was served from the cache (the check would be vacuous).

``--api load_file`` (default): ``safetensors.torch.load_file(<dir>/model.safetensors)``, a
cold fill ~60 ms; 5,000 loads took 279 s on 2 cores (2026-11-27: 1,001 served from the
cache, the rest fallbacks after evictions, 0 wrong). ``--api from_pretrained``:
``AutoModelForCausalLM.from_pretrained(<dir>)``, same race, but a cold fill of the tiny LM
took ~1.9 s in the loader here, so the evictor defaults to 1 s; a load took 1.6 s (median
of 300 with 2 workers).
``--widen-ms`` (20; 0: off): workers sleep up to that long between the Entry reply and
opening its segments, like a descheduled client; without it the race is rarely hit.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def tensors(obj) -> dict:
    return obj if isinstance(obj, dict) else obj.state_dict()


def digest(obj) -> str:
    import torch

    h = hashlib.blake2b(digest_size=16)
    for name, t in sorted(tensors(obj).items()):
        h.update(name.encode())
        h.update(memoryview(t.detach().contiguous().view(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


# Address ranges of the segments mapped from the server's replies during the current load.
# A plain load_file maps the model file MAP_PRIVATE too, so /proc/self/maps cannot tell a hit
# served from a file segment from a fallback: the mappings themselves are recorded.
mapped: list[tuple[int, int]] = []


def record_mappings() -> None:
    """Record every segment mapping ``LoadingConnection.map_segments`` hands back."""
    import ctypes

    from overmind.client.connection import LoadingConnection

    original = LoadingConnection.map_segments

    def map_segments(self, *args, **kwargs):
        mappings = original(self, *args, **kwargs)
        for m in mappings:
            if m is not None and len(m):
                view = ctypes.c_char.from_buffer(m)  # released at once: a live export blocks close()
                mapped.append((ctypes.addressof(view), len(m)))
                del view
        return mappings
    LoadingConnection.map_segments = map_segments


def served_by_cache(obj) -> bool:
    """Does every tensor lie in a segment this load mapped from the server's reply?"""
    starts = sorted(mapped)
    for t in tensors(obj).values():
        if t.nbytes:
            i = bisect.bisect_right(starts, (t.data_ptr(), float("inf"))) - 1
            if i < 0 or t.data_ptr() + t.nbytes > starts[i][0] + starts[i][1]:
                return False
    return True


def loader(api: str):
    if api == "load_file":
        from safetensors.torch import load_file

        return lambda path: load_file(os.path.join(path, "model.safetensors"))
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained


def widen(ms: float) -> None:
    """Sleep up to ``ms`` between the Entry reply and the segment opens (fault injection)."""
    from overmind.client.connection import LoadingConnection

    original = getattr(LoadingConnection, "map_segments", None)
    if original is None:
        print("wrong_model_stress: no LoadingConnection.map_segments; --widen-ms has no effect", file=sys.stderr)
        return

    def map_segments(self, *args, **kwargs):
        time.sleep(random.uniform(0, ms / 1e3))
        return original(self, *args, **kwargs)
    LoadingConnection.map_segments = map_segments


def worker(args: argparse.Namespace, index: int, count: int, paths: list[str], digests: list[str]) -> None:
    import warnings

    import torch

    torch.set_num_threads(1)
    import overmind.api

    overmind.api.monkey_patch_all()
    load = loader(args.api)
    if args.widen_ms > 0:
        widen(args.widen_ms)
    record_mappings()
    rng = random.Random(index)  # its own A/B sequence: fills of both models overlap
    for _ in range(count):
        which = rng.randrange(2)
        mapped.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            try:
                model = load(paths[which])
            except Exception as err:
                print(json.dumps({"result": "error", "error": f"{type(err).__name__}: {err}"[:300]}), flush=True)
                continue
            seconds = time.perf_counter() - t0
        d = digest(model)
        result = "correct" if d == digests[which] else "wrong" if d == digests[1 - which] else "garbage"
        warned = [str(w.message)[:300] for w in caught if str(w.message).startswith("overmind:")]
        print(json.dumps({"result": result, "model": "AB"[which], "cached": served_by_cache(model), "seconds": seconds,
                          "warnings": warned}), flush=True)
        del model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--loads", type=int, default=5000, help="loads in all, shared by the workers")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--api", choices=("load_file", "from_pretrained"), default="load_file")
    parser.add_argument("--budget-models", type=float, default=1.5,
                        help="server budget, in entries (one is measured by a probe load)")
    parser.add_argument("--evict-every", type=float, help="mean seconds between Evict(all); 0: none "
                        "(default 0.005, or 1 with --api from_pretrained)")
    parser.add_argument("--widen-ms", type=float, default=20.0, help="max sleep between reply and segment open")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)  # INDEX COUNT PATHS DIGESTS (internal)
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # PATH: one patched load, to size an entry (internal)
    args = parser.parse_args()
    if args.probe:
        import overmind.api

        overmind.api.monkey_patch_all()
        loader(args.api)(args.probe)
        return 0
    if args.evict_every is None:
        args.evict_every = 1.0 if args.api == "from_pretrained" else 0.005
    if args.worker:
        try:
            worker(args, int(args.worker[0]), int(args.worker[1]), *map(json.loads, args.worker[2:]))
        except (KeyboardInterrupt, BrokenPipeError):
            pass
        return 0

    def on_term(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, on_term)
    root = Path(tempfile.mkdtemp(prefix="om-wm-", dir="/tmp"))  # short: AF_UNIX paths are limited to 108 bytes
    server, procs, stop = None, [], threading.Event()
    try:
        import torch
        from transformers.utils import logging as hf_logging

        from overmind import modelgen
        from overmind.bench.harness import BenchServer
        from overmind.shared import protocol as P
        from overmind.client.connection import LoadingConnection
        from overmind.shared.settings.config import Config

        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        paths = [str(modelgen.save_lm(root / name, size="tiny", seed=seed)) for name, seed in (("a", 1), ("b", 2))]
        modelgen.age_files(root / "a", root / "b")
        digests = [digest(loader(args.api)(p)) for p in paths]  # plain loads: nothing is patched here
        assert digests[0] != digests[1]
        model_bytes = max(sum(f.stat().st_size for f in Path(p).glob("*.safetensors")) for p in paths)

        # The budget is in entries as the server counts them, so it is measured: one patched load
        # against a probe server with the default budget (half of RAM).
        with BenchServer.start({"OVERMIND_RESTORE": "0"}) as probe:
            subprocess.run([sys.executable, os.path.abspath(__file__), "--api", args.api, "--probe", paths[0]],
                           env=probe.client_env({"OVERMIND_COLD": "wait", "OMP_NUM_THREADS": "1"}), check=True)
            entry_bytes = probe.status()["bytes"]
        if not entry_bytes:
            raise RuntimeError("the probe load left nothing in the cache; see the probe's warnings above")
        budget = int(args.budget_models * entry_bytes)
        print(f"one entry: {entry_bytes} bytes (the model file: {model_bytes}); budget {budget} bytes",
              file=sys.stderr, flush=True)

        env = {k: v for k, v in os.environ.items() if k not in ("OVERMIND_STRICT", "OVERMIND_DISABLE")}
        # Private runtime and state dirs, nothing restored: the server starts empty.
        env.update(OVERMIND_RUNTIME_DIR=str(root / "rt"), OVERMIND_STATE_DIR=str(root / "state"), OVERMIND_RESTORE="0",
                   OVERMIND_NO_AUTOSTART="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
        server = subprocess.Popen([sys.executable, "-m", "overmind.server", "--foreground", "--max-memory",
                                   str(budget)], env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                  start_new_session=True)
        if "ready" not in server.stdout.readline():
            log = root / "rt" / "server.log"
            raise RuntimeError(f"overmind-server did not start:\n{log.read_text()[-2000:] if log.exists() else ''}")
        config = Config.from_env(env)
        evicted = [0, 0]  # Evict(all) requests, entries they dropped

        def evictor() -> None:
            with LoadingConnection.open(config, role="cli", autostart=False) as conn:
                while not stop.wait(random.uniform(0, 2 * args.evict_every)):
                    evicted[0] += 1
                    evicted[1] += len(conn.simple(P.Evict(all=True), P.Evicted).keys)

        counts = dict.fromkeys(("loads", "correct", "wrong", "garbage", "error", "plain", "cached"), 0)
        times, bad, reasons, lock, started = [], [], {}, threading.Lock(), time.monotonic()

        def reader(proc: subprocess.Popen) -> None:
            for text in proc.stdout:
                try:
                    rec = json.loads(text)
                except ValueError:
                    continue
                with lock:
                    counts["loads"] += 1
                    counts[rec["result"]] += 1
                    counts["plain"] += rec["result"] == "correct" and not rec["cached"]
                    counts["cached"] += rec.get("cached", False)
                    times.extend([rec["seconds"]] if "seconds" in rec else [])
                    for w in rec.get("warnings", ()):
                        reasons[w.split(" (")[0]] = reasons.get(w.split(" (")[0], 0) + 1
                    if rec["result"] != "correct" and len(bad) < 10:
                        bad.append(rec)
                    if counts["loads"] % 500 == 0:
                        print(f"[{time.monotonic() - started:6.1f}s] {counts['loads']} loads: {counts['correct']} "
                              f"correct, {counts['wrong']} wrong, {counts['garbage']} garbage, {counts['error']} "
                              f"errors, {counts['plain']} plain", file=sys.stderr, flush=True)

        wenv = {**env, "OVERMIND_COLD": "wait", "OMP_NUM_THREADS": "1"}
        threads = []
        for i in range(args.workers):
            share = args.loads // args.workers + (i < args.loads % args.workers)
            with open(root / f"worker{i}.log", "w") as err:
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--api", args.api, "--widen-ms", str(args.widen_ms),
                     "--worker", str(i), str(share), json.dumps(paths), json.dumps(digests)],
                    env=wenv, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True))
            threads.append(threading.Thread(target=reader, args=(procs[-1],), daemon=True))
            threads[-1].start()
        ev = threading.Thread(target=evictor, daemon=True)
        if args.evict_every > 0:
            ev.start()
        for proc, thread in zip(procs, threads):
            proc.wait()
            thread.join()
        elapsed = time.monotonic() - started
        stop.set()
        if ev.is_alive():
            ev.join(timeout=10)
        with LoadingConnection.open(config, role="cli", autostart=False) as conn:
            status = conn.simple(P.Status(), P.StatusReply).info
        failed = {i: p.returncode for i, p in enumerate(procs) if p.returncode != 0}
        for i in failed:
            print(f"worker {i} exited {failed[i]}:\n{(root / f'worker{i}.log').read_text()[-3000:]}", file=sys.stderr)
        times.sort()
        results = {
            **counts, "elapsed_s": round(elapsed, 1), "workers": args.workers, "api": args.api,
            "widen_ms": args.widen_ms, "evict_every_s": args.evict_every, "model_bytes": model_bytes,
            "entry_bytes": entry_bytes, "budget": budget,
            "evict_alls": evicted[0], "evicted_by_evictor": evicted[1], "server_hits": status["hits"],
            "server_misses": status["misses"], "server_evictions": status["evictions"],
            "load_ms_median": round(1e3 * times[len(times) // 2], 2) if times else None,
            "load_ms_p99": round(1e3 * times[int(len(times) * 0.99)], 2) if times else None,
            "fallback_warnings": reasons, "bad_samples": bad, "failed_workers": failed,
            "when": time.strftime("%Y-%m-%d %H:%M"),
        }
        print(json.dumps(results))
        print(f"{counts['loads']} loads ({args.api}) in {elapsed:.1f}s by {args.workers} workers: {counts['correct']} "
              f"correct, {counts['wrong']} WRONG (the other model), {counts['garbage']} garbage, {counts['error']} "
              f"errors; {counts['cached']} served from the cache, {counts['plain']} plain (fallbacks); server: "
              f"{status['hits']} hits, {status['misses']} misses, {status['evictions']} evictions ({evicted[1]} by "
              f"{evicted[0]} Evict(all))", file=sys.stderr)
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
        if counts["wrong"] + counts["garbage"]:
            return 1
        if not counts["cached"]:
            print("no load was served from the cache: the check exercised nothing", file=sys.stderr)
            return 2
        return 2 if counts["error"] or failed or counts["loads"] != args.loads else 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        stop.set()
        for proc in [*procs, server]:
            if proc is not None and proc.poll() is None:
                proc.terminate()
        for proc in [*procs, server]:
            if proc is not None:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
