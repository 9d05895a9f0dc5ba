"""The wire protocol: exact bytes, round trips over real sockets, and garbage handling.

Every test here uses real ``socket.socketpair()`` connections and real fds; the golden
bytes pin the frame layout so that a change to it is always a deliberate protocol bump.
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import sys

import pytest

from overmind.shared import protocol as P

# -- golden bytes ----------------------------------------------------------------------------

HELLO_FRAME = (
    b"OVMD"  # magic
    b"\x08\x00"  # protocol version 8
    b"\x01\x00"  # type 1: Hello
    b"\x40\x00\x00\x00"  # json_len 64
    b"\x00\x00\x00\x00\x00\x00\x00\x00"  # blob_len 0
    b'{"package_version":"0.1.0","pid":42,"role":"client","version":1}'
)

LOAD_FIELDS = (b'{"context":{"cwd":"/"},"description":"f(1)","key":"k1","lookup_only":true,'
               b'"modules":["torch"],"program":"p","refs":["r"],"rehearsal":false,"target":"m:f","wait":false}')
LOAD_FRAME = (
    b"OVMD"
    b"\x08\x00"  # protocol version 8
    b"\x0a\x00"  # type 10: Load
    b"\xa7\x00\x00\x00"  # json_len 167
    b"\x04\x00\x00\x00\x00\x00\x00\x00"  # blob_len 4 (the blob follows the frame, sent separately)
    + LOAD_FIELDS
)


def test_hello_frame_bytes_are_pinned():
    frame = P.encode_frame(P.Hello(version=1, pid=42, role="client", package_version="0.1.0"))
    assert frame == HELLO_FRAME


def test_load_frame_with_blob_bytes_are_pinned():
    message = P.Load(key="k1", target="m:f", description="f(1)", context={"cwd": "/"}, refs=["r"],
                     lookup_only=True, modules=["torch"], wait=False, program="p")
    frame = P.encode_frame(message, b"BLOB")
    assert frame == LOAD_FRAME
    assert len(LOAD_FIELDS) == 0xa7


def test_header_layout_is_pinned():
    assert P.HEADER.format == "<4sHHIQ"
    assert P.HEADER.size == 20
    assert P.MAGIC == b"OVMD"
    assert P.PROTOCOL_VERSION == 8


def test_message_type_codes_never_change():
    assert {code: cls.__name__ for code, cls in P.MESSAGE_TYPES.items()} == {
        1: "Hello", 2: "Welcome", 3: "Error",
        10: "Load", 11: "Entry", 12: "GetFds", 13: "Fds", 14: "Pending", 16: "Contents",
        17: "PlainLoaded", 18: "Prefetch", 19: "PrefetchReply",
        20: "Status", 21: "StatusReply", 22: "ListEntries", 23: "EntryList", 24: "Evict", 25: "Evicted",
        26: "Shutdown", 27: "Ok", 28: "Prepare",
        30: "Run", 31: "RunRefused", 32: "RunStarted", 33: "RunExited",
        40: "InterpreterReady", 41: "Job", 42: "JobStarted", 43: "JobResult", 44: "JobFailed", 45: "Warm", 46: "Fork",
        47: "Retire", 48: "FillProgress", 49: "Unforkable", 50: "FileContents",
    }
    assert {cls.__name__ for cls in P.MESSAGE_TYPES.values() if cls.WITH_BLOB} == {"Load", "Entry", "Contents", "EntryList", "Job",
                                                                                          "JobResult", "FileContents"}


def test_error_codes_never_change():
    E = P.ErrorCode
    assert (E.BAD_REQUEST, E.VERSION_MISMATCH, E.NOT_FOUND, E.LOADER_FAILED, E.LOADER_CRASHED, E.LOADER_TIMEOUT,
            E.PERMISSION_DENIED, E.SHUTTING_DOWN, E.TOO_LARGE, E.INTERNAL, E.BUSY, E.NOT_FORKABLE,
            E.CANNOT_CACHE, E.NOT_REBUILDABLE) == tuple(range(1, 15))
    assert E.name(5) == "LOADER_CRASHED"
    assert E.name(99) == "ERROR_99"


# -- round trips -----------------------------------------------------------------------------

SAMPLES: list[tuple[P.Message, bytes]] = [
    (P.Hello(version=1, pid=42, role="client", package_version="0.1.0"), b""),
    (P.Welcome(version=1, server_pid=7, server_version="0.1.0", uid=1000), b""),
    (P.Error(code=P.ErrorCode.LOADER_FAILED, message="boom", traceback="Traceback...\nValueError: x"), b""),
    (P.Load(key="a" * 32, target="torch:load", description="torch.load('/x')",
            context={"python": "/usr/bin/python3", "cwd": "/", "sys_path": ["/a"], "env": {"HF_HOME": "/h"}},
            refs=["b" * 32], lookup_only=False, modules=["torch"], wait=False), b"\x80\x05pickled call\x00\xff"),
    (P.Entry(key="k", server_pid=9, segments=[[5, 4096, 45, 1001], None, [6, 8192, 45, 1002]], nbytes=12288, hit=True,
             meta={"type": "dict", "load_seconds": 0.5}), b"skeleton" * 100),
    (P.Pending(key="k", loading=False, reason="OSError: no config.json"), b""),
    (P.Pending(key="k", loading=True, waiting=True), b""),
    (P.GetFds(key="k"), b""),
    (P.Fds(key="k", sizes=[4096]), b""),
    (P.Contents(regions=1), b'{"keys": ["k"], "regions": [["00ff", 65536, 0, 45, 1234, 4096]]}'),
    (P.Status(), b""),
    (P.StatusReply(info={"entries": 2, "hits": 3, "nested": {"x": [1, 2.5, None]}}), b""),
    (P.ListEntries(), b""),
    (P.EntryList(count=1), b'[{"key": "k", "bytes": 1}]'),
    (P.Evict(key="abc", all=False), b""),
    (P.Evicted(keys=["abc"]), b""),
    (P.Shutdown(), b""),
    (P.Ok(), b""),
    (P.Prepare(context={"python": "/usr/bin/python3", "cwd": "/", "sys_path": [], "env": {}}), b""),
    (P.Prepare(context={"python": "/usr/bin/python3", "cwd": "/", "sys_path": [], "env": {}},
               modules=["torch", "diffusers"]), b""),
    (P.Prepare(context={"python": "/usr/bin/python3", "cwd": "/", "sys_path": [], "env": {}},
               packages=[{"point": "torch._inductor::aoti_load_package", "path": "/m/a.pt2",
                          "kwargs": {"run_single_threaded": False, "device_index": -1}}]), b""),
    (P.PlainLoaded(key="k", seconds=0.54), b""),
    (P.PlainLoaded(key="k", seconds=0.54, modules=["transformers.models.llama.modeling_llama"]), b""),
    (P.Prefetch(program="0" * 32), b""),
    (P.Prefetch(program="0" * 32, importing=True), b""),
    (P.PrefetchReply(server_pid=9, entries=[["k", [[5, 4096, 45, 1001], None]]]), b""),
    (P.Run(context={"python": "/usr/bin/python3", "env": {"HF_HOME": "/h"}},
           spec={"mode": "script", "target": "/a/b.py", "argv": ["-x"], "cwd": "/a", "env": {"A": "1"}, "umask": 18}),
     b""),
    (P.RunRefused(reason="no warm interpreter for this context yet"), b""),
    (P.RunStarted(pid=77), b""),
    (P.RunExited(status=256), b""),
    (P.InterpreterReady(pid=3, imported=["torch"], refused=["threading_lib"]), b""),
    (P.Warm(modules=["torch", "diffusers"], refused=["threader"]), b""),
    (P.Warm(modules=[], packages=[{"point": "torch._export::aot_load", "path": "/m/a.so", "kwargs": {"device": "cpu"}}]),
     b""),
    (P.Fork(spec={"mode": "code", "target": "pass", "argv": [], "cwd": "/", "env": {}, "umask": 18}), b""),
    (P.Retire(), b""),
    (P.Job(key="k", sys_path=["/a", "/b"], cwd="/a", modules=["diffusers"]), b"call"),
    (P.JobStarted(key="k", pid=11, modules=3, learned=["json"]), b""),
    (P.JobResult(key="k", sizes=[4096], slots=[0], nslots=2, nbytes=4096, refs=[], meta={"pickler": "pickle"}),
     b"skel"),
    (P.FillProgress(key="k", written=1 << 30, expected=2 << 30, original_seconds=0.25), b""),
    (P.FileContents(key="k", records=1), b'[["00ff", 65536, 1, 4096]]'),
    (P.JobFailed(key="k", code=P.ErrorCode.LOADER_FAILED, message="OSError: no", traceback="tb"), b""),
    (P.JobFailed(key="run", code=P.ErrorCode.NOT_FORKABLE, message="2 threads", refused=["threader"]), b""),
    (P.Unforkable(why="1 native thread", refused=["threader"], environ={"names": ["HF_HOME"]}), b""),
]


def test_samples_cover_every_message_type():
    assert {type(m) for m, _ in SAMPLES} == set(P.MESSAGE_TYPES.values())


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(10)
    b.settimeout(10)
    yield a, b
    a.close()
    b.close()


@pytest.mark.parametrize("message,blob", SAMPLES, ids=[type(m).__name__ for m, _ in SAMPLES])
def test_every_message_type_round_trips_over_a_socketpair(pair, message, blob):
    a, b = pair
    P.send_message(a, message, blob)
    got, got_blob, fds = P.recv_message(b)
    assert got == message and type(got) is type(message)
    assert got_blob == blob
    assert fds == []


def test_many_frames_back_to_back_keep_their_boundaries(pair):
    a, b = pair
    for message, blob in SAMPLES:
        P.send_message(a, message, blob)
    for message, blob in SAMPLES:
        assert P.recv_message(b)[:2] == (message, blob)


def test_large_blob_round_trips_while_the_peer_reads_concurrently(pair):
    a, b = pair
    blob = os.urandom(3 << 20)  # far above the socket buffer: sendall must interleave with the reader
    sender = threading.Thread(target=P.send_message, args=(a, P.Entry("k", 1, [], 0, False), blob))
    sender.start()
    message, got, _ = P.recv_message(b)
    sender.join()
    assert isinstance(message, P.Entry) and got == blob


def test_fds_travel_with_the_message_and_work(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        P.send_message(a, P.Fds(key="k", sizes=[0]), fds=[w])
        message, _, fds = P.recv_message(b)
    finally:
        os.close(w)
    assert message == P.Fds(key="k", sizes=[0]) and len(fds) == 1
    assert fds[0] != w
    os.write(fds[0], b"through the received fd")
    os.close(fds[0])
    assert os.read(r, 100) == b"through the received fd"
    os.close(r)


def test_received_fds_are_close_on_exec(pair):
    a, b = pair
    r, w = os.pipe()
    P.send_message(a, P.Fds(key="k", sizes=[0, 0]), fds=[r, w])
    os.close(r)
    os.close(w)
    _, _, fds = P.recv_message(b)
    try:
        assert len(fds) == 2
        assert all(not os.get_inheritable(fd) for fd in fds)
    finally:
        for fd in fds:
            os.close(fd)


def test_send_refuses_a_blob_on_a_message_without_one(pair):
    with pytest.raises(ValueError, match="carries no blob"):
        P.send_message(pair[0], P.Status(), b"x")


def test_send_refuses_more_fds_than_allowed(pair):
    with pytest.raises(ValueError, match="fds exceed"):
        P.send_message(pair[0], P.Ok(), fds=[0] * (P.MAX_FDS + 1))


# -- garbage ---------------------------------------------------------------------------------


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _header(mtype: int = P.Status.TYPE, json_len: int = 2, blob_len: int = 0, magic: bytes = P.MAGIC,
            version: int = P.PROTOCOL_VERSION) -> bytes:
    return struct.pack("<4sHHIQ", magic, version, mtype, json_len, blob_len)


def _frame(mtype: int, fields: bytes, blob: bytes = b"") -> bytes:
    return _header(mtype, len(fields), len(blob)) + fields + blob


def _receive_garbage(raw: bytes, *, close: bool = False, **kwargs):
    """Send ``raw`` (a pipe fd riding on its first bytes) and return what recv_message raises."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(5)
    r, w = os.pipe()

    def send():  # in a thread: a frame larger than the socket buffer blocks until read
        try:
            a.sendmsg([raw[:16]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r]))])
            a.sendall(raw[16:])
        except OSError:
            pass  # the reader gave up and closed its end
        if close:
            a.close()

    try:
        before = _open_fds()  # a, b, r, w
        sender = threading.Thread(target=send)
        sender.start()
        with pytest.raises((P.ProtocolError, EOFError)) as info:
            P.recv_message(b, **kwargs)
        b.close()
        sender.join(5)
        a.close()
        assert _open_fds() == before - 2, "a received fd leaked"
        return info.value
    finally:
        for s in (a, b):
            s.close()
        os.close(r)
        os.close(w)


def test_bad_magic_is_refused():
    err = _receive_garbage(_header(magic=b"HTTP") + b"{}")
    assert isinstance(err, P.ProtocolError) and "magic" in str(err)


def test_version_mismatch_names_both_versions():
    err = _receive_garbage(_header(version=99) + b"{}")
    assert isinstance(err, P.ProtocolError)
    assert "99" in str(err) and str(P.PROTOCOL_VERSION) in str(err) and "version" in str(err)


def test_unknown_message_type_is_refused():
    err = _receive_garbage(_header(mtype=999) + b"{}")
    assert isinstance(err, P.ProtocolError) and "999" in str(err)


def test_oversized_json_len_is_refused_before_reading_it():
    err = _receive_garbage(_header(json_len=P.MAX_JSON + 1))
    assert isinstance(err, P.ProtocolError) and "limit" in str(err)


def test_oversized_blob_len_is_refused_before_allocating():
    import resource

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    err = _receive_garbage(_header(P.Load.TYPE, json_len=2, blob_len=1 << 40) + b"{}")
    assert isinstance(err, P.ProtocolError) and str(1 << 40) in str(err)
    # A caller's tighter bound is honoured too (the server uses max_blob=0 for the handshake).
    err = _receive_garbage(_header(P.Load.TYPE, json_len=2, blob_len=100) + b"{}", max_blob=10)
    assert isinstance(err, P.ProtocolError) and "100" in str(err)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 * 1024  # KiB: no 1 TiB attempt


def test_blob_on_a_message_without_blob_is_refused():
    err = _receive_garbage(_header(P.Status.TYPE, json_len=2, blob_len=3) + b"{}abc")
    assert isinstance(err, P.ProtocolError) and "blob" in str(err)


def test_peer_closing_mid_header_is_a_protocol_error():
    err = _receive_garbage(_header()[:9], close=True)
    assert isinstance(err, P.ProtocolError) and "mid-frame" in str(err)


def test_peer_closing_mid_fields_is_a_protocol_error():
    err = _receive_garbage(_header(P.Status.TYPE, json_len=50) + b'{"x":', close=True)
    assert isinstance(err, P.ProtocolError) and "mid-frame" in str(err)


def test_peer_closing_mid_blob_is_a_protocol_error():
    fields = b'{"key":"k","server_pid":1,"segments":[],"nbytes":0,"hit":false}'
    raw = _header(P.Entry.TYPE, len(fields), 1000) + fields + b"x" * 10
    err = _receive_garbage(raw, close=True)
    assert isinstance(err, P.ProtocolError) and "mid-frame" in str(err)


def test_clean_close_before_a_frame_is_eof():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.close()
    with pytest.raises(EOFError):
        P.recv_message(b)
    b.close()


@pytest.mark.parametrize("fields", [b"not json", b"\xff\xfe{}", b'{"a":', b""], ids=["text", "binary", "cut", "empty"])
def test_fields_that_are_not_json_are_refused(fields):
    err = _receive_garbage(_frame(P.Status.TYPE, fields))
    assert isinstance(err, P.ProtocolError) and "JSON" in str(err)


def test_json_array_instead_of_object_is_refused():
    err = _receive_garbage(_frame(P.Hello.TYPE, b"[1,42,\"client\"]"))
    assert isinstance(err, P.ProtocolError) and "object" in str(err)


def test_unknown_field_is_refused():
    err = _receive_garbage(_frame(P.Status.TYPE, b'{"evil":1}'))
    assert isinstance(err, P.ProtocolError) and "evil" in str(err)


def test_missing_required_field_is_refused():
    err = _receive_garbage(_frame(P.Hello.TYPE, b'{"version":1}'))
    assert isinstance(err, P.ProtocolError) and "Hello" in str(err)


@pytest.mark.parametrize("fields", [
    {"version": 1, "pid": "x", "role": "client"},  # str for int
    {"version": True, "pid": 1, "role": "client"},  # bool for int
    {"version": 1, "pid": 1.5, "role": "client"},  # float for int
    {"version": 1, "pid": 1, "role": 3},  # int for str
    {"version": 1, "pid": None, "role": "client"},  # null for int
    {"version": 1, "pid": [1], "role": "client"},  # list for int
], ids=["str-for-int", "bool-for-int", "float-for-int", "int-for-str", "null-for-int", "list-for-int"])
def test_wrong_field_type_is_refused(fields):
    err = _receive_garbage(_frame(P.Hello.TYPE, json.dumps(fields).encode()))
    assert isinstance(err, P.ProtocolError) and "Hello." in str(err)


def test_wrong_container_type_is_refused():
    err = _receive_garbage(_frame(P.Evicted.TYPE, b'{"keys":"not a list"}'))
    assert isinstance(err, P.ProtocolError) and "Evicted.keys" in str(err)
    err = _receive_garbage(_frame(P.Evict.TYPE, b'{"all":1}'))
    assert isinstance(err, P.ProtocolError) and "Evict.all" in str(err)


def test_huge_json_integer_is_a_protocol_error():
    # Python refuses int() of more than 4300 digits with ValueError: still a protocol error, not a crash.
    err = _receive_garbage(_frame(P.Hello.TYPE, b'{"version":1,"role":"c","pid":' + b"9" * 5000 + b"}"))
    assert isinstance(err, P.ProtocolError)


def test_deeply_nested_json_is_a_protocol_error():
    depth = 200_000  # under MAX_JSON, far over the JSON decoder's recursion limit
    err = _receive_garbage(_frame(P.StatusReply.TYPE, b'{"info":' + b"[" * depth + b"]" * depth + b"}"))
    assert isinstance(err, P.ProtocolError)


def test_more_fds_than_allowed_are_refused_and_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    b.settimeout(5)
    r, w = os.pipe()
    try:
        before = _open_fds()
        raw = _frame(P.Fds.TYPE, b'{"key":"k","sizes":[]}')
        a.sendmsg([raw], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r] * 5))])
        with pytest.raises(P.ProtocolError, match="fds"):
            P.recv_message(b, max_fds=2)
        assert _open_fds() == before
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


def test_fds_received_with_garbage_after_a_valid_header_are_closed():
    # The fds ride on the first bytes; the failure comes later, while reading the fields.
    err = _receive_garbage(_frame(P.Fds.TYPE, b'{"key":1,"sizes":[]}'))
    assert isinstance(err, P.ProtocolError) and "Fds.key" in str(err)


def test_fds_are_not_leaked_over_many_garbage_frames():
    before = _open_fds()
    for _ in range(50):
        _receive_garbage(os.urandom(64).replace(b"OVMD", b"xxxx"))
    assert _open_fds() == before


def test_expect_turns_an_error_into_remote_error_with_traceback():
    err = P.Error(P.ErrorCode.LOADER_FAILED, "OSError: gone", "Traceback (most recent call last):\nOSError: gone")
    with pytest.raises(P.RemoteError) as info:
        P.expect(err, P.Entry)
    assert info.value.code == P.ErrorCode.LOADER_FAILED
    assert "LOADER_FAILED: OSError: gone" in str(info.value) and "Traceback" in str(info.value)
    with pytest.raises(P.ProtocolError, match="expected Entry"):
        P.expect(P.Ok(), P.Entry)


def test_a_rehearsal_is_only_ever_a_lookup():
    """Note [A run's child is forked ahead] in overmind.warm.children: a Load the server counts as no
    hit never starts a fill either."""
    from overmind.server.loads import LoadFailure, check_request

    context = {"python": sys.executable, "cwd": "/", "sys_path": [], "env": {}}
    check_request(P.Load("a" * 32, "", "reference", {}, lookup_only=True, rehearsal=True))
    for bad in (P.Load("a" * 32, "t:f", "f()", context, rehearsal=True),
                P.Load("a" * 32, "", "reference", {}, lookup_only=True, rehearsal=1)):
        with pytest.raises(LoadFailure, match="a rehearsal is a lookup"):
            check_request(bad)
