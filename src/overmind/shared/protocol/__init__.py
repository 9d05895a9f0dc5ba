"""The overmind wire protocol: every byte that crosses the server's socket.

Standard library only (the server imports it). A frame is a fixed header, a JSON
object with the message's fields, and an optional binary blob (a pickled call or a
skeleton); file descriptors ride on the header's ``sendmsg`` as ``SCM_RIGHTS``::

    +-------+---------+------+----------+----------+------------+------------+
    | magic | version | type | json_len | blob_len | json bytes | blob bytes |
    | 4s    | u16     | u16  | u32      | u64      |            |            |
    +-------+---------+------+----------+----------+------------+------------+

    send_message(sock, Hello(version=PROTOCOL_VERSION, pid=os.getpid(), role="client"))
    message, blob, fds = recv_message(sock)

Note [Frames are untrusted]
The server reads frames from any process that passed the peer-credential check,
and a buggy or hostile one can send anything. Sizes are bounded before any
allocation, and a large blob is allocated as its bytes arrive, not as announced; a
frame that started must finish within the reader's ``frame_timeout``. JSON is parsed
only into the declared fields with their declared types, unknown message types are
refused, and every failure raises :class:`ProtocolError`, which closes that
connection only. Received fds that were not expected are closed at once.
"""

from __future__ import annotations

from overmind.shared.protocol.base import *  # noqa: F401,F403
from overmind.shared.protocol.base import __all__ as _base
from overmind.shared.protocol.frames import *  # noqa: F401,F403
from overmind.shared.protocol.frames import __all__ as _frames
from overmind.shared.protocol.messages import *  # noqa: F401,F403
from overmind.shared.protocol.messages import __all__ as _messages

__all__ = [*_base, *_messages, *_frames]
