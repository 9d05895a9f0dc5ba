"""The state file: its format, its checks, its directory's permissions, atomic saves.

Note [The state file] and Note [Atomic, rate-limited saves] in overmind.server.state.
"""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from overmind.shared import protocol as P
from overmind.server.loads import check_modules, check_request
from overmind.shared.settings.config import Config, ConfigError, default_state_dir
from overmind.server.pool import WarmPool, context_from_wire
from overmind.server.programs import ProgramHistory
from overmind.server.state import (FORMAT, VERSION, StateError, StateKeeper, open_state_dir, parse_state, read_state,
                            remove_leftovers, write_state)

CHECKS = (check_request, context_from_wire, check_modules)


def _entry(tmp_path: Path, key: str = "a" * 32, **load) -> dict:
    fields = {"key": key, "target": "transformers:AutoModel.from_pretrained", "description": "AutoModel(...)",
              "context": {"python": sys.executable, "cwd": str(tmp_path), "sys_path": [], "env": {"HOME": "/x"}},
              "refs": [], "wait": False, **load}
    return {"load": P.Load(**fields).to_dict(), "blob": base64.b64encode(b"the pickled call").decode(),
            "files": [[str(tmp_path / "model.safetensors"), 10, 1, 2, 3, 4]], "bytes": 1000, "last_used": 5.0,
            "plain_seconds": 0.5}


def _doc(tmp_path: Path, entries=None, contexts=None, **top) -> bytes:
    contexts = contexts if contexts is not None else [
        {"python": sys.executable, "env": {"HOME": "/x", "DISPLAY": ":0"}, "modules": ["torch", "diffusers"],
         "refused": [], "reads": {"names": ["TORCHINDUCTOR_CACHE_DIR"], "prefixes": []}, "last_used": 4.0,
         "interpreters": [{"values": {"TORCHINDUCTOR_CACHE_DIR": "/c"}, "last_used": 4.0}]}]
    doc = {"format": FORMAT, "version": VERSION, "saved": 6.0, "contexts": contexts,
           "entries": entries if entries is not None else [_entry(tmp_path)],
           "programs": [["p" * 16, ["a" * 32]]], **top}
    return json.dumps(doc).encode()


def test_a_state_file_gives_back_the_call_as_the_client_sent_it(tmp_path):
    state = parse_state(_doc(tmp_path), *CHECKS)
    assert state.dropped == 0 and state.saved == 6.0
    (entry,) = state.entries
    assert entry["call"] == b"the pickled call"
    assert isinstance(entry["request"], P.Load) and entry["request"].key == "a" * 32
    assert entry["request"].context["cwd"] == str(tmp_path) and entry["bytes"] == 1000
    (context,) = state.contexts
    assert context["env"] == {"HOME": "/x"}  # what a client sends: the selecting environment only
    assert context["modules"] == ["torch", "diffusers"]
    assert context["reads"] == {"names": ["TORCHINDUCTOR_CACHE_DIR"], "prefixes": []}
    assert state.programs == [["p" * 16, ["a" * 32]]]


@pytest.mark.parametrize("data, says", [
    (b'{"format": "overmind-state", "version": 1, "entries": [{"lo', "truncated or corrupt"),
    (bytes(range(256)) * 4, "not JSON"),
    (b'{"format": "overmind-state", "version": 2}', "version 2; this server reads version 1"),
    (b'{"format": "something else", "version": 1}', "not an overmind state file"),
    (b'[1, 2, 3]', "not an overmind state file"),
])
def test_a_truncated_corrupt_or_foreign_file_is_refused_whole(data, says):
    with pytest.raises(StateError, match=says):
        parse_state(data, *CHECKS)


@pytest.mark.parametrize("spoil", [
    lambda e: e["load"].update(key="../../etc"),  # not a key a client computes
    lambda e: e["load"].update(key="b" * 65),
    lambda e: e["load"].update(lookup_only=True),
    lambda e: e["load"].update(refs=["c" * 32] * 300),  # more references than a client may send
    lambda e: e["load"]["context"].update(python="python3"),  # not an absolute executable
    lambda e: e["load"]["context"].update(cwd="/no/such/dir"),
    lambda e: e["load"].update(surprise=1),  # a field no Load has
    lambda e: e.update(blob="not base64!"),
    lambda e: e.update(files=[["path", "10", 1, 2, 3, 4]]),
    lambda e: e.update(bytes=-1),
    lambda e: e.update(last_used="yesterday"),
])
def test_an_entry_a_client_could_not_ask_for_is_dropped(tmp_path, spoil):
    bad = _entry(tmp_path, key="d" * 32)
    spoil(bad)
    state = parse_state(_doc(tmp_path, entries=[_entry(tmp_path), bad]), *CHECKS)
    assert [e["request"].key for e in state.entries] == ["a" * 32] and state.dropped == 1


@pytest.mark.parametrize("spoil", [
    lambda c: c.update(python="/no/such/python"),
    lambda c: c.update(env={"HOME": 1}),
    lambda c: c.update(modules=["torch", 3]),
    lambda c: c.update(modules=["x"] * 20001),  # more than a client's Prepare may teach
])
def test_a_context_a_client_could_not_send_is_dropped(tmp_path, spoil):
    context = {"python": sys.executable, "env": {}, "modules": [], "refused": [], "last_used": 1.0}
    spoil(context)
    state = parse_state(_doc(tmp_path, contexts=[context]), *CHECKS)
    assert state.contexts == [] and state.dropped == 1


# -- the directory and the file ------------------------------------------------------------------


def test_the_state_dir_is_created_private(tmp_path):
    path = tmp_path / "a" / "state"
    os.close(open_state_dir(path))
    assert (os.stat(path).st_mode & 0o777) == 0o700


def test_a_state_dir_others_can_write_is_refused_never_chmod_ed(tmp_path):
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    path.chmod(0o770)
    with pytest.raises(ConfigError, match="open to other users.*OVERMIND_STATE_DIR"):
        open_state_dir(path)
    assert (os.stat(path).st_mode & 0o777) == 0o770
    path.chmod(0o755)  # others may read (the file itself is 0600), not write
    os.close(open_state_dir(path))


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another uid needs root")
def test_a_state_dir_of_another_uid_is_refused(tmp_path):
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)
    with pytest.raises(ConfigError, match="belongs to uid 65534"):
        open_state_dir(path)


def test_a_state_dir_that_is_a_symlink_is_refused(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="not a directory"):
        open_state_dir(tmp_path / "link")


def test_a_state_file_that_is_a_link_another_uids_or_writable_by_others_is_refused(tmp_path):
    dir_fd = open_state_dir(tmp_path / "state")
    try:
        write_state(dir_fd, "s.json", b"{}")
        assert read_state(dir_fd, "s.json") == b"{}"
        assert (os.stat(tmp_path / "state" / "s.json").st_mode & 0o777) == 0o600
        assert read_state(dir_fd, "none.json") is None
        (tmp_path / "secret").write_text("{}")
        os.symlink(tmp_path / "secret", tmp_path / "state" / "link.json")
        with pytest.raises(StateError, match="symlink"):
            read_state(dir_fd, "link.json")
        os.chmod(tmp_path / "state" / "s.json", 0o620)
        with pytest.raises(StateError, match="others can write it"):
            read_state(dir_fd, "s.json")
        if os.getuid() == 0:
            os.chmod(tmp_path / "state" / "s.json", 0o600)
            os.chown(tmp_path / "state" / "s.json", 65534, 65534)
            with pytest.raises(StateError, match="belongs to uid 65534"):
                read_state(dir_fd, "s.json")
            write_state(dir_fd, "s.json", b"[]")  # replaced, never written through
            assert os.stat(tmp_path / "state" / "s.json").st_uid == 0
        write_state(dir_fd, "link.json", b"[]")  # a planted link is replaced, its target untouched
        assert (tmp_path / "secret").read_text() == "{}" and not os.path.islink(tmp_path / "state" / "link.json")
    finally:
        os.close(dir_fd)


SAVER = """
import os, sys
from overmind.server.state import open_state_dir, write_state
dir_fd = open_state_dir(sys.argv[1])
versions = [(b'{"v": %d, "pad": "' % i) + b"x" * (4 << 20) + b'"}' for i in range(2)]
i = 0
print("saving", flush=True)
while True:
    write_state(dir_fd, "state.json", versions[i % 2])
    i += 1
"""


def test_a_save_killed_at_any_moment_leaves_a_whole_file(tmp_path):
    """kill -9 during saves of 4 MB: the file is always one whole version, never a torn one."""
    state = tmp_path / "state"
    dir_fd = open_state_dir(state)
    write_state(dir_fd, "state.json", b'{"v": -1}')
    rng = random.Random(23)
    seen = set()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    try:
        for _ in range(12):
            proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(SAVER), str(state)], env=env,
                                    stdout=subprocess.PIPE)
            assert proc.stdout.readline() == b"saving\n"
            time.sleep(rng.uniform(0.0, 0.15))
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            proc.stdout.close()
            data = read_state(dir_fd, "state.json")
            seen.add(json.loads(data)["v"])  # raises on a torn file
        assert seen & {0, 1}, seen  # the saves did replace it
        assert remove_leftovers(dir_fd, "state.json") >= 0
        assert [n for n in os.listdir(state) if n.endswith(".tmp")] == []
    finally:
        os.close(dir_fd)


# -- the keeper --------------------------------------------------------------------------------


class _Registry:
    budget = 1 << 30

    def __init__(self):
        self.used = {}

    def recency(self):
        return dict(self.used)


def _keeper(tmp_path: Path) -> StateKeeper:
    config = Config(tmp_path / "run", state_dir=tmp_path / "state")
    return StateKeeper(config, _Registry(), WarmPool(config), ProgramHistory())  # a pool that started nothing


class _Entry:
    def __init__(self, tmp_path):
        self.meta = P.LoadMeta(files=[[str(tmp_path / "m"), 1, 2, 3, 4, 5]])
        self.nbytes = 123
        self.last_used = 7.0


def test_the_keeper_replaces_a_spoiled_file_with_a_good_one_after_one_warning(tmp_path, caplog):
    keeper = _keeper(tmp_path)
    (tmp_path / "state").mkdir(mode=0o700)
    keeper.config.state_path.write_bytes(b'{"format": "overmind-state", "vers')
    with caplog.at_level("WARNING", logger="overmind.server.state"):
        assert keeper.open(*CHECKS) is None
    assert len(caplog.records) == 1 and "truncated or corrupt" in caplog.records[0].getMessage()
    request = P.Load(**_entry(tmp_path)["load"])
    keeper.record(request, b"call", _Entry(tmp_path))
    assert keeper.save_if_changed() and not keeper.save_if_changed()  # nothing changed: not written again
    state = parse_state(keeper.config.state_path.read_bytes(), *CHECKS)
    (entry,) = state.entries
    assert entry["call"] == b"call" and entry["bytes"] == 123 and entry["last_used"] == 7.0
    assert entry["request"].wait is False
    keeper.registry.used[request.key] = 9.0  # a hit moves it
    assert keeper.save_if_changed()
    assert parse_state(keeper.config.state_path.read_bytes(), *CHECKS).entries[0]["last_used"] == 9.0
    keeper.close()


def test_a_keeper_whose_dir_is_refused_keeps_nothing_and_says_why(tmp_path, caplog):
    keeper = _keeper(tmp_path)
    (tmp_path / "state").mkdir(mode=0o777)
    os.chmod(tmp_path / "state", 0o777)
    with caplog.at_level("WARNING", logger="overmind.server.state"):
        assert keeper.open(*CHECKS) is None
    assert len(caplog.records) == 1 and "open to other users" in caplog.records[0].getMessage()
    assert not keeper.enabled and not keeper.save_if_changed()
    assert os.listdir(tmp_path / "state") == []


# -- settings ----------------------------------------------------------------------------------


def test_state_dir_and_restore_settings():
    assert default_state_dir({"OVERMIND_STATE_DIR": "/s"}) == Path("/s")
    assert default_state_dir({"XDG_STATE_HOME": "/x", "HOME": "/h"}) == Path("/x/overmind")
    assert default_state_dir({"XDG_STATE_HOME": "rel", "HOME": "/h"}) == Path("/h/.local/state/overmind")
    base = {"HOME": "/h"}
    config = Config.from_env(base)
    assert (config.restore_bytes, config.restore_share) == (None, 1.0)
    assert config.state_path.parent == Path("/h/.local/state/overmind")
    other = Config.from_env({**base, "OVERMIND_RUNTIME_DIR": "/tmp/other"})
    assert other.state_path != config.state_path  # one state per server
    assert (Config.from_env({**base, "OVERMIND_RESTORE": "0"}).restore_bytes,
            Config.from_env({**base, "OVERMIND_RESTORE": "0"}).restore_share) == (0, 0.0)
    assert Config.from_env({**base, "OVERMIND_RESTORE": "25%"}).restore_share == 0.25
    assert Config.from_env({**base, "OVERMIND_RESTORE": "2G"}).restore_bytes == 2 << 30
    for bad in ("lots", "150%", "-1G"):
        with pytest.raises(ConfigError, match="OVERMIND_RESTORE"):
            Config.from_env({**base, "OVERMIND_RESTORE": bad})


PACKAGE = {"point": "torch._inductor::aoti_load_package", "path": "/models/block.pt2",
           "kwargs": {"load_constants": True}}


def test_a_contexts_aoti_packages_are_kept_and_malformed_ones_dropped(tmp_path):
    """Note [The state file]: what a context's runs loaded with aoti_load_package, checked as a
    client's Prepare is (overmind.shared.calls.compiled.packages_from_wire)."""
    bad = [{**PACKAGE, "path": "relative/block.pt2"}, {**PACKAGE, "point": "os::system"}, "block.pt2",
           {**PACKAGE, "kwargs": {"f": {"$py": "os.system"}}}]
    context = {"python": sys.executable, "env": {}, "modules": [], "refused": [], "last_used": 1.0,
               "packages": [PACKAGE, *bad]}
    (kept,) = parse_state(_doc(tmp_path, contexts=[context]), *CHECKS).contexts
    assert kept["packages"] == [PACKAGE]


def test_aoti_packages_a_context_learned_survive_a_restart(tmp_path):
    from overmind.server.restore import Restore

    keeper = _keeper(tmp_path)
    (tmp_path / "state").mkdir(mode=0o700)
    context = {"python": sys.executable, "env": {"HOME": "/x"}, "modules": ["torch"], "refused": [], "last_used": 1.0}
    keeper.config.state_path.write_bytes(_doc(tmp_path, contexts=[context]))
    assert keeper.open(*CHECKS) is not None
    base, _, _ = context_from_wire({**context, "cwd": "/", "sys_path": []})
    keeper.pool.lessons.add_packages(base, [PACKAGE])  # a run of it loaded the package
    assert keeper.save_if_changed()
    keeper.close()
    state = parse_state(keeper.config.state_path.read_bytes(), *CHECKS)
    assert state.contexts[0]["packages"] == [PACKAGE]
    fresh = WarmPool(keeper.config)  # the next server's

    class _Loads:
        pool, history = fresh, ProgramHistory()

        class joins:  # Loads.joins (overmind.server.joins), as a restore reaches it
            @staticmethod
            def remember_plain_seconds(key, seconds):
                pass

    Restore(keeper.config, None, _Loads(), None, None)._teach(state)
    assert fresh.lessons.packages_for(base) == [PACKAGE]  # its interpreters preload it


def test_state_files_of_runtime_dirs_that_are_gone_are_removed_by_the_next_server(tmp_path):
    # Note [State files die with their runtime directory]: five servers on runtime dirs that are
    # then removed leave five files; the next server to start keeps its own and a live one's.
    import shutil

    state = tmp_path / "state"

    def keeper(run: str) -> StateKeeper:
        (tmp_path / run).mkdir(mode=0o700, exist_ok=True)
        config = Config(tmp_path / run, state_dir=state)
        return StateKeeper(config, _Registry(), WarmPool(config), ProgramHistory())

    for i in range(5):
        k = keeper(f"gone-{i}")
        k.open(*CHECKS)
        k.record(P.Load(**_entry(tmp_path, key=f"{i:032d}")["load"]), b"call", _Entry(tmp_path))
        assert k.save_if_changed()
        k.close()
    for i in range(5):
        shutil.rmtree(tmp_path / f"gone-{i}")
    (state / "state-foreign.json").symlink_to(tmp_path / "elsewhere.json")  # never followed, never removed
    assert len(list(state.glob("state-*.json"))) == 6
    live = keeper("live")
    live.open(*CHECKS)
    live.record(P.Load(**_entry(tmp_path)["load"]), b"call", _Entry(tmp_path))
    assert live.save_if_changed()
    left = sorted(p.name for p in state.glob("state-*.json"))
    assert left == sorted([live.config.state_path.name, "state-foreign.json"]), left
    live.close()
    new = keeper("new")  # a live server's file stays
    new.open(*CHECKS)
    assert live.config.state_path.exists()
    new.close()
