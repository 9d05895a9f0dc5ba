"""Cost of checking that a hit is fresh, for a 20-file model folder (at most 2 ms).

    python benchmarks/fingerprint.py       # one JSON document on stdout, PASS or FAIL on stderr

Client side: ``overmind.shared.calls.keys.fingerprint_paths`` (walk + stat of the folder the call
names, part of every key). Server side: ``files_unchanged``, what ``CacheEntry.fresh`` asks
(stat of every file the loader observed). Medians of 200 runs each, page cache and dentry cache warm.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overmind.server.registry import files_unchanged
from overmind.shared.calls.keys import CTIME_RACY_SECONDS, file_fingerprint, fingerprint_paths


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "model"
        for i in range(20):
            sub = root / (f"part{i % 4}" if i % 2 else "")
            sub.mkdir(parents=True, exist_ok=True)
            (sub / f"file{i}.bin").write_bytes(os.urandom(1024))
        old = time.time() - 100
        for p in root.rglob("*"):
            os.utime(p, (old, old))
        time.sleep(2 * CTIME_RACY_SECONDS)  # files saved a while ago, not racy (Note [Racy files])
        files = [list(file_fingerprint(str(p), p.stat())) for p in root.rglob("*") if p.is_file()]
        assert files_unchanged(files), "the server's check must see these files unchanged, or it times a refusal"

        def median_ms(fn) -> float:
            times = []
            for _ in range(200):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return statistics.median(times) * 1000

        result = {
            "files": len(files),
            "client_fingerprint_ms": median_ms(lambda: fingerprint_paths([str(root)])),
            "server_fresh_check_ms": median_ms(lambda: files_unchanged(files)),
        }
    print(json.dumps(result, indent=2))
    ok = result["client_fingerprint_ms"] + result["server_fresh_check_ms"] <= 2.0
    print(f"fingerprint check: {result['client_fingerprint_ms']:.3f} + {result['server_fresh_check_ms']:.3f} ms "
          f"for {len(files)} files (<= 2 ms): {'PASS' if ok else 'FAIL'}", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
