"""Pipeline messages that carry their own shape and dtype (a ``TensorMeta`` header on each
forward edge's first message, as nanotron's p2p sends), and freeing what was sent.
See docs/pipelines.md "Running a schedule on your own stages".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from meshwise.comm import ops
from meshwise.comm.tensor_meta import TensorMeta, empty_message


@dataclass(frozen=True)
class Outgoing:
    """A tensor to send from stage ``src`` to ``dst`` (``backward``: a gradient)."""

    tensor: torch.Tensor
    peer: int
    tag: int
    src: int
    dst: int
    backward: bool = False


@dataclass(frozen=True)
class Incoming:
    """A tensor to receive on stage ``dst`` from ``src`` (``backward``: a gradient)."""

    peer: int
    tag: int
    src: int
    dst: int
    backward: bool = False


class Channels:
    """The headers a rank has sent or learned in one run, and the posting of batches."""

    def __init__(self, group: ops.Group | None):
        self.group = group  # None: one stage, which sends nothing
        self._meta: dict[tuple[int, int], TensorMeta] = {}  # forward edge -> its tensors
        self._meta_tag_base = 0
        self.headers_sent = self.headers_received = 0  # in this run

    def start(self, meta_tag_base: int, keep_shapes: bool = False) -> None:
        """A new run. Unless ``keep_shapes``, every forward edge carries a header again
        (every rank must decide alike). Header tags are ``meta_tag_base + receiving
        stage``, above every tensor tag of the run."""
        if not keep_shapes:
            self._meta.clear()
        self._meta_tag_base = meta_tag_base
        self.headers_sent = self.headers_received = 0

    def exchange(
        self,
        sends: list[Outgoing],
        recvs: list[Incoming],
        device: torch.device,
        recv_handles: list | None = None,
    ) -> tuple[list[torch.Tensor], list[list[ops.Handle]]]:
        """Post one batch; return the received tensors (in ``recvs`` order) once they
        have all arrived, and per send the handles still in flight (its header's and its
        own; none where the backend completed the batch as a whole). With
        ``recv_handles`` (a list), a receive whose header is known is not waited for:
        its ``Handle`` (or ``None``, where it has arrived) is appended in ``recvs``
        order, to wait for before the tensor is read."""
        assert self.group is not None, "one stage alone sends and receives nothing"
        messages = [self._with_header(send) for send in sends]
        outgoing = [item for items in messages for item in items]
        received: list[torch.Tensor] = []
        handles, first = [], True
        # A header sits right before its tensor in each end's posting order, so transports
        # that match by order (NCCL) pair them, and no receive waits on anything its
        # schedule did not already wait on.
        while first or len(received) < len(recvs):
            # One phase: every receive whose header is known, up to the first one whose
            # header has to arrive first (its tensor goes in the next phase).
            posts, header = [], None
            for r in recvs[len(received) :]:
                meta = self._known(r)
                if meta is None:
                    header = empty_message(device)
                    posts.append((header, r.peer, self._meta_tag_base + r.dst))
                    break
                posts.append((meta.empty(device), r.peer, r.tag))
            lazy = recv_handles is not None and header is None
            handles += ops.batch_p2p(
                outgoing if first else [],
                posts,
                self.group,
                category="p2p",
                wait_sends=False,
                recv_handles=recv_handles if lazy else None,
            )
            first = False
            if recv_handles is not None and not lazy:
                recv_handles += [None] * (len(posts) - 1)  # arrived; the header is not one
            if header is not None:
                posts.pop()
                waiting = recvs[len(received) + len(posts)]
                self._meta[(waiting.src, waiting.dst)] = TensorMeta.from_message(header)
                self.headers_received += 1
            received += [buffer for buffer, _, _ in posts]
        per_send, start = [], 0
        for items in messages:
            per_send.append(handles[start : start + len(items)])
            start += len(items)
        assert not handles or start == len(handles), "one handle per posted send"
        return received, per_send

    def _known(self, r: Incoming) -> TensorMeta | None:
        if r.backward:  # the gradient of the activation this rank sent on dst -> src
            return self._meta[(r.dst, r.src)]
        return self._meta.get((r.src, r.dst))

    def _with_header(self, send: Outgoing) -> list[tuple[torch.Tensor, int, int]]:
        meta, message = TensorMeta.of(send.tensor), (send.tensor, send.peer, send.tag)
        if send.backward:
            assert meta == self._meta[(send.dst, send.src)], (
                f"gradient {meta} of stage {send.src}'s input differs from its activation"
            )
            return [message]
        known = self._meta.get((send.src, send.dst))
        if known is None:
            self._meta[(send.src, send.dst)] = meta
            self.headers_sent += 1
            header = meta.to_message(send.tensor.device)
            return [(header, send.peer, self._meta_tag_base + send.dst), message]
        if known != meta:
            raise RuntimeError(
                f"pipeline stage {send.src} produced an output of {meta} for stage {send.dst}, "
                f"but {known} earlier: every micro-batch of every step must give each stage "
                "the same shape and dtype (cut the batch into equal micro-batches; where "
                "shapes change between steps, call PipelineRuntime.reset_shapes() on every "
                "rank first)"
            )
        return [message]


def release_storage(tensor: torch.Tensor) -> None:
    """Free an activation's data but keep its autograd graph (Megatron-LM's
    ``deallocate_output_tensor``): once sent, only its ``grad_fn`` is needed.

    The tensor keeps its shape over a one-element storage (stride 0), so a plain
    ``torch.autograd.backward(tensor, grad)`` passes the shape check. A backward that saved
    this output (``tanh``) keeps its own reference: correct, only not freed.
    """
    # No private entry point of autograd's engine: this works on every PyTorch release. A
    # view is released the same way; its base's memory goes once nothing else holds it.
    if tensor.numel() > 1:
        tensor.data = tensor.new_empty(1).expand(tensor.shape)
