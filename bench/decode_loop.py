"""The decode loop of bench/decode.py and its host-memory baseline: the routing a run replays
(a trace mapped onto the run's layers and experts, or the generator), :class:`Decoder` (tokens
through the MoE layers, each expert's FFN computed for real, time per token split into compute,
waiting and the rest; on the GPU from CUDA events) and :class:`LruHost` (an LRU cache of experts
in host memory, filled by a loader: the pageable and HTTP baselines).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from dpu_agent.routing.traces import generate_trace, read_trace
from gpu_kernels import reference
from host_client.worker import expert_ffn


def routing(trace: Path | None, layers: int, experts: int, top_k: int, tokens: int
            ) -> list[list[list[int]]]:
    """[token][layer] -> distinct experts."""
    if trace is None:
        steps = list(generate_trace(layers, experts, top_k, tokens, seed=7))
        return [[sorted(set(steps[t * layers + la].experts)) for la in range(layers)]
                for t in range(tokens)]
    raw = read_trace(trace)
    n_layers = max(s.layer for s in raw) + 1
    out = []
    for t in range(tokens):
        row = []
        for la in range(layers):
            step = raw[(t * n_layers + la % n_layers) % len(raw)]
            row.append(sorted({e % experts for e in step.experts}))
        out.append(row)
    return out


class Decoder:
    """The decode loop; ``fetch(layer, expert)`` returns the expert's (gate, up, down) bf16
    arrays, counting the time it waits."""

    def __init__(self, hidden: int, layer_ids: list[int], route: list[list[list[int]]],
                 xp: Any = np):
        self.hidden, self.layer_ids, self.route, self.xp = hidden, layer_ids, route, xp

    def sync(self) -> None:
        if self.xp is not np:
            self.xp.cuda.get_current_stream().synchronize()

    def _event(self) -> Any:
        """On the GPU, a CUDA event recorded now on the current stream (None on the CPU)."""
        if self.xp is np:
            return None
        event = self.xp.cuda.Event()
        event.record()
        return event

    def run(self, fetch: Any, release: Any, tokens: int, begin: Any = None,
            timeline: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """Decode ``tokens`` tokens. Each layer launches its experts' FFNs one after another,
        ``fetch(layer, expert)`` before each, then waits once for the layer's kernels (as an
        inference engine's MoE layer does: the next layer's routing needs this one's output)
        then ``release(layer, experts)``. ``begin(layer, experts)``, when given,
        is told each layer's experts before the first ``fetch`` (the offload path posts them
        all in one batch so their transfers overlap); its time counts as waiting.

        Besides the whole run's tokens/s: the first token's seconds (``first_token_s``: cold
        slots, and the first request each process serves) and the tokens/s of the rest
        (``steady_tokens_per_s``, None for one token). Per token, in seconds: waiting
        (``wait_s_per_token``: on a GPU the stream's time between the events before and after
        each ``fetch``, i.e. a wait the host enqueued or the idle stream while the host
        blocked; on the CPU the host's time in ``fetch``), the layers' expert compute
        (``compute_s_per_token``: the layers' host time from the first fetch to the end of
        the wait for their kernels, less waiting), the host's time in the FFN call
        (``host_ffn_launch_s_per_token``: its launches on a GPU) and, on a GPU, the CUDA
        events' time around the FFN's launches (``gpu_ffn_s_per_token``) and around the FFN
        and accumulation (``gpu_compute_s_per_token``). Where the stream is idle when the FFN
        is launched the events hold the host's launch too (bench/launch_after_sleep.py).

        ``timeline``, when given, gets a record per layer (:func:`layer_record`): where that
        layer's time went, in ms from its start, on the host and (from CUDA events) the GPU."""
        xp = self.xp
        x = reference.f32_to_bf16(xp.linspace(-1, 1, self.hidden, dtype=np.float32)[None])
        compute = wait = launch = 0.0
        # Per expert, CUDA events: before fetch, after it, after the FFN's own launches, after
        # the accumulation.
        marks: list[tuple[Any, Any, Any, Any]] = []
        outputs = []
        t_start = time.perf_counter()
        first_token = 0.0
        for t in range(tokens):
            h = reference.bf16_to_f32(x).copy()
            for la, layer in enumerate(self.layer_ids):
                h = h + 0.5 * xp.tanh(h)  # the attention stand-in
                experts = self.route[t][la]
                acc = xp.zeros_like(h)
                hb = reference.f32_to_bf16(h)
                t_begin = time.perf_counter()
                start = self._event() if timeline is not None else None
                if begin is not None:
                    begin(layer, experts)
                    wait += time.perf_counter() - t_begin
                t_layer = time.perf_counter()
                waited = 0.0
                layer_marks = []
                host = []
                for e in experts:
                    t0 = time.perf_counter()
                    before = self._event()
                    w = fetch(layer, e)
                    fetched = self._event()
                    t_launch = time.perf_counter()
                    if fetched is None:
                        waited += t_launch - t0
                    y = expert_ffn(hb, *w)
                    t_launched = time.perf_counter()
                    launch += t_launched - t_launch
                    ffn_done = self._event()
                    acc += reference.bf16_to_f32(y) / len(experts)
                    host.append((t0, t_launch, t_launched))
                    if fetched is not None:
                        layer_marks.append((before, fetched, ffn_done, self._event()))
                self.sync()
                t_synced = time.perf_counter()
                waited += sum(xp.cuda.get_elapsed_time(b, f) / 1e3
                              for b, f, _, _ in layer_marks)
                marks += layer_marks
                wait += waited
                compute += t_synced - t_layer - waited
                release(layer, experts)
                if timeline is not None:
                    timeline.append(layer_record(
                        t, layer, experts, t_begin, t_layer, host, t_synced,
                        time.perf_counter(), [[xp.cuda.get_elapsed_time(start, ev)
                                               for ev in m] for m in layer_marks]))
                h = h + acc
            outputs.append(reference.f32_to_bf16(h))
            x = reference.f32_to_bf16(xp.tanh(h))  # next token's input
            if t == 0:
                self.sync()
                first_token = time.perf_counter() - t_start
        self.sync()
        total = time.perf_counter() - t_start
        gpu = (sum(xp.cuda.get_elapsed_time(b, d) for _, b, _, d in marks) / 1e3 / tokens
               if marks else None)
        ffn = (sum(xp.cuda.get_elapsed_time(b, c) for _, b, c, _ in marks) / 1e3 / tokens
               if marks else None)
        return {"tokens_per_s": tokens / total, "first_token_s": first_token,
                "steady_tokens_per_s": ((tokens - 1) / (total - first_token)
                                        if tokens > 1 else None),
                "compute_s_per_token": compute / tokens,
                "gpu_compute_s_per_token": gpu,
                "gpu_ffn_s_per_token": ffn,
                "host_ffn_launch_s_per_token": launch / tokens,
                "wait_s_per_token": wait / tokens,
                "other_s_per_token": (total - compute - wait) / tokens,
                "outputs": xp.concatenate(outputs)}


def layer_record(token: int, layer: int, experts: list[int], t_begin: float, t_layer: float,
                 host: list[tuple[float, float, float]], t_synced: float, t_released: float,
                 gpu_ms: list[list[float]]) -> dict[str, Any]:
    """One layer's timeline, ms from the layer's start (``t_begin``, host clock; on a GPU the
    CUDA event recorded then, on an idle stream): ``begun`` (``begin`` returned: the offload
    path's batch posted), per expert in order ``host`` (fetch called, fetch returned, FFN
    launched) and ``gpu`` (the events before the fetch, after it: the expert READY on the
    stream, after the FFN, after the accumulation; empty on the CPU), ``synced`` (the layer's
    kernels done), ``released``."""
    def ms(t: float) -> float:
        return (t - t_begin) * 1e3

    return {"token": token, "layer": layer, "experts": experts, "begun": ms(t_layer),
            "host": [[ms(t) for t in h] for h in host], "gpu": gpu_ms,
            "synced": ms(t_synced), "released": ms(t_released)}


class LruHost:
    """A host-memory expert cache of ``capacity`` experts filled by ``load(layer, e)``."""

    def __init__(self, capacity: int, load: Any) -> None:
        self.capacity, self.load = capacity, load
        self.slots: OrderedDict[tuple[int, int], tuple[np.ndarray, ...]] = OrderedDict()
        self.hits = self.misses = 0

    def fetch(self, layer: int, e: int) -> tuple[np.ndarray, ...]:
        key = (layer, e)
        if key in self.slots:
            self.hits += 1
            self.slots.move_to_end(key)
            return self.slots[key]
        self.misses += 1
        if len(self.slots) >= self.capacity:
            self.slots.popitem(last=False)
        w = self.slots[key] = self.load(layer, e)
        return w
