"""Pipeline schedules as plain data: which forward (F) and backward (B) pass each rank
runs and in which order, the messages between them, and the idle time that costs.

No processes here: `forward_backward` executes exactly these orders and messages, and
`schedule_table` replays them on a model of the executor (every message is a rendezvous:
a batch of messages completes when both ends have posted it) to time them, to prove that
no order deadlocks, and to count the bubble.

Notation: p pipeline ranks, m micro-batches, v model chunks per rank. Virtual stage
`s = chunk * p + rank` holds the s-th of the p * v consecutive slices of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._validation import check_positive_ints

__all__ = [
    "SCHEDULES",
    "Action",
    "Message",
    "ScheduleTable",
    "check_schedule",
    "rank_units",
    "rank_actions",
    "boundary_messages",
    "simulate",
    "schedule_table",
]

SCHEDULES = ("gpipe", "1f1b", "interleaved")
FORWARD, BACKWARD = "F", "B"
TAGS = {FORWARD: 1, BACKWARD: 2}
"""Message tag per kind: gloo matches a link's messages per tag, so activations and
gradients sharing a link (p = 2 with virtual stages) cannot be confused."""


@dataclass(frozen=True)
class Action:
    """One pass (F or B) of micro-batch `micro` through this rank's model chunk `chunk`."""

    kind: str
    chunk: int
    micro: int

    def label(self, v: int) -> str:
        return f"{self.kind}{self.micro}" + (f".{self.chunk}" if v > 1 else "")


@dataclass(frozen=True)
class Message:
    """An activation (kind F, sent forward) or a gradient (kind B, sent backward) of
    micro-batch `micro` from virtual stage `src` to virtual stage `dst`."""

    kind: str
    src: int
    dst: int
    micro: int


def check_schedule(schedule: str, p: int, m: int, v: int) -> None:
    """Raise a ValueError naming what does not fit (the same on every rank, no processes)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"tpcore: pipeline schedule must be one of {SCHEDULES}, got {schedule!r}")
    check_positive_ints(
        "pipeline schedule", pipeline_size=p, num_micro_batches=m, num_model_chunks=v
    )
    if schedule != "interleaved" and v != 1:
        raise ValueError(
            f"tpcore: the {schedule} schedule runs one model chunk per rank, got {v}; use "
            "'interleaved' for virtual stages"
        )
    if schedule == "interleaved":
        if p < 2:
            raise ValueError(
                "tpcore: the interleaved schedule needs a pipeline of at least 2 ranks"
            )
        if v < 2:
            raise ValueError(
                "tpcore: the interleaved schedule needs at least 2 model chunks per rank, got "
                f"{v}; use '1f1b' for one"
            )
        if m % p:
            raise ValueError(
                f"tpcore: the interleaved schedule needs the number of micro-batches ({m}) to be a "
                f"multiple of the pipeline size ({p}): micro-batches go through the chunks in "
                "groups of p"
            )


def warmup_count(schedule: str, p: int, m: int, v: int, rank: int) -> int:
    """Forward passes a rank runs before its first backward (Megatron-LM's counts)."""
    if schedule == "gpipe":
        return m
    if schedule == "1f1b":
        return min(p - rank - 1, m)
    return min((p - rank - 1) * 2 + (v - 1) * p, m * v)


def _interleaved_pass(k: int, p: int, v: int, forward: bool) -> tuple[int, int]:
    """(chunk, micro) of a rank's k-th forward (or backward) pass: micro-batches go
    through the chunks in groups of p (backward: the chunks in reverse)."""
    group, within = divmod(k, p * v)
    chunk = within // p
    return (chunk if forward else v - 1 - chunk), group * p + within % p


def rank_units(
    schedule: str, p: int, m: int, v: int, rank: int, forward_only: bool = False
) -> list[list[Action]]:
    """The F/B passes of pipeline rank `rank` in the order it runs them, grouped into the
    units between two batches of messages. A unit is one pass, except in the steady state
    of the interleaved schedule where it is a forward and a backward run back to back
    with their four messages in one batch (Megatron-LM's order: with one batch per pass,
    p = 2 deadlocks, a rank waiting to hand a gradient to a peer that waits for its activation)."""
    check_schedule(schedule, p, m, v)
    total = m * v
    fwd = [Action(FORWARD, *_interleaved_pass(k, p, v, True)) for k in range(total)]
    if forward_only:
        return [[a] for a in fwd]
    bwd = [Action(BACKWARD, *_interleaved_pass(k, p, v, False)) for k in range(total)]
    warmup = warmup_count(schedule, p, m, v, rank)
    steady = [[fwd[warmup + k], bwd[k]] for k in range(total - warmup)]
    # 1F1B: a batch after every pass (send forward + receive backward, ...)
    if schedule != "interleaved":
        steady = [[a] for pair in steady for a in pair]
    return [[a] for a in fwd[:warmup]] + steady + [[a] for a in bwd[total - warmup :]]


def rank_actions(
    schedule: str, p: int, m: int, v: int, rank: int, forward_only: bool = False
) -> list[Action]:
    """The F/B passes of pipeline rank `rank`, in the order it runs them."""
    return [a for unit in rank_units(schedule, p, m, v, rank, forward_only) for a in unit]


def _messages_in(action: Action, rank: int, p: int, v: int) -> list[Message]:
    """What `action` must receive before it runs."""
    stage, last = action.chunk * p + rank, p * v - 1
    if action.kind == FORWARD:
        return [Message(FORWARD, stage - 1, stage, action.micro)] if stage > 0 else []
    return [Message(BACKWARD, stage + 1, stage, action.micro)] if stage < last else []


def _messages_out(action: Action, rank: int, p: int, v: int) -> list[Message]:
    """What `action` sends once it has run."""
    stage, last = action.chunk * p + rank, p * v - 1
    if action.kind == FORWARD:
        return [Message(FORWARD, stage, stage + 1, action.micro)] if stage < last else []
    return [Message(BACKWARD, stage, stage - 1, action.micro)] if stage > 0 else []


def boundary_messages(
    units: list[list[Action]], rank: int, p: int, v: int
) -> list[tuple[list[Message], list[Message]]]:
    """One batch of messages before each unit and one after the last: batch k sends what
    unit k - 1 produced and receives what unit k needs (Megatron's fused send-forward +
    receive-backward and the reverse)."""
    out = []
    for k in range(len(units) + 1):
        sends = [msg for a in units[k - 1] for msg in _messages_out(a, rank, p, v)] if k > 0 else []
        recvs = (
            [msg for a in units[k] for msg in _messages_in(a, rank, p, v)] if k < len(units) else []
        )
        out.append((sends, recvs))
    return out


@dataclass
class ScheduleTable:
    """The order of passes per rank, timed on the executor's model with a forward taking
    `forward_time` and a backward `backward_time` per chunk-sized pass."""

    schedule: str
    p: int
    m: int
    v: int
    actions: list[list[Action]]
    """Per rank, the passes in the order run."""
    starts: list[list[float]]
    """Per rank, when each pass starts."""
    step_time: float
    """When the last rank finishes."""
    forward_time: float
    backward_time: float
    tagless_order_matches: bool
    """Whether both ends of every link see its messages in one order even without tags
    (NCCL matches in order; gloo by tag)."""

    @property
    def busy_time(self) -> float:
        """Compute time of one rank (the same on every rank)."""
        return sum(
            self.forward_time if a.kind == FORWARD else self.backward_time for a in self.actions[0]
        )

    @property
    def bubble_fraction(self) -> float:
        """Idle time over compute time of a rank: (p - 1) / (v m) for these schedules."""
        return (self.step_time - self.busy_time) / self.busy_time

    @property
    def max_in_flight(self) -> list[int]:
        """Per rank, the most micro-batch chunks forwarded but not yet backwarded at once
        (activation memory): at most p for 1F1B's first rank, m for GPipe."""
        peaks = []
        for acts in self.actions:
            now = peak = 0
            for a in acts:
                now += 1 if a.kind == FORWARD else -1
                peak = max(peak, now)
            peaks.append(peak)
        return peaks

    def __str__(self) -> str:
        unit = 4 if self.v == 1 else 6  # characters per time unit
        lines = [
            f"{self.schedule}: p={self.p} m={self.m} v={self.v}, bubble {self.bubble_fraction:.3f} "
            "(idle / compute)"
        ]
        for rank, (acts, starts) in enumerate(zip(self.actions, self.starts)):
            row, t = "", 0.0
            for a, start in zip(acts, starts):
                row += "." * round((start - t) * unit)
                dur = self.forward_time if a.kind == FORWARD else self.backward_time
                row += a.label(self.v).ljust(round(dur * unit))
                t = start + dur
            lines.append(f"rank {rank} | {row}")
        return "\n".join(lines)


def _match(p: int, batches: list[list[tuple[list[Message], list[Message]]]]) -> tuple[dict, bool]:
    """For every (rank, batch, message), the (rank, batch) of its other end; and whether
    every link carries its messages in the same order at both ends even without tags.
    Messages are matched in order per (link, kind), as the executor tags them by kind."""
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for rank, rank_batches in enumerate(batches):
        for b, (sends, recvs) in enumerate(rank_batches):
            for msg in sends:  # issue order inside a batch: by (peer, tag), as in the C++
                sent.setdefault((rank, msg.dst % p), []).append((b, TAGS[msg.kind], msg))
            for msg in recvs:
                received.setdefault((msg.src % p, rank), []).append((b, TAGS[msg.kind], msg))
    partner, tagless = {}, True
    for link in sent.keys() | received.keys():
        out, inc = (
            sorted(sent.get(link, []), key=_order),
            sorted(received.get(link, []), key=_order),
        )
        tagless &= [m for *_, m in out] == [m for *_, m in inc]
        for kind in TAGS:
            kind_out = [(b, m) for b, _, m in out if m.kind == kind]
            kind_in = [(b, m) for b, _, m in inc if m.kind == kind]
            if [m for _, m in kind_out] != [m for _, m in kind_in]:
                raise RuntimeError(
                    f"tpcore: schedule sends and receives the {kind} messages of link "
                    f"{link[0]}->{link[1]} in different orders"
                )
            for (bs, msg), (br, _) in zip(kind_out, kind_in):
                partner[(link[0], bs, msg)] = (link[1], br)
                partner[(link[1], br, msg)] = (link[0], bs)
    return partner, tagless


def _order(entry: tuple) -> tuple[int, int]:
    return entry[0], entry[1]  # (batch, tag)


def simulate(
    units: list[list[list[Action]]],
    p: int,
    v: int,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> tuple[list[list[float]], float, bool]:
    """Run every rank's `units` on the executor's model: batch k of a rank completes when
    every message in it has been posted by both ends, then the rank runs unit k.
    Returns (start time of each pass per rank, step time, whether the link orders agree
    without tags); raises a RuntimeError naming the stuck batches if the order deadlocks."""
    batches = [boundary_messages(u, r, p, v) for r, u in enumerate(units)]
    partner, tagless = _match(p, batches)
    duration = {FORWARD: forward_time, BACKWARD: backward_time}
    posted: list[list[float | None]] = [
        [0.0] + [None] * len(u) for u in units
    ]  # when rank r posts batch b
    starts: list[list[float]] = [[] for _ in units]
    pos, finish = [0] * p, [None] * p
    progress = True
    while progress and None in finish:
        progress = False
        for r in range(p):
            b = pos[r]
            if finish[r] is not None:
                continue
            sends, recvs = batches[r][b]
            peers = [partner[(r, b, msg)] for msg in sends + recvs]
            if any(pos[peer] < pb for peer, pb in peers):
                continue  # a peer has not posted its side yet
            t = max([posted[r][b]] + [posted[peer][pb] for peer, pb in peers])
            if b == len(units[r]):
                finish[r] = t
            else:
                for a in units[r][b]:
                    starts[r].append(t)
                    t += duration[a.kind]
                posted[r][b + 1] = t
                pos[r] += 1
            progress = True
    if None in finish:
        stuck = {r: batches[r][pos[r]] for r in range(p) if finish[r] is None}
        raise RuntimeError(
            f"tpcore: pipeline order deadlocks: ranks stuck at their (sends, receives) {stuck}"
        )
    return starts, max(finish), tagless


def schedule_table(
    p: int,
    m: int,
    v: int = 1,
    schedule: str | None = None,
    *,
    forward_only: bool = False,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> ScheduleTable:
    """The schedule of p ranks, m micro-batches and v chunks per rank ("interleaved" when
    v > 1, else "1f1b", unless `schedule` says otherwise), timed by `simulate` (which
    would raise if the order could deadlock; the tests run every schedule through it)."""
    schedule = schedule or ("interleaved" if v > 1 else "1f1b")
    check_schedule(schedule, p, m, v)
    units = [rank_units(schedule, p, m, v, r, forward_only) for r in range(p)]
    starts, step_time, tagless = simulate(units, p, v, forward_time, backward_time)
    actions = [[a for unit in u for a in unit] for u in units]
    return ScheduleTable(
        schedule, p, m, v, actions, starts, step_time, forward_time, backward_time, tagless
    )
