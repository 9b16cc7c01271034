"""``fedsec bench scale --trace-memory DIR``: where the aggregator's memory goes.

The aggregator of each member count runs with a start-up hook: a ``sitecustomize``
module on the ``PYTHONPATH`` its process inherits, so the serving path itself carries
nothing for it.  Once the aggregator serves (its ``serve.json`` written), the hook starts
tracemalloc and, every :data:`SAMPLE_S` seconds, writes a line to ``memory.log`` (RSS,
anonymous and file-backed RSS, glibc's main arena in use and free, the traced heap and its
peak), a snapshot to ``peak.snap`` whenever the traced heap passes its previous high by
3 %, and the latest to ``last.snap``.  tracemalloc makes the aggregator several times
slower: a traced row's CPU figures are not comparable with an untraced one's.

What grows with the roster is the difference between two member counts:
``python -m fedsec.bench.scale_memory DIR/100/peak.snap DIR/300/peak.snap`` lists the
allocation sites (tracebacks) that grew most.  Memory tracemalloc does not see (aiohttp's
C parser buffers are seen; SQLite's page cache, numba's compiler and glibc's free lists
are not) shows as RSS above the traced heap in ``memory.log``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

#: The environment variable naming the output folder (not ``FEDSEC_*``: the simulation
#: strips those from its aggregator's environment).
ENV = "SCALE_TRACE_MEMORY_DIR"
SAMPLE_S = 1.0
#: Frames kept per allocation: enough to see the handler behind an aiohttp buffer.
FRAMES = 12
#: A new peak snapshot once the traced heap passes the last one's by this factor.
PEAK_STEP = 1.03

_SITECUSTOMIZE = (
    "from fedsec.bench.scale_memory import start_in_aggregator\nstart_in_aggregator()\n"
)


@contextlib.contextmanager
def traced_aggregator(out: Path) -> Iterator[None]:
    """While the block runs, an aggregator started by ``fedsec simulate`` traces its
    memory into ``out`` (see the module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    saved = {name: os.environ.get(name) for name in (ENV, "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix="fedsec-trace-memory-") as hook:
        Path(hook, "sitecustomize.py").write_text(_SITECUSTOMIZE)
        os.environ[ENV] = str(out.resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (hook, saved["PYTHONPATH"]) if p)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def start_in_aggregator() -> None:
    """In a ``fedsec aggregator serve`` process with :data:`ENV` set, start the sampling
    thread; anywhere else (members, other commands), nothing."""
    out = os.environ.get(ENV)
    argv = sys.argv
    if not out or "aggregator" not in argv or "serve" not in argv or "--workspace" not in argv:
        return
    workspace = Path(argv[argv.index("--workspace") + 1])
    threading.Thread(
        target=_sample, args=(Path(out), workspace), name="trace-memory", daemon=True
    ).start()


def _sample(out: Path, workspace: Path) -> None:
    while not (workspace / "serve.json").exists():
        time.sleep(0.2)
    tracemalloc.start(FRAMES)
    best = 0
    with (out / "memory.log").open("a") as log:
        while True:
            time.sleep(SAMPLE_S)
            traced, peak = tracemalloc.get_traced_memory()
            log.write(f"{time.time():.1f} {_process_memory()} traced={traced >> 20} ")
            log.write(f"traced_peak={peak >> 20}\n")
            log.flush()
            snapshot = tracemalloc.take_snapshot()
            if traced > best * PEAK_STEP:
                best = traced
                snapshot.dump(str(out / "peak.snap"))
            snapshot.dump(str(out / "last.snap"))


def _process_memory() -> str:
    """``rss= anon= file=`` (MB, from /proc) and glibc's main arena ``arena_used=
    arena_free=`` where there is glibc."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile"):
            fields[name] = int(value.split()[0]) >> 10
    text = f"rss={fields.get('VmRSS')} anon={fields.get('RssAnon')} file={fields.get('RssFile')}"
    arena = _main_arena()
    if arena is not None:
        text += f" arena_used={arena[0] >> 20} arena_free={arena[1] >> 20}"
    return text


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _main_arena() -> tuple[int, int] | None:
    """Bytes in use and free in glibc's main arena (mallinfo2), or None without glibc."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return int(info.uordblks), int(info.fordblks)


def growth(before: Path, after: Path, top: int = 20, frames: int = 6) -> list[str]:
    """The allocation sites that grew most from snapshot ``before`` to ``after``, each
    with its size change, block count change and innermost ``frames`` frames."""
    ignored = [tracemalloc.Filter(False, tracemalloc.__file__)]
    old = tracemalloc.Snapshot.load(str(before)).filter_traces(ignored)
    new = tracemalloc.Snapshot.load(str(after)).filter_traces(ignored)
    lines = []
    for stat in new.compare_to(old, "traceback")[:top]:
        lines.append(
            f"{stat.size_diff / 1e6:+8.2f} MB {stat.count_diff:+8d} blocks "
            f"(now {stat.size / 1e6:.2f} MB)"
        )
        lines += [f"    {line}" for line in stat.traceback.format(frames, most_recent_first=True)]
    return lines


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m fedsec.bench.scale_memory BEFORE.snap AFTER.snap")
    print("\n".join(growth(Path(sys.argv[1]), Path(sys.argv[2]))))
