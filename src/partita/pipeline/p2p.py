"""Point-to-point transfers between pipeline ranks, with timeouts that say who waited.

A maximal run of consecutive SEND/RECV actions is posted as one `batch_isend_irecv`
(through `GroupComm.p2p_op`, so the bytes are counted). Sends never block: their
handles and tensors are kept until the peer has them — completed ones are dropped as
the step goes on, which frees an activation once it has been sent — and all are waited
for at the end of the step. Receives block, with a timeout: a rank that died or stalls
makes its peers fail with a message naming the rank, the stage, the action and the
microbatch instead of hanging.

Matching is by order on each (sender, receiver) pair — NCCL has no tags — so both ends
must post their transfers in the same order; `check_transfer_order` proves that for a
schedule before it runs, and `validated_schedule` is the one place a schedule is built,
validated and proven.
"""

from __future__ import annotations

import datetime
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import torch
import torch.distributed as dist

from partita import shm_channel
from partita.comm import GroupComm
from partita.errors import PeerFailure
from partita.pipeline.actions import Action, Kind, Schedule, ScheduleError
from partita.pipeline.schedules import build_schedule
from partita.pipeline.validate import validate


class PipelineTimeout(PeerFailure):
    """A pipeline peer did not deliver in time (it died, stalls, or runs another step)."""


def describe(action: Action) -> str:
    """'activation of stage 2, microbatch 5' for RF2.5 / SF2.5."""
    what = "activation" if action.kind in (Kind.SEND_F, Kind.RECV_F) else "input gradient"
    return f"{what} of stage {action.stage}, microbatch {action.microbatch}"


def neighbour_pairs(n_stages: int, rank_of: Callable[[int], int]) -> list[tuple[int, int]]:
    """Every ordered pair of pipeline ranks that a schedule on `n_stages` stages moves
    data between (stage s to s + 1 and back), in one order on every rank: the rings a
    pipeline on one host needs (`partita.shm_channel`)."""
    pairs = set()
    for s in range(n_stages - 1):
        a, b = rank_of(s), rank_of(s + 1)
        if a != b:
            pairs |= {(a, b), (b, a)}
    return sorted(pairs)


def check_transfer_order(sched: Schedule) -> None:
    """Raise ScheduleError unless, for every ordered pair of ranks, the receiver posts
    its receives in the order the sender posts the sends (order-matched p2p)."""
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for r, acts in enumerate(sched.ranks):
        for a in acts:
            if a.kind.is_send or a.kind.is_recv:
                key = a.transfer_key
                peer = sched.rank_of(a.peer_stage)
                book = sent if a.kind.is_send else received
                book.setdefault((r, peer) if a.kind.is_send else (peer, r), []).append(key)
    for pair, keys in sent.items():
        if received.get(pair) != keys:
            raise ScheduleError(
                f"schedule '{sched.name}': rank {pair[1]} receives from rank {pair[0]} in "
                f"another order than rank {pair[0]} sends; point-to-point transfers match "
                "by order, so the runtime cannot run it. Reorder that rank's receives."
            )


def delivery_proofs(sched: Schedule, rank: int) -> dict[Action, Action]:
    """For each of `rank`'s sends, the first of its receives whose arrival proves the
    send was delivered: one the peer posts after it has taken that send. A rank waits
    for its receives in list order, so the peer cannot send that one before; the send
    has left this rank by then and waiting on it returns at once. A send with no such
    receive (the peer sends nothing back after it in this step) is absent."""
    receive_at = {(q, a.transfer_key): k for q, acts in enumerate(sched.ranks)
                  for k, a in enumerate(acts) if a.kind.is_recv}
    proofs: dict[Action, Action] = {}
    for a in sched.ranks[rank]:
        if not a.kind.is_send:
            continue
        peer = sched.rank_of(a.peer_stage)
        for b in sched.ranks[peer][receive_at[(peer, a.transfer_key)] + 1:]:
            if b.kind.is_send and sched.rank_of(b.peer_stage) == rank:
                kind = Kind.RECV_F if b.kind is Kind.SEND_F else Kind.RECV_B
                proofs[a] = Action(kind, b.stage, b.microbatch)
                break
    return proofs


class Transport:
    """Posts one rank's transfers and waits for them with a deadline."""

    def __init__(self, comm: GroupComm, peer_rank: Callable[[int], int], timeout_s: float,
                 stage_rank: int, pairs: list[tuple[int, int]] | None = None) -> None:
        """`pairs`: the ordered pairs of pipeline ranks that transfer
        (`neighbour_pairs`); given, a gloo pipeline on one host moves them
        through shared memory (collective over the group)."""
        self.comm = comm
        self.peer_rank = peer_rank  # pipeline stage -> global rank holding it
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.me = stage_rank  # this rank's pipeline index, for messages
        # Every transfer run is posted as one batch from the runner's thread when it is
        # reached (NCCL needs that: it runs a pair's sends and receives in issue order
        # on one stream, so a receive posted apart from its batch could wait for a peer
        # that waits for us). Gloo progresses each posted receive on its own, so there
        # the runner also posts receives ahead of the computes in front of them
        # (`post_recvs`), from one helper thread: posting a gloo receive copies a tensor
        # the peer already sent off the socket in the calling thread. With those
        # receives waiting at the peer, a gloo send's write in the runner's thread is
        # short; sends used to go through the helper too, and posting them here
        # instead measured 1.7-3.0% faster per step on 1F1B at p = 2 (0.3-1.6% on the
        # other schedules, bench pp config, 20 rounds each way).
        gloo = comm.group is not None and dist.get_backend(comm.group) == "gloo"
        # Where the mesh moves this gloo group's collectives through shared memory at
        # every size, the transfers take rings there too (`shm_channel`: none of the
        # helpers below is needed, a send is in the ring or queued at once).
        self.channels = shm_channel.open_channels(comm, pairs or [], timeout_s)
        self._index = {g: i for i, g in enumerate(comm.ranks)}
        gloo = gloo and self.channels is None
        self.early_receives = gloo
        self._receiver = ThreadPoolExecutor(1, "partita-pp-recv") if gloo else None
        # A gloo send reports itself complete only once waited on, so "drop the sends
        # that completed" would keep every sent tensor until the step's end (m of them
        # on the first stage instead of about p). Most sends are proven delivered by a
        # later receive from the same peer (`delivery_proofs`, set per step in
        # `proofs`): the runner's thread waits on them when that receive is in, which
        # returns at once. A second helper waits on each other send in turn (blocked,
        # off the runner's thread) and so marks it done as the peer takes it; the
        # receive helper must not wait itself: a receive could be queued behind it.
        # Handing every send to that helper cost about 1% of an interleaved step at
        # p = 2 (32 sends per rank: two thread switches each; 0.990, 0.982-1.001, 100
        # rounds without it against with it).
        self._reaper = _Reaper() if gloo else None
        self.proofs: dict[Action, Action] = {}
        self.proven: dict[Action, list[tuple[Action, object, torch.Tensor]]] = {}
        self.pending_sends: list[tuple[Action, object, torch.Tensor]] = []

    def post(self, batch: Sequence[tuple[Action, torch.Tensor]]) -> list[tuple[Action, object]]:
        """Post sends and receives in order as one batch; returns the receive handles."""
        if self.channels is not None:
            return self._post_shared(batch)
        ops = []
        for action, tensor in batch:
            peer = self.peer_rank(action.peer_stage)
            ops.append(self.comm.p2p_op(action.kind.is_send, tensor, peer))
        works = dist.batch_isend_irecv(ops) if ops else []
        recvs = []
        for (action, tensor), work in zip(batch, works):
            if action.kind.is_send:
                proof = self.proofs.get(action) if self._reaper is not None else None
                if proof is not None:  # gloo: see __init__
                    self.proven.setdefault(proof, []).append((action, work, tensor))
                    continue
                if self._reaper is not None:
                    work = _ReapedSend(work, self._reaper, self.timeout)
                self.pending_sends.append((action, work, tensor))
            else:
                recvs.append((action, work))
        return recvs

    def _post_shared(self, batch: Sequence[tuple[Action, torch.Tensor]]
                     ) -> list[tuple[Action, object]]:
        recvs = []
        for action, tensor in batch:
            peer = self._index[self.peer_rank(action.peer_stage)]
            if action.kind.is_send:
                self.pending_sends.append((action, self.channels.send(peer, tensor), tensor))
            else:
                recvs.append((action, self.channels.recv(peer, tensor)))
        return recvs

    def post_recvs(self, batch: Sequence[tuple[Action, torch.Tensor]]) -> list:
        """Post receives from the helper thread (gloo's early receives), in order;
        returns their handles. Posting a gloo receive can copy the tensor off the socket
        in the calling thread when the peer has already sent it (measured: about 0.25 ms
        per 512 KB), so the runner's thread hands that over instead of doing it between
        two passes."""
        peers = [self.peer_rank(a.peer_stage) for a, _ in batch]
        group = self.comm.group

        def post() -> list:
            return [dist.irecv(t, peer, group=group) for (_, t), peer in zip(batch, peers)]

        future = self._receiver.submit(post)
        return [_Posted(future, k) for k in range(len(batch))]

    def wait(self, action: Action, work) -> None:
        """Block until a receive (or send) completes; PipelineTimeout names it."""
        start = time.perf_counter()
        try:
            work.wait(timeout=self.timeout)
        except (RuntimeError, FutureTimeout) as exc:  # how gloo / NCCL report a timeout
            waited = time.perf_counter() - start
            peer = self.peer_rank(action.peer_stage)
            verb = "waited" if action.kind.is_recv else "waited to deliver"
            raise PipelineTimeout(
                f"pipeline rank {self.me} (global rank {dist.get_rank()}, stage "
                f"{action.local_stage}) {verb} {waited:.0f} s for {action} ({describe(action)}) "
                f"{'from' if action.kind.is_recv else 'to'} rank {peer}, which did not "
                f"answer: it probably died, stalls, or runs a different schedule or number "
                f"of microbatches. (timeout {self.timeout_s:g} s; cause: {exc})"
            ) from exc

    def received(self, action: Action) -> None:
        """`action`'s receive is in: drop the sends it proves delivered."""
        for sent, work, _ in self.proven.pop(action, ()):
            self.wait(sent, work)

    def release_sent(self) -> None:
        """Drop completed sends, so their tensors can be freed."""
        self.pending_sends = [s for s in self.pending_sends if not s[1].is_completed()]

    def finish(self) -> None:
        """Wait for every outstanding send (end of step)."""
        left = [s for sends in self.proven.values() for s in sends]
        for action, work, _ in left + self.pending_sends:
            self.wait(action, work)
        self.proven.clear()
        self.pending_sends.clear()


class _Reaper:
    """Runs waits one after another on a daemon thread: a wait on a peer that died must
    not hold up this process's exit (a pool's worker would be joined at exit, up to a
    full timeout per queued send)."""

    def __init__(self) -> None:
        jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._jobs = jobs
        threading.Thread(target=_run_jobs, args=(jobs,), name="partita-pp-reap",
                         daemon=True).start()

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._jobs.put((future, fn, args))
        return future

    def __del__(self) -> None:
        self._jobs.put(None)  # lets the thread end with its transport


def _run_jobs(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        future, fn, args = job
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)
        # Drop the job now: kept until the next get(), the last one (a gloo Work's bound
        # wait) was freed when `__del__` woke this thread during interpreter shutdown;
        # the Work's destructor releases the GIL, retaking it there ends the thread in
        # C++ and aborts the process ("terminate called without an active exception",
        # 1 run in 10-20 of a 2-process zero-bubble job under load).
        del job, future, fn, args


class _Posted:
    """An early receive posted from the helper thread: the k-th work of that batch."""

    def __init__(self, future: Future, k: int) -> None:
        self.future, self.k = future, k

    def wait(self, timeout: datetime.timedelta) -> None:
        self.future.result(timeout=timeout.total_seconds())[self.k].wait(timeout=timeout)


class _ReapedSend:
    """A gloo send whose one wait runs on the reaper (see Transport). A gloo send's wait
    takes one completion off its buffer, so a second wait on it would block forever:
    whoever waits here waits for the reaper instead."""

    def __init__(self, work, reaper: _Reaper, timeout: datetime.timedelta) -> None:
        self.reaped = reaper.submit(work.wait, timeout)

    def wait(self, timeout: datetime.timedelta) -> None:
        self.reaped.result(timeout=timeout.total_seconds())

    def is_completed(self) -> bool:
        # A failed send stays pending, for finish() to report.
        return self.reaped.done() and self.reaped.exception() is None


def validated_schedule(name: str, n_ranks: int, microbatches: int, virtual: int) -> Schedule:
    """A schedule, validated and proven to deliver every transfer in order (no process)."""
    sched = build_schedule(name, n_ranks, microbatches, virtual)
    validate(sched)
    check_transfer_order(sched)
    return sched
