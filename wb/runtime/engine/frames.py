"""Frames: small messages between two ranks that are ready together, moved as one.

A message costs a transport tens of microseconds whatever its size (posting, matching, completing
it), more than a small message's bytes take on any link. So the small messages of one sender to
one receiver that become ready at the same moment (the same parent message, or none) travel as
one *frame*: packed one after another into one staging buffer at the sender, sent once under the
first member's tag, and unpacked member by member at the receiver. Both sides cut the same frames
from what both parts of the plan hold alike (the messages' sources, destinations, parents,
travelling dtypes, sizes and schedule), so no rank tells another how it framed.

A frame's members are each at most :data:`FRAME_MEMBER_BYTES`; a frame holds at most
:data:`FRAME_BYTES`. Members keep their own plan message indices: traces, statistics and the
forwards a member releases see messages, not frames. A transport whose messages cost nothing
says so (``frames = False``: :func:`framing`), and its programs keep every message apart.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

__all__ = ["Frame", "frames", "framing", "FRAME_MEMBER_BYTES", "FRAME_BYTES"]

#: The largest message that travels in a frame with others (bytes).
FRAME_MEMBER_BYTES = 256 << 10
#: The most bytes one frame carries.
FRAME_BYTES = 4 << 20


class Frame:
    """Messages of one rank's program that travel as one (see the module doc); it stands where a
    :class:`~wb.runtime.engine.program.Message` stands in an update.

    Attributes:
        members: the messages, in the order they lie in the frame.
        offsets: each member's first byte in the frame.
        m: the first member's index (the frame's tag is its tag).
        peer, stage, parent, out, wire: the members' (the same for all).
        nbytes: the frame's size: the members' sizes added.
        conv: a member is converted by this rank (the frame is packed member by member).
        zc_src, zc_dst, local: False: a frame always travels through staging.
        table: the frame's regions as one device table (:mod:`wb.runtime.engine.gather`), made
            on first use.
    """

    __slots__ = ("members", "offsets", "m", "stage", "peer", "nbytes", "parent", "out", "local",
                 "zc_src", "zc_dst", "wire", "conv", "table")

    def __init__(self, members: list):
        first = members[0]
        self.members = members
        self.offsets, at = [], 0
        for g in members:
            self.offsets.append(at)
            at += g.nbytes
        self.m, self.stage, self.peer, self.parent = first.m, first.stage, first.peer, first.parent
        self.out, self.wire, self.nbytes = first.out, first.wire, at
        self.conv = any(g.conv for g in members)
        self.local = self.zc_src = self.zc_dst = False
        self.table: Any = None

    def label(self) -> str:
        return (f"a frame of {len(self.members)} messages from message {self.m} (stage "
                f"{self.stage}, {self.nbytes:,} bytes, peer {self.peer})")


def frames(messages: dict, when: dict[int, float]) -> list[list[int]]:
    """The frames of a rank's messages: lists of at least two message indices each, in frame
    order.

    Members: messages to or from another rank of at most :data:`FRAME_MEMBER_BYTES`; a frame's
    members share the sender, the receiver, the parent and the travelling dtype, and follow one
    another in schedule order (``when``, then index), at most :data:`FRAME_BYTES` together. What
    decides a frame is the same in the sender's and the receiver's part.

    Args:
        messages: ``{plan message index: Message}`` of the rank.
        when: ``{plan message index: schedule time}``.

    Returns:
        The frames, each its members' indices.
    """
    groups: dict[tuple, list[int]] = defaultdict(list)
    for m, g in messages.items():
        if not g.local and g.nbytes <= FRAME_MEMBER_BYTES:
            groups[(g.out, g.peer, g.parent, g.wire)].append(m)
    out = []
    for ms in groups.values():
        ms.sort(key=lambda m: (when[m], m))
        frame, size = [], 0
        for m in ms:
            n = messages[m].nbytes
            if frame and size + n > FRAME_BYTES:
                if len(frame) > 1:
                    out.append(frame)
                frame, size = [], 0
            frame.append(m)
            size += n
        if len(frame) > 1:
            out.append(frame)
    return out


def framing(transport) -> bool:
    """Whether programs over ``transport`` frame small messages: its ``frames`` attribute, True
    where it has none (a message costs every real transport something)."""
    return bool(getattr(transport, "frames", True))
