"""Every message type of the wire protocol, by the code it travels under. Standard library only.

Codes never change (tests/unit/test_protocol.py pins them); a new message takes a new code.
"""

from __future__ import annotations

from typing import ClassVar

from overmind.shared.protocol.base import Message, ProtocolError, message

__all__ = ["Hello", "Welcome", "Error", "Load", "PlainLoaded", "Prefetch", "PrefetchReply", "Entry", "Pending", "GetFds", "Fds", "Contents", "Status", "StatusReply", "ListEntries", "EntryList", "Evict", "Evicted", "Shutdown", "Ok", "Prepare", "Run", "RunRefused", "RunStarted", "RunExited", "Warm", "Fork", "Retire", "InterpreterReady", "Job", "JobStarted", "JobResult", "LoadMeta", "FillProgress", "FileContents", "JobFailed", "Unforkable", "MESSAGE_TYPES"]


@message
class Hello(Message):
    TYPE: ClassVar[int] = 1
    version: int
    pid: int
    role: str  # "client", "cli" or "run" (the `overmind run` front end)
    package_version: str = ""


@message
class Welcome(Message):
    TYPE: ClassVar[int] = 2
    version: int
    server_pid: int
    server_version: str
    uid: int


@message
class Error(Message):
    TYPE: ClassVar[int] = 3
    code: int
    message: str
    traceback: str = ""


@message
class Load(Message):
    """Get an entry, loading it on a miss. The blob is the pickled call (see overmind.client.connection)."""

    TYPE: ClassVar[int] = 10
    WITH_BLOB: ClassVar[bool] = True
    key: str
    target: str  # "module:qualname" of the original load function, for logs and listings
    description: str  # a short human-readable form of the call
    context: dict  # python, cwd, sys_path, env: where a loader must run
    refs: list = []  # keys of entries the call refers to
    lookup_only: bool = False  # never start a loader: NOT_FOUND on a miss
    modules: list = []  # modules the call needs, learned by the warm interpreter for later loads
    wait: bool = True  # on a miss, wait for the load; False: answer Pending at once
    program: str = ""  # the calling program (script, cwd, interpreter): Note [Prefetch] in overmind.client.prefetch
    # a lookup that is no client's hit: Note [A run's child is forked ahead] in overmind.warm.children
    rehearsal: bool = False


@message
class PlainLoaded(Message):
    """A client that got ``Pending`` ran the original itself, in ``seconds``; no answer. The
    server weighs a later caller's wait for the fill against it (Note [Joining a fill] in
    overmind.server.joins), and the fill's warm interpreter imports ``modules``, what that
    load imported, before it forks the loader (Note [Cold fills wait for their caller])."""

    TYPE: ClassVar[int] = 17
    key: str
    seconds: float
    modules: list = []


@message
class Prefetch(Message):
    """What ``program`` loaded last time: answered with ``PrefetchReply`` (Note [Prefetch])."""

    TYPE: ClassVar[int] = 18
    program: str
    # the client still imports (not a forked ``overmind run``): it reads back lost files meanwhile
    # (Note [Settling file segments] in overmind.server.settle)
    importing: bool = False
    # a child forked ahead asks (Note [A run's child is forked ahead] in overmind.warm.children): no
    # program was handed the files yet
    rehearsal: bool = False


@message
class PrefetchReply(Message):
    TYPE: ClassVar[int] = 19
    server_pid: int
    entries: list  # [[key, segments as in Entry.segments], ...], in the order they were loaded


@message
class Entry(Message):
    """A cache entry: segment handles (server fds) and, in the blob, the skeleton."""

    TYPE: ClassVar[int] = 11
    WITH_BLOB: ClassVar[bool] = True
    key: str
    server_pid: int
    # [[server fd, size, st_dev, st_ino], ...]; null for an unused slot. The fd number names the
    # segment for opening; (st_dev, st_ino) is what it must turn out to be once opened
    # (Note [A segment is opened by identity] in overmind.client.connection).
    segments: list
    nbytes: int
    hit: bool
    meta: dict = {}


@message
class Pending(Message):
    """A miss the server is loading in the background (or failed to load recently)."""

    TYPE: ClassVar[int] = 14
    key: str
    loading: bool
    reason: str = ""  # why the entry cannot be had (a recent failure), empty while loading
    code: int = 0  # that failure's ErrorCode
    # The request asked to wait: the Entry or Error follows when the load ends. A client
    # knows within its short reply bound that the server is alive, and waits long only now.
    waiting: bool = False


@message
class GetFds(Message):
    """Ask for an entry's segment fds over SCM_RIGHTS (when /proc/<pid>/fd is refused)."""

    TYPE: ClassVar[int] = 12
    key: str


@message
class Fds(Message):
    TYPE: ClassVar[int] = 13
    key: str
    sizes: list  # one size per fd sent, in order


# Type 15 was GetContents, a loader asking the server: loaders are handed the index now (Note
# [The loader is handed its references] in overmind.server.loaders). Never reuse a number.
@message
class Contents(Message):
    """The content index, as JSON in the blob: ``{"keys": [entry key, ...], "regions":
    [[xxh3-128 hex, nbytes, key index, st_dev, st_ino, offset], ...]}``."""

    TYPE: ClassVar[int] = 16
    WITH_BLOB: ClassVar[bool] = True
    regions: int


@message
class Status(Message):
    TYPE: ClassVar[int] = 20


@message
class StatusReply(Message):
    TYPE: ClassVar[int] = 21
    info: dict


@message
class ListEntries(Message):
    TYPE: ClassVar[int] = 22


@message
class EntryList(Message):
    """The entries, as a JSON array in the blob (thousands of them exceed MAX_JSON as fields)."""

    TYPE: ClassVar[int] = 23
    WITH_BLOB: ClassVar[bool] = True
    count: int


@message
class Evict(Message):
    TYPE: ClassVar[int] = 24
    key: str = ""  # a key or a unique prefix of one
    all: bool = False


@message
class Evicted(Message):
    TYPE: ClassVar[int] = 25
    keys: list


@message
class Shutdown(Message):
    TYPE: ClassVar[int] = 26


@message
class Ok(Message):
    TYPE: ClassVar[int] = 27


@message
class Prepare(Message):
    """Start a warm interpreter for this context now, so the first load does not wait for one."""

    TYPE: ClassVar[int] = 28
    context: dict
    modules: list = []  # installed modules this client imported since it last said (Note [Warm interpreters learn])
    packages: list = []  # AOTInductor packages it loaded plainly (Note [AOTInductor packages are handed over])
    # A plain first run's whole environment: a new interpreter imports under it (Note [A run's
    # interpreter imports under the run's environment] in overmind.server.pool); {}: the context's.
    env: dict = {}
    # Why a script's monkey_patch_all() runs it in its own process, for the server's log (Note
    # [When a warm start applies] in overmind.client.warm_start); "": it did not decline.
    plain: str = ""
    program: str = ""  # Note [Prefetch] in overmind.client.prefetch: its run's child is forked ahead


# -- overmind run: front end <-> server <-> warm interpreter ----------------------


@message
class Run(Message):
    """Run a script in a child of a warm interpreter (``overmind run``). Carries three fds: the
    front end's stdin, stdout and stderr. The server answers RunRefused, or hands the
    connection to the warm interpreter, which answers RunStarted and, at the end, RunExited."""

    TYPE: ClassVar[int] = 30
    context: dict  # python, env: which warm interpreter (overmind.shared.protocol.contexts.Context)
    spec: dict  # mode, target, argv, cwd, env, umask: what the child becomes (overmind.warm.script.become)


@message
class RunRefused(Message):
    """No warm run now (none ready yet, a stale or unsafe interpreter): run plainly."""

    TYPE: ClassVar[int] = 31
    reason: str


@message
class RunStarted(Message):
    TYPE: ClassVar[int] = 32
    pid: int


@message
class RunExited(Message):
    TYPE: ClassVar[int] = 33
    status: int  # the raw wait status (os.waitstatus_to_exitcode reads it)


# -- server <-> loader ---------------------------------------------------------


@message
class Warm(Message):
    """The server's first message to a new warm interpreter: the installed modules to import
    before it is ready (Note [Warm interpreters learn] in overmind.warm.interpreter)."""

    TYPE: ClassVar[int] = 45
    modules: list
    refused: list = []  # never to import: they started a thread (Note [Threads libraries start])
    packages: list = []  # AOTInductor packages to preload (Note [AOTInductor packages are handed over] in overmind.shared.calls.compiled)
    # a program that ran in this context: Note [A run's child is forked ahead] in overmind.warm.children
    program: str = ""


@message
class Fork(Message):
    """Fork a run. Carries four fds: stdin, stdout, stderr and the front end's connection."""

    TYPE: ClassVar[int] = 46
    spec: dict


@message
class Retire(Message):
    """Stop forking; exit once every load and run in progress has finished."""

    TYPE: ClassVar[int] = 47


@message
class InterpreterReady(Message):
    """A warm interpreter finished importing and waits for jobs."""

    TYPE: ClassVar[int] = 40
    pid: int
    imported: list
    refused: list = []  # modules that started a thread when imported: never to be pre-imported again
    environ: dict = {}  # names and prefixes its imports read (Note [Settings an import read] in overmind.shared.settings.import_env)


@message
class Job(Message):
    """Run one load in a forked child. Carries one fd: the child's end of the job socket."""

    TYPE: ClassVar[int] = 41
    WITH_BLOB: ClassVar[bool] = True
    key: str
    sys_path: list
    cwd: str = "/"
    modules: list = []  # the loader child imports them; the warm interpreter learns them after the fork, for later jobs


@message
class JobStarted(Message):
    TYPE: ClassVar[int] = 42
    key: str
    pid: int
    modules: int = 0  # installed modules the interpreter holds now
    learned: list = []  # installed modules runs imported that it did not hold (for its successor)
    environ: dict = {}  # names and prefixes its imports read since it last said (overmind.shared.settings.import_env)
    # Why it can fork no more ("": it can), and the modules kept out of its successor: it started
    # this job's loader as a fresh process (Note [A fill never waits for a fork] in overmind.warm.interpreter).
    unforkable: str = ""
    refused: list = []


@message
class JobResult(Message):
    """The loader's answer: the skeleton in the blob, the new segments as fds."""

    TYPE: ClassVar[int] = 43
    WITH_BLOB: ClassVar[bool] = True
    key: str
    sizes: list  # one per fd sent, in order
    slots: list  # segment slot of each fd (unused slots have no fd)
    nslots: int
    nbytes: int
    refs: list  # keys of entries whose segments this one also maps (their fds come after its own)
    meta: dict = {}


@message
class LoadMeta(Message):
    """What a loader says about its result (``JobResult.meta``, ``Entry.meta``): versioned and
    typed like a message, so the server, the registry, the client and the CLI read one schema.
    Not a message type of its own (no ``TYPE``); :meth:`from_wire` validates it."""

    VERSION: ClassVar[int] = 2
    version: int = 2
    type: str = ""  # module.qualname of the result
    pickler: str = ""
    storages: int = 0
    tensors: int = 0
    original_seconds: float = 0.0
    pack_seconds: float = 0.0
    load_seconds: float = 0.0  # set by the server: the whole fill, queueing included
    sys_path_extra: list = []  # dynamic-module folders the client must add to sys.path
    references: list = []  # keys of entries passed in and handed back unchanged
    files: list = []  # [[path, size, mtime_ns, ino, dev, ctime_ns]]: Note [Observed files] in overmind.warm.loader
    deduplicated: int = 0  # bytes referenced in other entries' segments instead of written
    contents: list = []  # [[digest hex, nbytes, slot, offset]]: Note [Content index] in overmind.server.registry
    # Note [Loads that draw random numbers] in overmind.shared.calls.callstate: {} when the load drew none,
    # else {"start": digest of the states it started from, "end": base64 of the states it left}.
    rng: dict = {}
    events: list = []  # warnings and log records to replay: Note [Replayed warnings and log records]

    @classmethod
    def from_wire(cls, data: dict) -> "LoadMeta":
        if not isinstance(data, dict) or data.get("version") != cls.VERSION:
            raise ProtocolError(f"load metadata of version {data.get('version') if isinstance(data, dict) else None}, "
                                f"expected {cls.VERSION}")
        return cls.from_fields(data)


@message
class FillProgress(Message):
    """A loader packing its result says how far it is, now and then, before its answer
    (Note [Joining a fill] in overmind.server.joins): bytes in place and the bytes it expects."""

    TYPE: ClassVar[int] = 48
    key: str
    written: int
    expected: int
    original_seconds: float = 0.0  # its call of the original load function


@message
class FileContents(Message):
    """A loader that answered sends the contents records (``LoadMeta.contents``, as JSON in the
    blob) of the storages it left in their model files unhashed (Note [Hashing a file's storages
    after the answer] in overmind.warm.loader)."""

    TYPE: ClassVar[int] = 50
    WITH_BLOB: ClassVar[bool] = True
    key: str
    records: int


@message
class JobFailed(Message):
    TYPE: ClassVar[int] = 44
    key: str
    code: int
    message: str
    traceback: str = ""
    refused: list = []  # a warm interpreter's modules that started a thread, for its successor
    environ: dict = {}  # names and prefixes its imports read since it last said (overmind.shared.settings.import_env)


@message
class Unforkable(Message):
    """A warm interpreter's one unasked message: an import it learned started a thread nobody
    vouches for, so it can fork no more (Note [A tainted interpreter says so at once] in
    overmind.warm.interpreter). The server retires it and starts its successor now, not at the next run."""

    TYPE: ClassVar[int] = 49
    why: str
    refused: list = []  # the modules to keep out of its successor
    environ: dict = {}  # names and prefixes its imports read since it last said (overmind.shared.settings.import_env)


MESSAGE_TYPES: dict[int, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Error, Load, Entry, Pending, GetFds, Fds, Contents, Status, StatusReply,
                ListEntries, EntryList, Evict, Evicted, Shutdown, Ok, Prepare, Run, RunRefused, RunStarted, RunExited,
                InterpreterReady, Job, JobStarted, JobResult, FillProgress, FileContents, JobFailed, Unforkable, Warm, Fork, Retire, PlainLoaded, Prefetch,
                PrefetchReply)
}
