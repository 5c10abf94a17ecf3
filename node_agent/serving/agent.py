"""The node agent: device threads, the models they serve, the heartbeat, cancel handling and a
clean shutdown on SIGTERM/SIGINT."""

import asyncio
import logging
import os
import signal
import socket
import sys
import time
import uuid

import torch
from redis.exceptions import RedisError

from node_agent import host_share
from node_agent.model import devices
from node_agent.serving import node_identity
from node_agent.serving.device_thread import DeviceThread
from node_agent.serving.fleet_listener import FleetListener
from node_agent.serving.heartbeat_writer import HeartbeatWriter
from node_agent.serving.publisher import Publisher
from node_agent.serving.served_model import ServedModel
from node_agent.serving.served_pooler import served_class
from node_agent.weights.file_server import FileServer
from node_agent.weights.puller import Puller
from shared import __version__, recovery, systemd_notify, tracing
from shared.catalog import Catalog, ModelProfile
from shared.commands import NodeCommand
from shared.errors import BrokerUnavailable, CortexError
from shared.heartbeat import DeviceInfo, NodeHeartbeat
from shared.lifecycle import ModelState, NodeState
from shared.model_store import HUB_PREFIX, HubRef
from shared.redis_conn import BACKOFF_MAX_S, Outage, atomic, connect
from shared.redis_health import warn_if_not_durable
from shared.settings import NodeSettings

log = logging.getLogger(__name__)

SCAN_COUNT = 1000  # keys a SCAN step looks at (Redis's default, 10, is a round trip per 10 keys)


def _now_ms() -> int:
    return int(time.time() * 1000)


class NodeAgent:
    def __init__(self, settings: NodeSettings):
        self.settings = settings
        self.keys = settings.keys
        self.name = host_share.node_name(settings)
        self.agents_here = host_share.AT_START  # node agents on this host, this one too
        self.catalog = Catalog.load(settings.models_file)
        self.started_ms = _now_ms()
        self.instance = uuid.uuid4().hex  # this process's, in its heartbeat (node_identity.py)
        self.state = NodeState.ACTIVE
        self.models: dict[str, ServedModel] = {}
        self.threads: dict[str, DeviceThread] = {}
        self._stop = asyncio.Event()
        self._redis_run_id: str | None = None
        self.heartbeats = HeartbeatWriter(
            self.keys, self.name, int(settings.heartbeat_ttl_s * 1000)
        )
        self._beating = asyncio.Lock()
        self._cancelling: set[str] = (
            set()
        )  # jobs being cancelled (their unheard steps say so only once)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        await self.serve()

    async def serve(self) -> None:
        """Serve until `stop()`: the devices, the predecessor's leftovers, the heartbeat, cancels,
        commands, keep-alive, the models to load at start; then a clean shutdown."""
        self.redis = connect(self.settings.redis_url)
        await warn_if_not_durable(self.redis, log)
        await self._claim_name()
        self.publisher = Publisher(
            self.redis,
            self.keys,
            self.name,
            on_unheard=self._on_unheard,
            on_lost=self._on_lost,
            retention_s=self.settings.stream_retention_s,
            max_event_bytes=self.settings.max_event_bytes,
        )
        self.publisher.start()
        self.listener = FleetListener(
            self.redis, self.settings.redis_url, self.keys, self._cancel, self._newcomer
        )
        self.puller = Puller(self.settings, self.redis, self.keys, self.name, self._protected_files)
        self.file_server = self._file_server()
        if self.file_server is not None:
            await self.file_server.start()
        for thread in self.start_devices(asyncio.get_running_loop()):
            self.threads[thread.device] = thread
        if self.settings.cpu_bind:
            await self._bind_cpu_threads()
        await self._recover_predecessor()
        tasks = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self.listener.run()),
            asyncio.create_task(self._command_listener()),
            asyncio.create_task(self._keep_alive_loop()),
        ]
        starting = asyncio.gather(*(self.load_model(m) for m in self.settings.models))
        stopping = asyncio.create_task(self._stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if (
            not starting.done()
        ):  # stopped while starting: a download may take hours, a load finishes
            await self.puller.stop()
        await starting
        if not self._stop.is_set():  # a Type=notify unit (packaging/systemd) starts now
            systemd_notify.ready(f"serving {', '.join(self.models) or 'no model'} as {self.name}")
        await stopping
        log.info("node %s stopping", self.name)
        systemd_notify.stopping()
        await self.shutdown(tasks)

    async def _claim_name(self) -> None:
        """Refuse to run under a name another live process beats under (node_identity.py)."""
        try:
            await node_identity.claim(
                self.redis,
                self.keys,
                self.name,
                self.settings.heartbeat_ttl_s,
                self.settings.heartbeat_s / 4,
            )
        except RedisError as exc:  # Redis away: its heartbeats are away too
            log.warning("could not check that no other node runs as %s: %s", self.name, exc)

    def start_devices(self, loop: asyncio.AbstractEventLoop) -> list[DeviceThread]:
        """One started thread per device found (a simulated node's are node_agent/sim/device.py's)."""
        threads = [
            DeviceThread(device, loop, nice=self.settings.device_nice)
            for device in devices.discover(self.settings.device, self.settings.cpu_devices)
        ]
        for thread in threads:
            thread.start()
        return threads

    def served_class(self, profile: ModelProfile) -> type[ServedModel]:
        """What serves `profile` here (a simulated node's: node_agent/sim/served.py)."""
        return served_class(profile)

    async def _bind_cpu_threads(self) -> None:
        """`cpu_bind`: the CPU device thread's torch threads one to a CPU each (one CPU device only:
        several would share the CPUs), or a log line saying why not."""
        cpu_threads = [thread for device, thread in self.threads.items() if devices.is_cpu(device)]
        if len(cpu_threads) != 1:
            log.warning(
                "cpu_bind %r ignored: it binds the threads of one CPU device (this node has %d)",
                self.settings.cpu_bind,
                len(cpu_threads),
            )
            return
        try:
            placed = await cpu_threads[0].call(devices.bind_threads, self.settings.cpu_bind)
        except (ValueError, RuntimeError) as exc:
            log.warning("torch threads not bound to CPUs: %s", exc)
            return
        log.info("torch threads bound to CPUs %s (cpu_bind %r)", placed, self.settings.cpu_bind)

    # ---- lifecycle ---------------------------------------------------------------------------

    def _file_server(self) -> FileServer | None:
        """The server of this node's model files to peers, when a file port and the fleet secret are set."""
        if not (self.settings.file_port and self.settings.fleet_secret):
            return None
        return FileServer(
            self.puller.store,
            self.settings.fleet_secret,
            self.settings.file_host,
            self.settings.file_port,
        )

    @property
    def file_url(self) -> str:
        if self.file_server is None:
            return ""
        return self.settings.file_url or f"http://{socket.gethostname()}:{self.settings.file_port}"

    async def _recover_predecessor(self) -> None:
        """A node that died under this name (a restarted container or service) within the janitor's
        dead-node window left entries read and unfinished: requeue or fail them now (as the janitor
        would), so that their clients do not wait for the request timeout."""
        try:
            streams = [
                k.decode()
                async for k in self.redis.scan_iter(match=self.keys.all_jobs(), count=SCAN_COUNT)
            ]
            found = [
                s
                for s in streams
                if await recovery.recover_consumer(
                    self.redis, self.keys, s, self.name, self.settings.stream_retention_s
                )
            ]
            await self.redis.delete(self.keys.started(self.name))
        except (
            RedisError
        ) as exc:  # Redis away: the janitor recovers them once this node's old heartbeat is gone
            log.warning("could not recover what a node called %s left: %s", self.name, exc)
            return
        if found:
            log.warning(
                "recovered the jobs a node called %s left unfinished on %d streams",
                self.name,
                len(found),
            )

    async def load_model(self, model_id: str) -> None:
        profile = self.catalog.resolve(model_id)
        while (
            current := self.models.get(profile.id)
        ) is not None and current.state == ModelState.UNLOADING:
            await asyncio.sleep(0.05)  # a load that races an unload waits for it, then loads again
        if current is not None and current.state == ModelState.SLEEPING:
            await current.wake()
            await self._beat()
            return
        if current is not None and current.state != ModelState.FAILED:
            return
        while profile.tensor_parallel > 1 and any(
            m.state == ModelState.UNLOADING and len(m.devices) > 1 for m in self.models.values()
        ):
            await asyncio.sleep(
                0.05
            )  # placement evicts the node's tensor-parallel model first: let it go
        # the least used devices (stable: discovery order breaks ties); a tensor-parallel model takes several
        ranked = sorted(
            self.threads.values(),
            key=lambda t: sum(t.device in m.devices for m in self.models.values()),
        )
        chosen = ranked[: profile.tensor_parallel]
        pull = self.puller.start(profile) if self.puller.needs(profile) else None
        served = self.served_class(profile)(
            profile,
            chosen[0],
            self.redis,
            self.keys,
            self.publisher,
            self.name,
            self.settings,
            devices=[t.device for t in chosen],
            load_from=self.puller.local_profile(profile),
            pull=pull,
        )
        self.models[profile.id] = served
        await self._beat()  # show `downloading` or `loading` at once: placement waits for it
        if pull is not None and not await served.fetch():
            await self._beat()
            return
        await served.load()
        await self._beat()

    async def unload_model(self, model_id: str) -> None:
        served = self.models.get(model_id)
        if served is None:
            return
        await served.unload(self.settings.shutdown_grace_s)
        self.models.pop(model_id, None)
        await self._beat()

    async def drain(self) -> None:
        """Stop taking jobs, let running ones finish, unload everything, stay up idle."""
        self.state = NodeState.DRAINING
        await self._beat()
        await asyncio.gather(*(self.unload_model(m) for m in list(self.models)))
        self.state = NodeState.DRAINED
        await self._beat()
        log.info("node %s drained", self.name)

    async def _command_listener(self) -> None:
        stream, last_id = self.keys.cmd(self.name), "0-0"
        outage = Outage(log, "command listener")
        while True:
            try:
                reply = await self.redis.xread({stream: last_id}, block=1000, count=10)
                outage.ok()
                for _stream, entries in reply or []:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        await self.redis.xdel(stream, entry_id)
                        asyncio.get_running_loop().create_task(self._obey(fields))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                outage.failed(exc)
                await asyncio.sleep(1)

    async def _obey(self, fields: dict[bytes, bytes]) -> None:
        try:
            command = NodeCommand.from_fields(fields)
            log.info("command %s %s from %s", command.cmd, command.model, command.by or "?")
            if command.cmd == "load":
                if self.state.takes_jobs:
                    await self.load_model(command.model)
            elif command.cmd == "pull":
                profile = self.catalog.resolve(command.model)
                if self.puller.needs(profile):
                    self.puller.start(
                        profile
                    )  # its end is logged; its progress is in the heartbeat
            elif command.cmd == "rm":
                await self.puller.remove(self.catalog.resolve(command.model))
                await self._beat()
            elif command.cmd == "unload":
                await self.unload_model(command.model)
            else:
                await self.drain()
        except Exception:
            log.exception("command failed: %r", fields)

    async def _keep_alive_loop(self) -> None:
        """Unload models idle past their keep_alive (apart from the heartbeat: an unload may wait
        for a job to finish, and a late heartbeat would make the node look dead)."""
        outage = Outage(log, "keep_alive check")
        while True:
            try:
                await self._tend_models()
                outage.ok()
            except Exception as exc:
                outage.failed(exc)
            await asyncio.sleep(min(self.settings.heartbeat_s, 1.0))

    async def _tend_models(self) -> None:
        """Unload the models idle past their keep_alive; give up those stuck outside `ready`; forget a
        failed replica after `failed_backoff_s` (until then placement does not place it here again)."""
        now = _now_ms()
        for model_id, served in list(self.models.items()):
            if served.faults.give_up_if_overdue():
                await self._beat()
            elif (
                served.state == ModelState.FAILED
                and served.replica.age_s() > self.settings.failed_backoff_s
            ):
                log.info(
                    "%s failed here %.0f s ago; it may be placed here again",
                    model_id,
                    served.replica.age_s(),
                )
                self.models.pop(model_id, None)
                await self._beat()
            elif (
                served.state == ModelState.READY
                and served.ledger.idle_past(served.profile.keep_alive_s, now)
                and not await self._pinned(served)
            ):
                await self._rest(served)

    async def _rest(self, served: ServedModel) -> None:
        """A model idle past its keep_alive sleeps where it can and `sleep_mb` has room (the least
        recently used sleeping models unloaded to make it), else it is unloaded."""
        model_id, room = served.profile.id, self.settings.sleep_mb - served.memory_mb
        if not served.can_sleep or room < 0:
            log.info("%s idle past keep_alive; unloading", model_id)
            await self.unload_model(model_id)
            return
        sleeping = sorted(
            (m for m in self.models.values() if m.state == ModelState.SLEEPING),
            key=lambda m: m.ledger.last_used_ms,
        )
        while sleeping and sum(m.memory_mb for m in sleeping) > room:
            oldest = sleeping.pop(0)
            log.info("%s unloaded: %s needs its room to sleep", oldest.profile.id, model_id)
            await self.unload_model(oldest.profile.id)
        if not served.can_sleep:  # it changed while the others were unloaded
            return
        log.info("%s idle past keep_alive; sleeping", model_id)
        await served.sleep(self.settings.shutdown_grace_s)
        await self._beat()

    async def _pinned(self, served: ServedModel) -> bool:
        override = await self.redis.hget(self.keys.pins(), served.profile.id)
        return served.profile.pin if override is None else override == b"1"

    async def _protected_files(self) -> dict[str, str]:
        """Model folders the disk budget must not delete -> why: those of replicas here, and of pinned models."""
        overrides = {
            k.decode(): v == b"1" for k, v in (await self.redis.hgetall(self.keys.pins())).items()
        }
        found = {}
        for profile in self.catalog.profiles.values():
            if profile.source.startswith(HUB_PREFIX) and overrides.get(profile.id, profile.pin):
                found[HubRef.parse(profile.source).folder] = f"{profile.id} is pinned"
        for model_id, served in self.models.items():
            if served.profile.source.startswith(HUB_PREFIX):
                found[HubRef.parse(served.profile.source).folder] = (
                    f"{model_id} is {served.state} here"
                )
        return found

    def stop(self) -> None:
        """Ask `run()` to shut down cleanly (what SIGTERM does)."""
        self._stop.set()

    async def shutdown(self, tasks: list[asyncio.Task]) -> None:
        """Finish or fail running jobs, free the devices, and take the heartbeat away (when Redis
        answers: else it expires by itself, and the janitor settles what Redis still holds for us)."""
        self.state = NodeState.DRAINING
        await self._quietly(self._beat())
        await asyncio.gather(
            *(m.drain(self.settings.shutdown_grace_s) for m in self.models.values())
        )
        await asyncio.gather(
            *(m.free() for m in self.models.values())
        )  # tensor-parallel workers stop too
        await self.puller.stop()
        if self.file_server is not None:
            await self.file_server.stop()
        await self.publisher.stop()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._quietly(
            self.redis.delete(
                self.keys.node(self.name),
                self.keys.model_files(self.name),
                *(self.keys.prefixes(model, self.name) for model in self.models),
                *(self.keys.prefix_tiers(model, self.name) for model in self.models),
            )
        )
        await self._quietly(self.redis.zrem(self.keys.nodes(), self.name))
        await self._quietly(host_share.leave(self.redis, self.keys, self.name))
        for thread in self.threads.values():
            thread.stop()
        await self.redis.aclose()
        log.info("node %s stopped", self.name)

    @staticmethod
    async def _quietly(redis_call) -> None:
        try:
            await redis_call
        except (RedisError, OSError) as exc:
            log.warning("shutting down without Redis: %s", exc)

    # ---- heartbeat ---------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        outage = Outage(log, "heartbeat")
        while True:
            try:
                await self._beat()
                await self._share_cores()
                await self._notice_redis_restart()
                outage.ok()
            except Exception as exc:  # Redis away: keep serving, keep trying
                outage.failed(exc)
            await asyncio.sleep(self.settings.heartbeat_s)

    async def _share_cores(self) -> None:
        """Renew this agent in its host's set; when agents came or went, re-split the cores
        (node_agent/host_share.py) on each CPU device thread, unless `torch_threads` or `cpu_bind`
        fixes them."""
        agents = await host_share.register(
            self.redis, self.keys, self.name, self.settings.heartbeat_ttl_s
        )
        if agents == self.agents_here:
            return
        self.agents_here = agents
        threads = devices.node_torch_threads(
            self.settings.torch_threads, list(self.threads), agents
        )
        if self.settings.torch_threads or self.settings.cpu_bind or not threads:
            return
        log.info(
            "%d node agents on this host: %d torch threads each (OMP_WAIT_POLICY %s)",
            agents,
            threads,
            os.environ.get("OMP_WAIT_POLICY", "unset"),
        )
        for thread in self.threads.values():  # queued between its steps, not awaited: a load may
            thread.call(torch.set_num_threads, threads)  # hold the thread for minutes

    async def _notice_redis_restart(self) -> None:
        """A new Redis process (its run_id changed) may have come back from its append-only file
        without the last second's writes: each model settles the entries Redis holds for it."""
        run_id = (await self.redis.info("server"))["run_id"]
        if self._redis_run_id not in (None, run_id):
            log.info("Redis restarted (run_id %s, was %s)", run_id[:8], self._redis_run_id[:8])
            self.heartbeats.forget()
            for model in self.models.values():
                model.consumer.redis_came_back()
        self._redis_run_id = run_id

    async def _beat(self) -> None:
        await self.listener.hear(self.models)  # (each change of the models here beats at once)
        async with self._beating:  # one at a time: each is written as a diff of the last
            await self._build_and_write_beat()

    async def _build_and_write_beat(self) -> None:
        now = _now_ms()
        beat = NodeHeartbeat(
            node=self.name,
            version=__version__,
            state=self.state,
            started_ms=self.started_ms,
            heartbeat_ms=now,
            labels=self.settings.labels,
            devices=[self._budgeted(await t.info()) for t in self.threads.values()],
            models={mid: m.info() for mid, m in self.models.items()},
            file_url=self.file_url,
            host=socket.gethostname(),
            pid=os.getpid(),
            instance=self.instance,
            pulls=self.puller.progress(),
        )
        ttl_ms = int(self.settings.heartbeat_ttl_s * 1000)
        async with atomic(self.redis) as pipe:
            self.heartbeats.write(pipe, beat)
            for model in self.models:  # what their caches hold lives as long as the heartbeat
                for held in (self.keys.prefixes, self.keys.prefix_tiers):
                    pipe.pexpire(held(model, self.name), ttl_ms)
                pipe.pexpire(self.keys.prefix_index(model), ttl_ms)
            self.puller.publish(pipe, ttl_ms)
            self.heartbeats.settle(await pipe.execute())

    def _budgeted(self, info: DeviceInfo) -> DeviceInfo:
        """A CPU device with a memory budget reports the budget, less what its models hold (a
        tensor-parallel model holds its share on each of its devices)."""
        budget = self.settings.memory_budget_mb
        if not devices.is_cpu(info.id) or not budget:
            return info
        held = sum(
            m.memory_mb // len(m.devices) for m in self.models.values() if info.id in m.devices
        )
        return info.model_copy(update={"total_mb": budget, "free_mb": max(budget - held, 0)})

    # ---- cancellations from the fleet ------------------------------------------------------------

    def _on_unheard(self, job: str) -> None:
        """Nobody listens to the job, which has no event log (no client can resume it): its client left
        without a cancel reaching us, or its gateway died or lost Redis. The latter subscribes again to
        its queued jobs: give it time before reading more."""
        if self._cancel_soon(job):
            log.info("job %s has no listener any more; cancelling it", job)

    def _on_lost(self, job: str) -> None:
        self._cancel_soon(
            job,
            BrokerUnavailable(
                f"node {self.name} lost its connection to Redis while it ran job "
                f"{job}; its output was lost"
            ),
        )

    def _cancel_soon(self, job: str, error: CortexError | None = None) -> bool:
        """Cancel a running job (once, however many of its steps report it) and pause reading new jobs
        of its model (others read on); False when there is nothing to do."""
        holding = [m for m in self.models.values() if job in m.ledger]
        if job in self._cancelling or not holding:
            return False
        self._cancelling.add(job)
        for model in holding:
            model.consumer.pause(
                BACKOFF_MAX_S + 0.5
            )  # a gateway's router tries Redis at least this often
        task = asyncio.get_running_loop().create_task(self._cancel(job, error))
        task.add_done_callback(lambda _: self._cancelling.discard(job))
        return True

    async def _cancel(self, job: str, error: CortexError | None = None) -> None:
        for model in self.models.values():
            await model.cancel(job, error)

    def _newcomer(self, model: str) -> None:
        if (served := self.models.get(model)) is not None:
            served.consumer.newcomer()


def run(settings: NodeSettings | None = None) -> None:
    settings = settings or NodeSettings()
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    threads = devices.node_torch_threads(
        settings.torch_threads,
        devices.discover(settings.device, settings.cpu_devices),
        host_share.AT_START,
    )
    if threads:
        torch.set_num_threads(threads)
    log.info(
        "torch threads %d (node agents on this host: %d; OMP_WAIT_POLICY %s)",
        torch.get_num_threads(),
        host_share.AT_START,
        os.environ.get("OMP_WAIT_POLICY", "unset"),
    )
    sys.setswitchinterval(settings.gil_switch_interval_s)
    agent = NodeAgent(settings)
    tracing.configure("cortex-node", settings.otlp_endpoint, instance=agent.name)
    try:
        asyncio.run(agent.run())
    except node_identity.NodeNameTaken as exc:
        log.error("%s", exc)
        raise SystemExit(2) from None
