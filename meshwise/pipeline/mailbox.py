"""One run's pipeline messages: each batch posted at once, a receive waited for only by the
action that reads it, sends freed by the next batch, as torch's pipelining does (later
waits than the validator's runtime: still deadlock-free).
"""

from __future__ import annotations

import torch

from meshwise.comm import ops
from meshwise.pipeline.actions import Action, Schedule
from meshwise.pipeline.p2p import Channels, Incoming, Outgoing, release_storage

SentKey = tuple[dict, tuple[int, int]]  # (the outputs, (chunk, mb)) of a sent activation
InFlight = tuple[list[ops.Handle], SentKey | None]  # a send's handles, what it frees

_RECEIVES = {"F": "RECV_F", "B": "RECV_B"}  # what each compute action reads


class Mailbox:
    """Activations and gradients received this run, gradients waiting to be sent."""

    def __init__(self, channels: Channels, schedule: Schedule, rank: int):
        self.channels, self.schedule, self.rank = channels, schedule, rank
        self.start(torch.device("cpu"))

    def start(self, device: torch.device) -> None:
        self.device = device
        self.activations: dict = {}  # (chunk, mb) -> a received input of that chunk's F
        self.gradients: dict = {}  # (chunk, mb) -> a received gradient of that chunk's output
        self.to_send: dict = {}  # (chunk, mb) -> the input gradient its B made, for SEND_B
        self.arriving: dict = {}  # (kind, chunk, mb) -> the receive's handle, not waited for
        self._in_flight: list[InFlight] = []

    def _tag(self, backward: bool, receiver_stage: int, micro_batch: int) -> int:
        """The same number on both ends of a message, unique within the step."""
        num_mb = self.schedule.num_micro_batches
        return ((int(backward) * self.schedule.num_logical) + receiver_stage) * num_mb + micro_batch

    def post(self, batch: tuple[Action, ...], outputs: dict) -> None:
        """Post one batch; ``outputs``: the runtime's chunk outputs by (chunk, mb), sent by
        SEND_F and freed once sent (their backward needs only the graph)."""
        sends: list[Outgoing] = []
        recvs: list[Incoming] = []
        sent_keys: list[SentKey | None] = []  # per send: the output it frees once sent
        for a in batch:
            key, mb, peer = (a.chunk, a.micro_batch), a.micro_batch, a.peer
            assert peer is not None, f"{a}: a message names its peer"
            stage = self.schedule.stage_of(self.rank, a.chunk)
            if a.kind == "SEND_F":
                sends.append(
                    Outgoing(
                        outputs[key].detach(),
                        peer,
                        self._tag(False, stage + 1, mb),
                        stage,
                        stage + 1,
                    )
                )
                sent_keys.append((outputs, key))
            elif a.kind == "SEND_B":
                sends.append(
                    Outgoing(
                        self.to_send.pop(key),
                        peer,
                        self._tag(True, stage - 1, mb),
                        stage,
                        stage - 1,
                        True,
                    )
                )
                sent_keys.append(None)
            else:
                backward = a.kind == "RECV_B"
                src = stage + 1 if backward else stage - 1
                recvs.append(Incoming(peer, self._tag(backward, stage, mb), src, stage, backward))
        recv_handles: list = []
        received, handles = self.channels.exchange(sends, recvs, self.device, recv_handles)
        receivers = [a for a in batch if a.kind in ("RECV_F", "RECV_B")]
        for a, tensor, handle in zip(receivers, received, recv_handles, strict=True):
            inbox = self.gradients if a.kind == "RECV_B" else self.activations
            inbox[(a.chunk, a.micro_batch)] = tensor
            if handle is not None:
                self.arriving[(a.kind, a.chunk, a.micro_batch)] = handle
        # A send listed before a receive from the same peer is waited for now: messages
        # are placed in meeting-time order, so that peer has posted its end already and
        # waiting costs at most the transfer (1F1B's steady state frees each output as
        # soon as it is sent). The others wait until the next batch.
        sent = iter(zip(handles, sent_keys, strict=True))
        now: list[InFlight] = []
        later: list[InFlight] = []
        for i, a in enumerate(batch):
            if a.kind in ("SEND_F", "SEND_B"):
                answered = any(
                    b.kind in ("RECV_F", "RECV_B") and b.peer == a.peer for b in batch[i + 1 :]
                )
                (now if answered else later).append(next(sent))
        self._in_flight += now
        self.finish_sends()
        self._in_flight = later

    def waits_for(self, a: Action) -> bool:
        """Whether compute action ``a`` reads a receive still on its way."""
        return (_RECEIVES.get(a.kind), a.chunk, a.micro_batch) in self.arriving

    def wait_for(self, a: Action) -> None:
        """Wait for the receive that compute action ``a`` reads (an F its input, a B its
        output's gradient), if it is still on its way."""
        handle = self.arriving.pop((_RECEIVES.get(a.kind), a.chunk, a.micro_batch), None)
        if handle is not None and not handle.done:  # NCCL: one handle for a whole batch
            handle.wait()

    def finish_sends(self) -> None:
        """Wait for the sends in flight; free the activations they carried."""
        for pending, sent in self._in_flight:
            for handle in pending:
                handle.wait()
            if sent is not None:
                outputs, key = sent
                if key in outputs:
                    release_storage(outputs[key])
        self._in_flight = []
