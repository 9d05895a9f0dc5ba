"""Host-to-device bandwidth of ``.to('cuda')``: a plain load, a warm hit from the overmind cache,
and the same bytes pinned.

    python3 benchmarks/h2d.py [--scale base] [--cache-dir DIR] [--loaders diffusers,safetensors]
                              [--repeats 1] [--json FILE]

The model is the SD1.5-size UNet of the bench's generated pipeline (overmind.bench.models
``sd``, fp16, 1.7 GB at ``--scale base``; generated into ``--cache-dir`` unless the bench made
it already). Loaders: ``diffusers`` (``UNet2DConditionModel.from_pretrained(sd, subfolder="unet",
torch_dtype=float16)``) and ``safetensors`` (``safetensors.torch.load_file`` of the same weights
file: a state dict, no diffusers import). Without diffusers, a synthetic file of the same size
stands in and only the ``safetensors`` loader runs.

Every measurement is a fresh process. Per loader: ``plain`` (no overmind), then ``fill`` (the
first ``monkey_patch_all()`` load, waiting for the cache: ``OVERMIND_COLD=wait``), then ``hit``
(a warm hit: checked with ``overmind.api.cache_key_of``, or for a state dict, which it cannot follow,
with the server's counters). Each loader has a private server of its own
(overmind.bench.harness.BenchServer, Note [The bench's own server]). Each
process creates its CUDA context first (not timed), then, each bracketed by
``torch.cuda.synchronize()``:

- ``to_cuda``: ``.to('cuda')`` of the loaded object, as a script does it (allocation included;
  a hit's pages are first touched here);
- ``copy_again``: the same CPU tensors copied again into CUDA tensors allocated beforehand (every
  page now resident);
- ``pinned`` (plain only): the same bytes ``pin_memory()``'d first (its time is ``pin_s``), then
  copied with ``non_blocking=True``.

GB/s are whole bytes (the tensors' numel x element size) over seconds, 1e9 bytes a GB. Prints
one JSON document; without CUDA it prints ``{"status": "skipped", "reason": "skipped: no CUDA"}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

MARK = "@h2d-json "
SYNTHETIC_BYTES = 1_719_000_000  # an SD1.5 UNet in fp16


# -- one measured process ------------------------------------------------------------------------


def _tensors(obj):
    import torch

    if isinstance(obj, torch.nn.Module):
        found = [*obj.parameters(), *obj.buffers()]
    elif isinstance(obj, dict):
        found = [v for v in obj.values() if isinstance(v, torch.Tensor)]
    else:
        raise TypeError(f"cannot find the tensors of a {type(obj).__name__}")
    seen, out = set(), []
    for t in found:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _load(loader: str, path: str):
    import torch

    if loader == "diffusers":
        from diffusers import UNet2DConditionModel

        return UNet2DConditionModel.from_pretrained(path, subfolder="unet", torch_dtype=torch.float16)
    from safetensors.torch import load_file

    return load_file(path)


def child(mode: str, loader: str, path: str, device: str) -> dict:
    if mode != "plain":
        import overmind.api

        overmind.api.monkey_patch_all()
    import torch

    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    start = time.perf_counter()
    obj = _load(loader, path)
    load_s = time.perf_counter() - start
    hit = None
    if mode != "plain":
        import overmind.api

        # cache_key_of cannot follow a dict (no weak references): the parent reads the server's counters then
        hit = overmind.api.cache_key_of(obj) is not None if not isinstance(obj, dict) else None
    tensors = _tensors(obj)
    cpu = [t.detach() for t in tensors]  # keeps the CPU storages: Module.to swaps each parameter's data
    nbytes = sum(t.numel() * t.element_size() for t in cpu)
    if cuda:
        torch.cuda.init()
        torch.empty(1, device=device)  # the context, outside every timing
        sync()

    def rate(seconds: float) -> dict:
        return {"s": seconds, "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else None}

    start = time.perf_counter()
    if isinstance(obj, torch.nn.Module):
        moved = obj.to(device) if cuda else [t.clone() for t in cpu]
    else:
        moved = {k: v.to(device) if cuda else v.clone() for k, v in obj.items()}
    sync()
    out = {"mode": mode, "loader": loader, "bytes": nbytes, "tensors": len(cpu), "load_s": load_s, "hit": hit,
           "to_cuda": rate(time.perf_counter() - start)}
    del moved
    dst = [torch.empty_like(t, device=device) for t in cpu]
    sync()
    start = time.perf_counter()
    for d, s in zip(dst, cpu):
        d.copy_(s)
    sync()
    out["copy_again"] = rate(time.perf_counter() - start)
    if mode == "plain" and cuda:
        start = time.perf_counter()
        pinned = [t.pin_memory() for t in cpu]
        out["pin_s"] = time.perf_counter() - start
        sync()
        start = time.perf_counter()
        for d, s in zip(dst, pinned):
            d.copy_(s, non_blocking=True)
        sync()
        out["pinned"] = rate(time.perf_counter() - start)
    if cuda:
        out["device"] = torch.cuda.get_device_name(torch.device(device))
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    return out


# -- the parent ----------------------------------------------------------------------------------


def _model(cache_dir: Path, scale: str, loaders: list, say) -> tuple:
    """(the path each loader is given, the loaders that can run, a note)."""
    try:
        import diffusers  # noqa: F401
    except Exception as err:  # noqa: BLE001 -- any failure: no diffusers here
        path = cache_dir / "h2d-synthetic" / "unet.safetensors"
        if not path.exists():
            import torch
            from safetensors.torch import save_file

            say(f"no diffusers ({type(err).__name__}: {err}); writing a synthetic {SYNTHETIC_BYTES / 1e9:.2f} GB file")
            path.parent.mkdir(parents=True, exist_ok=True)
            n = 1280 * 3360
            count = SYNTHETIC_BYTES // (2 * n)
            g = torch.Generator().manual_seed(0)
            state = {f"w{i:04d}": torch.randn(1280, 3360, generator=g, dtype=torch.float32).half() for i in range(count)}
            tmp = path.with_suffix(".tmp")
            save_file(state, str(tmp))
            os.rename(tmp, path)
        stamp = time.time() - 60  # Note [Racy files] in overmind.shared.calls.keys
        os.utime(path, (stamp, stamp))
        return {"safetensors": str(path)}, ["safetensors"], "synthetic file: diffusers is not importable"
    from overmind.bench.models import ensure_models

    sd = ensure_models(cache_dir, scale, ["sd"], progress=False)["sd"]
    weights = sorted((sd / "unet").glob("*.safetensors"))
    paths = {"diffusers": str(sd), "safetensors": str(weights[0]) if weights else None}
    usable = [name for name in loaders if paths.get(name)]
    return paths, usable, f"the bench's generated sd pipeline ({scale}): {sd}"


def _run_child(argv: list, env: dict, timeout: float) -> dict:
    proc = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                          cwd="/tmp")
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return {**json.loads(line[len(MARK):]), "stderr_tail": proc.stderr[-600:] if proc.stderr else ""}
    raise RuntimeError(f"exited {proc.returncode} without a result:\n{proc.stderr[-3000:]}")


def _median(runs: list, key: str):
    values = [r[key]["gb_per_s"] for r in runs if r.get(key) and r[key]["gb_per_s"] is not None]
    return statistics.median(values) if values else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", default="base", help="overmind.bench.models scale (default base: SD1.5 sizes)")
    parser.add_argument("--cache-dir", type=Path, help="where the bench's models are (default OVERMIND_BENCH_CACHE)")
    parser.add_argument("--loaders", default="diffusers,safetensors")
    parser.add_argument("--repeats", type=int, default=1, help="plain and hit processes per loader")
    parser.add_argument("--device", default="cuda", help="cuda[:N]; cpu only checks the plumbing (clones, no GB/s "
                                                          "worth reading)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per process")
    parser.add_argument("--json", type=Path, help="also write the document here")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--loader", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(child(args.child, args.loader, args.path, args.device)), flush=True)
        sys.stdout.flush()
        os._exit(0)  # no teardown of torch and the mapped segments to wait for

    def say(line: str) -> None:
        print(f"[h2d {time.monotonic() - started:6.1f} s] {line}", file=sys.stderr, flush=True)

    started = time.monotonic()
    doc: dict = {"status": "ok", "argv": sys.argv, "device": args.device}

    def finish(code: int) -> int:
        doc["wall_s"] = time.monotonic() - started
        text = json.dumps(doc, indent=2, default=str)
        print(text, flush=True)
        if args.json:
            args.json.write_text(text + "\n")
        return code

    import torch

    doc["torch"] = torch.__version__
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        doc.update(status="skipped", reason="skipped: no CUDA",
                   detail=f"torch {torch.__version__}, built for CUDA {torch.version.cuda}")
        return finish(0)
    from overmind.bench.harness import BenchServer, base_env
    from overmind.bench.models import default_cache_dir

    cache_dir = (args.cache_dir or default_cache_dir()).expanduser().resolve()
    loaders = [n.strip() for n in args.loaders.split(",") if n.strip()]
    paths, loaders, doc["model"] = _model(cache_dir, args.scale, loaders, say)
    doc["loaders"] = {}
    failed = False
    for loader in loaders:
        entry = doc["loaders"][loader] = {"path": paths[loader], "runs": [], "status": "ok"}
        # A server of its own per loader: a warm interpreter that learned diffusers' imports from the
        # diffusers runs would otherwise be the one to fill the state dict's load too.
        server = BenchServer.start()
        say(f"{loader}: private overmind-server pid {server.pid} in {server.runtime_dir}")
        argv = [sys.executable, os.path.abspath(__file__), "--loader", loader, "--path", paths[loader],
                "--device", args.device, "--child"]
        plan = [*["plain"] * args.repeats, "fill", *["hit"] * args.repeats]
        try:
            for mode in plan:
                env = base_env() if mode == "plain" else server.client_env(
                    {"OVERMIND_COLD": "wait"} if mode == "fill" else {})
                before = server.status() if mode != "plain" else {}
                run = _run_child([*argv, mode], env, args.timeout)
                if mode != "plain":
                    after = server.status()
                    run["server_hits"] = after.get("hits", 0) - before.get("hits", 0)
                    run["server_misses"] = after.get("misses", 0) - before.get("misses", 0)
                    if run["hit"] is None:
                        run["hit"] = run["server_hits"] > 0 and run["server_misses"] == 0
                if mode == "fill":
                    server.wait_idle(timeout=args.timeout)
                entry["runs"].append(run)
                figures = ", ".join(f"{k} {run[k]['gb_per_s']:.2f} GB/s" for k in ("to_cuda", "copy_again", "pinned")
                                    if run.get(k) and run[k]["gb_per_s"])
                say(f"{loader} {mode}: {run['bytes']} bytes, load {run['load_s']:.2f} s, {figures}"
                    f"{'' if run['hit'] is None else ', hit' if run['hit'] else ', NOT a hit'}")
        except Exception as err:  # noqa: BLE001 -- recorded, the next loader still runs
            entry.update(status="failed", reason=f"{type(err).__name__}: {err}"[-3000:])
            say(f"{loader}: FAILED: {entry['reason'].splitlines()[0]}")
            failed = True
        finally:
            entry["server_log_tail"] = server.log()[-3000:]
            server.stop()
        plain = [r for r in entry["runs"] if r["mode"] == "plain"]
        hits = [r for r in entry["runs"] if r["mode"] == "hit"]
        entry["summary"] = {
            "bytes": entry["runs"][0]["bytes"] if entry["runs"] else None,
            "plain_to_cuda_gb_s": _median(plain, "to_cuda"),
            "hit_to_cuda_gb_s": _median(hits, "to_cuda"),
            "pinned_gb_s": _median(plain, "pinned"),
            "plain_copy_again_gb_s": _median(plain, "copy_again"),
            "hit_copy_again_gb_s": _median(hits, "copy_again"),
            "hit_was_a_hit": all(r["hit"] for r in hits) if hits else None,
        }
    if failed:
        doc["status"] = "failed"
    return finish(1 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
