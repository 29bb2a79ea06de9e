"""Timelines of tk.dist calls, written as Chrome traces (``chrome://tracing``, https://ui.perfetto.dev).

A trace shows whether communication and compute overlap. It has two kinds of lanes, both in
microseconds from one origin per rank (the start of the traced call):

- **stream lanes** (``Tracer.span(name, stream)``): host code brackets work it enqueues on a stream
  (an all-gather on the communication stream, a chunk's GEMM on the compute stream); the bracket is a
  pair of CUDA events, so the span is when the GPU ran that work, not when the host enqueued it.
- **program lanes** (``trace_event`` inside a kernel): each program of a persistent kernel records
  what it did and when: ``fetch`` (pulling a peer's tile), ``wait`` (spinning on a signal), ``compute``
  (a tile's GEMM), each with a tag (the tile or chunk index).

How a program records an event (the buffer is ``DeviceTrace.events``, int64
``[programs, max_events, FIELDS]``, zeroed by the host before the launch; one row per event:
``(kind, start, end, tag)``, kind 0 = unused row)::

    t0 = trace_clock(trace_clock_ptr)
    ...wait for the chunk...
    trace_slot = trace_event(trace_events, trace_clock_ptr, pid, trace_slot, TRACE_WAIT, t0, chunk,
                             TRACE_MAX_EVENTS)

Times are ``%globaltimer`` (nanoseconds, read with inline PTX) on an NVIDIA GPU. Under the CPU
interpreter there is no clock a kernel can read, so ``trace_clock`` returns ticks of a counter
(``DeviceTrace.clock``, one atomic add per read): the order of events is real, their durations are
not (1 tick is drawn as 1 us). Events past ``max_events`` in a program are dropped.

Alignment of the two kinds of lanes: when a ``Tracer`` starts it records its base CUDA event, launches
a one-program kernel that stores ``%globaltimer``, and records a second event. A globaltimer value
``g`` is drawn at ``(g - g_base) / 1000`` us after the midpoint of those two events, so program lanes
and stream lanes agree to within half of that tiny kernel's run time (a few us). Ranks are not
aligned with each other: each rank's origin is its own call's start (the bench puts a device-side
barrier right before a traced call, so origins differ by about a microsecond there).

AMD GPUs: ``%globaltimer`` is PTX; a ROCm port reads ``s_memrealtime`` (100 MHz) instead.

Using it from an op. ``tk.dist.all_gather_matmul(..., trace=...)`` runs the untraced call inside
``traced_call``, which makes a ``Tracer`` the active one, brackets the whole call in a ``call`` lane
and writes the file (``resolve_trace_path``: ``trace=True`` -> ``./tilekernels-trace-rank{r}.json``).
Inside, the algorithms record their parts with the module functions, which do nothing (and cost
nothing but a lookup) when no tracer is active::

    with trace.span("gather from rank 1", comm_stream):     # a stream lane
        ...
    dev = trace.device_trace("gemm", grid_size, a.device)    # zeroed buffer, or a disabled placeholder
    kernel[grid](..., dev.events, dev.clock, TRACE=dev.enabled, TRACE_MAX_EVENTS=dev.max_events)

A ``Tracer`` can also be used directly (``span``, ``device_trace``, ``finish(path)``).

``render_png(trace_json, png_path)`` draws a trace (one lane per stream/program, coloured by kind);
``merge_chrome_traces`` puts the ranks' files into one (pid = rank).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import json
import os
import pathlib
import time
from collections.abc import Iterable, Sequence

import torch
import triton
import triton.language as tl

from .._runtime import TRACE_COMPUTE, TRACE_FETCH, TRACE_WAIT, default_device, trace_clock, trace_event  # noqa: F401

FIELDS = 4                      # (kind, start, end, tag) per event row
KIND_NAMES = {1: "fetch", 2: "wait", 3: "compute"}
DEFAULT_MAX_EVENTS = 64
# Colours of the PNG timeline; other span names take the next colour of the cycle.
KIND_COLORS = {"fetch": "#1f77b4", "wait": "#d62728", "compute": "#2ca02c"}


# ----------------------------------------------------------------------------------------------------
# device side


@triton.jit
def _read_clock_kernel(out, clock):
    tl.store(out, trace_clock(clock))


# ----------------------------------------------------------------------------------------------------
# spans and Chrome trace files


@dataclasses.dataclass
class Span:
    """One bar of the timeline: ``start_us``/``dur_us`` from the rank's origin, in lane ``lane``."""

    name: str
    lane: str
    start_us: float
    dur_us: float
    rank: int = 0
    cat: str = "stream"
    args: dict = dataclasses.field(default_factory=dict)


def device_spans(events, *, rank: int = 0, clock_origin: int = 0, origin_us: float = 0.0,
                 ticks_per_us: float = 1000.0, name: str = "",
                 kinds: dict[int, str] = KIND_NAMES) -> list[Span]:
    """Spans of a ``DeviceTrace.events`` buffer: clock value ``clock_origin`` is drawn at ``origin_us``,
    ``ticks_per_us`` clock ticks per us (1000 for globaltimer ns). Lanes are ``"<name> program <p>"``."""
    events = torch.as_tensor(events).detach().to("cpu", torch.int64)
    if events.dim() != 3 or events.shape[2] != FIELDS:
        raise ValueError(f"events must be [programs, max_events, {FIELDS}], got shape {tuple(events.shape)}")
    spans = []
    prefix = f"{name} " if name else ""
    for program, slot in events[:, :, 0].nonzero().tolist():
        kind, start, end, tag = events[program, slot].tolist()
        spans.append(Span(
            name=kinds.get(kind, f"kind {kind}"), lane=f"{prefix}program {program}",
            start_us=origin_us + (start - clock_origin) / ticks_per_us,
            dur_us=max(end - start, 0) / ticks_per_us, rank=rank, cat=name or "device",
            args={"tag": tag, "program": program}))
    return spans


def _lane_order(lane: str) -> tuple:
    # Streams first, then each kernel's programs in program order.
    head, _, number = lane.rpartition(" ")
    is_program = head.endswith("program") and number.isdigit()
    return (is_program, head if is_program else "", int(number) if is_program else 0, lane)


def chrome_trace(spans: Iterable[Span], metadata: dict | None = None) -> dict:
    """The Chrome trace object: ``ph: "X"`` events (name, cat, pid = rank, tid = lane number, ts/dur in
    us, args) plus ``ph: "M"`` metadata naming each process ``rank r`` and each thread by its lane."""
    spans = list(spans)
    events = []
    lanes: dict[int, dict[str, int]] = {}
    for rank in sorted({s.rank for s in spans}):
        names = sorted({s.lane for s in spans if s.rank == rank}, key=_lane_order)
        lanes[rank] = {lane: tid for tid, lane in enumerate(names)}
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0,
                       "args": {"sort_index": rank}})
        for lane, tid in lanes[rank].items():
            events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": lane}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid,
                           "args": {"sort_index": tid}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start_us)):
        events.append({"name": s.name, "cat": s.cat, "ph": "X", "pid": s.rank, "tid": lanes[s.rank][s.lane],
                       "ts": round(s.start_us, 3), "dur": round(s.dur_us, 3),
                       "args": {"lane": s.lane, **s.args}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_chrome_trace(path, spans: Iterable[Span], metadata: dict | None = None) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(spans, metadata)) + "\n")
    return path


def read_chrome_trace(trace) -> dict:
    """A trace object from a dict, a JSON path, or a list of events."""
    if isinstance(trace, (str, os.PathLike)):
        trace = json.loads(pathlib.Path(trace).read_text())
    if isinstance(trace, list):
        trace = {"traceEvents": trace}
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise ValueError("not a Chrome trace: expected an object with a 'traceEvents' list")
    return trace


def merge_chrome_traces(paths: Sequence, out_path) -> pathlib.Path:
    """One file holding several ranks' traces (their pids are their ranks, so lanes stay apart)."""
    traces = [read_chrome_trace(p) for p in paths]
    merged = {"traceEvents": [e for t in traces for e in t["traceEvents"]], "displayTimeUnit": "ms",
              "otherData": {"merged": [str(p) for p in paths],
                            **(traces[0].get("otherData", {}) if traces else {})}}
    out_path = pathlib.Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(merged) + "\n")
    return out_path


def _sampled_lanes(lanes, names: dict, max_program_lanes: int):
    """``lanes`` with at most ``max_program_lanes`` evenly spaced program lanes per (rank, kernel); the
    stream lanes all stay."""
    groups: dict[tuple, list] = {}
    for lane in lanes:
        head, _, number = str(names.get(lane, "")).rpartition(" ")
        if head.endswith("program") and number.isdigit():
            groups.setdefault((lane[0], head), []).append(lane)
    dropped = set()
    for members in groups.values():
        if len(members) > max_program_lanes:
            keep = {members[round(i * (len(members) - 1) / (max_program_lanes - 1))]
                    for i in range(max_program_lanes)} if max_program_lanes > 1 else {members[0]}
            dropped |= set(members) - keep
    return [lane for lane in lanes if lane not in dropped], len(dropped)


def render_png(trace_json, png_path, title: str | None = None, max_program_lanes: int = 32) -> pathlib.Path:
    """Draw a Chrome trace as a timeline: one lane per (rank, stream/program), bars coloured by span
    name (fetch/wait/compute fixed, others from a cycle). A kernel with more programs than
    ``max_program_lanes`` shows that many, evenly spaced (the title says how many were left out).
    Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_hex
    from matplotlib.patches import Patch

    trace = read_chrome_trace(trace_json)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"]
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    all_spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    lanes, dropped = _sampled_lanes(sorted({(e["pid"], e["tid"]) for e in all_spans}), names, max_program_lanes)
    kept = set(lanes)
    spans = [e for e in all_spans if (e["pid"], e["tid"]) in kept]
    row_of = {lane: i for i, lane in enumerate(lanes)}
    fixed = set(KIND_COLORS.values())  # a stream span never takes the colour of fetch, wait or compute
    palette = [to_hex(c) for c in plt.rcParams["axes.prop_cycle"].by_key()["color"]]
    cycle = iter([c for c in palette if c not in fixed] * 8)
    colors = dict(KIND_COLORS)
    for e in spans:
        if e["name"] not in colors:
            colors[e["name"]] = next(cycle, "#7f7f7f")
    height = min(0.22 * len(lanes) + 1.6, 40.0)
    fig, ax = plt.subplots(figsize=(12, height))
    by_lane_and_name: dict[tuple, list] = {}
    for e in spans:
        bar = (e["ts"], max(e["dur"], 0.01))
        by_lane_and_name.setdefault(((e["pid"], e["tid"]), e["name"]), []).append(bar)
    for (lane, name), bars in by_lane_and_name.items():
        ax.broken_barh(bars, (row_of[lane] - 0.4, 0.8), facecolors=colors[name], linewidth=0)
    ax.set_yticks(range(len(lanes)))
    ax.set_yticklabels([f"r{pid} {names.get((pid, tid), tid)}" for pid, tid in lanes],
                       fontsize=7 if len(lanes) < 60 else 4)
    ax.invert_yaxis()
    ax.set_xlabel("us from each rank's origin")
    used = list(dict.fromkeys(e["name"] for e in spans))[:16]
    ax.legend(handles=[Patch(color=colors[n], label=n) for n in used], fontsize=7, loc="upper right")
    title = title or trace.get("otherData", {}).get("title", "tilekernels trace")
    if dropped:
        title += f" ({dropped} program lanes not drawn)"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    png_path = pathlib.Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return png_path


def resolve_trace_path(trace, rank: int) -> pathlib.Path | None:
    """Where ``trace=`` writes: False/None -> nowhere; True -> ``./tilekernels-trace-rank{r}.json``; a
    path -> that path with ``{rank}`` formatted, or ``-rank{r}`` put before its suffix when it has no
    ``{rank}`` (every rank writes its own file)."""
    if trace is None or trace is False:
        return None
    if trace is True:
        return pathlib.Path.cwd() / f"tilekernels-trace-rank{rank}.json"
    if not isinstance(trace, (str, os.PathLike)):
        raise TypeError(f"trace must be a bool or a path, got {type(trace).__name__}")
    text = os.fspath(trace)
    if "{rank}" in text:
        return pathlib.Path(text.replace("{rank}", str(rank)))
    path = pathlib.Path(text)
    return path.with_name(f"{path.stem}-rank{rank}{path.suffix or '.json'}")


# ----------------------------------------------------------------------------------------------------
# recording


@dataclasses.dataclass
class DeviceTrace:
    """A kernel's event buffer: pass ``events``, ``clock`` and ``TRACE=enabled``,
    ``TRACE_MAX_EVENTS=max_events`` to the kernel. Disabled traces hold 1-element placeholders."""

    name: str
    events: torch.Tensor
    clock: torch.Tensor
    max_events: int
    enabled: bool
    host_start_ns: int = 0


_disabled: dict[torch.device, DeviceTrace] = {}


def disabled_device_trace(device) -> DeviceTrace:
    device = torch.device(device)
    if device not in _disabled:
        _disabled[device] = DeviceTrace("", torch.zeros(1, 1, FIELDS, dtype=torch.int64, device=device),
                                        torch.zeros(1, dtype=torch.int64, device=device), 1, False)
    return _disabled[device]


class Tracer:
    """Records stream spans and device traces of one call on one rank; ``finish`` writes the file.

    ``enabled=False`` makes every method a no-op (``span`` yields at once, ``device_trace`` returns the
    disabled placeholder), so an op can use one code path with and without tracing.
    """

    def __init__(self, device=None, *, rank: int | None = None, enabled: bool = True):
        self.enabled = bool(enabled)
        self.device = torch.device(device) if device is not None else default_device()
        if rank is None:
            import torch.distributed as dist

            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.rank = rank
        self._stream_spans: list[tuple] = []
        self._device_traces: list[DeviceTrace] = []
        self._lanes: dict[int, str] = {}
        self.on_gpu = self.device.type == "cuda"
        if not self.enabled:
            return
        if self.on_gpu:
            stream = torch.cuda.current_stream(self.device)
            self._lane(stream)
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record(stream)
            self._base_clock = torch.zeros(1, dtype=torch.int64, device=self.device)
            _read_clock_kernel[(1,)](self._base_clock, self._base_clock)
            self._after = torch.cuda.Event(enable_timing=True)
            self._after.record(stream)
        else:
            self._base_ns = time.perf_counter_ns()

    def _lane(self, stream) -> str:
        key = stream.cuda_stream
        if key not in self._lanes:
            self._lanes[key] = f"stream {len(self._lanes)}"
        return self._lanes[key]

    @contextlib.contextmanager
    def span(self, name: str, stream=None, *, lane: str | None = None, cat: str = "stream", **args):
        """Bracket the work enqueued inside the block on ``stream`` (default: the current one)."""
        if not self.enabled:
            yield
            return
        if self.on_gpu:
            stream = stream if stream is not None else torch.cuda.current_stream(self.device)
            lane = lane or self._lane(stream)
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                yield
            finally:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                self._stream_spans.append((name, lane, cat, start, end, args))
        else:
            start = time.perf_counter_ns()
            try:
                yield
            finally:
                end = time.perf_counter_ns()
                self._stream_spans.append((name, lane or "stream 0", cat, start, end, args))

    def device_trace(self, name: str, programs: int, max_events: int = DEFAULT_MAX_EVENTS) -> DeviceTrace:
        """A zeroed event buffer for a kernel of ``programs`` programs."""
        if not self.enabled:
            return disabled_device_trace(self.device)
        events = torch.zeros(programs, max_events, FIELDS, dtype=torch.int64, device=self.device)
        clock = torch.zeros(1, dtype=torch.int64, device=self.device)
        trace = DeviceTrace(name, events, clock, max_events, True, time.perf_counter_ns())
        self._device_traces.append(trace)
        return trace

    def spans(self) -> list[Span]:
        """Every span so far, resolved (synchronises the device)."""
        if not self.enabled:
            return []
        spans = []
        if self.on_gpu:
            torch.cuda.synchronize(self.device)
            for name, lane, cat, start, end, args in self._stream_spans:
                start_us, dur_us = self._base.elapsed_time(start) * 1e3, start.elapsed_time(end) * 1e3
                spans.append(Span(name, lane, start_us, dur_us, self.rank, cat, dict(args)))
            origin_us = self._base.elapsed_time(self._after) * 1e3 / 2
            clock_origin = int(self._base_clock.item())
            for trace in self._device_traces:
                spans += device_spans(trace.events, rank=self.rank, clock_origin=clock_origin,
                                      origin_us=origin_us, ticks_per_us=1000.0, name=trace.name)
        else:
            for name, lane, cat, start, end, args in self._stream_spans:
                start_us, dur_us = (start - self._base_ns) / 1e3, (end - start) / 1e3
                spans.append(Span(name, lane, start_us, dur_us, self.rank, cat, dict(args)))
            for trace in self._device_traces:
                spans += device_spans(trace.events, rank=self.rank, clock_origin=0,
                                      origin_us=(trace.host_start_ns - self._base_ns) / 1e3, ticks_per_us=1.0,
                                      name=trace.name)
        return spans

    def metadata(self) -> dict:
        return {"rank": self.rank, "device": str(self.device),
                "clock": "globaltimer ns" if self.on_gpu else "interpreter counter, 1 tick drawn as 1 us"}

    def finish(self, trace=True, **metadata) -> pathlib.Path | None:
        """Write the trace where ``trace`` says (``resolve_trace_path``); None when disabled."""
        path = resolve_trace_path(trace, self.rank) if self.enabled else None
        if path is None:
            return None
        return write_chrome_trace(path, self.spans(), {**self.metadata(), **metadata})


# ----------------------------------------------------------------------------------------------------
# the active tracer, for code deep inside an op


_active: contextvars.ContextVar[Tracer | None] = contextvars.ContextVar("tilekernels_tracer", default=None)


def active_tracer() -> Tracer | None:
    return _active.get()


def span(name: str, stream=None, **kwargs):
    """``active_tracer().span(...)``, or a no-op context when nothing is being traced."""
    tracer = _active.get()
    return tracer.span(name, stream, **kwargs) if tracer is not None else contextlib.nullcontext()


def device_trace(name: str, programs: int, device, max_events: int = DEFAULT_MAX_EVENTS) -> DeviceTrace:
    """A kernel's event buffer from the active tracer, or the disabled placeholder for ``device``."""
    tracer = _active.get()
    if tracer is None:
        return disabled_device_trace(device)
    return tracer.device_trace(name, programs, max_events)


def traced_call(fn, trace, rank: int, *args, **kwargs):
    """``fn(*args, trace=False, **kwargs)`` with a ``Tracer`` active, the whole call in lane ``call``;
    writes the trace where ``trace`` says and returns ``fn``'s result."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    tracer = Tracer(device, rank=rank)
    label = f"{getattr(fn, '__name__', 'call')} ({kwargs.get('algorithm', '')})"
    token = _active.set(tracer)
    try:
        with tracer.span(label, lane="call"):
            result = fn(*args, trace=False, **kwargs)
    finally:
        _active.reset(token)
    tracer.finish(trace, op=getattr(fn, "__name__", ""), algorithm=kwargs.get("algorithm"), title=label)
    return result
