"""Liveness: every rank of a run with more than one process watches the others, colocated or split.

A rank that dies leaves the others blocked in a collective or a receive (NCCL waits up to its
10-minute timeout; gloo notices a closed socket, but not a frozen process). Collective timeouts
cannot tell a dead rank from a slow one (a cold compile takes minutes), so every rank instead
bumps a counter in the launcher's TCPStore every HEARTBEAT_S from a watchdog thread that runs
whatever the main thread is doing, and a rank whose counter has not moved for dead_after_s
(--liveness_timeout_s) is dead. A rank that fails with an exception posts it (`report_failure`),
and the others stop within seconds. Counters, not timestamps: no clock skew between machines.
Under torchrun the store lives in the launcher's agent, which outlives the ranks.

`start_liveness` starts it (dflash_topology.setup_distributed); `report_failure` and
`StoppedByLauncher` are what a failing rank's last words use (dflash_progress.exit_after_failure).
"""

import functools
import logging
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

log = logging.getLogger("dflash_liveness")

HEARTBEAT_S = 2.0
LEFT = 1 << 40  # added to a rank's counter when it leaves cleanly: stop watching it
_ACTIVE: "Liveness | None" = None


class Liveness:
    def __init__(self, store: dist.Store, rank: int, world: int, dead_after_s: float, where: str):
        self.store, self.rank, self.world, self.where = store, rank, world, where
        self.dead_after_s = dead_after_s
        self.lock = threading.Lock()  # the store client is shared by the watchdog and the main thread
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="dflash-liveness", daemon=True)

    def _op(self, fn):
        with self.lock:
            return fn(self.store)

    def _run(self) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        last_value = {r: -1 for r in others}
        last_change = {r: time.monotonic() for r in others}
        store_down_since = None
        while not self.stopping.wait(HEARTBEAT_S):
            try:
                self._op(lambda s: s.add(f"hb/{self.rank}", 1))
                values = self._op(lambda s: [s.add(f"hb/{r}", 0) for r in others])  # add 0: read, never blocks
                failed = self._op(lambda s: s.get("failed").decode() if s.check(["failed"]) else None)
                store_down_since = None
            except Exception as error:  # the store is gone: the launcher (or rank 0 hosting it) died
                if self.stopping.is_set():
                    return
                store_down_since = store_down_since or time.monotonic()
                if time.monotonic() - store_down_since > 10.0:
                    self._die(f"lost the rendezvous store at {self.where} ({error}): the launcher or rank 0 died")
                continue
            if failed is not None:
                self._die(f"{failed}")
            now = time.monotonic()
            for r, value in zip(others, values):
                if value >= LEFT:
                    continue
                if value != last_value[r]:
                    last_value[r], last_change[r] = value, now
                elif now - last_change[r] > self.dead_after_s:
                    self._die(f"rank {r} sent no heartbeat for {now - last_change[r]:.0f} s: it died or is stuck")

    def _post_failure(self, message: str) -> str:
        """Post `message` as the run's failure unless a rank posted one first; return the one that
        stands. The first failure is the root cause: a rank that fails later because its peer
        exited (a closed socket, say) must not overwrite it."""
        try:
            return self._op(lambda s: s.compare_set("failed", "", message)).decode()
        except Exception:  # the store is gone too: nobody is left to tell
            return message

    def _die(self, reason: str) -> None:
        log.error("stopping rank %d: %s", self.rank, reason)
        self._post_failure(f"rank {self.rank} stopped: {reason}")  # before exiting, so the others learn why
        os._exit(1)  # the main thread may be blocked in a collective that will never return

    def report_failure(self, reason: str) -> bool:
        """Post this rank's failure; True (after logging the earlier one) if another rank failed first."""
        self.stopping.set()  # this rank's own watchdog must not read the message and exit before the traceback
        own = f"rank {self.rank} failed: {reason}"
        first = self._post_failure(own)
        if first != own:
            log.error("stopping rank %d after an earlier failure: %s", self.rank, first)
        return first != own

    def finish(self) -> None:
        """Clean end, watched: wait until every rank got here, then stop. Rank 0 leaves last, so a
        store that rank 0 hosts (launches without torchrun's agent) outlives every use of it."""
        self._op(lambda s: s.add("done", 1))
        while self._op(lambda s: s.add("done", 0)) < self.world:
            time.sleep(0.2)
        if self.rank != 0:
            self._op(lambda s: s.add(f"hb/{self.rank}", LEFT))
            self._op(lambda s: s.add("left", 1))
        else:
            while self._op(lambda s: s.add("left", 0)) < self.world - 1:
                time.sleep(0.2)
        self.stopping.set()
        self.thread.join()


def start_liveness(rank: int, world: int, dead_after_s: float) -> Liveness | None:
    """Start this rank's heartbeat and watchdog (None for a single process or without a TCPStore
    address). Uses its own client connection to the launcher's store (MASTER_ADDR:MASTER_PORT),
    with short timeouts that leave the process group's own store client alone."""
    global _ACTIVE
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if world == 1 or not host or not port:
        return None
    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=20), wait_for_workers=False)
    # Keys of this launch only (torchrun's agent store outlives restarts).
    prefix = f"dflash-liveness/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _ACTIVE = Liveness(dist.PrefixStore(prefix, client), rank, world, dead_after_s, f"{host}:{port}")
    _ACTIVE.thread.start()
    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGTERM, functools.partial(stop_on_sigterm, os.getpid()))
    return _ACTIVE


class StoppedByLauncher(Exception):
    """This rank received SIGTERM: torchrun's agent stops every rank once one has exited with an
    error, or when its own run is interrupted."""


def stop_on_sigterm(owner_pid: int, signum: int, frame) -> None:
    """SIGTERM handler of a rank with liveness: raise `StoppedByLauncher` in the main thread, so that
    the rank goes through `report_failure` and logs which rank failed first. Without it the agent's
    SIGTERM can kill a rank before it has noticed the failure, silently. Processes forked from the
    rank (data-loading workers) inherit the handler and end as SIGTERM ends them by default."""
    if os.getpid() != owner_pid:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)
        return
    raise StoppedByLauncher(f"stopped by the launcher ({signal.Signals(signum).name}): another rank exited, or the launch was interrupted")


def report_failure(error: BaseException) -> tuple[bool, bool]:
    """Tell the other ranks this one is failing, so they stop within seconds. Returns (whether anyone
    listens, whether another rank failed first: this failure then follows from that one, e.g. a
    collective whose peer exited, and the log already names the cause)."""
    if _ACTIVE is None:
        return False, False
    return True, _ACTIVE.report_failure(f"{type(error).__name__}: {error}"[:2000])
