"""The node's end of one model's output process (node_agent/serving/output_process.py): it starts
the process, writes it messages and reads its feedback.

Writes are blocking, under a lock: the device thread writes each step's record itself (when the
output process falls behind, the engine waits: back-pressure, not a queue that grows), and the
event loop writes the node's own messages (rare and small). The output process never blocks on
its writes (asyncio buffers them), so the two cannot wait on each other. Feedback is read on the
event loop; its end (the process exited or was killed) is reported once to `on_exit`."""

import asyncio
import logging
import socket
import subprocess
import sys
import threading
from typing import Callable

import msgspec

from node_agent.engine.detokenize import TokenizerText
from node_agent.engine.records import StepOutput
from node_agent.serving.output_messages import (
    FRAME,
    Delivery,
    Feedback,
    Open,
    Outgoing,
    Publish,
    Step,
)
from node_agent.serving.output_process import frame

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # for the process to publish what it holds and exit, before it is killed


class OutputLink:
    def __init__(
        self, config: dict, on_feedback: Callable[[Feedback], None], on_exit: Callable[[str], None]
    ):
        self.config = config  # redis_url, key_prefix, node, model, log_level, stream_retention_s
        self.on_feedback, self.on_exit = on_feedback, on_exit
        self.process: subprocess.Popen | None = None
        self._inbox: socket.socket | None = None
        self._reading: asyncio.Task | None = None
        self._feedback: asyncio.StreamWriter | None = None
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._closing = False
        self.alive = False

    async def start(self) -> None:
        """Start the process (it imports while the model loads; `open` hands it the tokenizer)."""
        inbox, inbox_child = socket.socketpair()
        feedback, feedback_child = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "node_agent.serving.output_process",
                    str(inbox_child.fileno()),
                    str(feedback_child.fileno()),
                ],
                pass_fds=(inbox_child.fileno(), feedback_child.fileno()),
            )
        finally:
            inbox_child.close()
            feedback_child.close()
        self._inbox, self.alive = inbox, True
        reader, self._feedback = await asyncio.open_unix_connection(
            sock=feedback
        )  # dropped, it would close
        self._reading = asyncio.create_task(
            self._read(reader), name=f"output-feedback-{self.config['model']}"
        )

    def open(self, text: TokenizerText) -> None:
        """Its settings and the model's tokenizer: the first message (the URL may hold Redis's password)."""
        self._write(Open(**self.config, tokenizer=text.dumps()))

    def step(self, out: StepOutput) -> None:
        """One engine step's record; called on the device thread."""
        self._write(Step(out))

    def publish(self, items: list[Outgoing], deliveries: list[Delivery] = ()) -> None:
        self._write(Publish(items, list(deliveries)))

    def _write(self, message) -> None:
        data = frame(message, self._encoder)
        with self._lock:
            if not self.alive:
                return
            try:
                self._inbox.sendall(data)
            except OSError as exc:  # the process is gone: its feedback ending reports it
                log.warning("%s: the output process does not read (%s)", self.config["model"], exc)
                self.alive = False

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = msgspec.msgpack.Decoder(Feedback)
        failure = ""
        try:
            while True:
                (size,) = FRAME.unpack(await reader.readexactly(FRAME.size))
                self.on_feedback(decoder.decode(await reader.readexactly(size)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except Exception as exc:  # a bug reading or handling feedback: as if the process died (its jobs fail, reload)
            log.exception("%s: handling the output process's feedback failed", self.config["model"])
            failure = f"handling its feedback failed ({type(exc).__name__}: {exc})"
            self.process.kill()
        with self._lock:
            self.alive = False
        if not self._closing:
            code = await asyncio.to_thread(self.process.wait)
            self.on_exit(
                f"the output process of {self.config['model']} exited (code {code})"
                + (f": {failure}" if failure else "")
            )

    async def close(self) -> None:
        """Let the process publish what it holds and exit (killed after STOP_TIMEOUT_S)."""
        if self.process is None:
            return
        self._closing = True
        with self._lock:
            self.alive = False
            self._inbox.close()
        try:
            await asyncio.wait_for(asyncio.to_thread(self.process.wait), STOP_TIMEOUT_S)
        except TimeoutError:
            log.warning(
                "%s: the output process did not stop in %.0f s; killing it",
                self.config["model"],
                STOP_TIMEOUT_S,
            )
            self.process.kill()
            await asyncio.to_thread(self.process.wait)
        if self._reading is not None:
            await asyncio.gather(self._reading, return_exceptions=True)
            self._feedback.close()
