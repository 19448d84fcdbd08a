"""The probe fork server: ``python -m gpudiag.probes.forkserver NAMES ROOM``, one per caller.

A small pre-imported parent that forks one child per probe, so a probe round stops paying a
fresh interpreter and gpudiag's imports for every probe (docs/design-notes.md "Probe fork
server"). The child is the same isolated child ``python -m gpudiag.probes NAME`` is: its own
session, the exact environment the caller gave, stdout/stderr on the caller's pipes, the same
argv (rewritten in place, so a sibling gpudiag still tells it from a user), the same exit codes.

Safe to fork only because this parent is single-threaded and has initialized nothing: no
NVML, no CUDA, no JAX, no IREE is imported here (they start threads, or read the environment
when imported); every fork checks /proc/self/task first and refuses when a thread appeared.

Protocol, on the AF_UNIX SOCK_SEQPACKET socket on its stdin: each request is one message, JSON
``{"backend", "options", "env"}`` with three descriptors attached (the child's stdout and
stderr, and a status pipe). On the status pipe this server writes ``pid N`` after the fork and
``exit W`` (the raw wait status) once it reaped the child, or ``error TEXT``. It exits when the
caller's end closes (the caller ended): its children then end their groups themselves.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import importlib.machinery
import json
import os
import selectors
import signal
import socket
import sys
from collections.abc import Collection, Mapping
from typing import Any

CONTROL_FD = 0  # stdin: the caller's socketpair end
MESSAGE_LIMIT_BYTES = 4 * 1024 * 1024
# Never imported here: they start threads (numpy's BLAS, jax) or read the environment when
# imported (jax's flags), or are big and used by one probe (iree) (design notes).
NEVER_PREIMPORTED = ("jax", "jaxlib", "iree", "numpy")
# Libraries imported here for the children. A fresh child would import them from where the
# import system finds them NOW: a pynvml installed, replaced or shadowed while this server
# runs (the old `pynvml` package over nvidia-ml-py) must reach the next probe, so every fork
# first checks that each still resolves to the same file, unchanged; else this server
# refuses (its caller spawns the probe) and ends once its children did (the caller starts a
# new one later).
PREIMPORTED_LIBRARIES = ("pynvml",)

Origin = tuple[str | None, int, int, int]


def import_origins(names: Collection[str] = PREIMPORTED_LIBRARIES) -> dict[str, Origin]:
    """Where a fresh import of each name would come from now: the file and its identity."""
    found: dict[str, Origin] = {}
    for name in names:
        try:
            spec = importlib.machinery.PathFinder.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origin = spec.origin if spec is not None else None
        try:
            st = os.stat(origin) if origin else None
        except OSError:
            st = None
        found[name] = (origin, *((st.st_ino, st.st_size, st.st_mtime_ns) if st else (0, 0, 0)))
    return found


def preimport(names: Collection[str] | None = None) -> None:
    """Import what the probe children would import first: gpudiag's probe modules (``names``,
    default every registered backend's; they import their libraries inside the probe
    function, in the child, never at import) and pynvml (no thread, no environment read and
    no library loaded at import: nvmlInit loads libnvidia-ml, in the child)."""
    from gpudiag.core import registry
    from gpudiag.probes import __main__ as entry
    from gpudiag.probes import load, probe_modules

    known = probe_modules()
    for name in [s.name for s in registry.specs()] if names is None else names:
        if name in known:
            load(name)
    del entry
    for library in PREIMPORTED_LIBRARIES:
        try:
            importlib.import_module(library)
        except Exception:  # a broken install: each child imports it again and says so
            pass


def threads() -> int:
    """How many threads this process has now (the kernel's count, not only Python's)."""
    return len(os.listdir("/proc/self/task"))


def _areas() -> tuple[int, int, int, int]:
    """This process's argv and environment areas: arg_start, arg_end, env_start, env_end."""
    with open("/proc/self/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    # stat fields 48-51; the split starts at field 3
    return int(fields[45]), int(fields[46]), int(fields[47]), int(fields[48])


def cmdline_text(argv: list[str], *, spill: bool = False) -> tuple[int, bytes] | None:
    """Where and what to write so that /proc/self/cmdline reads ``argv``; None: no room.

    The start argv left a room (forkclient.ARGV_ROOM_BYTES) that a child's argv is written
    into. When no word has a space, the words go in joined by spaces and ended by a NUL, and
    the area's last byte is left a space: the kernel's setproctitle convention (an area whose
    last byte is not NUL reads as one string up to its first NUL, which ps and psutil split
    at spaces), so ps shows exactly ``argv``, never the room's padding. With ``spill``, such
    an argv longer than the room may run on over the environment area, only in a child whose
    C environment no longer points there (``_child`` clears it). A word with a space stays
    NUL-separated in the room, the last word padded with spaces (a JSON options word ignores
    them) so that the area still ends in one NUL."""
    start, end, env_start, env_end = _areas()
    words = [w.encode() for w in argv]
    area = end - start
    if not any(b" " in w or not w for w in words):
        text = b" ".join(words) + b"\0"
        if len(text) < area:
            return start, text + b" " * (area - len(text))
        if (spill and env_start == end
                and len(text) <= min(env_end - start, os.sysconf("SC_PAGE_SIZE"))):
            return start, text
        return None
    head = b"\0".join(words[:-1]) + b"\0"
    room = area - 1 - len(head)
    if room >= len(words[-1]):
        return start, head + words[-1].ljust(room, b" ") + b"\0"
    return None


def set_cmdline(argv: list[str]) -> bool:
    """Rewrite this process's /proc/self/cmdline to ``argv`` in the room the start argv left
    (``cmdline_text``); False when it does not fit."""
    found = cmdline_text(argv)
    if found is None:
        return False
    ctypes.memmove(found[0], found[1], len(found[1]))
    return True


def child_argv(request: Mapping[str, Any], *, compact: bool = False) -> list[str]:
    """The argv a spawned child of ``request`` has (``compact``: its options without spaces)."""
    argv = [sys.executable, "-m", "gpudiag.probes", str(request["backend"])]
    if request.get("options"):
        argv.append(json.dumps(request["options"], sort_keys=True,
                               separators=(",", ":") if compact else None))
    return argv if len(argv) > 4 else [*argv, "{}"]


def child_cmdline(request: Mapping[str, Any]) -> tuple[int, bytes] | None:
    """What a forked child of ``request`` writes over its cmdline; None: it would not fit
    (a fork server forked from a caller has only the caller's argv area: spawn instead)."""
    # Compact options first: without spaces, ps shows the argv unpadded (cmdline_text).
    found = cmdline_text(child_argv(request, compact=True), spill=True)
    return found if found is not None else cmdline_text(child_argv(request))


def _child(request: Mapping[str, Any], fds: list[int], control: socket.socket,
           title: tuple[int, bytes]) -> int:
    """In the forked child: become an isolated probe child, run the probe, return its code."""
    from gpudiag.probes import __main__ as entry

    out, err, _status = fds
    parent = os.getppid()
    control.close()
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    # Replaced before anything in the child reads it: putenv/unsetenv reach C getenv too.
    # clearenv first: no C environment entry may point into the start block any more (the
    # argv may spill over it, cmdline_text).
    ctypes.CDLL(None).clearenv()
    os.environ.clear()
    os.environ.update({**request["env"], "GPUDIAG_PROBE_PARENT_PID": str(parent)})
    args = child_argv(request)[3:]
    if not request.get("options"):
        args = args[:1]
    ctypes.memmove(title[0], title[1], len(title[1]))
    sys.argv = [str(entry.__file__), *args]  # what ``python -m gpudiag.probes`` would see
    return entry.main(args)


def _fork(request: Mapping[str, Any], fds: list[int], control: socket.socket) -> int | None:
    """Fork one probe child; its pid, or None (the error is written on the status pipe)."""
    status = fds[2]
    if threads() != 1:
        os.write(status, b"error the fork server is not single-threaded\n")
        return None
    title = child_cmdline(request)
    if title is None:
        os.write(status, b"error no room for the child's argv: spawn the probe\n")
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as e:
        os.write(status, f"error fork failed: {e}\n".encode())
        return None
    if pid == 0:
        code = 70
        try:
            code = _child(request, fds, control, title)
        except BaseException:  # the child must end here, whatever happened
            # Imported only here: the CLI imports this module before it forks its server,
            # and traceback (with textwrap) is of use only to a child that failed.
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    try:
        os.write(status, f"pid {pid}\n".encode())
    except OSError:
        os.kill(pid, signal.SIGKILL)  # its caller gave up waiting and spawned the probe
        return None
    return pid


def _reap(children: dict[int, int]) -> None:
    """Reap every ended child and tell its caller the wait status."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = children.pop(pid, None)
        if fd is not None:
            try:
                os.write(fd, f"exit {status}\n".encode())
            except OSError:
                pass  # the caller gave up on it (its deadline passed and it went on)
            os.close(fd)


class Server:
    """This server's state: its children (pid -> status pipe) and its imports' origins."""

    def __init__(self, origins: Mapping[str, Origin]) -> None:
        self.children: dict[int, int] = {}
        self.origins = dict(origins)
        self.stale: list[str] = []

    def changed(self) -> list[str]:
        """The pre-imported libraries a fresh child would now import from elsewhere."""
        if not self.stale:
            now = import_origins(self.origins)
            self.stale = sorted(n for n, origin in now.items() if origin != self.origins[n])
        return self.stale


def _take(control: socket.socket, server: Server) -> bool:
    """Read one request and fork its child; False when the caller's end closed."""
    children = server.children
    try:
        data, fds, _flags, _addr = socket.recv_fds(control, MESSAGE_LIMIT_BYTES, 3)
    except OSError:
        return False
    if not data:
        for fd in fds:
            os.close(fd)
        return False
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return True  # a malformed request has no status pipe to answer on
    try:
        request = json.loads(data)
        stale = server.changed()
        if stale:
            os.write(fds[2], f"error {', '.join(stale)} changed on disk since the fork server "
                             "imported it: spawn the probe\n".encode())
            pid = None
        else:
            pid = _fork(request, fds, control)
    except (ValueError, KeyError, TypeError) as e:
        with contextlib.suppress(OSError):
            os.write(fds[2], f"error bad request: {e}\n".encode())
        pid = None
    except OSError:  # the caller gave up waiting and closed its end: serve the next one
        pid = None
    os.close(fds[0])
    os.close(fds[1])
    if pid is None:
        os.close(fds[2])
    else:
        children[pid] = fds[2]
    return True


def serve(control: socket.socket, origins: Mapping[str, Origin] | None = None) -> None:
    """Fork a child per request until the caller's end closes, or until a pre-imported
    library changed on disk and every child ended; reap children as they end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    os.set_blocking(wake_r, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    server = Server(import_origins() if origins is None else origins)
    with selectors.DefaultSelector() as sel:
        sel.register(control, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _events in sel.select():
                if key.fileobj is control and not _take(control, server):
                    return
                if key.fileobj == wake_r:
                    while True:
                        try:
                            if not os.read(wake_r, 4096):
                                break
                        except BlockingIOError:
                            break
            _reap(server.children)
            if server.stale and not server.children:
                return  # its caller starts a server that imports what is there now


def run_server(probes: Collection[str] | None) -> int:
    """Pre-import, check this process is single-threaded and imported nothing unsafe, serve
    on the socket at fd 0."""
    origins = import_origins()  # before the imports: what they will load
    preimport(probes)
    # A probe module that came to import one of them at its top would make forking unsafe.
    unsafe = unsafe_modules()
    if threads() != 1 or unsafe:
        print(f"probe fork server: {threads()} threads and {unsafe or 'none'} of "
              f"{NEVER_PREIMPORTED} after the imports; not serving", file=sys.stderr)
        return 1
    control = socket.socket(fileno=CONTROL_FD)
    serve(control, origins)
    return 0


def unsafe_modules() -> list[str]:
    """The modules imported here that no fork server may have (NEVER_PREIMPORTED)."""
    return sorted(m for m in NEVER_PREIMPORTED if m in sys.modules)


def forked_here_refusal() -> str | None:
    """Why this process may not become a fork server by forking itself; None: it may.

    Its state is the server's: one thread (a fork copies only the calling one, and locks
    another thread held stay held), none of NEVER_PREIMPORTED imported, no driver library
    loaded, and each pre-imported library it already imported loaded from where a fresh
    import would find it now."""
    if threads() != 1:
        return f"{threads()} threads"
    unsafe = unsafe_modules()
    if unsafe:
        return f"{', '.join(unsafe)} imported"
    loaded = driver_libraries_loaded()
    if loaded:
        return f"{', '.join(loaded)} loaded (a driver initialized here is no child's to share)"
    origins = import_origins()
    for name in PREIMPORTED_LIBRARIES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__file__", None) != origins[name][0]:
            return f"{name} imported from elsewhere than a fresh import finds"
    return None


# A process that loaded one of these may have initialized the driver (a caller that ran
# nvmlInit or cuInit itself): its state and descriptors are not a fresh child's.
DRIVER_LIBRARIES = ("libnvidia-ml.so", "libcuda.so")


def driver_libraries_loaded() -> list[str]:
    """The driver libraries (DRIVER_LIBRARIES) mapped into this process now."""
    try:
        with open("/proc/self/maps") as f:
            names = {line.rsplit("/", 1)[-1].strip() for line in f if "/" in line}
    except OSError:
        return ["(/proc/self/maps unreadable)"]
    return sorted(n for n in names if n.startswith(DRIVER_LIBRARIES))


def serve_forked(control: int, probes: Collection[str] | None) -> None:
    """In a child its caller just forked: become the fork server on ``control`` and exit.

    The server an exec would have started, without the exec: its own session, the control
    socket on fd 0, /dev/null on 1 and 2, no other descriptor of the caller's, and its argv
    the server's where the caller's argv area has room (ps tells it from the caller)."""
    code = 1
    try:
        # The caller's objects stay as they are: a collection here could run a finalizer
        # that closes a descriptor number this server has reused since.
        gc.freeze()
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd, target in ((control, 0), (devnull, 1), (devnull, 2)):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        names = "*" if probes is None else ",".join(probes)
        set_cmdline([sys.executable, "-m", "gpudiag.probes.forkserver", names])
        code = run_server(probes)
    except BaseException:  # the forked server must end here, whatever happened
        code = 1
    finally:
        os._exit(code)


def main() -> int:
    """The exec'd server: its probes from argv, then ``run_server``."""
    # NAMES: the probes to import for ("*": every backend); ROOM: space for a child's argv.
    words = sys.argv[1:2]
    # The room stays reserved for the children's argv; ps shows this server's argv without it.
    set_cmdline([sys.executable, "-m", "gpudiag.probes.forkserver", *words])
    return run_server(None if words in ([], ["*"]) else words[0].split(","))


if __name__ == "__main__":
    sys.exit(main())
