"""Getting `hf:` models onto this node: one pull per model folder however many ask (a load placed
here, `cortex models pull`), from a peer node that holds the folder whole (found in Redis,
`Keys.model_files`), else from the hub, by the one node holding the folder's hub lock (the
others wait for it and copy from it). Each pull makes room within the disk budget first and ends
with every file checked and the folder's manifest written; its progress goes out in the heartbeat."""

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path

import redis.asyncio as aioredis
from redis.exceptions import LockError

from node_agent.weights import disk_budget, hub, peer, peer_trust
from shared.catalog import ModelProfile
from shared.errors import DiskBudgetExceeded, ModelPullFailed
from shared.fleet import Fleet
from shared.heartbeat import PullProgress
from shared.keys import Keys
from shared.model_files import ModelLoadError, locate
from shared.model_store import HUB_PREFIX, HubRef, Manifest, ModelStore
from shared.settings import NodeSettings

log = logging.getLogger(__name__)

HUB_LOCK_S = 30.0  # the hub lock's PX; renewed every third of it while the pull runs
WAIT_FOR_HOLDER_S = 1.0  # how often a node waiting for another's hub pull looks for a peer copy
RATE_WINDOW_S = 5.0


class Pull:
    """One model folder on its way here."""

    def __init__(self, store: ModelStore, folder: str):
        self.store, self.folder = store, folder
        self.source, self.total = "", 0
        self._samples = deque([(time.monotonic(), store.bytes_in(folder))])  # (when, bytes on disk)
        self.task: asyncio.Task | None = None

    def progress(self) -> PullProgress:
        on_disk, now = self.store.bytes_in(self.folder), time.monotonic()
        self._samples.append((now, on_disk))
        while len(self._samples) > 2 and self._samples[0][0] < now - RATE_WINDOW_S:
            self._samples.popleft()
        first_s, first_bytes = self._samples[0]
        rate = max(on_disk - first_bytes, 0) / (now - first_s) if now > first_s else 0.0
        done = min(on_disk, self.total) if self.total else 0
        return PullProgress(
            source=self.source, bytes_done=done, bytes_total=self.total, rate_bps=rate
        )

    async def wait(self) -> Path:
        await asyncio.shield(self.task)
        return self.store.folder(self.folder)


class Puller:
    def __init__(
        self,
        settings: NodeSettings,
        redis: aioredis.Redis,
        keys: Keys,
        node: str,
        protected: Callable[[], Awaitable[dict[str, str]]],
    ):
        self.settings, self.redis, self.keys, self.node = settings, redis, keys, node
        self.store = ModelStore(settings.models_dir)
        self._protected = protected  # folders that must stay -> why (loaded, pinned)
        self.pulls: dict[str, Pull] = {}
        self.failed: dict[
            str, tuple[float, PullProgress]
        ] = {}  # folder -> (when, how far it got and why)
        self.held: dict[str, Manifest] = self.store.held()
        self._published = True  # the last heartbeat's `publish` wrote some (at first: may have)
        self._stopping = threading.Event()  # ends hub downloads (threads) when the node stops

    # ---- what a load needs ------------------------------------------------------------------

    def needs(self, profile: ModelProfile) -> bool:
        """An `hf:` model whose files are neither in the models directory nor in the Hugging Face cache."""
        if (
            not profile.source.startswith(HUB_PREFIX)
            or HubRef.parse(profile.source).folder in self.held
        ):
            return False
        try:
            locate(profile, self.settings.hf_cache)
            return False
        except ModelLoadError:
            return True

    def local_profile(self, profile: ModelProfile) -> ModelProfile:
        """`profile` pointed at its folder here, when it is an `hf:` model in the models directory."""
        if not profile.source.startswith(HUB_PREFIX):
            return profile
        folder = HubRef.parse(profile.source).folder
        if folder not in self.held:
            return profile
        self.store.touch(folder)
        return profile.model_copy(update={"source": str(self.store.folder(folder))})

    # ---- pulls -------------------------------------------------------------------------------

    def start(self, profile: ModelProfile) -> Pull:
        """The pull of `profile`'s folder: the one running, or a new one."""
        folder = HubRef.parse(profile.source).folder
        if folder in self.pulls:
            return self.pulls[folder]
        self.failed.pop(folder, None)
        pull = self.pulls[folder] = Pull(self.store, folder)
        pull.task = asyncio.create_task(self._run(pull, profile), name=f"pull-{folder}")
        pull.task.add_done_callback(lambda task: self._ended(pull, task))
        return pull

    def _ended(self, pull: Pull, task: asyncio.Task) -> None:
        self.pulls.pop(pull.folder, None)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("pulling %s failed: %s", pull.folder, error)
            why = getattr(error, "message", None) or f"{type(error).__name__}: {error}"
            self.failed[pull.folder] = (
                time.monotonic(),
                pull.progress().model_copy(update={"error": why}),
            )

    async def _run(self, pull: Pull, profile: ModelProfile) -> None:
        started, failed_peers = time.monotonic(), set()
        expected = await self._hub_manifest(profile)  # None: the hub did not answer
        while True:
            found = await self._peer_holding(pull.folder, failed_peers)
            if found is not None:
                name, url, offered = found
                try:
                    wanted = peer_trust.accepted(
                        offered, profile.source, profile.gguf_file, expected
                    )
                except ModelPullFailed as exc:
                    log.warning("not fetching %s from %s: %s", profile.source, name, exc.message)
                    failed_peers.add(name)
                    continue
                pull.source = f"peer {name}"
                try:
                    await self._fetch(
                        pull,
                        wanted,
                        lambda: peer.download(
                            wanted,
                            self.store.folder(pull.folder),
                            url,
                            self.settings.fleet_secret,
                            name,
                        ),
                    )
                    break
                except DiskBudgetExceeded:
                    raise  # no source makes room
                except (
                    ModelPullFailed
                ) as exc:  # the peer went away, or sent a bad file: another source
                    log.warning("%s; trying another peer, else the hub", exc.message)
                    failed_peers.add(name)
                    continue
            lock = self.redis.lock(self.keys.pull_lock(pull.folder), timeout=HUB_LOCK_S)
            if await lock.acquire(blocking=False):
                try:
                    pull.source = "hub"
                    wanted = expected or await asyncio.to_thread(
                        hub.manifest, profile.source, profile.gguf_file
                    )
                    await self._fetch(
                        pull,
                        wanted,
                        lambda: asyncio.to_thread(
                            hub.download, wanted, self.store.folder(pull.folder), self._stopping
                        ),
                        lock,
                    )
                finally:
                    with contextlib.suppress(LockError):
                        await lock.release()
                break
            pull.source = "waiting for the node pulling it from the hub"
            await asyncio.sleep(WAIT_FOR_HOLDER_S)
        self.store.complete(wanted)
        self.held[pull.folder] = wanted
        log.info(
            "%s is here (%d files, %.1f MB from %s in %.1f s)",
            profile.source,
            len(wanted.files),
            wanted.total_bytes / 1e6,
            pull.source,
            time.monotonic() - started,
        )

    @staticmethod
    async def _hub_manifest(profile: ModelProfile) -> Manifest | None:
        """The hub's manifest of `profile`'s source, which a peer's must match; None when the hub
        does not answer (then only a source pinned to a commit is taken from a peer)."""
        try:
            return await asyncio.to_thread(hub.manifest, profile.source, profile.gguf_file)
        except ModelPullFailed as exc:
            log.info("%s; a peer's copy is taken only of a pinned commit", exc.message)
            return None

    async def _fetch(
        self, pull: Pull, wanted: Manifest, transfer: Callable[[], Awaitable[None]], lock=None
    ) -> None:
        """Room first, then the transfer (renewing the hub lock, when held, while it runs)."""
        pull.total = wanted.total_bytes
        protected = await self._protected() | {
            f: "being pulled" for f in self.pulls if f != pull.folder
        }
        budget = int(self.settings.models_disk_gb * 1e9) if self.settings.models_disk_gb else None
        coming = {f: p.total for f, p in self.pulls.items() if f != pull.folder and p.total}
        for evicted in disk_budget.make_room(
            self.store, pull.folder, wanted.total_bytes, budget, protected, wanted.source, coming
        ):
            self.held.pop(evicted, None)
        self.store.folder(pull.folder).mkdir(parents=True, exist_ok=True)
        renewing = asyncio.create_task(self._renew(lock)) if lock is not None else None
        try:
            await transfer()
        finally:
            if renewing is not None:
                renewing.cancel()

    @staticmethod
    async def _renew(lock) -> None:
        while True:
            await asyncio.sleep(HUB_LOCK_S / 3)
            await lock.reacquire()

    async def _peer_holding(self, folder: str, skip: set[str]) -> tuple[str, str, Manifest] | None:
        """A live peer serving files, not in `skip`, that holds `folder` whole: (its name, its file URL,
        its manifest). A peer whose file URL is not on its own host (node_agent/weights/peer_trust.py)
        is skipped with a log line (and added to `skip`): the fleet secret never goes there."""
        if not self.settings.fleet_secret:
            return None
        for node in await Fleet(self.redis, self.keys, self.settings.heartbeat_ttl_s).live_nodes():
            if node.node == self.node or not node.file_url or node.node in skip:
                continue
            held = await self.redis.hget(self.keys.model_files(node.node), folder)
            if not held:
                continue
            refusal = await asyncio.to_thread(
                peer_trust.file_url_refusal, node.file_url, node.host, socket.gethostname()
            )
            if refusal:
                log.warning("not fetching from peer %s: %s", node.node, refusal)
                skip.add(node.node)
                continue
            try:
                return node.node, node.file_url, Manifest.model_validate_json(held)
            except ValueError as exc:
                log.warning(
                    "not fetching from peer %s: its manifest is unreadable: %s", node.node, exc
                )
                skip.add(node.node)
        return None

    def progress(self) -> dict[str, PullProgress]:
        """Pulls in progress, and those that failed within `failed_backoff_s`."""
        recent = time.monotonic() - self.settings.failed_backoff_s
        self.failed = {folder: (at, p) for folder, (at, p) in self.failed.items() if at > recent}
        return {folder: p for folder, (_, p) in self.failed.items()} | {
            folder: pull.progress() for folder, pull in self.pulls.items()
        }

    # ---- files held -------------------------------------------------------------------------

    async def remove(self, profile: ModelProfile) -> bool:
        """Delete `profile`'s folder unless it is loaded, pinned or being pulled (then log why not)."""
        folder = HubRef.parse(profile.source).folder
        why = (await self._protected()).get(folder) or (
            "being pulled" if folder in self.pulls else ""
        )
        if why:
            log.warning("the files of %s (%s) stay: %s", profile.id, folder, why)
            return False
        self.held.pop(folder, None)
        log.info(
            "deleted the files of %s (%s, %.1f MB)",
            profile.id,
            folder,
            self.store.remove(folder) / 1e6,
        )
        return True

    def publish(self, pipe, ttl_ms: int) -> None:
        """The folders held whole, into `Keys.model_files` (in the heartbeat's pipeline)."""
        key = self.keys.model_files(self.node)
        if not (self.held or self._published):  # nothing held, nothing to take back: no command
            return
        pipe.delete(key)
        if self.held:
            pipe.hset(key, mapping={folder: m.model_dump_json() for folder, m in self.held.items()})
            pipe.pexpire(key, ttl_ms)
        self._published = bool(self.held)

    async def stop(self) -> None:
        self._stopping.set()
        tasks = [pull.task for pull in self.pulls.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
