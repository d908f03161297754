"""The supervisor process of one sandboxed run (stdlib only; see ``reflow.envs.sandbox``).

``sandbox.run_program`` starts this file as ``python -I -S -B sandbox_launcher.py CONFIG``
in a new session. It runs with the caller's privileges and:

1. isolates itself: a new network namespace and a new mount namespace (as root
   directly, otherwise inside a new user namespace where the kernel allows
   one). In the mount namespace every mount is made read-only and nosuid,
   ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``/run`` are hidden under empty
   read-only tmpfs mounts, the working directory is a fresh size-limited tmpfs
   at ``/tmp/work`` owned by the sandbox uid, the interpreter prefix is bound
   read-only at ``/tmp/python`` (so it is reachable even when its real path is
   not, e.g. under ``/root``), and ``/proc`` is remounted with ``hidepid``;
2. becomes a child subreaper and forks the program: the child sets the
   resource limits, drops to the sandbox uid (root only), sets
   ``no_new_privs`` and execs an isolated interpreter on the program;
3. waits for the program until it exits, the wall clock runs out or the caller
   sends SIGTERM (output limit), then kills and reaps every descendant (as the
   subreaper it inherits all orphans, also ones that left the session);
4. writes a JSON report on the report fd and exits 0 (125 when setup failed).

The launcher keeps its own uid, so a program running under the sandbox uid can
neither signal it nor the caller.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
SYS_MOUNT_SETATTR = 442  # same number on x86-64 and aarch64 (unified syscall table)
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
SANDBOX_CWD = "/tmp/work"
SANDBOX_PYTHON = "/tmp/python"
HIDDEN_DIRS = ("/tmp", "/var/tmp", "/dev/shm", "/run")
REAP_SECONDS = 2.0

_libc = ctypes.CDLL(None, use_errno=True)


class _MountAttr(ctypes.Structure):
    _fields_ = [("attr_set", ctypes.c_uint64), ("attr_clr", ctypes.c_uint64),
                ("propagation", ctypes.c_uint64), ("userns_fd", ctypes.c_uint64)]


class _Stop(Exception):
    """The caller asked to stop the program (SIGTERM)."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    enc = (lambda s: None if s is None else s.encode())
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {target}")


def _mount_setattr(path: str, recursive: bool, attr_set: int, attr_clr: int) -> None:
    attr = _MountAttr(attr_set, attr_clr, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    ret = _libc.syscall(ctypes.c_long(SYS_MOUNT_SETATTR), ctypes.c_int(AT_FDCWD), path.encode(),
                        ctypes.c_uint(flags), ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)))
    _check(ret, f"mount_setattr {path}")


def _enter_namespaces() -> bool:
    """New net + mount namespaces; through a user namespace when not root. False if refused."""
    if os.geteuid() == 0:
        return _libc.unshare(ctypes.c_int(CLONE_NEWNS | CLONE_NEWNET)) == 0
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET)) != 0:
        return False
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)
    return True


def _build_filesystem(cfg: dict, prefix: str, files: dict[str, bytes]) -> list[str]:
    """Read-only view of the host, private /tmp with the work tmpfs, the program and the interpreter."""
    done = []
    _mount(None, "/", None, MS_REC | MS_PRIVATE, None)
    prefix_fd = os.open(prefix, os.O_PATH | os.O_DIRECTORY)
    _mount_setattr("/", True, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
    hidden = [path for path in HIDDEN_DIRS if os.path.isdir(path) and not os.path.islink(path)]
    for path in hidden:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    os.mkdir(SANDBOX_CWD, 0o755)
    os.mkdir(SANDBOX_PYTHON, 0o755)
    _mount("tmpfs", SANDBOX_CWD, "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={cfg['max_disk_mb']}m,mode=700,uid={cfg['uid']},gid={cfg['uid']}")
    _mount(f"/proc/self/fd/{prefix_fd}", SANDBOX_PYTHON, None, MS_BIND | MS_REC, None)
    os.close(prefix_fd)
    for path in hidden:  # read-only also where "root" is the caller's uid (user namespace)
        _mount_setattr(path, False, MOUNT_ATTR_RDONLY, 0)
    for name, data in files.items():
        path = os.path.join(SANDBOX_CWD, name)
        with open(path, "wb") as f:
            f.write(data)
        os.chown(path, cfg["uid"], cfg["uid"])
    done.append("filesystem")
    try:  # other users' processes become invisible; needs privilege over the pid namespace
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
        done.append("proc")
    except OSError:
        pass
    return done


def _world_reachable(path: str) -> bool:
    """Whether a non-owner can reach ``path`` (every ancestor searchable by others)."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _setup(cfg: dict) -> tuple[list[str], str, str, dict[str, str]]:
    """Isolation steps that the OS allows: (enforced, executable, cwd, environment)."""
    enforced = ["rlimits", "session", "environment"]
    exe = os.path.realpath(sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
    cwd = cfg["workdir"]
    rel_exe = os.path.relpath(exe, prefix)
    files = {}  # read before the host's /tmp is hidden
    for name in cfg["files"]:
        with open(os.path.join(cfg["workdir"], name), "rb") as f:
            files[name] = f.read()
    if _enter_namespaces():
        enforced.append("network")
        if not rel_exe.startswith(".."):
            enforced += _build_filesystem(cfg, prefix, files)
            exe = os.path.join(SANDBOX_PYTHON, rel_exe)
            env["LD_LIBRARY_PATH"] = os.path.join(SANDBOX_PYTHON, "lib")  # beats an absolute RUNPATH
            cwd = SANDBOX_CWD
    if os.geteuid() == 0 and ("filesystem" in enforced or _world_reachable(prefix)):
        enforced.append("uid")
        if cwd == cfg["workdir"]:
            os.chown(cwd, cfg["uid"], cfg["uid"])
    env.update(HOME=cwd, TMPDIR=cwd)
    return enforced, exe, cwd, env


def _exec_program(cfg: dict, exe: str, cwd: str, env: dict[str, str], drop_uid: bool) -> None:
    """In the forked child: limits, privileges, then the isolated interpreter on the program."""
    os.close(cfg["report_fd"])
    os.chdir(cwd)
    mb = 1024 * 1024
    cpu = max(1, int(-(-cfg["cpu_seconds"] // 1)))
    for limit, value in ((resource.RLIMIT_CPU, (cpu, cpu + 1)),
                         (resource.RLIMIT_AS, (cfg["memory_mb"] * mb,) * 2),
                         (resource.RLIMIT_FSIZE, (cfg["max_file_mb"] * mb,) * 2),
                         (resource.RLIMIT_NPROC, (cfg["max_processes"],) * 2),
                         (resource.RLIMIT_NOFILE, (64, 64)),
                         (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(limit, value)
    if drop_uid:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.execve(exe, [exe, "-I", "-S", "-B", *cfg["argv"]], env)


def _live_processes() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, real uid) of every live (not zombie) process."""
    processes = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
        except (OSError, ValueError):
            continue
        if not fields.get("State", "Z").strip().startswith(("Z", "X")):
            processes[int(entry)] = (int(fields["PPid"]), int(fields["Uid"].split()[0]))
    return processes


def _descendants(root: int, processes: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in processes.items():
        children.setdefault(ppid, []).append(pid)
    found, frontier = [], [root]
    while frontier:
        found += (frontier := [c for p in frontier for c in children.get(p, [])])
    return found


def _kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_uid(uid: int, deadline_seconds: float = REAP_SECONDS) -> bool:
    """SIGKILL every live process whose real uid is ``uid`` until none is left; True when none is."""
    end = time.monotonic() + deadline_seconds
    while time.monotonic() < end:
        pids = [pid for pid, (_, owner) in _live_processes().items() if owner == uid]
        if not pids:
            return True
        _kill_all(pids)
        time.sleep(0.001)
    return False


def _wait_program(pid: int, wall_seconds: float) -> str:
    """Wait for the program: 'exited', 'timeout' or 'stopped' (SIGTERM from the caller)."""
    deadline = time.monotonic() + wall_seconds
    pidfd = -1
    try:
        signal.signal(signal.SIGTERM, _raise_stop)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a SIGTERM already sent lands here
        pidfd = os.pidfd_open(pid)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            if select.select([pidfd], [], [], remaining)[0]:
                return "exited"
    except _Stop:
        return "stopped"
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if pidfd >= 0:
            os.close(pidfd)


def _kill_descendants() -> bool:
    """Kill and reap every descendant; True when none is left.

    Each round kills the whole process tree below the launcher; processes
    forked meanwhile lose their parent and, the launcher being a child
    subreaper, become its children: the next round finds them, also ones that
    left the session or process group.
    """
    me = os.getpid()
    end = time.monotonic() + REAP_SECONDS
    while time.monotonic() < end:
        _kill_all(_descendants(me, _live_processes()))
        try:
            while os.waitpid(-1, os.WNOHANG)[0] != 0:
                pass
        except ChildProcessError:
            return True
        time.sleep(0.001)
    return False


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()


def main() -> int:
    # SIGTERM (the caller's "stop") stays pending until _wait_program can turn it into "stopped".
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    cfg = json.loads(sys.argv[1])
    report_fd = cfg["report_fd"]
    try:
        enforced, exe, cwd, env = _setup(cfg)
        _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    except Exception as exc:  # a setup failure is the host's problem, not the program's
        os.write(report_fd, json.dumps({"error": f"sandbox setup failed: {exc!r}"}).encode())
        return 125
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        try:
            _exec_program(cfg, exe, cwd, env, "uid" in enforced)
        except BaseException as exc:
            os.write(2, f"sandbox: cannot start the program: {exc!r}\n".encode())
        os._exit(126)
    outcome = _wait_program(pid, cfg["wall_seconds"])
    os.kill(pid, signal.SIGKILL)  # no-op on an exited (zombie) program
    _, status, usage = os.wait4(pid, 0)  # before any other reaping, to keep its status
    wall = time.monotonic() - start
    cleaned = _kill_descendants()
    report = {"outcome": outcome, "returncode": os.waitstatus_to_exitcode(status),
              "cpu_seconds": usage.ru_utime + usage.ru_stime, "wall_seconds": wall,
              "isolation": enforced, "cleaned": cleaned}
    os.write(report_fd, json.dumps(report).encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
