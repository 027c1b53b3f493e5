"""The engine core's loop takes requests in between steps; the `queued` events of those it took in
leave for the front end (and so for every gateway following the KV stream) at once, not with the
output of the step it runs next, which on a GPU can be a long prefill."""

from __future__ import annotations

from radixpool.protocol.kv_blocks import KVEvent
from radixpool.worker.core_process import _Loop
from radixpool.worker.messages import GenerateRequest, StepOutput
from radixpool.worker.sampling_params import SamplingParams


class FakeCore:
    """What the loop sees of an `EngineCore`: requests taken in announce their blocks; a step
    runs only when the loop calls it."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.seq = 0
        self.waiting = 0

    @property
    def has_work(self) -> bool:
        return self.waiting > 0

    def add_request(self, msg: GenerateRequest):
        self.seq += 1
        self.events.append(KVEvent(self.seq, "queued", (len(msg.input_ids),)))
        self.waiting += 1
        return None

    def drain_events(self) -> list[KVEvent]:
        events, self.events = self.events, []
        return events

    def stats(self):
        return None


class Inbox:
    sock = None

    def __init__(self, messages: list) -> None:
        self.messages = messages

    def read(self) -> list:
        messages, self.messages = self.messages, []
        return messages


class Outbox:
    pending = False

    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def request(rid: str, tokens: int) -> GenerateRequest:
    return GenerateRequest(rid, list(range(tokens)), SamplingParams(), seed=0)


def test_requests_taken_in_are_announced_before_the_next_step_runs():
    core, outbox = FakeCore(), Outbox()
    loop = _Loop(core, Inbox([request("a", 32), request("b", 48)]), outbox, parent_pid=0)
    loop._drain_inbox(wait_s=0)
    assert len(outbox.sent) == 1
    out = outbox.sent[0]
    assert isinstance(out, StepOutput) and out.deltas == []
    assert [(e.seq, e.type, e.blocks) for e in out.events] == [(1, "queued", (32,)),
                                                                (2, "queued", (48,))]
    assert core.events == []   # nothing left for the next step's output to carry twice


def test_an_intake_with_nothing_to_say_sends_nothing():
    core, outbox = FakeCore(), Outbox()
    loop = _Loop(core, Inbox([]), outbox, parent_pid=0)
    loop._drain_inbox(wait_s=0)
    assert outbox.sent == []
