"""A session's event sink: every event emitted is either delivered, in order, or counted as
dropped, whichever thread emits it and whenever the stream comes, goes or the session ends."""

from __future__ import annotations

import asyncio
import threading

from dpu_agent.registry import ErrorEvent, EventSink, SessionEvent, Tally


def drain(loop: asyncio.AbstractEventLoop, q: asyncio.Queue[SessionEvent | None],
          most: int | None = None) -> list[SessionEvent | None]:
    """Read ``q`` on the loop, as a stream does: up to the end marker, or ``most`` events."""
    async def take() -> list[SessionEvent | None]:
        got: list[SessionEvent | None] = []
        while most is None or len(got) < most:
            got.append(await q.get())
            if got[-1] is None:
                break
        return got
    return asyncio.run_coroutine_threadsafe(take(), loop).result(timeout=30)


def settle(loop: asyncio.AbstractEventLoop) -> None:
    """Return once the loop has run the callbacks queued before this call."""
    asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=30)


def running_loop() -> asyncio.AbstractEventLoop:
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def test_what_an_unread_stream_was_sent_up_to_the_close_is_delivered_or_counted() -> None:
    """Emitted from several threads into a stream nobody reads, then closed at once (puts still
    pending on the loop): delivered + dropped equals emitted, each thread's events in order."""
    loop, tally = running_loop(), Tally()
    sink = EventSink(capacity=64, dropped=tally)
    q = asyncio.run_coroutine_threadsafe(_attach(sink), loop).result()
    per_thread, threads = 2000, 4

    def emit(t: int) -> None:
        for i in range(per_thread):
            sink.emit(ErrorEvent(f"{t}:{i}"))
    workers = [threading.Thread(target=emit, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    sink.close()
    sink.emit(ErrorEvent("after the end"))
    got = drain(loop, q)
    assert got[-1] is None
    events = [e for e in got if e is not None]
    assert len(events) <= 64
    assert len(events) + tally.value == per_thread * threads + 1
    for t in range(threads):
        mine = [int(e.message.split(":")[1]) for e in events if e.message.startswith(f"{t}:")]
        assert mine == sorted(mine)
    loop.call_soon_threadsafe(loop.stop)


async def _attach(sink: EventSink) -> asyncio.Queue[SessionEvent | None]:
    return sink.attach(asyncio.get_running_loop())


def test_a_stream_that_goes_leaves_its_unsent_events_to_the_next() -> None:
    loop, tally = running_loop(), Tally()
    sink = EventSink(capacity=8, dropped=tally)
    first = asyncio.run_coroutine_threadsafe(_attach(sink), loop).result()
    for i in range(5):
        sink.emit(ErrorEvent(str(i)))
    assert [e.message for e in drain(loop, first, most=2)] == ["0", "1"]
    sink.detach(first)
    sink.emit(ErrorEvent("5"))  # buffered: nobody attached
    second = asyncio.run_coroutine_threadsafe(_attach(sink), loop).result()
    sink.close()
    got = drain(loop, second)
    assert [e.message for e in got if e is not None] == ["2", "3", "4", "5"]
    assert got[-1] is None and tally.value == 0
    loop.call_soon_threadsafe(loop.stop)


def test_a_replaced_stream_counts_what_it_never_sent() -> None:
    loop, tally = running_loop(), Tally()
    sink = EventSink(capacity=8, dropped=tally)
    old = asyncio.run_coroutine_threadsafe(_attach(sink), loop).result()
    for i in range(3):
        sink.emit(ErrorEvent(str(i)))
    settle(loop)
    new = asyncio.run_coroutine_threadsafe(_attach(sink), loop).result()
    sink.detach(old)
    assert tally.value == 3
    sink.close()
    assert drain(loop, new) == [None]
    loop.call_soon_threadsafe(loop.stop)
