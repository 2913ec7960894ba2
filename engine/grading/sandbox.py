"""Where a submission's code runs when an instructor grades a folder: a sandbox built from what
Linux and Debian provide, and the limits that hold without one.

With bubblewrap (``apt-get install bubblewrap``; :func:`bwrap_works` tries it once), each
exercise's worker (:mod:`engine.grading.worker`) runs in a throwaway view of the machine:

* files: ``/usr`` and the system libraries, a few files of ``/etc``, the Python installation
  and its packages and the ``engine`` package, all read-only; a fresh copy of the student's
  ``exercises/`` at the same path, writable (what it writes there is thrown away); an empty
  ``/tmp``. The course's ``solutions/``, ``tests/``, ``.git``, other students' folders, the
  grader's report and junit files and the rest of the home directories are not there at all.
* processes: a PID namespace of its own (it cannot see or signal the grader; when the worker's
  sandbox ends, the kernel ends everything in it, daemons included), a new session (no
  terminal to write escape sequences to), no capabilities, user ``nobody`` inside.
* no network: a network namespace with loopback only (Gloo's ranks talk over it).
* limits (also without bubblewrap): address space per process (``memory_bytes``), CPU seconds,
  the size of a file written, no core dumps; and where the grader may make a cgroup
  (:class:`ControlGroup`), a cap on the processes and on the memory of all of them together.

Without bubblewrap the worker still runs under those limits, in a process group of its own,
killed by PID with every process it started (the grader is a child subreaper,
:mod:`engine.grading.remote`), with its results read as plain data; and Python's audit hooks
in the worker refuse to open the course's ``solutions/``, ``.git`` and ``tests/`` and other
students' folders, and to write outside the student's own folder and a scratch folder of its
own (its ``TMPDIR``).
Audit hooks are a Python-level check: code that goes through ``ctypes`` or starts another
program gets around them. :meth:`Sandbox.protections` says which mode is on, in the report.

For machines without bubblewrap (macOS, a locked-down container), the README's grading section
gives a container recipe in the manner of otter-grader: the grader inside a container with no
network, the solutions not copied into it, one container per student.
"""

from __future__ import annotations

import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from pathlib import Path

import engine

ENGINE_DIR = Path(engine.__file__).resolve().parent
DEFAULT_MEMORY_BYTES = 4 * 2**30  # address space per process: torch and 4 Gloo ranks fit
DEFAULT_PROCESSES = 256  # processes the worker may add (ranks, their threads count too)
FILE_SIZE_BYTES = 256 * 2**20
ETC_FILES = ("hosts", "ld.so.cache", "passwd", "group", "nsswitch.conf", "localtime",
             "host.conf", "gai.conf")
HIDDEN_IN_COURSE = ("solutions", "tests", ".git")
FORBID_ENV = "ENGINE_GRADING_FORBID"  # read by the worker's audit hook (no bubblewrap)
WRITABLE_ENV = "ENGINE_GRADING_WRITABLE"


@lru_cache(maxsize=1)
def bwrap_works() -> str:
    """"" when bubblewrap runs a sandbox here, else why not (one line)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    try:
        done = subprocess.run([bwrap, "--ro-bind", "/", "/", "--unshare-all", "--unshare-user",
                               "--uid", "65534", "--gid", "65534", "--die-with-parent", "true"],
                              capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"bubblewrap could not start: {e}"
    if done.returncode != 0:
        return ("bubblewrap cannot create namespaces here: "
                + done.stderr.decode(errors="replace").strip()[:200])
    return ""


class ControlGroup:
    """A cgroup for one worker and everything it starts, where this machine lets the grader make
    one (cgroup v1's ``pids`` and ``memory`` hierarchies, or v2 with those controllers): a cap on
    the number of processes (``RLIMIT_NPROC`` does not bind a worker whose user outside the
    sandbox is root) and on the memory of all of them together. Empty where it cannot."""

    def __init__(self, processes: int, memory_bytes: int):
        self.dirs: list[Path] = []
        self.controllers: set[str] = set()
        name = f"engine-grading-{os.getpid()}-{os.urandom(4).hex()}"
        for controller, limits in (("pids", {"pids.max": processes}),
                                   ("memory", {"memory.limit_in_bytes": memory_bytes,
                                               "memory.max": memory_bytes})):
            folder = self._make(controller, name)
            if folder is None:
                continue
            wrote = False
            for file, value in limits.items():
                try:
                    (folder / file).write_text(str(value))
                    wrote = True
                except OSError:
                    pass
            if wrote:
                self.dirs.append(folder)
                self.controllers.add(controller)
            else:
                self._remove(folder)

    @staticmethod
    def _make(controller: str, name: str) -> Path | None:
        try:
            lines = Path("/proc/self/cgroup").read_text().splitlines()
        except OSError:
            return None
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controller in controllers.split(","):
                base = Path("/sys/fs/cgroup") / controller / path.lstrip("/")
                break
        else:  # cgroup v2: one hierarchy, controllers enabled for the children
            v2 = [line.split(":", 2)[2] for line in lines if line.startswith("0::")]
            if not v2:
                return None
            base = Path("/sys/fs/cgroup") / v2[0].lstrip("/")
            try:
                if controller not in (base / "cgroup.controllers").read_text().split():
                    return None
                (base / "cgroup.subtree_control").write_text(f"+{controller}")
            except OSError:
                return None
        try:
            folder = base / name
            folder.mkdir()
            return folder
        except OSError:
            return None

    def join(self) -> None:
        """In the worker, before exec: enter every group made."""
        for folder in self.dirs:
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    @property
    def limits_processes(self) -> bool:
        return "pids" in self.controllers

    @property
    def limits_memory(self) -> bool:
        return "memory" in self.controllers

    @staticmethod
    def _remove(folder: Path) -> None:
        for _ in range(50):
            try:
                folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:  # processes still leaving
                time.sleep(0.02)

    def remove(self) -> None:
        for folder in self.dirs:
            self._remove(folder)
        self.dirs = []


def _user_processes() -> int:
    uid, count = os.getuid(), 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += 1
            except OSError:
                pass
    return count


class Sandbox:
    """How the grader starts each worker of one student: ``student`` is the submission's folder
    (holding ``exercises/``), ``course`` the installed course (its ``solutions/`` hidden).
    ``mode``: "bwrap" (the sandbox above) or "limits" (limits, process control and audit
    hooks only); "auto" picks bwrap where it works."""

    def __init__(self, student: str | Path, course: str | Path | None, mode: str = "auto",
                 memory_bytes: int = DEFAULT_MEMORY_BYTES, cpu_seconds: int = 600,
                 processes: int = DEFAULT_PROCESSES):
        if mode not in ("auto", "bwrap", "limits"):
            raise ValueError(f"sandbox mode must be auto, bwrap or limits, got {mode!r}")
        why_not = bwrap_works()
        if mode == "bwrap" and why_not:
            raise RuntimeError(f"--sandbox bwrap: {why_not}")
        self.mode = "bwrap" if mode in ("auto", "bwrap") and not why_not else "limits"
        self.why_not = why_not
        self.student = Path(student).resolve()
        self.course = Path(course).resolve() if course is not None else None
        self.memory_bytes, self.cpu_seconds = memory_bytes, cpu_seconds
        self.processes = processes
        self.scratch: Path | None = None
        probe = ControlGroup(processes, memory_bytes)  # what this machine lets us limit
        self.cgroup_processes, self.cgroup_memory = probe.limits_processes, probe.limits_memory
        probe.remove()
        self.group: ControlGroup | None = None

    # -- what the report says
    def protections(self) -> str:
        gib = f"{self.memory_bytes / 2**30:g} GiB"
        limits = (f"{gib} of address space per process"
                  + (f" and {gib} for all together" if self.cgroup_memory else "")
                  + f", {self.cpu_seconds} CPU seconds, "
                  + (f"at most {self.processes} processes" if self.cgroup_processes else
                     "processes not counted (no writable pids cgroup)"))
        if self.mode == "bwrap":
            return ("sandbox: bubblewrap (no network, own PID namespace, user nobody inside; "
                    "sees its own copy of exercises/, the engine and Python read-only; no "
                    f"solutions/, tests/, .git or other students' folders); {limits}")
        return (f"sandbox: OFF ({self.why_not or 'not asked for'}): {limits}; processes "
                "killed by PID; solutions/, tests/, .git and other students' folders refused "
                "by Python audit hooks only (ctypes or another program gets around them)")

    # -- starting a worker
    def limits(self) -> None:
        """In the child, before exec: a process group of its own and the limits."""
        os.setpgid(0, 0)
        mem, cpu = self.memory_bytes, self.cpu_seconds
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_BYTES, FILE_SIZE_BYTES))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        nproc = self._nproc
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))  # binds a user other than root
        if self.group is not None:
            self.group.join()

    def environment(self) -> dict[str, str]:
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp",
               "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1",
               "PYTHONUNBUFFERED": "1", "GLOO_SOCKET_IFNAME": "lo"}
        if self.mode == "limits":
            env["TMPDIR"] = str(self.scratch)
            env[FORBID_ENV] = os.pathsep.join(str(p) for p in self._forbidden())
            env[WRITABLE_ENV] = os.pathsep.join([str(self.student), str(self.scratch),
                                                 "/dev/shm"])
            if "PYTHONPATH" in os.environ:
                env["PYTHONPATH"] = os.environ["PYTHONPATH"]
        return env

    def _forbidden(self) -> list[Path]:
        hidden = [self.course / name for name in HIDDEN_IN_COURSE] if self.course else []
        parent = self.student.parent  # the class folder: the other students
        hidden += [p for p in parent.iterdir() if p != self.student] \
            if parent != Path("/") and parent.is_dir() else []
        return [p for p in hidden if p.exists()]

    def command(self, argv: list[str], pass_fds: tuple[int, ...] = ()) -> list[str]:
        """``argv`` wrapped in the sandbox (unchanged in "limits" mode)."""
        self._nproc = _user_processes() + self.processes
        self.group = ControlGroup(self.processes, self.memory_bytes)
        self.scratch = Path(tempfile.mkdtemp(prefix="grade-scratch-"))
        if self.mode != "bwrap":
            return argv
        copy = self.scratch / "exercises"
        shutil.copytree(self.student / "exercises", copy, symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__"))
        args = ["bwrap", "--die-with-parent", "--new-session", "--unshare-all",
                "--unshare-user", "--uid", "65534", "--gid", "65534", "--cap-drop", "ALL",
                "--hostname", "localhost", "--proc", "/proc", "--dev", "/dev",
                "--tmpfs", "/tmp"]
        for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
            args += ["--ro-bind-try", top, top]
        hosts = self.scratch / "hosts"  # loopback by name, both families: nothing to ask DNS
        hosts.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n"
                         "::ffff:127.0.0.1 localhost\n")
        for name in ETC_FILES:
            if name != "hosts":
                args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
        args += ["--ro-bind", str(hosts), "/etc/hosts"]
        for path in self._python_paths():
            args += ["--ro-bind", str(path), str(path)]
        args += ["--ro-bind", str(ENGINE_DIR), str(ENGINE_DIR)]
        args += ["--bind", str(copy), str(self.student / "exercises"),
                 "--chdir", str(self.student)]
        return args + ["--", *argv]

    def _python_paths(self) -> list[Path]:
        """The Python installation and every folder on its import path, except any that holds
        the course or the student's folder (those would show solutions/ or other students)."""
        keep = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
                Path(sys.executable).resolve().parent.parent}
        keep |= {Path(p).resolve() for p in sys.path if p and Path(p).is_dir()}
        private = [p for p in (self.course, self.student) if p is not None]
        found = []
        for path in sorted(keep):
            if any(q == path or q.is_relative_to(path) for q in private):
                continue
            if any(path.is_relative_to(other) for other in found):
                continue
            if str(path).startswith(("/usr", "/lib", "/bin")):
                continue
            found.append(path)
        return found

    def cleanup(self) -> None:
        if self.group is not None:
            self.group.remove()
            self.group = None
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


def install_audit_hook() -> None:
    """In a worker started without bubblewrap: refuse to open the paths the grader forbids
    (:data:`FORBID_ENV`), and to write outside :data:`WRITABLE_ENV`. Audit hooks cannot be
    removed from Python; ctypes and other programs get around them (the report says so)."""
    forbidden = [Path(p) for p in os.environ.get(FORBID_ENV, "").split(os.pathsep) if p]
    writable = [Path(p) for p in os.environ.get(WRITABLE_ENV, "").split(os.pathsep) if p]
    if not forbidden and not writable:
        return

    def refuse(event: str, args: tuple) -> None:
        if event != "open" or not args or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = Path(os.fsdecode(args[0]))
        path = path if path.is_absolute() else Path.cwd() / path
        path = Path(os.path.normpath(path))
        try:
            real = path.resolve()
        except (OSError, RuntimeError):
            real = path
        for place in forbidden:
            if any(p == place or p.is_relative_to(place) for p in (path, real)):
                raise PermissionError(f"the grader refuses to open {path}: a submission may "
                                      "not read solutions, tests or other students' work")
        mode = args[1] if len(args) > 1 else "r"
        flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or bool(
            flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND))
        if writing and writable and not any(real.is_relative_to(w) for w in writable) \
                and not str(real).startswith("/dev/"):
            raise PermissionError(f"the grader refuses to write {path}: a submission may only "
                                  "write in its own folder and the temporary folder")

    sys.addaudithook(refuse)
